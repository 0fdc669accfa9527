"""The one scoring routine of the Pallas backend (Eq. 1), and its jnp twin.

    s_i = α_i · Σ_h w_h relu(q_h · k̄_i)

:func:`score_tile` is called *inside* the dense kernel, the refinement kernel
and the seed kernel with the same tile shape (``BQ`` queries × H heads rows
against ``BK`` keys, same operand pieces, same ``num_warps``), so the three
produce bitwise-identical scores for the same (query, key): DoSA-pallas and
dense-pallas agree bitwise (DESIGN §12). It is one Triton ``dot`` per operand
piece pair (bf16 × bf16 → float32 on the tensor cores, or fp8 × fp8 when asked),
a ReLU, the head weights, a sum over the H heads of each query, the key scale
last (as DeepGEMM ``fp8_mqa_logits``) and ``-0.0 → +0.0``.

Pallas scores are **not** bitwise equal to the XLA reference scorer
(``dosa_jax.scorer``, float32 HIGHEST einsum and a left-to-right head sum): the
tensor cores accumulate the D products in their own order and precision, the
head sum is a tree reduction, and float32/float16 operands are represented by
two bf16 pieces. The difference is bounded by
:func:`pallas_kernels.numerics.scorer_error_coefficient`; the jnp twin
:func:`score_reference` computes the same mathematical function (same operand
pieces, float32 accumulation) and agrees to that bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (column_sums, keys_rows_dot, piece_pairs,
                                   rows_keys_dot)

Array = jax.Array


def load_query_tile(q_refs, w_ref, g, *, BQ: int, H: int, layout: str):
    """Load query group ``g``'s operand rows inside a kernel; its head weights lazily.

    ``layout="hk"`` or ``"kc"``: one [BQ*H, D] block per piece and a [BQ*H] weight vector.
    ``layout="kh"``: per piece a list of BQ [H, D] blocks, and BQ [H] weight vectors.
    The weights come as a zero-argument loader that :func:`score_tile` calls per tile:
    spread over the MMA accumulator's columns they would hold registers for the whole scan
    (and make the dense and refinement kernels spill); reloaded from L1 they cost a few
    loads per tile.
    """
    if layout in ("hk", "kc"):
        rows = pl.ds(g * BQ * H, BQ * H)
        return [q_ref[rows, :] for q_ref in q_refs], lambda: w_ref[rows]
    qs = [[q_ref[pl.ds((g * BQ + i) * H, H), :] for i in range(BQ)] for q_ref in q_refs]
    return qs, lambda: [w_ref[pl.ds((g * BQ + i) * H, H)] for i in range(BQ)]


def score_tile(q_pieces, w_rows, k_pieces, scale, *, BQ: int, H: int, pairs,
               fp8_mma: bool = False, layout: str = "hk", lane_sums: bool = False):
    """Scores of a tile inside a kernel.

    Three MMA layouts compute the same function with different rounding orders
    (each is used by *every* scoring kernel of a run, so their scores agree):

    * ``"hk"``: one dot [BQ*H, D] × [D, BK] (query heads as MMA rows); the head
      sum reduces across the accumulator's rows.
    * ``"kh"``: per query one dot [BK, D] × [D, H] (keys as MMA rows, H ≥ 16);
      the head sum reduces along the accumulator's columns, which a thread holds
      (in-thread adds and a quad shuffle instead of a cross-warp reduction).
    * ``"kc"``: one dot [BK, D] × [D, BQ*H] for all BQ queries (keys as MMA rows, the
      queries' heads concatenated as columns: one wider MMA instead of BQ narrow ones);
      the head sum reduces each query's H columns, then the [BK, BQ] result is transposed.
      With ``lane_sums`` the operand rows are in
      :func:`pallas_kernels.common.lane_aligned_order` (``prepare_operands``), so each
      query's head sum runs inside one thread (no shuffle; another fixed order).

    Args:
      q_pieces: per piece, [BQ*H, D] ("hk", "kc") or a list of BQ [H, D] ("kh") operands
        (:func:`load_query_tile`).
      w_rows: [BQ*H] ("hk", "kc") or BQ × [H] ("kh") float32 head weights (0 for padding
        heads), or a zero-argument function returning them (called here, once per tile).
      k_pieces: list of [BK, D] MMA operands.
      scale: [BK] float32 key scales α_i.
      pairs: static (q piece, k piece) products to sum, in order.
      fp8_mma: multiply fp8 × fp8 (dense baseline only; not certified).
    Returns:
      [BQ, BK] float32 scores.
    """
    if callable(w_rows):
        w_rows = w_rows()
    if layout == "kh":
        bk = k_pieces[0].shape[0]
        qi = lax.broadcasted_iota(jnp.int32, (BQ, bk), 0)
        s = jnp.zeros((BQ, bk), jnp.float32)
        for i in range(BQ):
            x = keys_rows_dot(k_pieces, [qp[i] for qp in q_pieces], pairs, fp8_mma)  # [BK, H]
            si = jnp.sum(jnp.maximum(x, 0.0) * w_rows[i][None, :], axis=1)
            s = jnp.where(qi == i, jnp.broadcast_to(si[None, :], (BQ, bk)), s)
    elif layout == "kc":
        x = keys_rows_dot(k_pieces, q_pieces, pairs, fp8_mma)       # [BK, BQ*H]
        bk = x.shape[0]
        y = jnp.maximum(x, 0.0) * w_rows[None, :]
        if lane_sums:
            s = column_sums(y, BQ, H, True).reshape(bk, BQ).T      # [BQ, BK]
        else:
            s = jnp.sum(y.reshape(bk, BQ, H), axis=2).T              # [BQ, BK]
    else:
        x = rows_keys_dot(q_pieces, k_pieces, pairs, fp8_mma)      # [BQ*H, BK]
        bk = x.shape[-1]
        y = jnp.maximum(x, 0.0) * w_rows[:, None]
        s = jnp.sum(y.reshape(BQ, H, bk), axis=1)
    s = s * scale[None, :]
    return jnp.where(s == 0, 0.0, s)


def score_reference(q_pieces: Array, w: Array, k_pieces: Array, scale=None) -> Array:
    """jnp twin of :func:`score_tile` on full arrays.

    Args:
      q_pieces: [Pq, T, H, D] operand pieces (``common.mma_pieces(q)``).
      w: [T, H] float32.
      k_pieces: [Pk, N, D] operand pieces.
      scale: None or [N] float32.
    Returns:
      [T, N] float32 scores (float32 accumulation of exact products).
    """
    x = None
    for a, b in piece_pairs(q_pieces.shape[0], k_pieces.shape[0]):
        d = jnp.einsum("thd,nd->tnh", q_pieces[a].astype(jnp.float32),
                       k_pieces[b].astype(jnp.float32), precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
        x = d if x is None else x + d
    s = jnp.sum(jnp.maximum(x, 0.0) * w[:, None, :], axis=-1)
    if scale is not None:
        s = s * scale[None, :]
    return jnp.where(s == 0, 0.0, s)

