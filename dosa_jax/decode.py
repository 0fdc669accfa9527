"""Decode: exact Top-K for every generated token with temporal witnesses (paper Sec. 3; DESIGN §11).

With one (or a few) queries per sequence and step, screening has little reuse, so every
visible key is scored in full. What changes is the selection: keys that scored high in the
previous step, rescored for the current query, are *witnesses* (Eq. 2). Their K-th largest
current score τ_w is a certified lower bound on the K-th score τ* — K distinct visible keys
already score ≥ τ_w — so only keys with ``s ≥ τ_w`` (ties included) can be in the Top-K.
Those are compacted into a bounded buffer and selected exactly.

The witnesses carried to the next step are the best W' = W / M (``W`` = ``DecodeState``
width, M queries; default W' = 4·K) of what the step looked at: its candidates and its
witnesses, by the current score (every key, in score order, when the step fell back to the
full selection). Exactly K witnesses would not do: τ_w would be the *lowest* current score of
the previous selection, and the ~40 % of the previous winners that lose the current query
(trained indexers, consecutive positions) score far below τ*, often below zero. With 4·K
witnesses τ_w is the K-th of 4·K keys that all scored high recently.

A witness slot holding no visible key (the first step from ``decode_init``, a reset or stale
state, ids past a shorter sequence) takes one of the sequence's seeds instead
(:func:`seeded_witnesses`: the prefill's seed layout — the most recent keys first, the
sinks, strided keys): seeds are visible keys, so τ_w stays a lower bound, and a sequence
with no witnesses starts from its seeds' threshold rather than from none (on the trained
code layer-2 indexer, K = 2048: about 3·K candidates at N = 128K, about 17·K at N = 1M). Only with fewer than K
distinct visible keys among witnesses and seeds (a sequence shorter than K, a state
narrower than K) is τ_w = −inf and every visible key a candidate. When more candidates than the buffer holds
clear τ_w (a topic change makes the witnesses useless), the step falls back to exact
selection over all scores (``lax.cond``: no value leaves the device program; XLA:GPU
captures the conditional in a CUDA graph, or reads its predicate back itself where a branch
sorts one long row, at B = 1). Either way the answer is
``dense_topk``'s, bitwise: the witnesses change the work, never the answer.

    state = dosa_jax.decode_init(batch, config)
    res, state = dosa_jax.decode_topk(q, k, w, state, k_scale=s, lengths=n, config=config)

Keys are contiguous per sequence (k [B, N, D], ``lengths`` [B]) or paged (k [P, page, D]
pages, ``page_table`` [B, max_pages] page ids, ``lengths`` [B]): sequence b sees its first
``lengths[b]`` keys, key i of a paged sequence living at row ``i % page`` of page
``page_table[b, i // page]``. Shapes are static and nothing leaves the device, so a step
runs under ``jax.jit``, ``lax.scan`` and ``lax.while_loop``.

This module holds the API, the state and the reference (pure jnp) implementation; the
Pallas kernels (``pallas_kernels.decode``) are reached through the dispatch table
(:data:`dosa_jax.api.IMPLEMENTATIONS`, field ``decode_topk``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dosa_jax.config import Config
from dosa_jax.inputs import FLOAT_INPUT_DTYPES, FP8_DTYPE
from dosa_jax.scorer import full_scores_tile
from dosa_jax.seeds import distinct_visible, seed_at, seed_layout
from dosa_jax.selection import INT32_MIN, key_to_score, order_key

Array = jax.Array

#: Most queries per sequence and step (speculative / multi-token decode).
MAX_QUERIES = 4
#: Order key that accepts every eligible score (one above the NaN key).
ACCEPT_ALL = int(INT32_MIN) + 1
#: Witnesses carried per query and step, in units of K (``decode_init``'s default width).
WITNESS_FACTOR = 4

__all__ = ["DecodeState", "DecodeStats", "MAX_QUERIES", "WITNESS_FACTOR", "best_witnesses",
           "candidate_capacity", "decode_config", "decode_init", "decode_topk_reference",
           "differentiable_scores", "distinct_pool", "fit_witnesses", "key_table", "looked_at",
           "seeded_witnesses", "select_and_witness", "select_with_witnesses", "selected_rows",
           "witness_budget",
           "witness_threshold"]


class DecodeState(NamedTuple):
    """What a decode step carries to the next (a pytree of one array).

    ids: [B, W] int32 witness key ids per sequence: the best W / M keys of each of the previous
    step's M queries (its candidates and witnesses by score; the first K are its selection),
    −1 pads. Any ids are harmless: invisible, negative, repeated or
    stale ids (a slot reused by another sequence) are ignored or only loosen τ_w.
    """

    ids: Array


class DecodeStats(NamedTuple):
    """Per-query statistics of a decode step ([B] or [B, M] arrays, as the indices).

    visible: keys the query sees (``lengths``). witnesses: distinct visible witness ids
    (seeds in empty slots included: :func:`seeded_witnesses`).
    tau_witness: τ_w, the K-th largest witness score (−inf with fewer than K witnesses).
    candidates: keys with s ≥ τ_w (every visible key when τ_w = −inf; the Pallas scan counts
    the keys it appended, fewer when a full record buffer raised its threshold mid-scan; the
    Pallas screen's second round, the keys whose upper bound clears τ_w).
    overflow: 1 where the candidates exceeded a buffer (``Config.capacity``; on the Pallas
    backend also a record buffer compacted mid-scan) and a fallback answered: the exact
    selection, or on the Pallas screen its certified second round.
    """

    visible: Array
    witnesses: Array
    tau_witness: Array
    candidates: Array
    overflow: Array


def candidate_capacity(config: Config) -> int:
    """Compaction buffer per query: ``Config.capacity`` (at least K), default
    ``WITNESS_FACTOR``·K (as many as the witnesses: along real text a step's candidates are a
    few K, and a buffer of 2·K overflowed on a third of the queries at N = 1M)."""
    K = config.top_k
    return max(K, config.capacity if config.capacity is not None else WITNESS_FACTOR * K)


def decode_init(batch: int, config: Optional[Config] = None, *, queries: int = 1,
                witnesses: Optional[int] = None) -> DecodeState:
    """Empty witnesses for ``batch`` sequences: ``ids`` [batch, W] all −1.

    W = ``witnesses`` or ``queries · WITNESS_FACTOR · top_k`` (each step stores the best
    W / queries keys of each query; W ≥ K per query keeps τ_w away from the lowest score
    of the previous selection).
    """
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a dosa_jax.Config, got {type(config).__name__}")
    for name, v in (("batch", batch), ("queries", queries)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if queries > MAX_QUERIES:
        raise ValueError(f"queries must be <= {MAX_QUERIES}, got {queries}")
    W = queries * WITNESS_FACTOR * config.top_k if witnesses is None else witnesses
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"witnesses must be an int >= 1, got {W!r}")
    return DecodeState(jnp.full((batch, W), -1, jnp.int32))


# ------------------------------------------------------------------ argument checking

def _array(name, x):
    if x is None:
        raise TypeError(f"{name} is required")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return x


def _check_int_array(name, x, shape):
    _array(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    return jnp.asarray(x).astype(jnp.int32)


def _known(x):
    """``x`` as a numpy array when its values are known at the call (not traced), else None."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_known_pages(lengths, page_table, pages: int, page: int):
    """Where ``lengths`` [B] and ``page_table`` [B, max_pages] hold known values (an eager
    call, not a traced one), a page id outside ``[0, pages)`` in an entry that holds visible
    keys (the first ⌈lengths[b] / page⌉ of row b; later entries are never read) raises
    ``ValueError`` naming the entry: read as it stands, it would take another page's keys.
    Traced values cannot be checked; the caller clips them (:func:`check_decode_inputs`)."""
    n, table = _known(lengths), _known(page_table)
    if n is None or table is None:
        return
    used = np.arange(table.shape[1])[None, :] < -(-n // page)[:, None]
    bad = np.argwhere(used & ((table < 0) | (table >= pages)))
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise ValueError(f"page_table[{b}, {j}] = {int(table[b, j])} is not a page of k (0 .. "
                         f"{pages - 1}) and holds visible keys of sequence {b} "
                         f"(lengths[{b}] = {int(n[b])})")


def check_decode_inputs(q, k, w, state, k_scale, lengths, page_table, *, devices: int = 1):
    """Validate and normalise the decode arguments, naming the argument at fault.

    ``devices``: the keys are this device's slice of a sequence sharded over that many devices
    (context parallel): ``lengths`` are global, up to ``devices`` times the local capacity.

    On one device, a known (not traced) page id outside ``[0, P)`` that holds visible keys
    raises ``ValueError`` (:func:`check_known_pages`); traced ones are clipped into ``[0, P)``
    (never a read outside ``k``).

    Returns (q [B, M, H, D], k, w [B, M, H] float32, ids [B, W] int32, k_scale or None,
    lengths [B] int32 clipped to [0, devices · capacity], page_table [B, max_pages] int32 or
    None, squeeze: q was [B, H, D]).
    """
    for name, x in (("q", q), ("k", k), ("w", w)):
        _array(name, x)
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a dosa_jax.DecodeState (from decode_init), got "
                        f"{type(state).__name__}")
    if q.ndim not in (3, 4):
        raise ValueError(f"q must have shape [B, H, D] or [B, M, H, D], got {tuple(q.shape)}")
    squeeze = q.ndim == 3
    if squeeze:
        q = q[:, None]
    B, M, H, D = q.shape
    if M < 1 or M > MAX_QUERIES:
        raise ValueError(f"q: M (queries per sequence) must be in [1, {MAX_QUERIES}], got {M}")
    if H < 1 or D < 1:
        raise ValueError(f"q must have H >= 1 and D >= 1, got shape {tuple(q.shape)}")
    want_w = (B, H) if squeeze else (B, M, H)
    if tuple(w.shape) != want_w:
        raise ValueError(f"w must have shape {want_w} (as q), got {tuple(w.shape)}")
    if not jnp.issubdtype(w.dtype, jnp.floating) or jnp.dtype(w.dtype) == FP8_DTYPE \
            or jnp.dtype(w.dtype).itemsize > 4:
        raise TypeError(f"w must be float32, got {w.dtype}")
    w = jnp.asarray(w).astype(jnp.float32).reshape(B, M, H)
    for name, x in (("q", q), ("k", k)):
        if jnp.dtype(x.dtype) not in FLOAT_INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float8_e4m3fn, "
                            f"got {x.dtype}")
    if k.ndim != 3:
        raise ValueError(f"k must have shape [B, N, D] (contiguous) or [P, page, D] (paged), "
                         f"got {tuple(k.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"k has head dimension {k.shape[2]} but q has D={D}")
    if page_table is None:
        if k.shape[0] != B:
            raise ValueError(f"k must have shape [B, N, D] with B={B} (or pass page_table for "
                             f"paged keys), got {tuple(k.shape)}")
        capacity = k.shape[1]
    else:
        _array("page_table", page_table)
        if page_table.ndim != 2 or page_table.shape[0] != B:
            raise ValueError(f"page_table must have shape [B, max_pages] with B={B}, got "
                             f"{tuple(page_table.shape)}")
        page_table = _check_int_array("page_table", page_table, page_table.shape)
        if lengths is None:
            raise ValueError("lengths is required with page_table (keys per sequence)")
        capacity = page_table.shape[1] * k.shape[1]
    if k_scale is None:
        if jnp.dtype(k.dtype) == FP8_DTYPE:
            raise ValueError("k_scale is required for float8_e4m3fn keys (k = k_scale[..., None] "
                             "* payload)")
    else:
        _array("k_scale", k_scale)
        if tuple(k_scale.shape) != tuple(k.shape[:2]):
            raise ValueError(f"k_scale must have shape {tuple(k.shape[:2])} (k's first two "
                             f"axes), got {tuple(k_scale.shape)}")
        if jnp.dtype(k_scale.dtype) != jnp.dtype(jnp.float32):
            raise TypeError(f"k_scale must be float32, got {k_scale.dtype}")
    capacity *= devices
    if lengths is None:
        lengths = jnp.full((B,), capacity, jnp.int32)
    lengths = jnp.clip(_check_int_array("lengths", lengths, (B,)), 0, capacity)
    if page_table is not None:
        if devices == 1:
            check_known_pages(lengths, page_table, k.shape[0], k.shape[1])
        # traced: an out-of-range page id would read another sequence's keys; clip, never
        # read outside k
        page_table = jnp.clip(page_table, 0, k.shape[0] - 1)
    ids = state.ids
    if not hasattr(ids, "shape") or ids.ndim != 2 or ids.shape[0] != B:
        raise ValueError(f"state.ids must have shape [B, W] with B={B}, got "
                         f"{getattr(ids, 'shape', None)}")
    ids = _check_int_array("state.ids", ids, ids.shape)
    return q, k, w, ids, k_scale, lengths, page_table, squeeze


def decode_config(config) -> Config:
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a dosa_jax.Config, got {type(config).__name__}")
    return config


# ------------------------------------------------------------------ the selection (pure jnp)

def witness_threshold(keys: Array, witness_ids: Array, length, K: int, combine=None):
    """τ_w as an order key per query: the K-th largest current key of the distinct visible
    witnesses (Eq. 2), ``ACCEPT_ALL`` with fewer than K of them.

    ``combine`` (optional) maps the witnesses' keys [M, W] to the keys τ_w is taken from: under
    context parallelism an all-reduce (max) over the devices, each holding the keys of the
    witnesses it stores (:func:`dosa_jax.context_parallel.decode_topk`); the returned keys stay
    this device's own.

    Args:
      keys: [M, Npad] int32 order keys of every key of the sequence (``INT32_MIN`` where
        not eligible: invisible or NaN).
      witness_ids: [W] int32 ids (any values).
      length: scalar visible keys.
    Returns:
      (θ [M] int32, distinct visible witnesses scalar int32, the witnesses' current keys
      [M, W]: ``INT32_MIN`` for repeated, invisible or NaN ones).
    """
    first = distinct_visible(witness_ids[None, :], jnp.zeros((1,), jnp.int32),
                             jnp.reshape(length, (1,)).astype(jnp.int32))[0]
    wk = jnp.take(keys, jnp.clip(witness_ids, 0, keys.shape[1] - 1), axis=1)
    wk = jnp.where(first[None, :], wk, INT32_MIN)
    n_wit = jnp.sum(first, dtype=jnp.int32)
    if wk.shape[1] < K:
        return jnp.full((keys.shape[0],), ACCEPT_ALL, jnp.int32), n_wit, wk
    kth = lax.top_k(wk if combine is None else combine(wk), K)[0][:, K - 1]
    return jnp.where(kth == INT32_MIN, ACCEPT_ALL, kth), n_wit, wk


def seeded_witnesses(ids: Array, lengths: Array, config: Config) -> Array:
    """The state's witness ids [B, W] with every slot outside ``[0, lengths[b])`` (−1 from
    ``decode_init``, stale, or past a shorter sequence) given a seed of its sequence
    (:func:`dosa_jax.seeds.seed_at`: the ``Config.seed_strategy`` layout of W seeds over the
    visible keys, ``sink_size`` sinks, ``local_fraction`` of them the most recent keys; the
    r-th empty slot of a row takes the r-th seed, local keys most recent first). Seeds are
    visible keys of the sequence, so their K-th largest current score is still a lower
    bound on τ*: a sequence without witnesses (the first step, a reset state) gets a τ_w
    from its seeds instead of none, and one with few gets a higher one. Repeats of a carried
    witness count once (:func:`witness_threshold`). Changes the work, never the answer."""
    B, W = ids.shape
    lengths = lengths.astype(jnp.int32)
    layout = seed_layout(jnp.zeros((B,), jnp.int32), lengths, config.seed_strategy, W,
                         config.sink_size, config.local_fraction)
    empty = (ids < 0) | (ids >= lengths[:, None])
    rank = jnp.cumsum(empty.astype(jnp.int32), axis=1) - 1
    return jnp.where(empty, seed_at(layout, rank), ids).astype(jnp.int32)


def witness_budget(W: int, M: int) -> int:
    """Witnesses each of M queries carries to the next step out of a state of width W."""
    return max(1, W // M)


def best_witnesses(keys: Array, ids: Array, n: int):
    """(ids, order keys) [M, n] of the ``n`` largest order keys of rows ``keys`` [M, P] (−1 /
    ``INT32_MIN`` where ``INT32_MIN``, and beyond P): the witnesses carried to the next step,
    with their current keys (what merges them across devices)."""
    nn = min(n, keys.shape[1])
    top_key, top_pos = lax.top_k(keys, nn)
    out = jnp.where(top_key == INT32_MIN, -1, jnp.take_along_axis(ids, top_pos, axis=1))
    if nn < n:
        out = jnp.pad(out, ((0, 0), (0, n - nn)), constant_values=-1)
        top_key = jnp.pad(top_key, ((0, 0), (0, n - nn)), constant_values=INT32_MIN)
    return out, top_key


def looked_at(buffer_keys, buffer_ids, witness_keys, witness_ids, theta):
    """The keys a step has current scores for, each once: its candidate buffer, then the
    witnesses below θ (those ≥ θ are candidates, already in the buffer). [M, C + W] keys
    and ids, for :func:`best_witnesses`."""
    M = buffer_keys.shape[0]
    wk = jnp.where(witness_keys < theta[:, None], witness_keys, INT32_MIN)
    wi = jnp.broadcast_to(witness_ids, (M, witness_ids.shape[-1]))
    return (jnp.concatenate([buffer_keys, wk], axis=1),
            jnp.concatenate([buffer_ids, wi.astype(jnp.int32)], axis=1))


def distinct_pool(buffer_keys, buffer_ids, witness_keys, witness_ids):
    """:func:`looked_at` when the buffer may miss candidates (a split's records compacted to
    its Top-K): every witness joins, each id once (first occurrence; both occurrences of an
    id carry the same bitwise score). [M, C + W] keys and ids."""
    M = buffer_keys.shape[0]
    ids = jnp.concatenate([buffer_ids, jnp.broadcast_to(
        witness_ids, (M, witness_ids.shape[-1])).astype(jnp.int32)], axis=1)
    keys = jnp.concatenate([buffer_keys, witness_keys], axis=1)
    first = distinct_visible(ids, jnp.zeros((M,), jnp.int32),
                             jnp.full((M,), jnp.iinfo(jnp.int32).max, jnp.int32))
    return jnp.where(first, keys, INT32_MIN), ids


def _members(sorted_ids: Array, ids: Array) -> Array:
    """Whether each of ``ids`` [n] occurs in ``sorted_ids`` [m] (ascending; pads
    ``INT32_MAX``): a binary search per id, unrolled (one fused pass, no sort)."""
    pos = jnp.searchsorted(sorted_ids, ids, side="left", method="scan_unrolled")
    hit = jnp.take(sorted_ids, jnp.minimum(pos, sorted_ids.shape[0] - 1))
    return (pos < sorted_ids.shape[0]) & (hit == ids)


def select_and_witness(cand_keys: Array, cand_ids: Array, witness_keys: Array,
                       witness_ids: Array, K: int, n: int):
    """The Top-K of the candidates and the next ``n`` witnesses in one selection.

    ``cand_keys`` / ``cand_ids`` [M, C]: every key whose certified upper bound clears τ_w
    (the screen's candidates), in ascending id order (−1 / ``INT32_MIN`` pads after them),
    with their canonical order keys; ``witness_keys`` / ``witness_ids`` [M, W]: the step's
    witnesses (``INT32_MIN`` for repeated, invisible or NaN ones). The pool is the candidates
    then the witnesses that are not candidates (:func:`distinct_pool`'s pool, each id once,
    found by a binary search in the sorted candidate ids instead of a sort of the pool).

    Every witness at or above τ_w is a candidate (its bound ≥ its score ≥ τ_w), so a
    witness outside the candidates scores strictly below τ_w, below the K-th candidate
    whenever τ_w was taken over ≥ K witnesses: the pool's Top-K (stable, so id order breaks
    ties) is then the candidates' Top-K, and its best ``n`` are :func:`best_witnesses` of
    the pool. Returns (indices [M, K], order keys [M, K], next witness ids and keys
    [M, n]).
    """
    imax = jnp.iinfo(jnp.int32).max
    sorted_ids = jnp.where(cand_ids >= 0, cand_ids, imax)
    member = jax.vmap(_members)(sorted_ids, witness_ids.astype(jnp.int32))
    wk = jnp.where(member | (witness_ids < 0), INT32_MIN, witness_keys)
    keys = jnp.concatenate([cand_keys, wk], axis=1)
    ids = jnp.concatenate([cand_ids, witness_ids.astype(jnp.int32)], axis=1)
    out, top = best_witnesses(keys, ids, max(K, n))
    return out[:, :K], top[:, :K], (out[:, :n], top[:, :n])


def select_compacted(keys: Array, theta: Array, K: int, capacity: int):
    """Exact Top-K of key rows [M, Npad] (position = key id) through a bounded buffer.

    Every eligible key ≥ θ (a lower bound on the K-th key) is compacted, in id order, into
    ``capacity`` slots; Top-K of the buffer (``lax.top_k``: stable, so id order breaks
    ties). Rows with more candidates than ``capacity`` take the exact selection over all
    keys instead (computed only when some row needs it: ``lax.cond``).

    Returns (indices [M, K], scores [M, K], candidates [M], overflow [M] bool,
    (buffer keys, buffer ids) [M, capacity]).
    """
    M, n = keys.shape
    elig = keys != INT32_MIN
    cand = elig & (keys >= theta[:, None])
    count = jnp.sum(cand, axis=1, dtype=jnp.int32)
    pos = jnp.cumsum(cand.astype(jnp.int32), axis=1) - 1
    rows = jnp.broadcast_to(jnp.arange(M)[:, None], (M, n))
    dest = jnp.where(cand & (pos < capacity), pos, capacity)
    ck = jnp.full((M, capacity), INT32_MIN, jnp.int32).at[rows, dest].set(keys, mode="drop")
    ci = jnp.full((M, capacity), -1, jnp.int32).at[rows, dest].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (M, n)), mode="drop")
    top_key, top_pos = lax.top_k(ck, K)
    comp = (jnp.where(top_key == INT32_MIN, -1, jnp.take_along_axis(ci, top_pos, axis=1)),
            key_to_score(top_key))
    over = count > capacity

    def fallback(c):
        fi, fs = _select_keys(keys, K)
        return jnp.where(over[:, None], fi, c[0]), jnp.where(over[:, None], fs, c[1])

    idx, sc = lax.cond(jnp.any(over), fallback, lambda c: c, comp)
    return idx, sc, count, over, (ck, ci)


