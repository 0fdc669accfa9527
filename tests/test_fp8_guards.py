"""FP8 keys with scales, and faults that lose nothing (App. C guards).

Guard policy (README "Non-finite values"): an invalid scale (≤ 0, NaN, inf) in a
query's range, a non-finite plan value (NaN/inf in q or w) or a non-finite bound
met during the scan disables pruning for that query; it is answered by
full-domain recovery and counted. Dense and DoSA then agree bitwise.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import dosa_jax
from dosa_jax import synthetic
from test_exactness import check_case, run_pair

B = 64
CFG = dosa_jax.Config(top_k=16, key_block=B, query_tile=8)  # shared with test_exactness: one compile


def fp8_case(seed, query_dtype="float32", kind="structured", N=384, T=8, H=8, D=32):
    gen = synthetic.structured if kind == "structured" else synthetic.gaussian
    return gen(T=T, N=N, H=H, D=D, seed=seed, key_dtype="float8_e4m3fn", query_dtype=query_dtype)


@pytest.mark.parametrize("query_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_fp8_keys_dosa_equals_dense(query_dtype):
    rng = np.random.default_rng(7)
    for i in range(12):
        inp = fp8_case(i, query_dtype, "structured" if i % 2 else "gaussian")
        # scales spanning many binades
        scale = np.asarray(inp.k_scale) * np.exp2(rng.integers(-20, 21, inp.k_scale.shape))
        lo, hi = (inp.lo, inp.hi) if i % 3 else (jnp.zeros_like(inp.lo), jnp.full_like(inp.hi, 384))
        check_case(CFG, inp.q, inp.k, inp.w, lo, hi, k_scale=jnp.asarray(scale, jnp.float32))


def assert_equal_dense(cfg, q, k, w, lo, hi, k_scale=None):
    d, e = run_pair(cfg, q, k, w, lo, hi, k_scale)
    np.testing.assert_array_equal(np.asarray(d.indices), np.asarray(e.indices))
    np.testing.assert_array_equal(np.asarray(d.scores), np.asarray(e.scores))
    return d


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf])
def test_bad_scale_disables_pruning_for_queries_that_see_it(bad):
    inp = fp8_case(1)
    scale = np.asarray(inp.k_scale).copy()
    scale[300] = bad  # visible to the queries whose range reaches key 300
    lo = jnp.array([0, 0, 0, 0, 301, 0, 250, 0], jnp.int32)
    hi = jnp.array([384, 300, 301, 200, 384, 384, 350, 299], jnp.int32)
    d = assert_equal_dense(CFG, inp.q, inp.k, inp.w, lo, hi, jnp.asarray(scale))
    sees = (np.asarray(lo) <= 300) & (np.asarray(hi) > 300)
    np.testing.assert_array_equal(~np.asarray(d.stats.pruning), sees)
    assert np.all(np.isneginf(np.asarray(d.stats.tau_seed))[sees])


@pytest.mark.parametrize("where", ["q", "w"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_query_side_disables_pruning(where, value):
    inp = synthetic.structured(T=8, N=384, H=8, D=32, seed=2)
    q, w = np.array(inp.q), np.array(inp.w)
    if where == "q":
        q[3, 2, 5] = value
    else:
        w[3, 1] = value
    d = assert_equal_dense(CFG, q, inp.k, w, inp.lo, inp.hi)
    pr = np.asarray(d.stats.pruning)
    assert not pr[3] and pr[[0, 1, 2, 4, 5, 6, 7]].all()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_key_mid_scan_recovers_everything(value):
    """A bad key late in the range is met mid-scan, after other keys were rejected:
    recovery must rescore every visible key, including those rejected before."""
    inp = synthetic.structured(T=8, N=384, H=8, D=32, seed=4)
    k = np.array(inp.k)
    k[330, 7] = value
    d = assert_equal_dense(CFG, inp.q, k, inp.w, inp.lo, inp.hi)
    sees = np.asarray(inp.hi) > 330
    rec = np.asarray(d.stats.recoveries)
    assert (rec[sees] == 1).all() and (rec[~sees] == 0).all()
    # recovery scored the whole visible domain minus seeds
    vis = np.asarray(d.stats.visible) - np.asarray(d.stats.seeds)
    assert (np.asarray(d.stats.survivors)[sees] >= vis[sees]).all()


def test_nan_fp8_payload_recovers():
    inp = fp8_case(5)
    k = np.asarray(inp.k).copy()
    k[350] = np.float32(np.nan)  # e4m3fn has NaN (no inf)
    k = jnp.asarray(k, jnp.float8_e4m3fn)
    lo, hi = jnp.zeros_like(inp.lo), jnp.full_like(inp.hi, 384)
    d = assert_equal_dense(CFG, inp.q, k, inp.w, lo, hi, inp.k_scale)
    assert (np.asarray(d.stats.recoveries) == 1).all()
    assert not (np.asarray(d.indices) == 350).any()  # a NaN score is never selected


def test_fp8_extremes_and_capacity_overflow():
    """Payloads at ±448 and the subnormal minimum 2^-9, alternating signs that cancel,
    with a one-block candidate buffer."""
    rng = np.random.default_rng(11)
    N, D = 384, 32
    vals = np.array([448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 0.0, 1.0, -1.0], np.float32)
    k = rng.choice(vals, (N, D)).astype(np.float32)
    k[::7, ::2], k[::7, 1::2] = 448.0, -448.0  # exact cancellation pairs
    k8 = jnp.asarray(k, jnp.float8_e4m3fn)
    scale = jnp.asarray(np.exp2(rng.integers(-20, 21, N)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((8, 8, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    lo, hi = dosa_jax.causal_ranges(8, N)
    cfg = CFG.replace(capacity=B)
    d = check_case(cfg, q, k8, w, lo, hi, k_scale=scale)
    assert np.asarray(d.stats.overflows).max() >= 1
