"""The one scoring routine of the Pallas backend (Eq. 1), and its jnp twin.

    s_i = α_i · Σ_h w_h relu(q_h · k̄_i)

:func:`score_tile` is called *inside* the dense kernel, the refinement kernel
and the seed kernel with the same tile shape (``BQ`` queries × H heads rows
against ``BK`` keys, same operand pieces, same ``num_warps``), so the three
produce bitwise-identical scores for the same (query, key): DoSA-pallas and
dense-pallas agree bitwise (SPEC §12). It is one Triton ``dot`` per operand
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

from pallas_kernels.common import as_mma_operand, pieces_value, piece_pairs

Array = jax.Array


def score_tile(q_pieces, w_rows, k_pieces, scale, *, BQ: int, H: int, pairs,
               fp8_mma: bool = False):
    """Scores of a tile inside a kernel.

    Args:
      q_pieces: list of [BQ*H, D] MMA operands (rows = query-major, head-minor).
      w_rows: [BQ*H] float32 head weights (0 for padding heads).
      k_pieces: list of [BK, D] MMA operands.
      scale: [BK] float32 key scales α_i.
      pairs: static (q piece, k piece) products to sum, in order.
      fp8_mma: multiply fp8 × fp8 (dense baseline only; not certified).
    Returns:
      [BQ, BK] float32 scores.
    """
    x = None
    for a, b in pairs:
        d = jnp.dot(as_mma_operand(q_pieces[a], fp8_mma),
                    as_mma_operand(k_pieces[b], fp8_mma).T, preferred_element_type=jnp.float32)
        x = d if x is None else x + d
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


def operand_value(pieces: Array) -> Array:
    """The float32 operand a kernel actually multiplies (sum of its pieces)."""
    return pieces_value(pieces)
