"""The import graph of dosa_jax and pallas_kernels: no cycle, one lazy edge to the kernels.

Every module is parsed (not imported); module-level and function-level imports
both count as edges. The library may reach the optional kernel package only
through the api's dispatch table (:data:`dosa_jax.api.IMPLEMENTATIONS`).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dosa_jax", "pallas_kernels")
#: The one allowed dosa_jax -> pallas_kernels edge: the api's lazy loader of the kernels.
ALLOWED_KERNEL_EDGES = {("dosa_jax.api", "pallas_kernels.pipeline"),
                        ("dosa_jax.api", "pallas_kernels.select"),
                        ("dosa_jax.api", "pallas_kernels.numerics"),
                        ("dosa_jax.api", "pallas_kernels.decode")}


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _resolve(name, mods):
    """The module an imported name lives in (``pkg.mod.attr`` -> ``pkg.mod``), or None."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _edges(mods):
    edges = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                # the parent packages that importing a submodule initialises are import
                # machinery, not edges (else every submodule would depend on its package)
                r = _resolve(t, mods)
                if r and r != name:
                    out.add(r)
        edges[name] = out
    return edges


def _find_cycle(edges):
    color, stack = {}, []

    def visit(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in color:
                c = visit(v)
                if c:
                    return c
        stack.pop()
        color[u] = 2
        return None

    for u in sorted(edges):
        if u not in color:
            c = visit(u)
            if c:
                return c
    return None


def test_every_module_is_seen():
    mods = _modules()
    for m in ("dosa_jax.api", "dosa_jax.backend", "pallas_kernels.tiles",
              "pallas_kernels.operands", "pallas_kernels.dense", "pallas_kernels.refine"):
        assert m in mods


def test_no_import_cycle():
    cycle = _find_cycle(_edges(_modules()))
    assert cycle is None, " -> ".join(cycle)


def test_only_the_api_reaches_the_kernels():
    edges = _edges(_modules())
    back = {(u, v) for u, vs in edges.items() for v in vs
            if u.startswith("dosa_jax") and v.startswith("pallas_kernels")}
    assert back <= ALLOWED_KERNEL_EDGES, sorted(back - ALLOWED_KERNEL_EDGES)
    assert back, "the api's lazy loader of the kernels was not found"


def test_the_kernel_edge_is_lazy():
    """The api imports the kernels inside a function, never at module level."""
    tree = ast.parse((ROOT / "dosa_jax" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
            assert not any(n.startswith("pallas_kernels") for n in names)


def test_cycle_detector_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
