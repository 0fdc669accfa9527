"""Exact Top-K of float32 score rows faster than ``lax.top_k`` (Pallas Triton), and its twin.

``lax.top_k`` sorts every row (DESIGN §13). This is a *threshold select* over int32 order keys
(:func:`dosa_jax.selection.order_key`; NaN never selected):

1. **guess** — a strided sample of each row (≤ 16384 columns) gives a
   threshold θ₀ expected to leave about 2k keys above it (the
   ⌈2k·m/M⌉+16-th largest sampled key);
2. **filter** — one streaming pass (Triton kernel, grid rows × splits)
   appends keys ≥ θ₀ into per-(row, split) record buffers with the online
   threshold of :mod:`pallas_kernels.records` (compaction to the split's own
   K-th largest when a buffer fills: never drops a candidate);
3. **check** — if fewer than k keys of a row cleared θ₀ (the guess was too
   high), the row is filtered again with no threshold (counted, exact);
4. **select** — ``lax.top_k`` over the records (each split's scan ends with
   at most k of them, so k slots per split; score desc, then position asc =
   index asc), indices mapped back.

The whole row is read once from device memory (twice for a failed guess).
Backend: Triton (``cumsum`` + masked stores at computed positions; DESIGN §13).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax import selection
from dosa_jax.selection import INT32_MIN, order_key
from dosa_jax.tiling import round_up_to
from pallas_kernels import records as rec
from pallas_kernels.common import (THETA_NONE, compiler_params, interpret_default, kernel_order_key)

Array = jax.Array


def _rows_kernel(s_ref, v_ref, th_ref, rk_ref, ri_ref, cnt_ref, app_ref, *, M: int, S: int,
                 C: int, K: int, BK: int, CH: int, interpret: bool):
    r = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    theta0 = th_ref[pl.ds(r, 1)]
    base = (r * S + s) * C + jnp.zeros((1,), jnp.int32)
    ntile = (M + BK - 1) // BK
    per = (ntile + S - 1) // S
    start = s * per
    stop = jnp.minimum(start + per, ntile)
    lanes = jnp.arange(BK, dtype=jnp.int32)

    def tile(j, state):
        cols = j * BK + lanes
        inb = cols < M
        x = rec._plgpu().load(s_ref.at[r, pl.ds(j * BK, BK)], mask=inb, other=float("nan"))
        x = jnp.where(x == 0, 0.0, x)
        key = kernel_order_key(x)[None, :]
        elig = inb[None, :] & (key != INT32_MIN)
        if v_ref is not None:
            vv = rec._plgpu().load(v_ref.at[r, pl.ds(j * BK, BK)], mask=inb, other=0)
            elig = elig & (vv[None, :] != 0)
        count, theta, strict = state
        count, n = rec.append(rk_ref, ri_ref, base, count, rec.theta_accept(theta, strict),
                              key, cols[None, :], elig, C=C, size=size)
        return (count, theta, strict), n

    state, appended = rec.scan_tiles(start, stop, tile, theta0, rk_ref, ri_ref, base, K, C=C,
                                     BK=BK, CH=CH, size=size, interpret=interpret)
    o = jnp.zeros((1,), jnp.int32) + r * S + s
    cnt_ref[o] = state[0]
    app_ref[o] = appended


def _kernel_with_optional_valid(has_valid, **kw):
    if has_valid:
        def k(s_ref, v_ref, th_ref, *outs):
            _rows_kernel(s_ref, v_ref, th_ref, *outs, **kw)
    else:
        def k(s_ref, th_ref, *outs):
            _rows_kernel(s_ref, None, th_ref, *outs, **kw)
    return k


@functools.partial(jax.jit, static_argnames=("K", "S", "C", "BK", "CH", "num_warps", "interpret"))
def _filter_rows(scores, valid, theta0, *, K, S, C, BK, CH, num_warps, interpret):
    T, M = scores.shape
    size = T * S * C
    kern = _kernel_with_optional_valid(valid is not None, M=M, S=S, C=C, K=K, BK=BK, CH=CH,
                                       interpret=interpret)
    i32 = jnp.int32
    args = (scores,) + ((valid,) if valid is not None else ()) + (theta0,)
    rk, ri, cnt, app = pl.pallas_call(
        kern, grid=(T, S),
        out_shape=(jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                   jax.ShapeDtypeStruct((T * S,), i32), jax.ShapeDtypeStruct((T * S,), i32)),
        compiler_params=compiler_params(num_warps, 2), interpret=interpret,
        name="dosa_threshold_select")(*args)
    return rk.reshape(T, S, C), ri.reshape(T, S, C), cnt.reshape(T, S), app.reshape(T, S)


def sample_threshold(keys_sample: Array, k: int, M: int) -> Array:
    """θ₀ from a strided sample's order keys [T, m]: the rank leaving ≈ 2k keys above it."""
    m = keys_sample.shape[-1]
    j = min(m, -(-2 * k * m // M) + 16)
    kth = lax.top_k(keys_sample, j)[0][..., j - 1]
    return jnp.where(kth == INT32_MIN, THETA_NONE, kth)


def filter_plan(T: int, M: int, k: int, block: int = 512, splits=None, sample: int = 16384):
    """Static sizes of the filter pass: tile BK, compaction chunk CH, slots C per
    (row, split) (≥ k + BK: a compaction always frees a tile's room), splits S, sample stride."""
    CH = 512
    return dict(BK=block, CH=CH, C=round_up_to(k + block, CH),
                S=splits or max(1, min(8, 1024 // max(T, 1), M // (block * 64))),
                stride=max(1, M // sample))


def guess_threshold(scores: Array, k: int, plan: dict, valid=None) -> Array:
    """Step 1, the guess θ₀ per row from its strided sample (:func:`sample_threshold`)."""
    stride = plan["stride"]
    skey = order_key(scores[:, ::stride])
    if valid is not None:
        skey = jnp.where(valid[:, ::stride], skey, INT32_MIN)
    return sample_threshold(skey, k, scores.shape[1])


def filter_rows(scores, valid_i8, theta0, *, k: int, plan: dict, interpret: bool):
    """Step 2, the filter kernel with the plan's sizes: (order keys, ids, counts, appended)."""
    return _filter_rows(scores, valid_i8, theta0, K=k, S=plan["S"], C=plan["C"], BK=plan["BK"],
                        CH=plan["CH"], num_warps=4, interpret=interpret)


def exact_topk(scores: Array, k: int, *, valid=None, splits=None, block: int = 512,
               sample: int = 16384, min_columns: int = 65536, interpret=None,
               return_stats: bool = False):
    """Exact Top-k of each row of ``scores`` [T, M] (position = key index).

    Same contract as :func:`dosa_jax.selection.exact_topk`: score desc, index asc,
    NaN never selected, ``-1``/``-inf`` pads. Rows shorter than ``min_columns``
    (or ``k`` close to M) use the reference (``lax.top_k``), which is fast there.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a static int >= 1, got {k!r}")
    if scores.ndim != 2:
        lead = scores.shape[:-1]
        flat = scores.reshape((-1, scores.shape[-1]))
        fv = None if valid is None else valid.reshape(flat.shape)
        out = exact_topk(flat, k, valid=fv, splits=splits, block=block, sample=sample,
                         min_columns=min_columns, interpret=interpret, return_stats=return_stats)
        i, s = out[0].reshape(lead + (k,)), out[1].reshape(lead + (k,))
        return (i, s, out[2]) if return_stats else (i, s)
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"scores must be floating point, got {scores.dtype}")
    scores = scores.astype(jnp.float32)
    T, M = scores.shape
    if M < max(min_columns, 8 * k):
        i, s = selection.exact_topk(scores, k, valid=valid)
        return (i, s, {"fallback_rows": jnp.zeros((T,), jnp.int32)}) if return_stats else (i, s)
    if interpret is None:
        interpret = interpret_default()
    plan = filter_plan(T, M, k, block, splits, sample)
    theta0 = guess_threshold(scores, k, plan, valid)
    v8 = None if valid is None else valid.astype(jnp.int8)
    run = functools.partial(filter_rows, k=k, plan=plan, interpret=interpret)
    rk, ri, cnt, app = run(scores, v8, theta0)
    # the guess θ₀ is valid iff at least k keys cleared it; otherwise filter again, unthresholded
    bad = jnp.sum(app, axis=1) < k
    bad = bad & (theta0 > THETA_NONE)

    def redo(args):
        rk, ri, cnt = args
        th = jnp.where(bad, THETA_NONE, jnp.int32(2 ** 31 - 1))  # other rows accept nothing
        rk2, ri2, cnt2, _ = run(scores, v8, th)
        sel = bad[:, None, None]
        return (jnp.where(sel, rk2, rk), jnp.where(sel, ri2, ri),
                jnp.where(bad[:, None], cnt2, cnt))

    rk, ri, cnt = lax.cond(jnp.any(bad), redo, lambda a: a, (rk, ri, cnt))
    idx, sc = rec.select_from_records(rk, ri, cnt, k)
    if return_stats:
        return idx, sc, {"fallback_rows": bad.astype(jnp.int32), "theta0": theta0,
                         "records": jnp.sum(cnt, axis=1)}
    return idx, sc


def exact_topk_reference(scores: Array, k: int, *, valid=None):
    """jnp twin: ``lax.top_k`` on order keys (the contract's reference)."""
    return selection.exact_topk(scores, k, valid=valid)
