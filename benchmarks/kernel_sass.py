"""Read the Pallas kernels' sm_90 machine code without a GPU (or where no GPU profiler runs).

1. Lowers ``dense_topk`` and ``dosa_topk`` for CUDA on any machine (jax's cross-platform
   lowering) at benchmark shapes and saves each Pallas kernel's Triton IR (``*.ttir``).
2. If the ``triton`` package is importable (``pip install triton``; it bundles ``ptxas`` and
   ``cuobjdump``), compiles each kernel for sm_90 (TTGIR, PTX, cubin, SASS) and prints its
   registers, spills, shared memory and a few instruction counts (``HGMMA``, ``LDS``,
   ``BAR.SYNC``, ``LDGSTS`` widths, local-memory spills ``STL``/``LDL``).

The standalone Triton need not be the Triton inside the GPU machine's jaxlib: read the output as
a lead and check it with timings.

    python -m benchmarks.kernel_sass --out /tmp/sass [--T 16384 --N 1048576] [--tiles SPEC]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys


@contextlib.contextmanager
def triton_modules():
    """Within the block, every Pallas Triton kernel lowered appends (kernel name, Triton IR
    text) to the yielded list (lower with ``lowering_platforms=("cuda",)``: no GPU needed)."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    seen = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, *a, **kw):
        res = orig(jaxpr, grid_mapping, *a, **kw)
        name = getattr(getattr(jaxpr, "debug_info", None), "func_name", "kernel")
        seen.append((name, res.module.operation.get_asm(enable_debug_info=False)))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield seen
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig


def lower_kernels(out_dir: str, T: int, N: int, H: int, D: int, K: int, tiles_spec: str,
                  which=("dense", "dosa")):
    """Lower the kernels for CUDA and write ``NN_<kernel>.ttir`` files; returns their paths."""
    import jax
    import jax.numpy as jnp
    from benchmarks.tiles import parse_tiles
    from pallas_kernels import dense as dense_mod, pipeline

    tiles, opts = parse_tiles(tiles_spec)
    cfg = opts.config(K)
    S = jax.ShapeDtypeStruct
    args = (S((T, H, D), jnp.bfloat16), S((N, D), jnp.float8_e4m3fn), S((T, H), jnp.float32),
            S((N,), jnp.float32), S((T,), jnp.int32), S((T,), jnp.int32))
    fns = dict(dense=lambda *x: dense_mod.dense_topk(*x, cfg, tiles=tiles, interpret=False),
               dosa=lambda *x: pipeline.dosa_topk(*x, cfg, tiles=tiles, interpret=False)[:2])
    with triton_modules() as seen:
        for w in which:
            jax.jit(fns[w]).trace(*args).lower(lowering_platforms=("cuda",))
    paths = []
    for i, (name, asm) in enumerate(seen):
        path = os.path.join(out_dir, f"{i:02d}_{name}.ttir")
        with open(path, "w") as f:
            f.write(asm)
        paths.append(path)
    return paths


def compile_kernel(ttir_path: str, num_warps: int, num_stages: int) -> dict:
    """TTIR -> (Triton's TTIR passes, as jaxlib runs them) -> TTGIR, PTX, cubin, SASS; a summary."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = ir.parse_mlir_module(ttir_path, ctx)
    mod.context = ctx
    mod = CUDABackend.make_ttir(mod, {}, options, 90)
    base = ttir_path[:-len(".ttir")]
    with open(base + ".opt.ttir", "w") as f:
        f.write(str(mod))
    k = triton.compile(base + ".opt.ttir", target=target,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    for key in ("ttgir", "ptx"):
        with open(f"{base}.{key}", "w") as f:
            f.write(k.asm[key])
    with open(base + ".cubin", "wb") as f:
        f.write(k.asm["cubin"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx",
                            "-o", base + ".ptxas.cubin"], capture_output=True, text=True).stderr
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"],
                          capture_output=True, text=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    regs = re.search(r"Used (\d+) registers", ptxas)
    spill = re.search(r"(\d+) bytes spill stores", ptxas)
    count = lambda pat: len(re.findall(pat, sass))
    return dict(kernel=os.path.basename(base), registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spill.group(1)) if spill else None,
                shared_bytes=k.metadata.shared, HGMMA=count(r"\bHGMMA\."),
                QGMMA=count(r"\bQGMMA\."), HMMA=count(r"\bHMMA\."),
                HGMMA_register_A=count(r"HGMMA\.\S+ R\d+, R\d+,"), LDS=count(r"\bLDS[.\s]"),
                LDS_U16=count(r"\bLDS\.U16\b"), LDSM=count(r"\bLDSM\b"),
                BAR_SYNC=count(r"BAR\.SYNC"), LDGSTS_128=count(r"LDGSTS\.E\.BYPASS\.128"),
                LDGSTS_64=count(r"LDGSTS\.E\.64"), STL=count(r"\bSTL\b"), LDL=count(r"\bLDL\b"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--N", type=int, default=1 << 20)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--tiles", default="/8192", help="benchmarks.tiles.parse_tiles spec")
    ap.add_argument("--which", default="dense,dosa")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    paths = lower_kernels(a.out, a.T, a.N, a.H, a.D, a.K, a.tiles, a.which.split(","))
    print(f"{len(paths)} kernels lowered to {a.out}")
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: stopping at the Triton IR", file=sys.stderr)
        return
    from benchmarks.tiles import parse_tiles
    tiles, _ = parse_tiles(a.tiles)
    for p in paths:
        scr, ref = "dosa_screen" in p, "dosa_refine" in p
        nw = (tiles.screen_warps if scr else (tiles.refine_warps or tiles.num_warps) if ref
              else tiles.num_warps)
        ns = ((tiles.screen_stages if scr else tiles.refine_stages if ref else 0)
              or tiles.num_stages)
        print(compile_kernel(p, nw, ns), flush=True)


if __name__ == "__main__":
    main()
