"""Seed sets and the seed threshold (paper Eq. 2; DESIGN §3).

A seed set S holds at least K *distinct visible* keys; scored with the
original scorer, its K-th largest score τ satisfies τ ≤ τ* (S already holds K
witnesses). Seed quality decides pruning, never correctness.

Every strategy here is a deterministic *layout* of S distinct positions inside
``[lo, hi)``: ``a`` sinks ``[lo, lo+a)``, ``b`` local keys ``[hi−b, hi)`` and
``c`` strided keys ``lo + a + j·stride`` (j < c) in between, with
``stride = ⌊(n−a−b)/c⌋ ≥ 1``, so positions never repeat and membership of any
key is an O(1) test (the scan must skip seeds: they are already candidates).
When the range has at most S keys, every visible key is a seed and nothing
is left to prune.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax.selection import order_key, key_to_score, INT32_MIN


class SeedLayout(NamedTuple):
    """Per-query seed layout (all [T] int32)."""

    lo: jax.Array
    hi: jax.Array
    sinks: jax.Array    # a
    local: jax.Array    # b
    strided: jax.Array  # c
    stride: jax.Array


def seed_layout(lo, hi, strategy: str, size: int, sink_size: int, local_fraction: float):
    """Layout of ``size`` distinct seeds in [lo, hi) for the named strategy."""
    n = hi - lo
    small = n <= size
    if strategy == "union":
        a = min(sink_size, size)
        b = min(int(round(local_fraction * size)), size - a)
    elif strategy == "local":
        a, b = 0, size
    elif strategy == "sinks":
        a, b = size, 0
    elif strategy == "strided":
        a, b = 0, 0
    else:
        raise ValueError(f"seed_strategy: unknown {strategy!r}")
    c = size - a - b
    a = jnp.where(small, n, a).astype(jnp.int32)
    b = jnp.where(small, 0, b).astype(jnp.int32)
    c = jnp.where(small, 0, c).astype(jnp.int32)
    middle = n - a - b
    stride = jnp.maximum(middle // jnp.maximum(c, 1), 1).astype(jnp.int32)
    return SeedLayout(lo, hi, a, b, c, stride)


def seed_ids(layout: SeedLayout, padded: int):
    """Seed key ids [T, padded] and validity; slot j holds a sink, local or strided key."""
    j = jnp.arange(padded, dtype=jnp.int32)[None, :]
    lo, hi = layout.lo[:, None], layout.hi[:, None]
    a, b, c, st = (x[:, None] for x in (layout.sinks, layout.local, layout.strided, layout.stride))
    ids = jnp.where(j < a, lo + j,
                    jnp.where(j < a + b, hi - b + (j - a), lo + a + (j - a - b) * st))
    valid = j < a + b + c
    return jnp.where(valid, ids, -1), valid


def seed_at(layout: SeedLayout, rank):
    """The ``rank``-th seed of each query ([T, R] ranks → key ids, −1 from its seed count
    on): the local window's keys most recent first, then the sinks, then the strided keys —
    the seeds a decode step's empty witness slots take in turn
    (:func:`dosa_jax.decode.seeded_witnesses`). The same set as :func:`seed_ids`, in
    another order."""
    lo, hi = layout.lo[:, None], layout.hi[:, None]
    a, b, c, st = (x[:, None] for x in (layout.sinks, layout.local, layout.strided, layout.stride))
    r = jnp.asarray(rank, jnp.int32)
    ids = jnp.where(r < b, hi - 1 - r,
                    jnp.where(r < a + b, lo + (r - b), lo + a + (r - a - b) * st))
    return jnp.where((r >= 0) & (r < a + b + c), ids, -1)


def is_seed(ids, layout: SeedLayout):
    """Whether key ``ids`` [T, B] is one of the query's seeds (O(1) per key)."""
    lo, hi = layout.lo[:, None], layout.hi[:, None]
    a, b, c, st = (x[:, None] for x in (layout.sinks, layout.local, layout.strided, layout.stride))
    inside = (ids >= lo) & (ids < hi)
    off = ids - lo - a
    strided = (off >= 0) & (off % st == 0) & (off // st < c)
    return inside & ((ids < lo + a) | (ids >= hi - b) | strided)


def seed_threshold(scores, valid, k: int):
    """τ = K-th largest eligible seed score (Eq. 2); −inf when fewer than K are eligible.

    NaN scores are not eligible (the selection policy); ``valid`` marks real seeds.
    """
    key = jnp.where(valid, order_key(scores), INT32_MIN)
    if scores.shape[-1] < k:
        return jnp.full(scores.shape[:-1], -jnp.inf, jnp.float32)
    kth = lax.top_k(key, k)[0][..., k - 1]
    return jnp.where(kth == INT32_MIN, -jnp.inf, key_to_score(kth))


def distinct_visible(ids, lo, hi):
    """Mask of the first occurrence of each visible id in rows of ``ids`` [T, M]."""
    vis = (ids >= lo[:, None]) & (ids < hi[:, None])
    key = jnp.where(vis, ids, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=1, stable=True)
    sk = jnp.take_along_axis(key, order, axis=1)
    first = jnp.concatenate([jnp.ones_like(sk[:, :1], bool), sk[:, 1:] != sk[:, :-1]], axis=1)
    first = first & (sk != jnp.iinfo(jnp.int32).max)
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros_like(vis).at[rows, order].set(first)