def _select_keys(keys: Array, K: int):
    """Exact Top-K of order-key rows (position = id; ``INT32_MIN`` not eligible)."""
    n = keys.shape[1]
    kk = min(K, n)
    top_key, top_pos = lax.top_k(keys, kk)
    idx = jnp.where(top_key == INT32_MIN, -1, top_pos.astype(jnp.int32))
    sc = key_to_score(top_key)
    if kk < K:
        idx = jnp.pad(idx, ((0, 0), (0, K - kk)), constant_values=-1)
        sc = jnp.pad(sc, ((0, 0), (0, K - kk)), constant_values=-jnp.inf)
    return idx, sc


def _all_ids(keys: Array) -> Array:
    return jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :], keys.shape)


def select_with_witnesses(scores: Array, length, witness_ids: Array, K: int, capacity: int,
                          carry: int, combine=None):
    """One sequence's decode selection from its scores [M, Npad] (keys ≥ ``length`` invisible).

    Returns (indices [M, K], scores [M, K], DecodeStats of [M] arrays, the next step's
    witnesses (ids, order keys) [M, carry]: :func:`best_witnesses` of the candidates and the
    witnesses, or of every key for rows that overflowed the buffer). ``combine``: as
    :func:`witness_threshold`'s.
    """
    M, n = scores.shape
    vis = jnp.arange(n, dtype=jnp.int32)[None, :] < length
    keys = jnp.where(vis, order_key(scores), INT32_MIN)
    theta, n_wit, wk = witness_threshold(keys, witness_ids, length, K, combine)
    if capacity >= n:   # the buffer holds every key: select directly (same answer)
        idx, sc = _select_keys(keys, K)
        count = jnp.sum((keys != INT32_MIN) & (keys >= theta[:, None]), axis=1, dtype=jnp.int32)
        over = jnp.zeros((M,), bool)
        nxt = best_witnesses(keys, _all_ids(keys), carry)
    else:
        idx, sc, count, over, (ck, ci) = select_compacted(keys, theta, K, capacity)
        nxt = best_witnesses(*looked_at(ck, ci, wk, witness_ids, theta), carry)
        nxt = lax.cond(jnp.any(over), lambda x: tuple(jnp.where(over[:, None], a, b) for a, b in
                                                      zip(best_witnesses(keys, _all_ids(keys),
                                                                         carry), x)),
                       lambda x: x, nxt)
    stats = DecodeStats(visible=jnp.full((M,), length, jnp.int32),
                        witnesses=jnp.full((M,), n_wit, jnp.int32),
                        tau_witness=jnp.where(theta == ACCEPT_ALL, -jnp.inf, key_to_score(theta)),
                        candidates=count, overflow=over.astype(jnp.int32))
    return idx, sc, stats, nxt


