"""Extra witnesses for τ: a neighbouring query's exact selection, and the keys of the
key blocks whose mean scores highest.

Anchors: with ``Config.anchor_stride`` = s (and T ≥ 4s), queries 0, s, 2s, … are answered
first by the backend's dense path; their exact Top-K ids are rescored for the
following queries and join the seeds in τ (DESIGN §3, Eq. 2). Neighbouring
queries share most winners, so τ rises towards τ*.

Block witnesses: with ``Config.block_witnesses`` = W and ``Config.witness_block`` = B,
each query takes every key of the W / B blocks of B consecutive keys whose *mean key*
scores highest for it (the indexer's own score s(q, k̄_b) of the block mean k̄_b, ranked
by the backend's dense path over the ⌈N / B⌉ means: 1/B of a dense scan). A query's
winners cluster in few blocks (text repeats its topics), so where the local window does
not hold them the blocks do, and τ rises towards τ*.

Any ids are safe, since only distinct visible keys count: witnesses change pruning,
never the answer.
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


def block_means(k, k_scale, block: int):
    """Mean key of each block of ``block`` consecutive keys, [⌈N / block⌉, D] float32 (the
    keys dequantised, k_i = α_i k̄_i; the last block's mean over the keys it has)."""
    N, D = k.shape
    nb = -(-N // block)
    kf = k.astype(jnp.float32)
    if k_scale is not None:
        kf = kf * k_scale.astype(jnp.float32)[:, None]
    kf = jnp.pad(kf, ((0, nb * block - N), (0, 0))).reshape(nb, block, D)
    count = jnp.minimum(N - jnp.arange(nb) * block, block).astype(jnp.float32)
    return jnp.sum(kf, axis=1) / count[:, None]


def best_blocks(dense_topk, q, k, w, k_scale, lo, hi, config):
    """Block ids [T, m] of each query's m = W / B best blocks (W = ``config.block_witnesses``,
    B = ``config.witness_block``, m at most the ⌈N / B⌉ blocks), ranked by the score of the
    block's mean key (:func:`block_means`) among the blocks that meet the query's range
    [lo, hi); −1 where fewer blocks are visible. The ranking is ``dense_topk(q, means, w,
    None, lo_b, hi_b, config) -> (indices, scores)``, the backend's dense path over the
    means (bf16 for bf16 or FP8 keys, float32 for float32 keys). None when
    ``block_witnesses`` is 0 or None (a backend that decides per call resolves None first)."""
    W, B = config.block_witnesses or 0, config.witness_block
    if not W:
        return None
    N = k.shape[0]
    nb = -(-N // B)
    means = block_means(k, k_scale, B)
    means = means if k.dtype == jnp.float32 else means.astype(jnp.bfloat16)
    lo = lo.astype(jnp.int32)
    hi = hi.astype(jnp.int32)
    lo_b = jnp.minimum(lo // B, nb)
    hi_b = jnp.where(hi > lo, (hi + B - 1) // B, lo_b)      # the blocks meeting [lo, hi)
    ranked = config.replace(top_k=min(W // B, nb), anchor_stride=0, block_witnesses=0,
                            guided_witnesses=0)
    return dense_topk(q, means, w, None, lo_b, hi_b, ranked)[0]


def block_key_ids(blocks, block: int, N: int):
    """Every key id of the blocks [R, m] (−1 for none), [R, m·block]: −1 for a −1 block and
    past the last key."""
    ids = blocks[..., None] * block + jnp.arange(block, dtype=jnp.int32)
    ids = jnp.where((blocks[..., None] >= 0) & (ids < N), ids, -1)
    return ids.reshape(blocks.shape[:-1] + (blocks.shape[-1] * block,))


def block_witnesses(dense_topk, q, k, w, k_scale, lo, hi, config):
    """Witness ids [T, W] of each query: every key of its :func:`best_blocks` (−1 past the
    last key and where fewer blocks are visible). None when ``block_witnesses`` is 0 or None."""
    blocks = best_blocks(dense_topk, q, k, w, k_scale, lo, hi, config)
    if blocks is None:
        return None
    ids = block_key_ids(blocks, config.witness_block, k.shape[0])
    return jnp.pad(ids, ((0, 0), (0, config.block_witnesses - ids.shape[1])),
                   constant_values=-1)


def per_query_witnesses(anchor_ids, stride: int, T: int, hint=None, block_ids=None):
    """Witness ids [T, M] of each query: the Top-K of the last anchor at or before it
    (``anchor_ids`` [A, K] from :func:`anchor_topk`, or None), then its block witnesses
    (``block_ids`` [T, W] from :func:`block_witnesses`, or None), then the caller's
    ``hint`` [T, M'] (or None). None when there are none."""
    parts = []
    if anchor_ids is not None:
        parts.append(jnp.repeat(anchor_ids, stride, axis=0)[:T])
    if block_ids is not None:
        parts.append(block_ids)
    if hint is not None:
        parts.append(hint.astype(jnp.int32))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
