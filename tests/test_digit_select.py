"""Top-k of long rows without a sort (``dosa_jax.digit_select``): bitwise ``lax.top_k`` —
keys and positions, ties in position order — on adversarial rows; and the decode fallbacks
built on it (every record selected, the next witnesses from every record) bitwise the
functions they replace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dosa_jax import digit_select as ds
from dosa_jax.decode import best_witnesses, distinct_pool
from dosa_jax.selection import INT32_MAX, INT32_MIN, select_by_position

IMIN, IMAX = int(INT32_MIN), int(INT32_MAX)


def _rows(seed=0, W=600):
    """Rows that stress the k-th key: random, many ties, all equal, the int32 extremes,
    INT32_MIN pads, two values only, negative keys only."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(IMIN, IMAX, W, dtype=np.int64),
            rng.integers(-3, 4, W),                         # ties everywhere
            np.full(W, 7),                                  # all equal
            np.where(rng.random(W) < 0.5, IMIN, IMAX),      # the extremes only
            np.where(np.arange(W) < W // 3, rng.integers(0, 50, W), IMIN),   # pads after
            np.where(rng.random(W) < 0.9, 5, 6),            # one value above a sea of ties
            -rng.integers(1, 1000, W)]                      # negative keys only
    return jnp.asarray(np.stack(rows).astype(np.int32))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_kth_largest_by_digits_is_lax_top_k_kth(bits):
    x = _rows(1)
    for k in (1, 2, 37, 199, 200, 599, 600):
        want = lax.top_k(x, k)[0][:, k - 1]
        got = ds.kth_largest_by_digits(x, k, bits)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"k={k}")


@pytest.mark.parametrize("k", [1, 5, 64, 200, 599, 600])
def test_top_k_by_digits_is_lax_top_k_bitwise(k):
    x = _rows(2)
    want_key, want_pos = lax.top_k(x, k)
    got_key, got_pos = jax.jit(ds.top_k_by_digits, static_argnums=1)(x, k)
    np.testing.assert_array_equal(np.asarray(got_key), np.asarray(want_key))
    np.testing.assert_array_equal(np.asarray(got_pos), np.asarray(want_pos))
    assert got_pos.dtype == jnp.int32


def test_top_k_rows_switches_at_the_limit_and_answers_the_same():
    x = _rows(3, W=300)
    for limit in (299, 300):          # by digits, then by lax.top_k: the same answer
        key, pos = ds.top_k_rows(x, 40, limit)
        np.testing.assert_array_equal(np.asarray(key), np.asarray(lax.top_k(x, 40)[0]))
        np.testing.assert_array_equal(np.asarray(pos), np.asarray(lax.top_k(x, 40)[1]))


def test_digit_select_rejects_bad_arguments():
    x = _rows(4, W=20)
    with pytest.raises(ValueError, match="k must be in"):
        ds.top_k_by_digits(x, 21)
    with pytest.raises(ValueError, match="k must be in"):
        ds.kth_largest_by_digits(x, 0)
    with pytest.raises(ValueError, match="keys must be int32"):
        ds.top_k_by_digits(x.astype(jnp.float32), 3)
    with pytest.raises(ValueError, match="bits must divide 32"):
        ds.kth_largest_by_digits(x, 3, bits=3)


def test_select_by_position_with_a_limit_is_the_same_selection():
    rng = np.random.default_rng(5)
    s = rng.standard_normal((3, 500)).astype(np.float32)
    s[0, ::7] = 1.0                        # ties at the top
    s[1, 50:] = np.nan                     # not eligible
    s[2, :] = -np.inf
    valid = jnp.asarray(rng.random((3, 500)) < 0.8)
    for k in (10, 450, 600):               # 600: more than the row (pads)
        a = select_by_position(jnp.asarray(s), k, valid)
        b = select_by_position(jnp.asarray(s), k, valid, limit=100)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _records(seed, T=3, S=5, C=48, K=32):
    """Split record buffers as the canonical scan leaves them: each split's records in id
    order within its own id range (ascending across splits), counts up to C (only the first
    K read), order keys with ties; one row with no record, one with few."""
    rng = np.random.default_rng(seed)
    span = 1000
    rk = rng.integers(-40, 40, (T, S, C)).astype(np.int32)
    ri = np.zeros((T, S, C), np.int32)
    cnt = rng.integers(0, C + 1, (T, S)).astype(np.int32)
    cnt[1] = 0
    cnt[2, :] = [3, 0, 1, 0, 2]
    for t in range(T):
        for s in range(S):
            ri[t, s] = np.sort(rng.choice(span, C, replace=False)) + s * span
    return jnp.asarray(rk), jnp.asarray(ri), jnp.asarray(cnt), K


def test_select_all_records_is_select_from_records(monkeypatch):
    from pallas_kernels import decode as kd
    from pallas_kernels import records as rec
    monkeypatch.setattr(kd, "SORT_ROW_LIMIT", 40)     # rows of S·K = 160: by digits
    for seed in range(3):
        rk, ri, cnt, K = _records(seed)
        want = rec.select_from_records(rk, ri, cnt, K)
        got = kd.select_all_records(rk, ri, cnt, K)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_record_witnesses_is_the_distinct_pool_selection(monkeypatch):
    """The next witnesses from every record: the records end to end, witnesses not among
    them — bitwise ``best_witnesses(distinct_pool(...))`` over the split layout, with
    witnesses that repeat a record id, invalid witnesses, and rows with few records."""
    from pallas_kernels import decode as kd
    monkeypatch.setattr(kd, "SORT_ROW_LIMIT", 40)
    for seed in range(3):
        rk, ri, cnt, K = _records(seed)
        T, S, _ = rk.shape
        rng = np.random.default_rng(100 + seed)
        W = 24
        wids = rng.choice(S * 1000, (T, W)).astype(np.int32)
        wids[:, :6] = np.asarray(ri)[:, 0, :6]         # some witnesses are records
        wids[:, 6:9] = -1                              # repeats / invisible
        wk = rng.integers(-40, 40, (T, W)).astype(np.int32)
        wk[:, :6] = np.asarray(rk)[:, 0, :6]           # a record's own key
        wk[:, 6:9] = IMIN
        for t in range(T):        # as the step passes them: a repeated witness carries −1
            seen = set()
            for j in range(W):
                if wids[t, j] in seen:
                    wids[t, j], wk[t, j] = -1, IMIN
                seen.add(int(wids[t, j]))
        wids, wk = jnp.asarray(wids), jnp.asarray(wk)
        valid = jnp.arange(K)[None, None, :] < jnp.minimum(cnt, K)[:, :, None]
        keys = jnp.where(valid, rk[..., :K], IMIN).reshape(T, S * K)
        ids = jnp.where(valid, ri[..., :K], -1).reshape(T, S * K)
        for n in (10, 100, 400):
            want = best_witnesses(*distinct_pool(keys, ids, wk, wids), n)
            got = kd.record_witnesses(rk, ri, cnt, K, n, wk, wids)
            for x, y in zip(got, want):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"n={n}")
