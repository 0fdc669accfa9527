"""The dense fused indexer (Pallas Triton) and its jnp twin — ``dense_topk`` on the GPU.

Full-head scoring of every visible key with an online threshold filter and
compact writeback, never materialising the [T, N] score matrix (the analogue
of the paper's LiteTopK baseline; DESIGN §14 (b)). Grid: (query groups of
``BQ``, key splits ``S``). A program loads its ``BQ·H`` query rows once, walks
its key tiles (``BK`` keys, contiguous loads), scores them with the shared
:func:`pallas_kernels.scoring.score_tile`, and appends records whose order key
clears its running threshold into its per-query buffers
(:mod:`pallas_kernels.records`: online K-th-largest threshold, in-place
compaction, no candidate ever dropped). Exact selection of the records
(score desc, id asc) finishes ``dense_topk``.

Backend: Triton, because the epilogue needs ``cumsum`` and masked stores at
computed positions (DESIGN §13); Mosaic GPU has neither. The same kernel serves
the DoSA recovery path (``theta0 = τ``, survivors of a failed screen).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dosa_jax.selection import select_by_position
from pallas_kernels import records as rec
from pallas_kernels.common import (THETA_NONE, compiler_params, group_range, interpret_default,
                                   mma_pieces, split_key_tiles)
from pallas_kernels.operands import Candidates, Operands, capacity_for, prepare_operands
from pallas_kernels.scoring import load_query_tile, score_reference, score_tile
from pallas_kernels.tiles import Tiles, check_tiles

Array = jax.Array


def _dense_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, H: int, N: int, S: int, C: int, K: int,
                  pairs, fp8_mma: bool, lane_sums: bool, interpret: bool):
    q_refs, (w_ref, lo_ref, hi_ref, th_ref), k_refs, (sc_ref,), outs = (
        refs[:Pq], refs[Pq:Pq + 4], refs[Pq + 4:Pq + 4 + Pk], refs[Pq + 4 + Pk:Pq + 5 + Pk],
        refs[Pq + 5 + Pk:])
    rk_ref, ri_ref, cnt_ref, tho_ref, app_ref = outs
    BQ, BK, CH = tiles.BQ, tiles.BK, tiles.CH
    g = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, g, BQ=BQ, H=H, layout=tiles.layout)
    lo = lo_ref[pl.ds(g * BQ, BQ)]
    hi = hi_ref[pl.ds(g * BQ, BQ)]
    theta0 = th_ref[pl.ds(g * BQ, BQ)]
    t_ids = g * BQ + jnp.arange(BQ, dtype=jnp.int32)
    base = (t_ids * S + s) * C

    klo, khi = group_range(lo, hi)
    start, stop = split_key_tiles(klo, khi, BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)

    def tile(j, state):
        ids = j * BK + lanes
        inb = ids < N
        kp = [k_ref[pl.ds(j * BK, BK), :] for k_ref in k_refs] if N % BK == 0 else [
            rec._plgpu().load(k_ref.at[pl.ds(j * BK, BK), :], mask=inb[:, None])
            for k_ref in k_refs]
        scale = rec._plgpu().load(sc_ref.at[pl.ds(j * BK, BK)], mask=inb, other=1.0)
        sc = score_tile(qp, wv, kp, scale, BQ=BQ, H=H, pairs=pairs, fp8_mma=fp8_mma,
                        layout=tiles.layout, lane_sums=lane_sums)
        return rec.append_scored_tile(rk_ref, ri_ref, base, state, sc, ids, lo, hi, C=C,
                                      size=size)

    state, appended = rec.scan_tiles(start, stop, tile, theta0, rk_ref, ri_ref, base, K, C=C,
                                     BK=BK, CH=CH, size=size, interpret=interpret)
    count, theta, _ = state
    oidx = t_ids * S + s
    cnt_ref[oidx] = count
    tho_ref[oidx] = theta
    app_ref[oidx] = appended


@functools.partial(jax.jit, static_argnames=("K", "splits", "capacity", "tiles", "interpret",
                                             "T", "H", "pairs", "fp8_mma", "lane_sums"))
def _dense_call(q, w, lo, hi, theta0, k, scale, *, K, splits, capacity, tiles, interpret,
                T, H, pairs, fp8_mma, lane_sums):
    BQ = tiles.BQ
    Tpad = lo.shape[0]
    G = Tpad // BQ
    S = splits
    C = capacity
    N = k.shape[1]
    size = Tpad * S * C
    kern = functools.partial(_dense_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, H=H, N=N,
                             S=S, C=C, K=K, pairs=pairs, fp8_mma=fp8_mma, lane_sums=lane_sums,
                             interpret=interpret)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                 jax.ShapeDtypeStruct((Tpad * S,), i32), jax.ShapeDtypeStruct((Tpad * S,), i32),
                 jax.ShapeDtypeStruct((Tpad * S,), i32))
    rk, ri, cnt, th, app = pl.pallas_call(
        kern, out_shape=out_shape, grid=(G, S),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_dense_scan")(*q, w, lo, hi, theta0, *k, scale)
    return Candidates(rk.reshape(Tpad, S, C)[:T], ri.reshape(Tpad, S, C)[:T],
                      cnt.reshape(Tpad, S)[:T], th.reshape(Tpad, S)[:T],
                      app.reshape(Tpad, S)[:T])


def dense_candidates(ops: Operands, lo, hi, theta0, K: int, *, splits: int = 1, capacity=None,
                     tiles: Tiles = Tiles(), interpret=None) -> Candidates:
    """Run the dense scan: records holding every key of the exact Top-K of each query.

    Args:
      ops: :func:`prepare_operands` output.
      lo, hi: [T] int32 visible ranges (clipped); theta0: [T] int32 initial order-key
        threshold (``THETA_NONE``: none; a valid lower bound on τ* otherwise).
    """
    if interpret is None:
        interpret = interpret_default()
    T = ops.T
    Tpad = ops.q.shape[1] // ops.H
    pad = Tpad - T
    lo = jnp.pad(lo.astype(jnp.int32), (0, pad))
    hi = jnp.pad(hi.astype(jnp.int32), (0, pad))
    theta0 = jnp.pad(theta0.astype(jnp.int32), (0, pad), constant_values=THETA_NONE)
    C = capacity_for(K, tiles.BK, capacity if capacity is not None else tiles.record_slots or None)
    return _dense_call(ops.q, ops.w, lo, hi, theta0, ops.k, ops.scale, K=K, splits=splits,
                       capacity=C, tiles=tiles, interpret=interpret, T=T, H=ops.H,
                       pairs=ops.pairs, fp8_mma=ops.fp8_mma, lane_sums=ops.lane_sums)


def default_splits(T: int, N: int, BQ: int, BK: int) -> int:
    """Key splits so that the grid has enough programs (≥ ~4 per SM of 132) and each split
    still walks many tiles."""
    groups = max(1, -(-T // BQ))
    want = max(1, 528 // groups)
    max_by_work = max(1, N // (BK * 64))
    return int(max(1, min(want, max_by_work, 64)))


def dense_topk(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(), splits=None,
               mma_dtype=jnp.bfloat16, interpret=None, return_candidates=False):
    """Exact Top-K by the dense fused Pallas indexer (validated inputs).

    Returns (indices [T, K] int32, scores [T, K] float32) in contract order.
    """
    check_tiles(tiles)
    ops = prepare_operands(q, w, k, k_scale, tiles.BQ, mma_dtype, tiles.layout, tiles.widen_fp8,
                           tiles.lane_sums)
    theta0 = jnp.full((q.shape[0],), THETA_NONE, jnp.int32)
    return topk_from_operands(ops, lo, hi, theta0, config.top_k, splits=splits, tiles=tiles,
                              interpret=interpret, return_candidates=return_candidates)


def topk_from_operands(ops: Operands, lo, hi, theta0, K: int, *, splits=None,
                       tiles: Tiles = Tiles(), interpret=None, return_candidates=False):
    """The dense scan of prepared operands from thresholds ``theta0`` ([T] order keys, each a
    valid lower bound on τ* or ``THETA_NONE``), then exact selection of the records."""
    S = splits or default_splits(ops.T, ops.k.shape[1], tiles.BQ, tiles.BK)
    cand = dense_candidates(ops, lo, hi, theta0, K, splits=S, tiles=tiles, interpret=interpret)
    idx, sc = rec.select_from_records(cand.key, cand.ids, cand.count, K)
    if return_candidates:
        return idx, sc, cand
    return idx, sc


def dense_topk_reference(q, k, w, k_scale, lo, hi, config, *, mma_dtype=jnp.bfloat16):
    """jnp twin of :func:`dense_topk`: the same scoring function (operand pieces, float32
    accumulation) on the full [T, N] matrix, then exact selection."""
    qp = mma_pieces(q, mma_dtype)
    kp = mma_pieces(k, mma_dtype)
    s = score_reference(qp, w.astype(jnp.float32), kp, k_scale)
    ids = jnp.arange(k.shape[0], dtype=jnp.int32)[None, :]
    valid = (ids >= lo[:, None]) & (ids < hi[:, None])
    return select_by_position(s, config.top_k, valid)


__all__ = ["dense_candidates", "default_splits", "dense_topk", "dense_topk_reference",
           "topk_from_operands"]
