"""Static tile arithmetic and the map over query tiles, shared by both backends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def round_up_to(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ≥ ``x`` (static ints)."""
    return -(-int(x) // m) * m


def map_query_tiles(fn, q, w, lo, hi, tile: int, *extra):
    """Apply ``fn(q, w, lo, hi, *extra)`` over query tiles of size ``tile`` (padding with
    empty queries); ``extra`` are further per-query arrays (leading axis T), padded with −1."""
    T = q.shape[0]
    tq = max(1, min(tile, T))
    tpad = round_up_to(T, tq)
    pad = lambda x, v=0: jnp.pad(x, ((0, tpad - T),) + ((0, 0),) * (x.ndim - 1), constant_values=v)
    if tpad != T:
        q, w, lo, hi = pad(q), pad(w), pad(lo), pad(hi)
        extra = tuple(pad(x, -1) for x in extra)
    nt = tpad // tq
    split = lambda x: x.reshape((nt, tq) + x.shape[1:])
    args = (split(q), split(w), split(lo), split(hi)) + tuple(split(x) for x in extra)
    out = lax.map(lambda a: fn(*a), args)
    return jax.tree_util.tree_map(lambda x: x.reshape((tpad,) + x.shape[2:])[:T], out)
