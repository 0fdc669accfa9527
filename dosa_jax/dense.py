"""The dense baseline: score every visible key with the canonical scorer, select exactly.

This is the answer DoSA must agree with bitwise: the same ``score_ids`` on
[Tq, key_block] blocks (key ids are gathered exactly as the refinement does),
then :func:`~dosa_jax.selection.select_by_position` (score desc, index asc).
"""

from __future__ import annotations

import jax.numpy as jnp

from dosa_jax.scorer import full_scores_tile
from dosa_jax.selection import select_by_position
from dosa_jax.tiling import map_query_tiles


def dense_topk_reference(q, k, w, k_scale, lo, hi, config):
    """Exact Top-K by full scoring (validated inputs). Returns (indices [T, K], scores [T, K])."""
    K, B = config.top_k, config.key_block

    def tile(qt, wt, lot, hit):
        s = full_scores_tile(qt, wt, k, k_scale, B)
        ids = jnp.arange(s.shape[1], dtype=jnp.int32)[None, :]
        valid = (ids >= lot[:, None]) & (ids < hit[:, None])
        idx, sc = select_by_position(s, K, valid)
        return idx, sc

    return map_query_tiles(tile, q, w, lo, hi, config.query_tile)
