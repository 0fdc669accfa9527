"""The original indexer scorer (paper Eq. 1), defined once.

    s_i = α_i · Σ_h w_h · relu(q_h · k̄_i)

Exactness (DESIGN §12) needs *one* scoring routine with a fixed accumulation
order used by the seeds, the refinement and the dense path alike. Every score
in the reference backend is therefore produced by :func:`score_gathered` on a
block of ``[Tq, B]`` (query, key) pairs whose keys were gathered by index:

* the head dot products are one batched ``einsum('thd,tbd->tbh')`` in float32
  with ``Precision.HIGHEST`` (never TF32), always with the same operand shapes
  ``[Tq, H, D] x [Tq, B, D]``, so XLA emits the same dot for every path;
* the head sum is an explicit left-to-right chain of elementwise
  ``acc + w_h * relu(x_h)`` (h = 0..H-1): its rounding is per element and
  cannot depend on the shape or the path;
* the key scale multiplies the head sum last, as in DeepGEMM ``fp8_mqa_logits``;
* ``-0.0`` is canonicalised to ``+0.0`` so that equal scores compare equal in
  the tie order.

:func:`score_matrix` is the full-matrix scorer behind the public ``score``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax.tiling import map_query_tiles, round_up_to

Array = jax.Array
HIGHEST = lax.Precision.HIGHEST


def to_f32(x: Array) -> Array:
    """Exact widening of a float32/bf16/fp16/fp8 array to float32, kept *as float32*.

    The optimization barrier stops XLA from folding the convert into the dot:
    on Hopper, XLA's GEMM rewriter turns ``dot(convert(fp8), convert(fp8))`` into
    a cuBLASLt FP8 GEMM whose accumulation is not float32, which would put computed
    scores above U^num for FP8 queries. The scorer's arithmetic is float32
    accumulation by definition (DESIGN §9).
    """
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32):
        return x
    return lax.optimization_barrier(x.astype(jnp.float32))


def head_dot_products(q_rows: Array, keys: Array) -> Array:
    """x[t, b, h] = q_rows[t, h] · keys[t, b] in float32 (HIGHEST precision).

    Args:
      q_rows: [Tq, H, D] float32.
      keys: [Tq, B, D] float32 (gathered per query).
    Returns:
      [Tq, B, H] float32.
    """
    return jnp.einsum("thd,tbd->tbh", q_rows, keys, precision=HIGHEST,
                      preferred_element_type=jnp.float32)


def weighted_relu_sum(x: Array, w: Array) -> Array:
    """Σ_h w_h relu(x_h), accumulated left to right over h (fixed order).

    Args:
      x: [..., B, H] head dot products.
      w: [..., H] weights (broadcast over B).
    Returns:
      [..., B] float32.
    """
    H = x.shape[-1]
    xt = jnp.moveaxis(x, -1, 0)  # [H, ..., B]
    wt = jnp.moveaxis(w, -1, 0)[..., None]  # [H, ..., 1]
    acc = wt[0] * jnp.maximum(xt[0], 0.0)
    if H == 1:
        return acc
    # lax.fori_loop keeps the order h = 1..H-1 and a small program (no unrolling)
    return lax.fori_loop(1, H, lambda h, a: a + wt[h] * jnp.maximum(xt[h], 0.0), acc)


def canonical_zero(s: Array) -> Array:
    """Map -0.0 to +0.0 (equal scores must be equal keys in the tie order)."""
    return jnp.where(s == 0, jnp.zeros_like(s), s)


def score_gathered(q: Array, w: Array, keys: Array, scale=None, *, return_head_dots=False):
    """The canonical scorer on a gathered block (Eq. 1).

    Args:
      q: [Tq, H, D] queries (any accepted float dtype).
      w: [Tq, H] float32 head weights.
      keys: [Tq, B, D] gathered keys or payloads (any accepted float dtype).
      scale: None or [Tq, B] float32 per-key scales α_i.
      return_head_dots: also return the [Tq, B, H] head dot products.
    Returns:
      scores [Tq, B] float32 (and head dots if asked).
    """
    x = head_dot_products(to_f32(q), to_f32(keys))  # float32 operands, never an FP8 GEMM
    s = weighted_relu_sum(x, w.astype(jnp.float32))
    if scale is not None:
        s = s * scale
    s = canonical_zero(s)
    return (s, x) if return_head_dots else s


def gather_rows(table: Array, ids: Array) -> Array:
    """table[ids] with ids clipped into range (callers mask invalid ids)."""
    n = table.shape[0]
    return jnp.take(table, jnp.clip(ids, 0, n - 1), axis=0)


def score_ids(q: Array, w: Array, k: Array, k_scale, ids: Array, *, return_head_dots=False):
    """Score keys ``ids`` [Tq, B] for queries ``q`` [Tq, H, D] with the canonical scorer."""
    keys = gather_rows(k, ids)
    scale = None if k_scale is None else gather_rows(k_scale, ids)
    return score_gathered(q, w, keys, scale, return_head_dots=return_head_dots)


def score_ids_blocked(q, w, k, k_scale, ids, block: int, *, return_head_dots=False):
    """:func:`score_ids` over ``ids`` [Tq, M] in blocks of ``block`` keys (M % block == 0).

    Every block has the canonical shape [Tq, block], so scores are bitwise the
    same as the dense path's.
    """
    Tq, M = ids.shape
    if M % block:
        raise ValueError(f"internal: {M} ids is not a multiple of block {block}")
    nb = M // block
    ids_b = ids.reshape(Tq, nb, block).transpose(1, 0, 2)

    def one(idb):
        return score_ids(q, w, k, k_scale, idb, return_head_dots=return_head_dots)

    out = lax.map(one, ids_b)
    if return_head_dots:
        s, x = out
        return (s.transpose(1, 0, 2).reshape(Tq, M),
                x.transpose(1, 0, 2, 3).reshape(Tq, M, x.shape[-1]))
    return out.transpose(1, 0, 2).reshape(Tq, M)


def full_scores_tile(q, w, k, k_scale, block: int):
    """[Tq, Npad] canonical scores of every key for one query tile (blocks of ``block``
    keys gathered by id, the refinement's shape)."""
    Tq = q.shape[0]
    N = k.shape[0]
    npad = max(round_up_to(N, block), block)
    nb = npad // block
    ids = jnp.arange(npad, dtype=jnp.int32).reshape(nb, block)

    def one(idb):
        return score_ids(q, w, k, k_scale, jnp.broadcast_to(idb[None, :], (Tq, block)))

    s = lax.map(one, ids)  # [nb, Tq, block]
    return s.transpose(1, 0, 2).reshape(Tq, npad)


def score_matrix(q, k, w, k_scale, lo, hi, block: int, tile: int):
    """[T, N] canonical scores (validated inputs); keys outside [lo, hi) are −inf."""
    N = k.shape[0]

    def one(qt, wt, lot, hit):
        s = full_scores_tile(qt, wt, k, k_scale, block)[:, :N]
        ids = jnp.arange(N, dtype=jnp.int32)[None, :]
        return jnp.where((ids >= lot[:, None]) & (ids < hit[:, None]), s, -jnp.inf)

    return map_query_tiles(one, q, w, lo, hi, tile)
