"""What the kernels read and write: prepared operands and record buffers.

:func:`prepare_operands` turns (q, w, k, α) into MMA pieces padded to the
kernels' shapes (:class:`Operands`, :func:`pallas_kernels.common.mma_pieces`);
the scoring kernels (dense, refinement) return their record buffers as
:class:`Candidates`, sized by :func:`capacity_for`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dosa_jax.tiling import round_up_to
from pallas_kernels.common import (in_lane_order, lane_sums_apply, mma_pieces, next_pow2,
                                   pad_axis, piece_pairs)

Array = jax.Array


class Candidates(NamedTuple):
    """Record buffers of a scoring scan ([T, S, C] / [T, S])."""

    key: Array      # int32 order keys
    ids: Array      # int32 key ids
    count: Array    # int32 valid records per (query, split)
    theta: Array    # int32 order key: final threshold (≤ τ* when ≥ K witnesses were held)
    appended: Array  # int32 records appended (work statistic)


class Operands(NamedTuple):
    """Kernel-ready operands: MMA pieces and padded shapes."""

    q: Array        # [Pq, Tpad*Hp, Dp]
    w: Array        # [Tpad*Hp] float32
    k: Array        # [Pk, N, Dp]
    scale: Array    # [N] float32
    T: int
    H: int          # padded heads Hp
    pairs: tuple
    fp8_mma: bool = False
    lane_sums: bool = False   # q/w rows in common.lane_aligned_order per group of BQ ("kc")


def prepare_key_operands(k, k_scale, mma_dtype=jnp.bfloat16, widen_fp8: bool = True):
    """The key side of :func:`prepare_operands`: (MMA pieces [Pk, N, Dp], scale [N] float32).

    Computed once per call and shared by the waves of :func:`pallas_kernels.pipeline.dosa_topk`
    (XLA does not hoist the fp8 → bf16 widening, which doubles the bytes, out of a loop).
    """
    Dp = max(16, next_pow2(k.shape[-1]))
    kp = pad_axis(mma_pieces(k, mma_dtype, widen_fp8), 2, Dp)
    scale = (jnp.ones((k.shape[0],), jnp.float32) if k_scale is None
             else k_scale.astype(jnp.float32))
    return kp, scale


def prepare_operands(q, w, k, k_scale, BQ: int, mma_dtype=jnp.bfloat16,
                     layout: str = "hk", widen_fp8: bool = True,
                     lane_sums: bool = False, keys=None, q_pieces=None) -> Operands:
    """Pieces, pads (heads to a power of two with zero weights, D to ≥ 16, T to BQ).

    ``layout="kh"`` multiplies keys by one query's H heads, so H is padded to ≥ 16.
    ``widen_fp8``: FP8 operands of a bf16 MMA become bf16 pieces here
    (:func:`pallas_kernels.common.mma_pieces`).
    ``lane_sums`` (``"kc"``): each group's BQ·H query rows and weights in
    :func:`pallas_kernels.common.lane_aligned_order` (the kernels follow ``ops.lane_sums``).
    ``keys``: :func:`prepare_key_operands` of the same ``k``, ``k_scale``, ``mma_dtype`` and
    ``widen_fp8``, computed before (``k`` is then only read for its shape).
    ``q_pieces``: the query's MMA pieces [P, T, H, D], made before
    (:func:`pallas_kernels.common.scaled_f16_pieces`); ``q`` is then only read for its shape.
    """
    T, H, D = q.shape
    Hp = next_pow2(max(H, 1))
    while BQ * Hp < 16 or (layout == "kh" and Hp < 16):
        Hp *= 2
    Dp = max(16, next_pow2(D))
    Tpad = round_up_to(max(T, 1), BQ)
    qp = mma_pieces(q, mma_dtype, widen_fp8) if q_pieces is None else q_pieces
    kp, scale = keys if keys is not None else prepare_key_operands(k, k_scale, mma_dtype,
                                                                   widen_fp8)
    qp = pad_axis(pad_axis(pad_axis(qp, 3, Dp), 2, Hp), 1, Tpad)
    wp = pad_axis(pad_axis(w.astype(jnp.float32), 1, Hp), 0, Tpad)
    qp = qp.reshape(qp.shape[0], Tpad * Hp, Dp)
    wp = wp.reshape(Tpad * Hp)
    lane_sums = bool(lane_sums) and layout == "kc" and lane_sums_apply(BQ, Hp)
    if lane_sums:
        qp = in_lane_order(qp, BQ, Hp)
        wp = in_lane_order(wp[None, :, None], BQ, Hp)[0, :, 0]
    return Operands(q=qp, w=wp, k=kp, scale=scale, T=T, H=Hp,
                    pairs=piece_pairs(qp.shape[0], kp.shape[0]),
                    fp8_mma=jnp.dtype(mma_dtype) == jnp.dtype(jnp.float8_e4m3fn),
                    lane_sums=lane_sums)


def capacity_for(K: int, BK: int, capacity=None) -> int:
    """Record slots per (query, split).

    At least K + BK, so that a compaction (to at most K + slack records,
    :func:`pallas_kernels.records.compaction_slack`) always frees room for the
    next tile; by default 3K + BK, so that a compaction keeps at most 2K
    records and happens only after ≥ K new ones (with exactly K + BK every tile
    that appends anything after the first fill triggers a compaction: correct,
    but far slower).
    """
    c = max(K + BK, capacity if capacity is not None else 3 * K + BK)
    return round_up_to(c, 16)
