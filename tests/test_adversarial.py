"""Adversarial inputs: ties, equal scores, zero vectors, one-signed and zero
weights, empty ranges, |Ω| < K, capacity far below the survivor count."""

import jax.numpy as jnp
import numpy as np
import pytest

import dosa_jax
from dosa_jax import synthetic
from test_exactness import check_case

B = 64
CFG = dosa_jax.Config(top_k=16, key_block=B, query_tile=8)  # shared with test_exactness: one compile


def base(seed=0, T=8, N=384, H=8, D=32):
    inp = synthetic.gaussian(T=T, N=N, H=H, D=D, seed=seed)
    return np.array(inp.q), np.array(inp.k), np.array(inp.w)


def ranges(T, N):
    return dosa_jax.causal_ranges(T, N)


def test_all_scores_equal_keeps_lowest_indices():
    q, k, w = base()
    k[:] = k[0]  # every key identical: every score ties
    lo, hi = ranges(8, 384)
    d = check_case(CFG, q, k, w, lo, hi)
    idx = np.asarray(d.indices)
    for t in range(8):
        assert idx[t].tolist() == list(range(16))


def test_many_ties_at_the_kth_score():
    q, k, w = base(1)
    k[100:220] = k[5]  # 120 copies of one key straddle the K-th place
    w = np.abs(w)
    lo, hi = ranges(8, 384)
    check_case(CFG, q, k, w, lo, hi)


def test_zero_norm_heads_and_zero_keys():
    q, k, w = base(2)
    q[:, ::3, :] = 0.0
    k[::5] = 0.0
    lo, hi = ranges(8, 384)
    check_case(CFG, q, k, w, lo, hi)
    q[:] = 0.0  # every score is exactly zero
    d = check_case(CFG, q, k, w, lo, hi)
    assert np.all(np.asarray(d.scores) == 0.0)


@pytest.mark.parametrize("sign", ["positive", "negative", "zero"])
def test_one_signed_or_zero_weights(sign):
    q, k, w = base(3)
    w = {"positive": np.abs(w), "negative": -np.abs(w), "zero": np.zeros_like(w)}[sign]
    lo, hi = ranges(8, 384)
    d = check_case(CFG, q, k, w, lo, hi)
    if sign == "zero":
        assert np.all(np.asarray(d.scores) == 0.0)


def test_empty_ranges_and_fewer_visible_than_k():
    q, k, w = base(4)
    lo = jnp.array([0, 5, 364, 10, 0, 383, 100, 0], jnp.int32)
    hi = jnp.array([0, 5, 384, 20, 3, 384, 90, 384], jnp.int32)
    d = check_case(CFG, q, k, w, lo, hi)
    idx = np.asarray(d.indices)
    assert (idx[0] == -1).all() and (idx[1] == -1).all() and (idx[6] == -1).all()
    assert (idx[2] >= 0).sum() == 16 and (idx[3] >= 0).sum() == 10 and (idx[5] >= 0).sum() == 1
    st = d.stats
    assert np.asarray(st.visible).tolist() == [0, 0, 20, 10, 3, 1, 0, 384]


def test_capacity_far_below_survivors_merges_exactly():
    """Gaussian data: most keys survive; a one-block buffer forces many rounds."""
    cfg = CFG.replace(capacity=B, raise_threshold=False)
    q, k, w = base(5)
    lo, hi = ranges(8, 384)
    d = check_case(cfg, q, k, w, lo, hi)
    st = d.stats
    assert np.asarray(st.overflows).max() >= 3
    assert np.all(np.asarray(st.rounds) == np.asarray(st.overflows) + 1)
    # no candidate lost: every survivor was fully scored exactly once
    assert np.all(np.asarray(st.survivors) <= np.asarray(st.screened))
