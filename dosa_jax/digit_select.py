"""Exact Top-k of long int32 rows without sorting them: the k-th largest found digit by digit,
the keys at or above it compacted in position order, only those k sorted.

``lax.top_k(keys, k)`` sorts the whole row. On a GPU, XLA hands a long one-row sort to CUB's
radix sort (its rewrite of sorts that CUB runs faster: on an H100, 32-bit keys in one row of
more than about 22 000), and a CUB sort cannot be captured into a command buffer (CUDA graph):
a ``lax.cond`` whose branch holds one runs on the host, which reads its predicate back every
time the step runs, taken or not. :func:`top_k_by_digits` returns exactly what ``lax.top_k``
returns — the same keys and the same positions, ties in position order — with no sort longer
than k:

1. :func:`kth_largest_by_digits`: t, the k-th largest key of the row (ties counted), built
   from the top in the keys' unsigned order ``DIGIT_BITS`` bits a pass; each pass counts the
   keys at or above the 2^bits − 1 prefixes that extend t's by one digit and keeps the
   largest whose count is ≥ k (the counts fall as the digit grows).
2. The keys > t (fewer than k) and the first k − #{> t} keys equal to t, in position order
   (``lax.top_k`` is stable: among equal keys the lower position first), compacted by
   prefix sums into k slots — position order kept.
3. ``lax.top_k`` of those k slots: stable, so the order among equal keys stays position
   order; the positions map back through the compaction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

#: Bits of the k-th largest key found per counting pass (32 / DIGIT_BITS passes, each
#: comparing every key with 2^DIGIT_BITS − 1 thresholds).
DIGIT_BITS = 4
#: Rows at most this long are selected by ``lax.top_k`` itself (XLA sorts them in its own
#: kernels, which command buffers capture); longer rows by :func:`top_k_by_digits`.
SORT_ROW_LIMIT = 16384


def _unsigned(keys: Array) -> Array:
    """int32 keys as uint32 in the same order (the top bit flipped)."""
    return lax.bitcast_convert_type(keys.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(0x80000000)


def _signed(u: Array) -> Array:
    return lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)


def largest_with_count(keys_u: Array, k: int, bits: int = DIGIT_BITS) -> Array:
    """v [R] uint32: the largest value with at least ``k`` of the row's unsigned keys
    ``keys_u`` [R, W] at or above it — the k-th largest key (0 when the row has fewer than k
    keys: every key is ≥ 0)."""
    if not 1 <= bits <= 16 or 32 % bits:
        raise ValueError(f"bits must divide 32 and lie in [1, 16], got {bits}")
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    v = jnp.zeros(keys_u.shape[:1], jnp.uint32)          # every key is ≥ 0
    for shift in range(32 - bits, -1, -bits):
        t = v[:, None] | (digits[None, :] << shift)                            # [R, 2^b − 1]
        enough = jnp.sum(keys_u[:, :, None] >= t[:, None, :], axis=1) >= k       # falls with t
        v = v | (jnp.sum(enough, axis=1, dtype=jnp.uint32) << shift)
    return v


def kth_largest_by_digits(keys: Array, k: int, bits: int = DIGIT_BITS) -> Array:
    """The k-th largest of each row of int32 ``keys`` [R, W] (1 ≤ k ≤ W): [R] int32, bitwise
    ``lax.top_k(keys, k)[0][:, k - 1]``, by ``32 / bits`` counting passes, no sort."""
    _check(keys, k)
    return _signed(largest_with_count(_unsigned(keys), k, bits))


def _check(keys, k):
    if keys.ndim != 2 or jnp.dtype(keys.dtype) != jnp.int32:
        raise ValueError(f"keys must be int32 [rows, width], got {keys.dtype} {keys.shape}")
    if not 1 <= k <= keys.shape[1]:
        raise ValueError(f"k must be in [1, {keys.shape[1]}] (the row width), got {k}")


def top_k_by_digits(keys: Array, k: int, bits: int = DIGIT_BITS):
    """``lax.top_k(keys, k)`` of int32 rows [R, W] (1 ≤ k ≤ W), bitwise — (keys [R, k], positions
    [R, k] int32), ties in position order — sorting only k keys a row (module docstring)."""
    _check(keys, k)
    R, W = keys.shape
    t = kth_largest_by_digits(keys, k, bits)[:, None]
    above = keys > t
    tied = keys == t
    room = k - jnp.sum(above, axis=1, dtype=jnp.int32)[:, None]       # ≥ 1: t is the k-th
    take = above | (tied & (jnp.cumsum(tied, axis=1, dtype=jnp.int32) <= room))
    dest = jnp.where(take, jnp.cumsum(take, axis=1, dtype=jnp.int32) - 1, k)   # k: dropped
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, W))
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32)[None, :], (R, W))
    ck = jnp.zeros((R, k), jnp.int32).at[rows, dest].set(keys, mode="drop")
    cp = jnp.zeros((R, k), jnp.int32).at[rows, dest].set(pos, mode="drop")
    top_key, at = lax.top_k(ck, k)                 # every slot written: exactly k taken
    return top_key, jnp.take_along_axis(cp, at, axis=1)


def top_k_rows(keys: Array, k: int, limit: int = SORT_ROW_LIMIT):
    """``lax.top_k(keys, k)`` (int32 rows, positions as int32): by ``lax.top_k`` for rows of
    at most ``limit`` keys, by :func:`top_k_by_digits` for longer ones (no sort of the row,
    nothing a command buffer cannot hold)."""
    if keys.shape[-1] <= limit:
        top_key, pos = lax.top_k(keys, k)
        return top_key, pos.astype(jnp.int32)
    return top_k_by_digits(keys, k)


__all__ = ["DIGIT_BITS", "SORT_ROW_LIMIT", "kth_largest_by_digits", "largest_with_count",
           "top_k_by_digits", "top_k_rows"]
