"""Anchor queries: extra witnesses for τ from a neighbouring query's exact selection.

With ``Config.anchor_stride`` = s (and T ≥ 4s), queries 0, s, 2s, … are answered
first by the backend's dense path; their exact Top-K ids are rescored for the
following queries and join the seeds in τ (DESIGN §3, Eq. 2). Neighbouring
queries share most winners, so τ rises towards τ*; any ids are safe, since only
distinct visible keys count, so witnesses change pruning, never the answer.
"""

from __future__ import annotations

import jax.numpy as jnp


def anchor_topk(dense_topk, q, k, w, k_scale, lo, hi, config):
    """Exact Top-K ids [A, K] of the anchor queries 0, s, 2s, … (s = ``config.anchors(T)``),
    answered by ``dense_topk(q, k, w, k_scale, lo, hi, config) -> (indices, scores)``;
    None when anchors are off for T queries."""
    s = config.anchors(q.shape[0])
    if not s:
        return None
    a = slice(0, None, s)
    return dense_topk(q[a], k, w[a], k_scale, lo[a], hi[a], config)[0]


def per_query_witnesses(anchor_ids, stride: int, T: int, hint=None):
    """Witness ids [T, M] of each query: the Top-K of the last anchor at or before it
    (``anchor_ids`` [A, K] from :func:`anchor_topk`, or None), then the caller's ``hint``
    [T, M'] (or None). None when there are neither."""
    parts = []
    if anchor_ids is not None:
        parts.append(jnp.repeat(anchor_ids, stride, axis=0)[:T])
    if hint is not None:
        parts.append(hint.astype(jnp.int32))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