def fit_witnesses(ids: Array, W: int) -> Array:
    """The next state's ids [B, W] from this step's witnesses [B, M, W'] (−1 padded or cut)."""
    B = ids.shape[0]
    flat = ids.reshape(B, -1).astype(jnp.int32)
    if flat.shape[1] >= W:
        return flat[:, :W]
    return jnp.pad(flat, ((0, 0), (0, W - flat.shape[1])), constant_values=-1)


def sequence_keys(k, k_scale, page_table, b):
    """Sequence b's keys [capacity, D] (and scales) in position order (a gather for pages)."""
    if page_table is None:
        return k[b], None if k_scale is None else k_scale[b]
    pages = page_table[b]
    kb = jnp.take(k, pages, axis=0).reshape((-1, k.shape[2]))
    sb = None if k_scale is None else jnp.take(k_scale, pages, axis=0).reshape(-1)
    return kb, sb


def decode_topk_reference(q, k, w, ids, k_scale, lengths, page_table, config: Config, *,
                          combine=None):
    """The reference decode step on validated inputs (q [B, M, H, D], w [B, M, H]).

    Each sequence's queries are scored as one query tile by the canonical scorer
    (:func:`dosa_jax.scorer.full_scores_tile`, ``Config.key_block`` blocks: exactly the
    arithmetic of ``dense_topk``'s reference path on the sequence's keys), then
    :func:`select_with_witnesses`. Returns (indices [B, M, K], scores, DecodeStats [B, M],
    next witnesses [B, M, W / M]); with ``combine`` (context parallel: the witnesses' keys
    combined over the devices before τ_w is taken) the next witnesses are (ids, order keys).
    """
    K, cap = config.top_k, candidate_capacity(config)
    carry = witness_budget(ids.shape[1], q.shape[1])

    def one(b):
        kb, sb = sequence_keys(k, k_scale, page_table, b)
        s = full_scores_tile(q[b], w[b], kb, sb, config.key_block)
        return select_with_witnesses(s, lengths[b], ids[b], K, cap, carry, combine)

    idx, sc, stats, nxt = lax.map(one, jnp.arange(q.shape[0]))
    return idx, sc, stats, (nxt if combine is not None else nxt[0])


