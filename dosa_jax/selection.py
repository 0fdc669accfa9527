"""Exact Top-K selection with the contract's tie order (DESIGN §10, Theorem 1).

Order: score descending, then key index ascending. Policy for non-finite
scores (identical on every path): ``+inf`` ranks highest and ``-inf`` lowest
among real scores; a key whose score is NaN is *not eligible* and is never
selected. Results shorter than ``k`` are padded with index ``-1`` and score
``-inf``, after every eligible key (a genuine ``-inf`` score keeps its index).

Scores are compared through a monotone int32 *order key*: equal floats
(after ``-0.0 -> +0.0``) have equal keys, NaN maps to ``INT32_MIN`` (below
every real score, including ``-inf``). Integer keys make ties exact and let
``lax.top_k`` (stable: lower position first) and radix selection work on them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
INT32_MIN = jnp.iinfo(jnp.int32).min
INT32_MAX = jnp.iinfo(jnp.int32).max


def order_key(scores: Array) -> Array:
    """Monotone int32 key of float32 scores; NaN -> INT32_MIN (ineligible)."""
    s = jnp.where(scores == 0, jnp.zeros_like(scores), scores).astype(jnp.float32)
    bits = lax.bitcast_convert_type(s, jnp.int32)
    key = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    return jnp.where(jnp.isnan(s), jnp.int32(INT32_MIN), key)


def key_to_score(key: Array) -> Array:
    """Inverse of :func:`order_key` for eligible keys (INT32_MIN -> -inf)."""
    bits = jnp.where(key >= 0, key, key ^ jnp.int32(0x7FFFFFFF))
    s = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(key == INT32_MIN, -jnp.inf, s)


def _decode(top_key, top_id, k: int):
    """(indices, scores) from selected order keys and ids, padded to k with -1 / -inf."""
    idx = jnp.where(top_key == INT32_MIN, -1, top_id)
    out_s = jnp.where(top_key == INT32_MIN, -jnp.inf, key_to_score(top_key))
    kk = top_key.shape[-1]
    if kk < k:
        pad = [(0, 0)] * (idx.ndim - 1) + [(0, k - kk)]
        idx = jnp.pad(idx, pad, constant_values=-1)
        out_s = jnp.pad(out_s, pad, constant_values=-jnp.inf)
    return idx, out_s


def select_by_position(scores: Array, k: int, valid=None):
    """Exact Top-k of rows where the key index is the column position.

    Args:
      scores: [..., M] float32.
      k: static number to select (k may exceed M: extra slots are pads).
      valid: optional [..., M] bool; invalid columns are not eligible.
    Returns:
      (indices int32 [..., k], scores float32 [..., k]) in contract order.
    """
    M = scores.shape[-1]
    key = order_key(scores)
    if valid is not None:
        key = jnp.where(valid, key, INT32_MIN)
    kk = min(k, M)
    top_key, top_pos = lax.top_k(key, kk)  # stable: equal keys keep position order
    return _decode(top_key, top_pos.astype(jnp.int32), k)


def select_records(scores: Array, ids: Array, k: int, valid=None):
    """Exact Top-k over (score, id) records in arbitrary order.

    Records with ``valid == False`` or ``id < 0`` or a NaN score are not
    eligible. Ids must be distinct among eligible records.

    Args:
      scores: [..., M] float32; ids: [..., M] int32.
    Returns:
      (indices int32 [..., k], scores float32 [..., k]) in contract order.
    """
    key = order_key(scores)
    ok = ids >= 0
    if valid is not None:
        ok = ok & valid
    key = jnp.where(ok, key, INT32_MIN)
    sort_id = jnp.where(key == INT32_MIN, INT32_MAX, ids)
    # ascending on (~key, id) == descending key, then ascending id; ~ avoids overflow
    nk, sid = lax.sort((~key, sort_id), dimension=-1, num_keys=2)
    M = scores.shape[-1]
    kk = min(k, M)
    top_key = ~nk[..., :kk]
    top_id = sid[..., :kk]
    return _decode(top_key, top_id, k)


def exact_topk(scores: Array, k: int, *, valid=None):
    """Public exact Top-k over full score rows (position = key index).

    Same contract as ``dosa_jax.topk``'s selection: (score desc, index asc),
    NaN never selected, ``-1``/``-inf`` pads. ``k`` must be a static int >= 1.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a static int >= 1, got {k!r}")
    if scores.ndim < 1:
        raise ValueError(f"scores must have rank >= 1, got shape {scores.shape}")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"scores must be floating point, got {scores.dtype}")
    return select_by_position(scores.astype(jnp.float32), k, valid)
