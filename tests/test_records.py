"""The record buffers' compaction (``pallas_kernels.records.raise_threshold``) on adversarial
buffers, in a one-program kernel (interpret mode on CPU; compiled on a GPU).

Every case checks, per query, against numpy on the buffer it was given:
- the threshold t has #{key ≥ t} ≥ K (a lower bound on the K-th largest key: K witnesses);
- every record of the buffer's Top-K (score desc, id asc) is kept, in slot order;
- the kept records are exactly the keys ≥ t, at most K + slack of them; or, when ties at
  the K-th key leave no such t, exactly the K best in tie order, and the threshold is strict;
- the accepted minimum never decreases; buffers with fewer than K records are untouched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dosa_jax.selection import INT32_MAX, INT32_MIN
from pallas_kernels import records
from pallas_kernels.common import interpret_default

BQ, C, CH, K = 4, 128, 32, 40   # C a power of two: Triton tensors


def _kernel(k_in, i_in, cnt_in, th_in, st_in, k_out, i_out, cnt_out, th_out, st_out, *, slack,
            interpret):
    size = BQ * C
    base = jnp.arange(BQ, dtype=jnp.int32) * C
    for q in range(BQ):   # the buffers are compacted in place: copy them to the outputs first
        k_out[pl.ds(q * C, C)] = k_in[pl.ds(q * C, C)]
        i_out[pl.ds(q * C, C)] = i_in[pl.ds(q * C, C)]
    count, theta, strict = cnt_in[...], th_in[...], st_in[...]
    count, theta, strict = records.raise_threshold(k_out, i_out, base, count, theta, strict, K,
                                                   slack=slack, CH=CH, size=size,
                                                   interpret=interpret)
    cnt_out[...] = count
    th_out[...] = theta
    st_out[...] = strict


@functools.partial(jax.jit, static_argnames=("slack",))
def _raise(keys, ids, count, theta, strict, *, slack):
    i32 = jnp.int32
    interpret = interpret_default()
    return pl.pallas_call(
        functools.partial(_kernel, slack=slack, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((BQ * C,), i32), jax.ShapeDtypeStruct((BQ * C,), i32),
                   jax.ShapeDtypeStruct((BQ,), i32), jax.ShapeDtypeStruct((BQ,), i32),
                   jax.ShapeDtypeStruct((BQ,), i32)),
        interpret=interpret)(keys.reshape(-1), ids.reshape(-1), count, theta, strict)


def _case(rng, kind):
    """Per query: (keys [n], n). Slots hold ascending ids, as the scans append them."""
    out = []
    for q in range(BQ):
        n = [C - 8, C, K + 3, K][q] if kind != "short" else [K - 1, 0, 5, C][q]
        if kind in ("distinct", "short"):
            v = rng.choice(np.arange(-10 ** 6, 10 ** 6), n, replace=False)
        elif kind == "all_equal":
            v = np.full(n, 7)
        elif kind == "two_values":
            v = rng.choice([3, 9], n)
        elif kind == "ties_at_kth":   # a block of equal keys straddling rank K
            v = rng.integers(-50, 50, n) * 1000
            v[rng.permutation(n)[: n // 2]] = 0
        elif kind == "extremes":
            v = rng.choice([INT32_MIN + 1, INT32_MIN + 2, -1, 0, 1, INT32_MAX - 1, INT32_MAX], n)
        else:
            raise ValueError(kind)
        out.append(v.astype(np.int32))
    return out


def _top_k_slots(v, k):
    """Slots of the k best records in tie order (key desc, slot = id asc)."""
    order = np.lexsort((np.arange(len(v)), -v.astype(np.int64)))
    return np.sort(order[:k])


@pytest.mark.parametrize("slack", [0, 8, 28])
@pytest.mark.parametrize("kind", ["distinct", "all_equal", "two_values", "ties_at_kth",
                                  "extremes", "short"])
def test_raise_threshold_keeps_the_top_k(kind, slack):
    rng = np.random.default_rng([slack, len(kind)])
    vals = _case(rng, kind)
    keys = np.full((BQ, C), INT32_MIN, np.int32)
    ids = np.full((BQ, C), -1, np.int32)
    for q, v in enumerate(vals):
        keys[q, :len(v)] = v
        ids[q, :len(v)] = 1000 * q + 3 * np.arange(len(v))
    count = np.array([len(v) for v in vals], np.int32)
    theta = np.array([INT32_MIN + 1, -5, INT32_MIN + 1, 0], np.int32)
    strict = np.array([0, 1, 0, 0], np.int32)
    ko, io, cnt, th, st = map(np.asarray, _raise(jnp.asarray(keys), jnp.asarray(ids),
                                                 jnp.asarray(count), jnp.asarray(theta),
                                                 jnp.asarray(strict), slack=slack))
    ko, io = ko.reshape(BQ, C), io.reshape(BQ, C)
    for q, v in enumerate(vals):
        n = len(v)
        if n < K:   # nothing to compact: buffer, count and threshold untouched
            assert cnt[q] == n and th[q] == theta[q] and st[q] == strict[q]
            np.testing.assert_array_equal(ko[q, :n], v)
            continue
        kept = ko[q, :cnt[q]]
        top = _top_k_slots(v, K)
        kth = np.sort(v)[::-1][K - 1]
        # the kept records are a slot-ordered subsequence of the buffer holding its Top-K
        slots = (io[q, :cnt[q]] - 1000 * q) // 3
        assert np.all(np.diff(slots) > 0)
        np.testing.assert_array_equal(kept, v[slots])
        assert set(top) <= set(slots.tolist()), "a record of the Top-K was dropped"
        acc_old = int(theta[q]) + int(strict[q])
        acc_new = int(th[q]) + int(st[q])
        assert acc_new >= acc_old
        if acc_new > acc_old:   # the threshold was raised by this compaction
            t = int(th[q])
            assert np.sum(v >= t) >= K        # K witnesses: t ≤ the K-th largest key
            if st[q]:   # ties forced the exact K-th: exactly the K best, tie order
                assert t == kth and cnt[q] == K
                np.testing.assert_array_equal(slots, top)
                assert np.sum(v >= t) > K + slack
            else:
                np.testing.assert_array_equal(slots, np.nonzero(v >= t)[0])
                assert cnt[q] <= K + slack
        # room for the next tile whenever the buffer was full
        if np.sum(v >= kth) <= K + slack:
            assert cnt[q] <= K + slack
        else:
            assert cnt[q] == K or cnt[q] <= K + slack


def test_raise_threshold_probes_stop_inside_the_window():
    """With slack the search stops at the first probe inside [K, K + slack]; without, it still
    returns a t with exactly K keys ≥ t when one exists (distinct keys)."""
    rng = np.random.default_rng(3)
    v = rng.choice(np.arange(-10 ** 6, 10 ** 6), C, replace=False).astype(np.int32)
    keys = np.tile(v, (BQ, 1))
    ids = np.tile(np.arange(C, dtype=np.int32) * 3, (BQ, 1))
    count = np.full(BQ, C, np.int32)
    z = np.full(BQ, INT32_MIN + 1, np.int32)
    for slack in (0, 28):
        _, _, cnt, th, st = map(np.asarray, _raise(jnp.asarray(keys), jnp.asarray(ids),
                                                   jnp.asarray(count), jnp.asarray(z),
                                                   jnp.zeros(BQ, jnp.int32), slack=slack))
        assert np.all(st == 0)
        assert np.all((cnt >= K) & (cnt <= K + slack))
        assert np.all(cnt == np.sum(v[None, :] >= th[:, None], axis=1))