def key_table(k, k_scale):
    """The sequences' keys as one table [rows, D] (and scales [rows]): pages' rows, or b·N + i."""
    return (k.reshape((-1, k.shape[-1])), None if k_scale is None else k_scale.reshape(-1))


def selected_rows(k, page_table, idx):
    """Rows of :func:`key_table` of the sequence positions ``idx`` [B, M, K] (−1 stays −1)."""
    B = idx.shape[0]
    if page_table is None:
        rows = jnp.arange(B, dtype=jnp.int32)[:, None, None] * k.shape[1] + idx
    else:
        page = k.shape[1]
        pg = jnp.take_along_axis(page_table[:, None, :],
                                 jnp.clip(idx // page, 0, page_table.shape[1] - 1), axis=2)
        rows = pg * page + idx % page
    return jnp.where(idx >= 0, rows, -1)


def differentiable_scores(q, k, w, k_scale, page_table, idx, sc):
    """Scores carrying the scorer's derivative at the selected keys (as ``dense_topk``'s):
    the sequences' keys as one table (:func:`key_table`), ids as rows."""
    from dosa_jax import autodiff
    B, M, H, D = q.shape
    K = idx.shape[-1]
    flat_k, flat_s = key_table(k, k_scale)
    rows = selected_rows(k, page_table, idx).reshape(B * M, K)
    out = autodiff.selected_scores(q.reshape(B * M, H, D), flat_k, w.reshape(B * M, H), flat_s,
                                   lax.stop_gradient(rows), sc.reshape(B * M, K))
    return out.reshape(B, M, K)
