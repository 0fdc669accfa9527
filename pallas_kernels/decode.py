"""The decode step on the GPU (Pallas Triton): witness scores, one fused scan, exact selection.

A decode step (DESIGN §11, :mod:`dosa_jax.decode`) scores every visible key of every
sequence in full and keeps only keys at or above the witness threshold τ_w. Three parts:

1. **witness scores** — the previous step's distinct visible ids of each sequence are
   gathered (a [B, W, D] table, W ≈ K: small) and scored by the seed kernel
   (:func:`pallas_kernels.seeds.seed_scores`, the shared scoring tile); τ_w is each
   query's K-th largest witness order key (``THETA_NONE`` with fewer than K witnesses).
2. **scan** (:func:`decode_scan`, this module's kernel) — grid (sequence, key split). A
   program loads its sequence's ≤ 4 queries once (4 query slots, the ``kc`` tile of the
   dense kernel), streams its split of the sequence's keys in tiles of ``BK`` rows —
   contiguous rows, or the rows of the page that ``page_table`` names for the tile — scores
   them with :func:`pallas_kernels.scoring.score_tile` (FP8 payloads are read as they are
   stored, 1 byte per element, and widened in registers: no copy of the cache), and
   appends the keys whose order key clears τ_w to its record buffers
   (:mod:`pallas_kernels.records`: in id order, no atomics; a full buffer is compacted in
   place to its exact Top-K and its threshold raised — never a dropped candidate).
3. **select** — the splits' records (each ≤ K after the scan's last compaction) are
   gathered, in id order, into a buffer of ``capacity`` slots per query and selected with
   ``lax.top_k`` (stable: id order breaks ties); queries with more records than the
   buffer holds are selected over all records instead (``lax.cond``).

Scores are the dense kernel's (:mod:`pallas_kernels.dense`): the same operand pieces, the same
``kc`` tile of 4 query slots, the same lane-aligned head sums; a key's ``kc`` score is one
MMA row's head sum whatever the tile's key count, so decode and ``dense_topk`` agree bitwise
on the pallas backend. Workspace beyond the key cache (:func:`workspace_bytes`) depends on B,
K, W and the splits, never on N, for FP8 or bf16 keys whose N (contiguous) or page size is a
multiple of 16; float32/float16 keys are split into two bf16 pieces per step (a copy of the
cache), as the dense path does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax.decode import (DecodeStats, best_witnesses, candidate_capacity, distinct_pool,
                             select_with_witnesses, sequence_keys, witness_budget)
from dosa_jax.seeds import distinct_visible
from dosa_jax.selection import INT32_MIN, key_to_score
from dosa_jax.tiling import round_up_to
from pallas_kernels import records as rec
from pallas_kernels.common import (ID_BITS, THETA_NONE, compiler_params, interpret_default,
                                   mma_pieces, pad_axis, split_key_tiles)
from pallas_kernels.operands import capacity_for, prepare_operands
from pallas_kernels.scoring import load_query_tile, score_reference, score_tile
from pallas_kernels.seeds import seed_scores
from pallas_kernels.tiles import Tiles, check_tiles

Array = jax.Array

#: Query slots per sequence (the scoring tile's queries; M ≤ 4 real ones).
SLOTS = 4
#: Keys per scan tile (at most; a page smaller than this sets the tile): the dense kernel's tuned
#: 64 (128 keys × 4·H float32 accumulator columns are 256 registers per thread at H = 64).
KEY_TILE = 64
#: Programs wanted per step (≈ 4 per SM of an H200's 132) when choosing the key splits.
PROGRAMS = 528


def _scan_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, BK: int, H: int, S: int, C: int, K: int,
                 page: int, max_pages: int, has_scale: bool, pairs, lane_sums: bool,
                 interpret: bool, contiguous: bool):
    # contiguous keys: sequence b's rows start at b·page (one page each), no table lookups
    q_refs, (w_ref, hi_ref, th_ref, pt_ref) = refs[:Pq], refs[Pq:Pq + 4]
    k_refs = refs[Pq + 4:Pq + 4 + Pk]
    rest = refs[Pq + 4 + Pk:]
    sc_ref, rest = (rest[0], rest[1:]) if has_scale else (None, rest)
    rk_ref, ri_ref, cnt_ref, app_ref = rest
    BQ, CH = SLOTS, tiles.CH
    tpp = page // BK
    b = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, b, BQ=BQ, H=H, layout=tiles.layout)
    hi = hi_ref[pl.ds(b * BQ, BQ)]
    theta0 = th_ref[pl.ds(b * BQ, BQ)]
    t_ids = b * BQ + jnp.arange(BQ, dtype=jnp.int32)
    base = (t_ids * S + s) * C
    start, stop = split_key_tiles(0, jnp.max(hi), BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)

    def tile(j, state):
        ids = j * BK + lanes
        if contiguous:
            row0 = b * page + j * BK
        else:
            pg = jnp.max(pt_ref[pl.ds(b * max_pages + j // tpp, 1)])   # the tile's page
            row0 = pg * page + (j % tpp) * BK
        kp = [k_ref[pl.ds(row0, BK), :] for k_ref in k_refs]
        scale = sc_ref[pl.ds(row0, BK)] if has_scale else jnp.ones((BK,), jnp.float32)
        sc = score_tile(qp, wv, kp, scale, BQ=BQ, H=H, pairs=pairs, layout=tiles.layout,
                        lane_sums=lane_sums)
        return rec.append_scored_tile(rk_ref, ri_ref, base, state, sc, ids, None, hi, C=C,
                                      size=size)

    state, appended = rec.scan_tiles(start, stop, tile, theta0, rk_ref, ri_ref, base, K, C=C,
                                     BK=BK, CH=CH, size=size, interpret=interpret)
    oidx = t_ids * S + s
    cnt_ref[oidx] = state[0]
    app_ref[oidx] = appended


@functools.partial(jax.jit, static_argnames=("K", "S", "C", "BK", "page", "tiles", "H", "pairs",
                                             "lane_sums", "interpret", "contiguous"))
def decode_scan(q, w, hi, theta0, page_table, k, scale, *, K, S, C, BK, page, tiles, H, pairs,
                lane_sums, interpret, contiguous=False):
    T = hi.shape[0]
    B = T // SLOTS
    size = T * S * C
    has_scale = scale is not None
    kern = functools.partial(_scan_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, BK=BK, H=H,
                             S=S, C=C, K=K, page=page, max_pages=page_table.shape[1],
                             has_scale=has_scale, pairs=pairs, lane_sums=lane_sums,
                             interpret=interpret, contiguous=contiguous)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                 jax.ShapeDtypeStruct((T * S,), i32), jax.ShapeDtypeStruct((T * S,), i32))
    args = (*q, w, hi, theta0, page_table.reshape(-1), *k) + ((scale,) if has_scale else ())
    rk, ri, cnt, app = pl.pallas_call(
        kern, out_shape=out_shape, grid=(B, S),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_decode_scan")(*args)
    return rk.reshape(T, S, C), ri.reshape(T, S, C), cnt.reshape(T, S), app.reshape(T, S)


def key_layout(k, page_table, key_tile: int = KEY_TILE):
    """(keys as rows [R, D], page size, page table [B, max_pages], scan tile BK).

    Contiguous keys [B, N, D] are one page of N per sequence (N padded to a multiple of 16
    when it is not one). Paged keys need pages of a multiple of 16 rows.
    """
    if page_table is None:
        B, N, D = k.shape
        Np = max(16, round_up_to(N, 16))
        kk = pad_axis(k, 1, Np)
        return kk.reshape(B * Np, D), Np, jnp.arange(B, dtype=jnp.int32)[:, None], Np
    P, page, D = k.shape
    if page % 16:
        raise NotImplementedError(f"paged decode kernels need pages of a multiple of 16 keys, "
                                  f"got {page}")
    return k.reshape(P * page, D), page, page_table, page


def scan_tile(page: int, key_tile: int = KEY_TILE) -> int:
    """Keys per scan tile: the largest power of two ≤ ``key_tile`` dividing the page."""
    bk = 16
    while bk * 2 <= key_tile and page % (bk * 2) == 0:
        bk *= 2
    return bk


def default_splits(B: int, tiles_per_sequence: int) -> int:
    """Key splits per sequence: enough programs for the GPU (≈ :data:`PROGRAMS`), each
    walking ≥ 16 tiles; at most 64."""
    return int(max(1, min(64, PROGRAMS // max(B, 1), tiles_per_sequence // 16)))


def witness_keys(ops, kp, scale, rows, first, M: int, tiles: Tiles, interpret: bool):
    """Order keys [B·4, Wp] of each sequence's witnesses for its 4 query slots (seed kernel).

    ``rows`` [B, W] are the witnesses' key rows in ``kp``, ``first`` [B, W] marks the
    distinct visible ones (others score ``INT32_MIN``); W is padded to a multiple of the tile.
    """
    B, W = rows.shape
    Wp = max(tiles.BK, round_up_to(W, tiles.BK))
    rows = pad_axis(rows, 1, Wp)
    first = pad_axis(first, 1, Wp, False)
    table = jnp.take(kp, jnp.clip(rows, 0, kp.shape[1] - 1).reshape(-1), axis=1)
    tscale = (jnp.ones((B * Wp,), jnp.float32) if scale is None
              else jnp.take(scale, jnp.clip(rows, 0, scale.shape[0] - 1).reshape(-1)))
    slot = jnp.arange(B * Wp, dtype=jnp.int32).reshape(B, Wp)
    entries = jnp.where(first, slot | jnp.int32(((1 << M) - 1) << ID_BITS), -1)
    wops = ops._replace(k=table, scale=tscale)
    count = jnp.full((B, 1), Wp, jnp.int32)
    return seed_scores(wops, entries[:, None, :], count, tiles=tiles, interpret=interpret)


def gather_records(rk, ri, cnt, K: int, capacity: int):
    """Exact Top-K of the splits' records through a buffer of ``capacity`` slots per query.

    Each split holds ≤ K records in id order and the splits cover ascending id ranges, so
    the records laid end to end are in id order; ``lax.top_k`` of that buffer (stable) is
    the Top-K in tie order. Queries with more records than ``capacity`` are selected over
    all records (:func:`pallas_kernels.records.select_from_records`; ``lax.cond``).

    Returns (indices [T, K], scores [T, K], records [T], overflow [T] bool,
    (buffer keys, buffer ids) [T, capacity]).
    """
    T, S, C = rk.shape
    cnt = jnp.minimum(cnt, K)
    end = jnp.cumsum(cnt, axis=1)
    total = end[:, -1]
    p = jnp.arange(capacity, dtype=jnp.int32)
    split = jnp.minimum(jnp.sum(p[None, :, None] >= end[:, None, :], axis=2), S - 1)
    src = split * C + p[None, :] - jnp.take_along_axis(end - cnt, split, axis=1)
    valid = p[None, :] < total[:, None]
    src = jnp.where(valid, src, 0)
    keys = jnp.where(valid, jnp.take_along_axis(rk.reshape(T, S * C), src, axis=1), INT32_MIN)
    ids = jnp.take_along_axis(ri.reshape(T, S * C), src, axis=1)
    top_key, top_pos = lax.top_k(keys, K)
    comp = (jnp.where(top_key == INT32_MIN, -1, jnp.take_along_axis(ids, top_pos, axis=1)),
            key_to_score(top_key))
    over = total > capacity

    def fallback(c):
        fi, fs = rec.select_from_records(rk, ri, cnt, K)
        return jnp.where(over[:, None], fi, c[0]), jnp.where(over[:, None], fs, c[1])

    idx, sc = lax.cond(jnp.any(over), fallback, lambda c: c, comp)
    return idx, sc, total, over, (keys, jnp.where(valid, ids, -1))


def record_witnesses(rk, ri, cnt, K: int, n: int, wk, wids):
    """The ``n`` best of each query's records (all splits) and witnesses, each id once
    (:func:`dosa_jax.decode.best_witnesses`: ids and order keys): the next step's witnesses
    of a query whose records overflowed the selection buffer."""
    T, S, _ = rk.shape
    valid = jnp.arange(K, dtype=jnp.int32)[None, None, :] < jnp.minimum(cnt, K)[:, :, None]
    keys = jnp.where(valid, rk[..., :K], INT32_MIN).reshape(T, S * K)
    ids = jnp.where(valid, ri[..., :K], -1).reshape(T, S * K)
    return best_witnesses(*distinct_pool(keys, ids, wk, wids), n)


def workspace_bytes(B: int, K: int, W: int, D: int, *, capacity=None, splits: int,
                    key_tile: int = KEY_TILE, key_bytes: int = 1) -> dict:
    """Device bytes a decode step allocates besides the key cache (independent of N).

    records: order keys + ids of C slots per (query slot, split); counts; the witness table
    (gathered keys, scales, entries, order keys); the selection buffer and the witnesses below
    τ_w (keys + ids: what the next witnesses are chosen from).
    """
    C = capacity_for(K, key_tile, 2 * K)
    T = B * SLOTS
    cap = max(K, capacity if capacity is not None else 2 * K)
    Wp = round_up_to(W, 64)
    parts = dict(records=T * splits * C * 8, counts=T * splits * 8,
                 witness_table=B * Wp * (D * key_bytes + 4 + 4) + T * Wp * 4,
                 selection=T * (cap + Wp) * 8)
    parts["total"] = sum(parts.values())
    return parts


class Prepared(NamedTuple):
    """Kernel operands of one step (:func:`prepare`)."""

    ops: object          # Operands of the 4 query slots per sequence (keys: ``kp``)
    kp: Array            # [Pk, R, Dp] key rows (FP8 payloads as stored)
    scale: object        # [R] float32 key scales, or None
    page_table: Array    # [B, max_pages] int32 (contiguous: one page per sequence)
    page: int            # keys per page
    BK: int              # keys per scan tile
    tiles: Tiles
    contiguous: bool     # keys [B, N, D]: sequence b's rows at b·page


def prepare(q, w, k, k_scale, page_table, *, tiles: Tiles = Tiles(),
            key_tile: int = KEY_TILE) -> Prepared:
    """Operands of the kernels: 4 query slots per sequence, keys as rows (no copy of FP8 or
    bf16 keys whose N is a multiple of 16)."""
    check_tiles(tiles)
    if tiles.layout != "kc" or tiles.BQ != SLOTS:
        raise NotImplementedError("decode kernels use the kc scoring tile of 4 query slots")
    B, M, H, D = q.shape
    keys_rows, page, pt, _ = key_layout(k, page_table, key_tile)
    BK = scan_tile(page, key_tile)
    tiles = tiles._replace(BK=BK)
    scale = None if k_scale is None else (
        pad_axis(k_scale, 1, page).reshape(-1) if page_table is None else k_scale.reshape(-1))
    kp = mma_pieces(keys_rows, jnp.bfloat16, widen_fp8=False)   # FP8 stays 1 byte per element
    Dp = max(16, 1 << max(0, (D - 1).bit_length()))
    kp = pad_axis(kp, 2, Dp)
    qs = pad_axis(q, 1, SLOTS).reshape(B * SLOTS, H, D)
    ws = pad_axis(w, 1, SLOTS).reshape(B * SLOTS, H)
    ops = prepare_operands(qs, ws, None, None, SLOTS, jnp.bfloat16, tiles.layout,
                           widen_fp8=False, lane_sums=tiles.lane_sums,
                           keys=(kp, jnp.ones((1,), jnp.float32)))
    return Prepared(ops, kp, scale, pt.astype(jnp.int32), page, BK, tiles, page_table is None)


def scan_records(prep: Prepared, theta, lengths, M: int, K: int, *, splits=None,
                 interpret=None):
    """The scan kernel from thresholds ``theta`` [B·4] (order keys; ``THETA_NONE``: none):
    record buffers (order keys, ids [B·4, S, C], counts, appended [B·4, S])."""
    if interpret is None:
        interpret = interpret_default()
    B = prep.page_table.shape[0]
    S = splits or default_splits(B, prep.page * prep.page_table.shape[1] // prep.BK)
    C = capacity_for(K, prep.BK, 2 * K)
    slot = jnp.arange(SLOTS)[None, :]
    hi = jnp.where(slot < M, lengths[:, None], 0).reshape(-1).astype(jnp.int32)
    return decode_scan(prep.ops.q, prep.ops.w, hi, theta, prep.page_table, prep.kp, prep.scale,
                       K=K, S=S, C=C, BK=prep.BK, page=prep.page, tiles=prep.tiles, H=prep.ops.H,
                       pairs=prep.ops.pairs, lane_sums=prep.ops.lane_sums, interpret=interpret,
                       contiguous=prep.contiguous)


def witness_threshold(prep: Prepared, ids, lengths, M: int, K: int, *, interpret=None,
                      combine=None):
    """τ_w of every query slot as an order key ([B·4]; ``THETA_NONE`` with fewer than K
    distinct visible witnesses), the distinct visible witness count [B], and the witnesses'
    order keys and ids [B·4, Wp] (``INT32_MIN`` / −1 for repeated, invisible, NaN, pads).
    ``combine``: as :func:`dosa_jax.decode.witness_threshold`'s (τ_w from the combined keys;
    the returned keys stay this device's)."""
    if interpret is None:
        interpret = interpret_default()
    B = ids.shape[0]
    capacity_keys = prep.page * prep.page_table.shape[1]
    first = distinct_visible(ids, jnp.zeros((B,), jnp.int32), lengths)
    safe = jnp.clip(ids, 0, capacity_keys - 1)
    wrows = jnp.take_along_axis(prep.page_table, safe // prep.page, axis=1) * prep.page \
        + safe % prep.page
    wk = witness_keys(prep.ops, prep.kp, prep.scale, wrows, first, M, prep.tiles, interpret)
    if wk.shape[1] >= K:
        kth = lax.top_k(wk if combine is None else combine(wk), K)[0][:, K - 1]
        theta = jnp.where(kth == INT32_MIN, THETA_NONE, kth)
    else:
        theta = jnp.full((B * SLOTS,), THETA_NONE, jnp.int32)
    wids = pad_axis(jnp.where(first, ids, -1), 1, wk.shape[1], -1)
    wids = jnp.repeat(wids, SLOTS, axis=0)
    return theta, jnp.sum(first, axis=1, dtype=jnp.int32), wk, wids


def decode_topk(q, k, w, ids, k_scale, lengths, page_table, config, *, tiles: Tiles = Tiles(),
                key_tile: int = KEY_TILE, splits=None, interpret=None, combine=None):
    """One decode step by the kernels (validated inputs: q [B, M, H, D], w [B, M, H]).

    Returns (indices [B, M, K], scores [B, M, K], DecodeStats [B, M], next witnesses
    [B, M, W / M]) as :func:`dosa_jax.decode.decode_topk_reference`, indices and scores
    bitwise equal to ``dense_topk`` on the pallas backend. The next witnesses are the best
    of the selection buffer (of all records on overflow) and the witnesses, each id once;
    with ``combine`` (context parallel) they are (ids, order keys), as the reference's.
    """
    B, M = q.shape[:2]
    K = config.top_k
    carry = witness_budget(ids.shape[1], M)
    prep = prepare(q, w, k, k_scale, page_table, tiles=tiles, key_tile=key_tile)
    theta, n_wit, wk, wids = witness_threshold(prep, ids, lengths, M, K, interpret=interpret,
                                               combine=combine)
    rk, ri, cnt, app = scan_records(prep, theta, lengths, M, K, splits=splits,
                                    interpret=interpret)
    idx, sc, _, over, (bk, bi) = gather_records(rk, ri, cnt, K, candidate_capacity(config))
    r = lambda x: x.reshape(B, SLOTS, *x.shape[1:])[:, :M]
    rm = lambda x: r(x).reshape((B * M,) + x.shape[1:])      # the M real slots only
    wit = (rm(wk), rm(wids))     # split buffers end compacted to their Top-K: dedupe by id
    nxt = best_witnesses(*distinct_pool(rm(bk), rm(bi), *wit), carry)
    nxt = lax.cond(jnp.any(over), lambda x: tuple(
        jnp.where(rm(over)[:, None], a, b)
        for a, b in zip(record_witnesses(rm(rk), rm(ri), rm(cnt), K, carry, *wit), x)),
        lambda x: x, nxt)
    nxt = tuple(a.reshape(B, M, carry) for a in nxt)
    merged = jnp.any(app > rk.shape[2] - prep.BK, axis=1)   # a buffer compacted mid-scan
    stats = DecodeStats(visible=jnp.broadcast_to(lengths[:, None], (B, M)).astype(jnp.int32),
                        witnesses=jnp.broadcast_to(n_wit[:, None], (B, M)),
                        tau_witness=r(jnp.where(theta == THETA_NONE, -jnp.inf,
                                                key_to_score(theta))),
                        candidates=r(jnp.sum(app, axis=1)),
                        overflow=r((over | merged).astype(jnp.int32)))
    return r(idx), r(sc), stats, (nxt if combine is not None else nxt[0])


def decode_topk_reference(q, k, w, ids, k_scale, lengths, page_table, config):
    """jnp twin of :func:`decode_topk`: the kernels' scoring function
    (:func:`pallas_kernels.scoring.score_reference`: the same operand pieces, float32
    accumulation) on each sequence's keys, then the witness selection of
    :func:`dosa_jax.decode.select_with_witnesses`."""
    K, cap = config.top_k, candidate_capacity(config)
    carry = witness_budget(ids.shape[1], q.shape[1])

    def one(b):
        kb, sb = sequence_keys(k, k_scale, page_table, b)
        s = score_reference(mma_pieces(q[b]), w[b], mma_pieces(kb), sb)
        return select_with_witnesses(s, lengths[b], ids[b], K, cap, carry)

    idx, sc, stats, nxt = lax.map(one, jnp.arange(q.shape[0]))
    return idx, sc, stats, nxt[0]


__all__ = ["KEY_TILE", "Prepared", "SLOTS", "decode_scan", "decode_topk", "decode_topk_reference",
           "default_splits", "gather_records", "key_layout", "prepare", "record_witnesses",
           "scan_records", "scan_tile",
           "witness_keys", "witness_threshold", "workspace_bytes"]
