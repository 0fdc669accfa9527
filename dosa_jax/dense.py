"""The dense path: score every visible key with the canonical scorer, select exactly.

This is the baseline DoSA must agree with bitwise: the same ``score_ids`` on
[Tq, key_block] blocks (key ids are gathered exactly as the refinement does),
then :func:`~dosa_jax.selection.select_by_position` (score desc, index asc).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dosa_jax.pipeline import map_query_tiles, round_up_to
from dosa_jax.scorer import score_ids
from dosa_jax.selection import select_by_position


def full_scores_tile(q, w, k, k_scale, block: int):
    """[Tq, Npad] canonical scores of every key for one query tile."""
    Tq = q.shape[0]
    N = k.shape[0]
    npad = max(round_up_to(N, block), block)
    nb = npad // block
    ids = jnp.arange(npad, dtype=jnp.int32).reshape(nb, block)

    def one(idb):
        return score_ids(q, w, k, k_scale, jnp.broadcast_to(idb[None, :], (Tq, block)))

    s = lax.map(one, ids)  # [nb, Tq, block]
    return s.transpose(1, 0, 2).reshape(Tq, npad)


def dense_topk_reference(q, k, w, k_scale, lo, hi, config):
    """Exact Top-K by full scoring (validated inputs). Returns (indices, scores, n_visible)."""
    K, B = config.top_k, config.key_block

    def tile(qt, wt, lot, hit):
        s = full_scores_tile(qt, wt, k, k_scale, B)
        ids = jnp.arange(s.shape[1], dtype=jnp.int32)[None, :]
        valid = (ids >= lot[:, None]) & (ids < hit[:, None])
        idx, sc = select_by_position(s, K, valid)
        return idx, sc

    return map_query_tiles(tile, q, w, lo, hi, config.query_tile)


def anchor_hint(q, k, w, k_scale, lo, hi, config):
    """Witness ids [T, K] from anchor queries (``Config.anchor_stride``), or None.

    Queries 0, s, 2s, … are answered by :func:`dense_topk_reference`; each query
    takes the Top-K ids of the last anchor at or before it (SPEC §3: a
    neighbouring query's selection, rescored for the current query by the caller).
    """
    T = q.shape[0]
    s = config.anchors(T)
    if not s:
        return None
    a = slice(0, None, s)
    idx, _ = dense_topk_reference(q[a], k, w[a], k_scale, lo[a], hi[a], config)
    return jnp.repeat(idx, s, axis=0)[:T]


def score_matrix(q, k, w, k_scale, lo, hi, block: int, tile: int):
    """[T, N] canonical scores; keys outside [lo, hi) are −inf."""
    N = k.shape[0]

    def one(qt, wt, lot, hit):
        s = full_scores_tile(qt, wt, k, k_scale, block)[:, :N]
        ids = jnp.arange(N, dtype=jnp.int32)[None, :]
        return jnp.where((ids >= lot[:, None]) & (ids < hit[:, None]), s, -jnp.inf)

    return map_query_tiles(one, q, w, lo, hi, tile)
