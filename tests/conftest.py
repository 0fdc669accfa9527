"""Shared test helpers: float64 NumPy reference scorer and comparison utilities."""

import functools
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: XLA's CPU code generation without LLVM's optimisation passes (``DOSA_TEST_XLA_OPT``, default
#: "0"): the suite is compile-bound (thousands of small programs, Pallas kernels interpreted),
#: and at level 0 the whole CPU suite ran in 1090 s against 1584 s at XLA's default level on
#: the same two cores, every test passing at both. The arithmetic is the same IEEE arithmetic:
#: XLA's CPU backend emits no fast-math flags, so LLVM may not reassociate or contract, and
#: the bitwise tests compare programs compiled alike. DOSA_TEST_XLA_OPT=default keeps XLA's
#: level. GPU runs (JAX_PLATFORMS other than cpu) never change it.
if os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("DOSA_TEST_XLA_OPT", "0") == "0":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_backend_optimization_level=0").strip()

import numpy as np
import pytest

#: XLA's persistent compilation cache for a test run: a path: that directory, shared by the
#: pytest-xdist workers and kept across runs; "run": a fresh directory per run, removed at
#: the end; unset or "off": no cache. Off by default: within one run it loaded about 200 of
#: about 3300 programs (≈ 27 s of compilation), while serializing every CPU executable
#: (jaxlib 0.10.2, ``executable.serialize()``) now and then crashed a worker with a
#: segmentation fault.
CACHE_ENV = "DOSA_TEST_COMPILATION_CACHE"


def _use_compilation_cache(path):
    """Every compiled program goes to ``path`` and is loaded from there when any process of
    the run compiles the same HLO again: a worker reuses the other worker's programs, and
    programs that trace to identical HLO (the dense path under Configs that differ only in
    DoSA fields, the same kernel reached from two tests) compile once. The key is the HLO
    and the compile options, so a cached program is the program that would be compiled."""
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


#: A process may hold at most ``vm.max_map_count`` memory mappings (65530 by default) and
#: every CPU executable XLA keeps maps about three: one pytest-xdist worker running half of
#: the suite kept ≈ 50,000 programs' worth (test_pallas_kernels alone left 19,000 mappings)
#: and crashed with a segmentation fault inside the compiler when a new mapping failed. Past
#: this share of the limit the worker drops jax's compiled programs (they recompile on use).
MAP_SHARE = 0.6


@functools.lru_cache(maxsize=None)
def _map_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None                      # not Linux: no such limit to guard


def _mappings():
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test: when the process's memory mappings pass :data:`MAP_SHARE` of the
    kernel's limit, clear jax's caches of compiled programs and collect them."""
    limit = _map_limit()
    if limit is None or _mappings() < MAP_SHARE * limit:
        return
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:          # a pytest-xdist worker: the controller's directory
        path = workerinput.get("dosa_compilation_cache")
    else:
        path = os.environ.get(CACHE_ENV) or None
        if path is not None and path.lower() == "run":
            path = tempfile.mkdtemp(prefix="dosa-jax-test-xla-cache-")
            config._dosa_cache_owned = path
        elif path is not None and path.lower() == "off":
            path = None
    config._dosa_compilation_cache = path
    if path:
        _use_compilation_cache(path)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (controller): hand the run's cache directory to each worker."""
    node.workerinput["dosa_compilation_cache"] = node.config._dosa_compilation_cache


def pytest_collection_modifyitems(config, items):
    """Modules holding a test marked ``slow`` run first, each module's tests kept together in
    their order (a module split in two sets its module fixtures up twice). Under ``-n 2
    --dist loadgroup`` the xdist groups go out first, then single tests in collection order:
    a long test collected last (the notebook, the trained fixture) ran alone at the end."""
    module = lambda item: item.nodeid.split("::")[0]
    slow = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: module(item) not in slow)


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` a pytest-xdist worker marks each grouped test's id with its
    group; where the installed pytest ignores that mark the groups are silently split (module
    fixtures re-run on both workers). Stop the run with the reason instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items
            if i.get_closest_marker("xdist_group") is not None and "@" not in i.nodeid]
    if lost:
        msg = (f"pytest-xdist's loadgroup marks are not applied under pytest "
               f"{pytest.__version__} (e.g. {lost[0]}): install the test extra's pytest "
               f"(pyproject.toml)")
        print(msg, file=sys.__stderr__, flush=True)     # a worker's error reaches the
        raise pytest.UsageError(msg)                     # controller as an internal error


def pytest_unconfigure(config):
    owned = getattr(config, "_dosa_cache_owned", None)
    if owned:
        shutil.rmtree(owned, ignore_errors=True)


def reference_scores_f64(q, k, w, k_scale=None):
    """s[t, i] = α_i Σ_h w_h relu(q_h · k_i) in float64 (independent of the library)."""
    q64 = np.asarray(q, dtype=np.float32).astype(np.float64)
    k64 = np.asarray(k, dtype=np.float32).astype(np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    x = np.einsum("thd,nd->tnh", q64, k64)
    s = np.einsum("tnh,th->tn", np.maximum(x, 0.0), w64)
    if k_scale is not None:
        s = s * np.asarray(k_scale, np.float64)[None, :]
    return s


def rounding_band(q, k, w, k_scale=None):
    """Per (t, i) bound on |float32 scorer − float64 score|: generous γ·Σ|w|‖q‖‖k‖α."""
    q64 = np.asarray(q, dtype=np.float32).astype(np.float64)
    k64 = np.asarray(k, dtype=np.float32).astype(np.float64)
    mag = np.einsum("th,th->t", np.abs(np.asarray(w, np.float64)), np.linalg.norm(q64, axis=-1))
    kn = np.linalg.norm(k64, axis=-1)
    if k_scale is not None:
        kn = kn * np.asarray(k_scale, np.float64)
    D, H = q64.shape[2], q64.shape[1]
    return (D + H + 4) * 2.0 ** -23 * mag[:, None] * kn[None, :] + 1e-30


def dense_reference_topk(s64, lo, hi, k):
    """Top-k by float64 scores with the contract order (score desc, index asc); -1 pads."""
    T, N = s64.shape
    out = np.full((T, k), -1, np.int64)
    for t in range(T):
        ids = np.arange(lo[t], hi[t])
        if ids.size == 0:
            continue
        sc = s64[t, ids]
        order = np.lexsort((ids, -sc))
        sel = ids[order][:k]
        out[t, :sel.size] = sel
    return out


def assert_matches_f64(idx, s64, band, lo, hi, k):
    """Index sets agree with the float64 Top-k except among keys within the rounding band
    of the float64 K-th score (DESIGN §12)."""
    idx = np.asarray(idx)
    ref = dense_reference_topk(s64, lo, hi, k)
    for t in range(idx.shape[0]):
        a = set(int(i) for i in idx[t] if i >= 0)
        b = set(int(i) for i in ref[t] if i >= 0)
        assert len(a) == len(b), (t, len(a), len(b))
        if a == b:
            continue
        kth = s64[t, ref[t][ref[t] >= 0][-1]]
        for i in a ^ b:
            assert abs(s64[t, i] - kth) <= 2 * band[t, i] + 2 * band[t].max() * 1e-3, (
                t, i, s64[t, i], kth, band[t, i])


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """A small weights file (tiny random LM, its H=4 indexers) as export_weights writes it,
    named as the slack weights are."""
    import jax
    from dosa_jax.lm import checkpoint, indexer as idx, train
    from dosa_jax.lm.model import init_lm
    tiny = train.PRESETS["tiny"]
    path = str(tmp_path_factory.mktemp("w") / "lm_weights_slack.npz")
    cfg = tiny.indexers[0]
    lm = init_lm(jax.random.PRNGKey(0), tiny.lm)
    checkpoint.export_weights(path, tiny.lm, lm, {4: (cfg, idx.init_indexers(
        jax.random.PRNGKey(3), tiny.lm, cfg))}, {"kind": "test"})
    return path
