"""The candidate buffer with an online threshold (in-kernel), and its jnp twin.

Each kernel program owns, for each of its BQ queries, a fixed slice of
``C`` record slots (order key, key id) in device memory and a count. Records
arrive in ascending key-id order (the scans walk keys, or sorted survivor
lists, upward) and are *appended* at ``count + cumsum(accept) − 1``: no atomics,
so the output is deterministic and the kernels run in interpret mode on CPU.

Online threshold (the "LiteTopK" filter; paper Sec. 3, DESIGN §10): when some
buffer could not take another tile (``count > C − BK``), the program finds,
per query with at least K records, a threshold ``t`` with K ≤ #{key ≥ t} ≤
K + slack (:func:`rank_threshold`: a binary search over int32 order keys,
one counting pass over the buffer per probe, stopped as soon as a probe lands
in that window; ``slack`` is half the room beyond K + BK), compacts the
buffer in place to the keys ≥ t, and from then on accepts keys ≥ t. ``t`` is
a valid lower bound on τ* (K witnesses), so nothing of the Top-K is dropped.
When ties at the K-th key leave no such t, ``t`` is the K-th largest key and
the buffer keeps exactly K records — all keys ``> t`` and the lowest-id
``K − #{> t}`` keys equal to ``t`` — and accepts only keys ``> t``
(``strict``): a later key equal to ``t`` ranks after K held records with
smaller ids (tie order: score desc, id asc), so it cannot enter the Top-K.
With ``C ≥ K + BK`` a compaction always frees room for the next tile, so a
buffer never overflows and never drops a candidate, whatever the data
(massive ties included).

Threshold states are order keys (:func:`dosa_jax.selection.order_key`);
``theta_acc`` is the smallest accepted key (``t + 1`` when strict).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax.selection import INT32_MAX, INT32_MIN, key_to_score, order_key, select_by_position
from pallas_kernels.common import cdiv, kernel_order_key

Array = jax.Array


def _plgpu():
    from jax.experimental.pallas import triton as plgpu
    return plgpu


def barrier(interpret: bool):
    """CTA barrier between reading and rewriting buffer slots (no-op when interpreting)."""
    if not interpret:
        _plgpu().debug_barrier()


def masked_index(idx, mask, oob: int):
    """Index array with masked-off entries sent out of bounds.

    Interpret mode implements a masked store as a scatter of old values; routing
    masked-off lanes out of bounds (dropped) keeps them from colliding with real
    writes. On the GPU masked-off lanes issue no memory access.
    """
    return jnp.where(mask, idx, jnp.int32(oob))


def load_slots(ref, base, slots, valid, size: int, other=0):
    """ref[base[:, None] + slots] for valid lanes ([BQ, n])."""
    idx = masked_index(base[:, None] + slots, valid, size)
    return _plgpu().load(ref.at[idx], mask=valid, other=other)


def store_slots(ref, base, slots, val, mask, size: int):
    idx = masked_index(base[:, None] + slots, mask, size)
    _plgpu().store(ref.at[idx], val, mask=mask)


def append_scored_tile(key_ref, id_ref, base, state, scores, ids, lo, hi, *, C: int,
                       size: int):
    """A scanned tile's scores [BQ, BK] appended to the queries' record buffers: each key of
    ``ids`` [BK] in a query's range ``[lo, hi)`` (``lo`` None: from 0) whose order key is not
    NaN's and clears the scan state's threshold. ``state`` = (count, theta, strict) of
    :func:`scan_tiles`; returns (the new state, number appended [BQ])."""
    key = kernel_order_key(scores)
    idb = jnp.broadcast_to(ids[None, :], scores.shape)
    elig = (idb < hi[:, None]) & (key != INT32_MIN)
    if lo is not None:
        elig = elig & (idb >= lo[:, None])
    count, theta, strict = state
    count, n = append(key_ref, id_ref, base, count, theta_accept(theta, strict), key, idb, elig,
                      C=C, size=size)
    return (count, theta, strict), n


def append(key_ref, id_ref, base, count, theta_acc, key, ids, eligible, *, C: int, size: int):
    """Append eligible records with ``key ≥ theta_acc`` after ``count`` (per query).

    Args:
      base: [BQ] flat offset of each query's C slots; count, theta_acc: [BQ].
      key: [BQ, BK] order keys; ids: [BQ, BK] key ids; eligible: [BQ, BK] bool.
    Returns:
      (new count [BQ], number appended [BQ]).
    """
    acc = eligible & (key >= theta_acc[:, None])
    acc_i = acc.astype(jnp.int32)
    n = jnp.sum(acc_i, axis=1)

    def write():
        # the prefix sum's 0/1 values made here, not ``acc_i``: the compiler then moves them to
        # the scan's layout inside this branch (taken by few tiles), not on every tile
        pos = count[:, None] + jnp.cumsum(jnp.where(acc, 1, 0), axis=1) - 1
        ok = acc & (pos < C)
        store_slots(key_ref, base, pos, key, ok, size)
        store_slots(id_ref, base, pos, ids, ok, size)

    # most tiles of a long scan append nothing once the threshold has risen
    jax.lax.cond(jnp.max(n) > 0, write, lambda: None)
    return jnp.minimum(count + n, C), n


def count_at_least(key_ref, base, count, t, *, CH: int, size: int, n_chunks):
    """#{records with key ≥ t} per query ([BQ]).

    Each lane keeps its own partial counts over the chunks and the lanes are summed once at
    the end: one cross-thread reduction per pass instead of one per chunk.
    """
    lanes = jnp.arange(CH, dtype=jnp.int32)[None, :]

    def body(c, acc):
        slots = c * CH + lanes
        valid = slots < count[:, None]
        kk = load_slots(key_ref, base, slots, valid, size, other=INT32_MIN)
        return acc + (valid & (kk >= t[:, None])).astype(jnp.int32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((count.shape[0], CH), jnp.int32))
    return jnp.sum(acc, axis=1)


def rank_threshold(key_ref, base, count, K: int, slack: int, *, CH: int, size: int):
    """Per query, a threshold t with #{key ≥ t} ≥ K, as tight as ``slack`` asks.

    Binary search on int32 order keys for the largest t with #{key ≥ t} ≥ K (the K-th
    largest key), stopped early for a query as soon as a probe t has
    K ≤ #{key ≥ t} ≤ K + slack: then keeping the keys ≥ t keeps at most K + slack records
    and every key of the Top-K. With ``slack = 0`` it stops at #{≥ t} = K exactly (any such
    t), or runs to the K-th largest key. Queries with fewer than K records get
    ``INT32_MIN + 1`` (below every record). A lane's search ends in at most 32 probes; the
    loop ends when every lane's has.

    Returns (t [BQ], #{key ≥ t} [BQ]).
    """
    n_chunks = cdiv(jnp.max(count), CH)
    lo0 = jnp.full_like(count, INT32_MIN + 1)
    hi0 = jnp.where(count >= K, jnp.full_like(count, INT32_MAX), lo0)

    def cond(st):
        return jnp.max((st[0] < st[1]).astype(jnp.int32)) > 0   # (no reduce_or in Triton)

    def step(st):
        lo, hi, c_lo = st
        live = lo < hi
        # ceil((lo + hi) / 2) without int32 overflow
        mid = (lo & hi) + ((lo ^ hi) >> 1) + ((lo ^ hi) & 1)
        mid = jnp.where(live, mid, lo)
        c = count_at_least(key_ref, base, count, mid, CH=CH, size=size, n_chunks=n_chunks)
        ok = live & (c >= K)
        lo_n = jnp.where(ok, mid, lo)
        hi_n = jnp.where(ok, jnp.where(c <= K + slack, mid, hi), jnp.where(live, mid - 1, hi))
        return lo_n, hi_n, jnp.where(ok, c, c_lo)

    # all records are > INT32_MIN, so #{key ≥ lo0} = count
    lo, _, c_lo = lax.while_loop(cond, step, (lo0, hi0, count))
    return lo, c_lo


def compact(key_ref, id_ref, base, count, t, trim, K: int, *, CH: int, size: int,
            interpret: bool):
    """Compact, in slot order, the buffers of queries with count ≥ K.

    A query with ``trim`` set keeps the keys > t and the first K − #{> t} keys == t (t its
    K-th largest key: exactly K records); the others keep the keys ≥ t. Returns the new counts
    (unchanged where count < K).
    """
    do = count >= K
    n_chunks = cdiv(jnp.max(count), CH)
    lanes = jnp.arange(CH, dtype=jnp.int32)[None, :]

    def run(ties: bool):
        if ties:
            n_gt = count_at_least(key_ref, base, count, t + 1, CH=CH, size=size,
                                  n_chunks=n_chunks)
            ties_wanted = K - n_gt

        def body(c, carry):
            kept, n_eq = carry
            slots = c * CH + lanes
            valid = slots < count[:, None]
            kk = load_slots(key_ref, base, slots, valid, size, other=INT32_MIN)
            ii = load_slots(id_ref, base, slots, valid, size, other=-1)
            keep = valid & (kk >= t[:, None])
            if ties:   # the tie order (score desc, id asc): the lowest-slot ties stay
                eq_i = (valid & (kk == t[:, None])).astype(jnp.int32)
                eq_rank = n_eq[:, None] + jnp.cumsum(eq_i, axis=1) - 1
                keep = jnp.where(trim[:, None], (kk > t[:, None]) | (
                    (eq_i != 0) & (eq_rank < ties_wanted[:, None])), keep)
                n_eq = n_eq + jnp.sum(eq_i, axis=1)
            keep = valid & jnp.where(do[:, None], keep, True)
            keep_i = keep.astype(jnp.int32)
            pos = kept[:, None] + jnp.cumsum(keep_i, axis=1) - 1
            barrier(interpret)  # every lane has read this chunk before any slot is rewritten
            store_slots(key_ref, base, pos, kk, keep, size)
            store_slots(id_ref, base, pos, ii, keep, size)
            return kept + jnp.sum(keep_i, axis=1), n_eq

        z = jnp.zeros_like(count)
        return lax.fori_loop(0, n_chunks, body, (z, z))[0]

    return lax.cond(jnp.max((trim & do).astype(jnp.int32)) > 0, lambda: run(True),
                    lambda: run(False))


def raise_threshold(key_ref, id_ref, base, count, theta, strict, K: int, *, slack: int, CH: int,
                    size: int, interpret: bool):
    """Compact every buffer holding ≥ K records and raise its threshold.

    :func:`rank_threshold` finds t with K ≤ #{key ≥ t} (≤ K + ``slack`` unless ties at the
    K-th key forbid it). Within the window the buffer keeps the keys ≥ t and from then on
    accepts keys ≥ t; otherwise t is the K-th largest key, the buffer keeps exactly K records
    (tie order) and accepts keys > t only. Either way t is a lower bound on τ* (≥ K witnesses)
    and nothing of the Top-K is dropped. The accepted minimum never decreases.

    Returns (count, theta, strict).
    """
    barrier(interpret)  # records appended by other lanes are visible
    t, c_ge = rank_threshold(key_ref, base, count, K, slack, CH=CH, size=size)
    do = count >= K
    trim = c_ge > K + slack
    new_count = compact(key_ref, id_ref, base, count, t, trim, K, CH=CH, size=size,
                        interpret=interpret)
    raised = do & (t + trim.astype(jnp.int32) > theta_accept(theta, strict))
    theta = jnp.where(raised, t, theta)
    strict = jnp.where(raised, trim.astype(strict.dtype), strict)
    return new_count, theta, strict


def scan_state(theta0):
    """(count, theta, strict) at the start of a scan."""
    z = jnp.zeros_like(theta0)
    return z, theta0, z


def theta_accept(theta, strict):
    return theta + strict


def compaction_slack(C: int, BK: int, K: int) -> int:
    """Records a compaction may keep beyond K: half the room a buffer has beyond K + BK (so a
    compaction always frees at least half of it, and never less than a tile)."""
    return max(0, (C - BK - K) // 2)


def raise_above(limit, state, key_ref, id_ref, base, K: int, *, slack: int, CH: int, size: int,
                interpret: bool):
    """:func:`raise_threshold` when some buffer holds more than ``limit`` records; else
    ``state`` (count, theta, strict) unchanged."""
    return lax.cond(
        jnp.max(state[0]) > limit,
        lambda s: raise_threshold(key_ref, id_ref, base, s[0], s[1], s[2], K, slack=slack,
                                  CH=CH, size=size, interpret=interpret),
        lambda s: s, state)


def scan_tiles(start, stop, tile_fn, theta0, key_ref, id_ref, base, K: int, *, C: int, BK: int,
               CH: int, size: int, interpret: bool):
    """Run ``tile_fn`` over tiles [start, stop) with the online threshold.

    ``tile_fn(j, state) -> (state, appended_now)`` appends one tile's records
    (at most BK per query) and never compacts. Compaction happens *between*
    runs of tiles: each run is as long as the fullest buffer can surely absorb
    (``(C − max count) // BK`` tiles), so the inner loop holds no nested loop
    and Triton can software-pipeline its key loads. ``C ≥ K + BK`` guarantees
    every run makes progress. A last compaction (``slack = 0``) leaves at most K
    records in every buffer: the K best in tie order.

    Returns ((count ≤ K, theta, strict), appended).
    """

    def cond(c):
        return c[0] < stop

    def body(c):
        j, state, appended = c
        # compact when some buffer could not take another tile of BK records
        state = raise_above(C - BK, state, key_ref, id_ref, base, K,
                            slack=compaction_slack(C, BK, K), CH=CH, size=size,
                            interpret=interpret)
        room = jnp.maximum((C - jnp.max(state[0])) // BK, 1)
        j_end = jnp.minimum(j + room, stop)

        def inner(jj, carry):
            st, app = carry
            st, n = tile_fn(jj, st)
            return st, app + n

        state, appended = lax.fori_loop(j, j_end, inner, (state, appended))
        return j_end, state, appended

    _, state, appended = lax.while_loop(
        cond, body, (start, scan_state(theta0), jnp.zeros_like(theta0)))
    # end with at most K records per buffer (exactly its Top-K in tie order), so that the final
    # selection reads K slots per buffer instead of C (select_from_records)
    state = raise_above(K, state, key_ref, id_ref, base, K, slack=0, CH=CH, size=size,
                        interpret=interpret)
    return state, appended


# ---------------------------------------------------------------- jnp side

def select_from_records(rec_key: Array, rec_id: Array, count: Array, k: int):
    """Exact Top-k of per-query record buffers.

    Args:
      rec_key, rec_id: [T, S, C] order keys and ids (each split in ascending id
        order, splits in ascending id ranges, so slot position order is id order).
      count: [T, S] valid records per split, at most k (:func:`scan_tiles` ends with a
        compaction to k): only the first k slots of each split are read.
    Returns:
      (indices [T, k] int32, scores [T, k] float32) in contract order.
    """
    rec_key, rec_id = rec_key[..., :k], rec_id[..., :k]
    T, S, C = rec_key.shape
    valid = jnp.arange(C, dtype=jnp.int32)[None, None, :] < count[:, :, None]
    scores = key_to_score(jnp.where(valid, rec_key, INT32_MIN)).reshape(T, S * C)
    pos, sc = select_by_position(scores, k, valid.reshape(T, S * C))
    idx = jnp.where(pos >= 0, jnp.take_along_axis(rec_id.reshape(T, S * C),
                                                  jnp.maximum(pos, 0), axis=1), -1)
    return idx.astype(jnp.int32), sc


def kth_order_key_reference(scores: Array, valid: Array, k: int) -> Array:
    """K-th largest order key of score rows ([T, M] -> [T]); what :func:`rank_threshold`
    returns with ``slack = 0`` when ties leave no t with #{≥ t} = K."""
    key = jnp.where(valid, order_key(scores), INT32_MIN)
    if scores.shape[-1] < k:
        return jnp.full(scores.shape[:-1], INT32_MIN + 1, jnp.int32)
    kth = lax.top_k(key, k)[0][..., k - 1]
    return jnp.where(kth == INT32_MIN, INT32_MIN + 1, kth)
