"""The decode step on the GPU (Pallas Triton): witness scores, one fused scan, exact selection.

A decode step (DESIGN §11, :mod:`dosa_jax.decode`) scores every visible key of every
sequence in full and keeps only keys at or above the witness threshold τ_w:

1. **witness scores** — the previous step's distinct visible ids of each sequence are
   gathered (a [B, W, D] table, W = 4·K: small against N) and scored by the seed kernel
   (:func:`pallas_kernels.seeds.seed_scores`, the shared scoring tile); τ_w is each
   query's K-th largest witness order key (``THETA_NONE`` with fewer than K witnesses),
   found without a sort (:func:`pallas_kernels.kth_largest.kth_largest`).
2. **screen** (one query per sequence, FP8 or bf16 keys: :func:`screens`) — the scan kernel
   (:func:`decode_scan`) with one query slot: grid (sequence, key split), each program
   streams its split of the sequence's keys in tiles of ``BK`` rows (contiguous, or the
   page that ``page_table`` names; FP8 payloads read as stored, 1 byte per element, widened
   in registers) and scores them with :func:`pallas_kernels.scoring.score_tile` on a
   [BK, D] × [D, H] tile: a quarter of the canonical tile's MMA work, but another head-sum
   order. So it keeps each key whose *upper bound* u_i = a_i + |α_i|·n_i·coef clears τ_w
   (:func:`screen_upper`; any two kernel scorers of the same pieces lie within
   α_i·n_i·E_s of the real score, :func:`screen_margin_coefficient`; n_i bounds the payload
   norm, :func:`payload_norm_bound`). The buffers are never compacted (that would rank
   bounds). The candidates are rescored by the seed kernel — the canonical tile — and
   one ``lax.top_k`` (stable: id order breaks ties) over them and the witnesses outside them
   gives both the Top-K and the next witnesses (:func:`dosa_jax.decode.select_and_witness`:
   a binary search in the sorted candidate ids, no sort of the pool). A step whose screen cannot
   certify its candidates (no τ_w, a full buffer, more candidates than ``capacity``) runs 3.
   instead (``lax.cond``): the answer is the canonical one either way.
3. **canonical scan** — the same kernel with the dense kernel's 4 query slots (M ≤ 4 real
   ones): scores in the canonical order, appended to record buffers when they clear τ_w
   (:mod:`pallas_kernels.records`: in id order, no atomics; a full buffer is compacted in
   place to its exact Top-K and its threshold raised — never a dropped candidate); the
   splits' records are gathered, in id order, into ``capacity`` slots per query and
   selected with ``lax.top_k``; queries with more records are selected over all records.

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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax.decode import (WITNESS_FACTOR, DecodeStats, best_witnesses, candidate_capacity,
                             distinct_pool, select_and_witness, select_with_witnesses,
                             sequence_keys, witness_budget)
from dosa_jax import numerics as nm
from dosa_jax.seeds import distinct_visible
from dosa_jax.selection import INT32_MIN, key_to_score
from dosa_jax.tiling import round_up_to
from pallas_kernels import numerics
from pallas_kernels import records as rec
from pallas_kernels.kth_largest import kth_largest
from pallas_kernels.common import (BF16, FP8, ID_BITS, ID_MASK, THETA_NONE, compiler_params,
                                   interpret_default, mma_pieces, pad_axis, scaled_f16_pieces,
                                   split_key_tiles)
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
#: The screen's Triton warps and pipeline stages: two warps, fewer than a warpgroup, so Triton
#: multiplies with ``mma.sync`` from registers, the query tile loaded into registers once;
#: with four, its ``wgmma`` reads the query tile from shared memory, which the compiled loop
#: stores there again (with a fence and a barrier) before every key tile.
SCREEN_WARPS = 2
SCREEN_STAGES = 2


def screen_key_tile(H: int) -> int:
    """Keys per screen tile at H heads (one query slot: a [BK, H] float32 accumulator over
    :data:`SCREEN_WARPS` warps, 64 registers a thread at 128 keys and H = 32)."""
    return 128 if H <= 32 else 64


#: Programs wanted per step (≈ 4 per SM of an H200's 132) when choosing the key splits.
PROGRAMS = 528
#: The screen's programs wanted per step and its most splits per sequence: its buffers hold
#: only candidates, so it splits finer (on the H200 at N = 1M, 512 splits against 64: the
#: screen 0.414 → 0.101 ms at B = 1, 0.688 → 0.637 ms at B = 8).
SCREEN_PROGRAMS = 4096
SCREEN_MAX_SPLITS = 512
#: The second round's record slots per sequence, in multiples of the candidate capacity: the
#: screen's records are first laid end to end in this many slots (its [S, C] buffers hold
#: S·C slots, mostly empty: 16.8M at B = 8, N = 1M), so θ₂'s counting passes read few; a sequence
#: with more records is left to the canonical scan.
SECOND_ROUND_SLOTS = 8
#: Bits of θ₂ found per counting pass of :func:`bound_threshold` (32 / bits passes, each
#: comparing every slot with 2^bits − 1 thresholds).
THRESHOLD_DIGIT_BITS = 4


def _scan_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, BK: int, H: int, S: int, C: int, K: int,
                 page: int, max_pages: int, has_scale: bool, pairs, lane_sums: bool,
                 interpret: bool, contiguous: bool, BQ: int, screen: bool, norm_bound,
                 fp8_mma: bool = False, ahead: bool = True):
    # contiguous keys: sequence b's rows start at b·page (one page each), no table lookups
    q_refs, (w_ref, hi_ref, th_ref, pt_ref) = refs[:Pq], refs[Pq:Pq + 4]
    k_refs = refs[Pq + 4:Pq + 4 + Pk]
    rest = refs[Pq + 4 + Pk:]
    sc_ref, rest = (rest[0], rest[1:]) if has_scale else (None, rest)
    e_ref, rest = (rest[0], rest[1:]) if screen else (None, rest)
    rk_ref, ri_ref, cnt_ref, app_ref = rest
    CH = tiles.CH
    tpp = page // BK
    b = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, b, BQ=BQ, H=H, layout=tiles.layout)
    hi = hi_ref[pl.ds(b * BQ, BQ)]
    theta0 = th_ref[pl.ds(b * BQ, BQ)]
    coef = e_ref[pl.ds(b * BQ, BQ)] if screen else None
    t_ids = b * BQ + jnp.arange(BQ, dtype=jnp.int32)
    base = (t_ids * S + s) * C
    start, stop = split_key_tiles(0, jnp.max(hi), BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)

    def tile_row(j):   # the first key row of tile j
        if contiguous:
            return b * page + j * BK
        pg = jnp.max(pt_ref[pl.ds(b * max_pages + j // tpp, 1)])   # the tile's page
        return pg * page + (j % tpp) * BK

    def tile_scale(j):
        return sc_ref[pl.ds(tile_row(j), BK)] if has_scale else jnp.ones((BK,), jnp.float32)

    def scored(j, scale=None):
        ids = j * BK + lanes
        row0 = tile_row(j)
        kp = [k_ref[pl.ds(row0, BK), :] for k_ref in k_refs]
        scale = tile_scale(j) if scale is None else scale
        sc = score_tile(qp, wv, kp, scale, BQ=BQ, H=H, pairs=pairs, layout=tiles.layout,
                        lane_sums=lane_sums, fp8_mma=fp8_mma)
        if screen:
            sc = screen_upper(sc, kp[0], scale, coef, norm_bound)
        return sc, ids

    if screen:   # no compaction (it would rank upper bounds): a full buffer is an overflow
        # ``ahead``: each tile's scales are read one tile ahead (the compiler pipelines the
        # key tiles' loads, not a plain load: a scale read in its own tile waits on memory
        # there), the last tile re-reading its own (an index inside the split: never out of
        # range); the head weights, one query's, are read once into registers.
        if ahead:
            last = jnp.maximum(stop - 1, 0)
            wv = wv()

        def tile_s(j, carry):   # carry: count, appended (and, ahead, this tile's scales)
            # the next tile's scales are loaded first, before this tile's record stores
            nxt = (tile_scale(jnp.minimum(j + 1, last)),) if ahead else ()
            sc, ids = scored(j, carry[2] if ahead else None)
            (count, _, _), n = rec.append_scored_tile(
                rk_ref, ri_ref, base, (carry[0], theta0, jnp.zeros_like(carry[0])), sc, ids,
                None, hi, C=C, size=size)
            return (count, carry[1] + n) + nxt

        zero = jnp.zeros_like(theta0)
        first = (tile_scale(jnp.minimum(start, last)),) if ahead else ()
        count, appended = lax.fori_loop(start, stop, tile_s, (zero, zero) + first)[:2]
    else:
        def tile(j, state):
            sc, ids = scored(j)
            return rec.append_scored_tile(rk_ref, ri_ref, base, state, sc, ids, None, hi, C=C,
                                          size=size)

        state, appended = rec.scan_tiles(start, stop, tile, theta0, rk_ref, ri_ref, base, K,
                                         C=C, BK=BK, CH=CH, size=size, interpret=interpret)
        count = state[0]
    oidx = t_ids * S + s
    cnt_ref[oidx] = count
    app_ref[oidx] = appended


#: Relative widening of the screen's margin and of its sum with the score (covers their
#: float32 roundings, 2^-24 each, many times over), and an absolute floor.
_NUDGE_MARGIN = 2.0 ** -20
_NUDGE_SCORE = 2.0 ** -21
_TINY = 2.0 ** -120


def key_norm_upper(kp, D: int):
    """Upper bound on each key payload's Euclidean norm inside a kernel ([BK, Dp] single MMA
    piece: FP8 or bf16 values, exact in float32): Σ x² with relative error ≤ γ_{D+1} plus D
    flushed squares, one more rounding for the square root."""
    x = kp.astype(jnp.float32)
    ss = jnp.sum(x * x, axis=1)
    g = jnp.float32(nm.gamma(D + 4))
    # the GPU's square root may be an approximation (relative error ~2^-23): widen by 2^-18
    return jnp.sqrt(ss * (1.0 + g) + jnp.float32((D + 4) * 2.0 ** -126)) \
        * jnp.float32(1.0 + 2.0 ** -18)


def screen_upper(sc, kp, scale, coef, norm_bound=None):
    """Upper bounds u ≥ the canonical score of each key of a tile from its 1-slot score ``sc``
    [BQ, BK] (:func:`screen_margin_coefficient`: |sc − c| ≤ |α|·n·coef), n the payload norm
    bound: ``norm_bound`` (a constant for every key, :func:`payload_norm_bound`) or, None,
    each key's (:func:`key_norm_upper`). Non-finite parts give +inf (the key stays a
    candidate and is rescored)."""
    if norm_bound is None:
        n = key_norm_upper(kp, kp.shape[1])
    else:
        n = jnp.full((kp.shape[0],), norm_bound, jnp.float32)
    m = coef[:, None] * (jnp.abs(scale) * n)[None, :]
    u = sc + (m * jnp.float32(1.0 + _NUDGE_MARGIN) + jnp.abs(sc) * jnp.float32(_NUDGE_SCORE)
              + jnp.float32(_TINY))
    ok = (jnp.abs(sc) < jnp.inf) & (m < jnp.inf)
    return jnp.where(ok, u, jnp.inf)


def payload_norm_bound(k_dtype, D: int):
    """A norm bound of every finite FP8 payload: max finite · √D, rounded up (None for bf16
    keys: the scan bounds each key's norm). FP8 keys quantised per key (max |payload| near
    the dtype's max) have norms within √D of it, so the constant costs the screen little,
    and saves the scan a reduction over D per key."""
    if jnp.dtype(k_dtype) != FP8:
        return None
    return float(np.nextafter(np.float32(float(jnp.finfo(FP8).max) * np.sqrt(D) * (1 + 2e-7)),
                              np.float32(np.inf)))


def screen_margin_coefficient(q, w, k_dtype, f16=None):
    """coef [T]: 2·E_s (:func:`pallas_kernels.numerics.scorer_error_coefficient`). Any two
    kernel scorers of the same operand pieces — the canonical 4-slot tile and the screen's
    1-slot tile — lie within α·n_i·E_s of α·s_i (every MMA dot, any head-sum order, the same
    error model), so within α·n_i·coef of each other. ``f16`` = (pieces, exponents): the
    screen multiplies :func:`pallas_kernels.common.scaled_f16_pieces` instead of the
    canonical pieces, so coef = E_s + that scorer's E_s
    (:func:`pallas_kernels.numerics.scaled_f16_scorer_error_coefficient`)."""
    e_s = numerics.scorer_error_coefficient(q, w, k_dtype)
    if f16 is None:
        return 2.0 * e_s
    return nm.upper_sum(e_s, numerics.scaled_f16_scorer_error_coefficient(q, w, k_dtype, *f16))


@functools.partial(jax.jit, static_argnames=("K", "S", "C", "BK", "page", "tiles", "H", "pairs",
                                             "lane_sums", "interpret", "contiguous", "slots",
                                             "norm_bound", "fp8_mma", "ahead"))
def decode_scan(q, w, hi, theta0, page_table, k, scale, coef=None, *, K, S, C, BK, page, tiles,
                H, pairs, lane_sums, interpret, contiguous=False, slots=SLOTS, norm_bound=None,
                fp8_mma=False, ahead=True):
    """The scan kernel over each sequence's keys for its ``slots`` query slots.

    ``coef`` None: the canonical scores (the dense kernel's 4-slot tile) from thresholds
    ``theta0``, with compaction (:func:`pallas_kernels.records.scan_tiles`). ``coef`` [T]:
    the screen — each key's upper bound (:func:`screen_upper`) against ``theta0``, no
    compaction; ``appended > C`` marks a buffer that overflowed. ``fp8_mma``: FP8 query and
    key pieces multiplied fp8 × fp8 (:func:`screen_records`' timing study only). ``ahead``
    (the screen): each tile's key scales read a tile ahead and the head weights once
    (False, a timing study: in each tile, as the canonical scan reads them; the same bounds
    either way)."""
    T = hi.shape[0]
    B = T // slots
    size = T * S * C
    has_scale = scale is not None
    screen = coef is not None
    kern = functools.partial(_scan_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, BK=BK, H=H,
                             S=S, C=C, K=K, page=page, max_pages=page_table.shape[1],
                             has_scale=has_scale, pairs=pairs, lane_sums=lane_sums,
                             interpret=interpret, contiguous=contiguous, BQ=slots,
                             screen=screen, norm_bound=norm_bound, fp8_mma=fp8_mma,
                             ahead=ahead)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                 jax.ShapeDtypeStruct((T * S,), i32), jax.ShapeDtypeStruct((T * S,), i32))
    args = ((*q, w, hi, theta0, page_table.reshape(-1), *k) + ((scale,) if has_scale else ())
            + ((coef.astype(jnp.float32),) if screen else ()))
    rk, ri, cnt, app = pl.pallas_call(
        kern, out_shape=out_shape, grid=(B, S),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_decode_screen" if screen else "dosa_decode_scan")(*args)
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


def max_screen_splits(B: int) -> int:
    """The screen's most key splits per sequence at batch B (any N)."""
    return int(max(1, min(SCREEN_MAX_SPLITS, SCREEN_PROGRAMS // max(B, 1))))


def screen_layout(B: int, tiles_per_sequence: int, K: int, BK: int, splits=None):
    """(key splits per sequence, record slots per split) of the screen: ≈
    :data:`SCREEN_PROGRAMS` programs, each walking ≥ 16 tiles, at most
    :data:`SCREEN_MAX_SPLITS`; slots for 2·K records, or for every key of the split when it
    has fewer (such a buffer never overflows)."""
    S = splits or int(max(1, min(max_screen_splits(B), tiles_per_sequence // 16)))
    per_split = -(-tiles_per_sequence // S) * BK
    return S, min(capacity_for(K, BK, 2 * K), round_up_to(max(per_split, BK), 16))


def direct_rows(kp, scale) -> bool:
    """Whether the seed kernel can read list rows straight from ``kp`` [Pk, rows, Dp] (and the
    scales from ``scale`` [rows]): every row id fits a list entry's ``ID_BITS`` and every
    element offset an int32; else the rows are first gathered into a table."""
    rows, Dp = kp.shape[1], kp.shape[2]
    return scale is not None and rows <= ID_MASK + 1 and rows * Dp < 2 ** 31


def reads_rows_in_place(q, w, k, k_scale, page_table) -> bool:
    """:func:`direct_rows` of the operands :func:`prepare` builds from these (shapes only: no
    copy of the cache)."""
    return direct_rows(*jax.eval_shape(lambda *a: prepare(*a)[1:3], q, w, k, k_scale,
                                       page_table))


def witness_keys(ops, kp, scale, rows, first, M: int, tiles: Tiles, interpret: bool,
                 direct=None):
    """Order keys [B·4, Wp] of each sequence's witnesses for its 4 query slots (seed kernel).

    ``rows`` [B, W] are the witnesses' key rows in ``kp``, ``first`` [B, W] marks the
    distinct visible ones (others score ``INT32_MIN``); W is padded to a multiple of the tile.
    ``direct`` (default :func:`direct_rows`): the kernel gathers the rows from ``kp`` itself;
    False: from a table of the rows gathered first (the same scores, bitwise).
    """
    B, W = rows.shape
    Wp = max(tiles.BK, round_up_to(W, tiles.BK))
    rows = pad_axis(rows, 1, Wp)
    first = pad_axis(first, 1, Wp, False)
    bits = jnp.int32(((1 << M) - 1) << ID_BITS)
    if direct is None:
        direct = direct_rows(kp, scale)
    elif direct and not direct_rows(kp, scale):
        raise ValueError(f"witness_keys(direct=True): {kp.shape[1]} key rows of {kp.shape[2]} "
                         "elements (or no scales) are beyond what the seed kernel reads in place")
    if direct:
        entries = jnp.where(first, jnp.clip(rows, 0, kp.shape[1] - 1) | bits, -1)
        wops = ops._replace(k=kp, scale=scale)
    else:
        table = jnp.take(kp, jnp.clip(rows, 0, kp.shape[1] - 1).reshape(-1), axis=1)
        tscale = (jnp.ones((B * Wp,), jnp.float32) if scale is None
                  else jnp.take(scale, jnp.clip(rows, 0, scale.shape[0] - 1).reshape(-1)))
        slot = jnp.arange(B * Wp, dtype=jnp.int32).reshape(B, Wp)
        entries = jnp.where(first, slot | bits, -1)
        wops = ops._replace(k=table, scale=tscale)
    count = jnp.full((B, 1), Wp, jnp.int32)
    return seed_scores(wops, entries[:, None, :], count, tiles=tiles, interpret=interpret)


def record_slots(cnt, C: int, capacity: int, *, search: bool = False):
    """Where slot p of each query's ``capacity`` slots reads from its splits' records laid end
    to end (``cnt`` [T, S] records per split of C slots): (flat source [T, capacity], 0
    beyond the records; valid; total records [T]). A slot's split: the number of split ends
    at or below it, counted over every split, or with ``search`` by a binary search (for
    many slots)."""
    S = cnt.shape[1]
    end = jnp.cumsum(cnt, axis=1)
    total = end[:, -1]
    p = jnp.arange(capacity, dtype=jnp.int32)
    if search:
        split = jax.vmap(lambda e: jnp.searchsorted(e, p, side="right",
                                                       method="scan_unrolled"))(end)
    else:
        split = jnp.sum(p[None, :, None] >= end[:, None, :], axis=2)
    split = jnp.minimum(split, S - 1)
    src = split * C + p[None, :] - jnp.take_along_axis(end - cnt, split, axis=1)
    valid = p[None, :] < total[:, None]
    return jnp.where(valid, src, 0), valid, total


def same_records(a, b) -> bool:
    """Whether two scans' records (rk, ri, cnt, appended) are the same, bitwise: every count
    and appended number, and every split's first ``cnt`` keys and ids (a buffer's slots past
    its count are never written: whatever memory held)."""
    (rka, ria, cnta, appa), (rkb, rib, cntb, appb) = a, b
    if not (bool(jnp.array_equal(cnta, cntb)) and bool(jnp.array_equal(appa, appb))):
        return False
    used = jnp.arange(rka.shape[-1]) < cnta[..., None]
    return all(bool(jnp.array_equal(jnp.where(used, x, 0), jnp.where(used, y, 0)))
               for x, y in ((rka, rkb), (ria, rib)))


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
    src, valid, total = record_slots(jnp.minimum(cnt, K), C, capacity)
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
                    key_tile: int = KEY_TILE, key_bytes: int = 1, screen: bool = True,
                    screen_splits: int = 0, screen_slots: int = 0, direct: bool = False) -> dict:
    """Device bytes a decode step allocates besides the key cache (independent of N).

    records: order keys + ids of C slots per (query slot, split) of the canonical scan;
    counts; the screen's records (one slot per sequence: ``screen``, 0 without it) on
    ``screen_splits`` × ``screen_slots`` (:func:`screen_layout`'s for a given N; 0: the most
    it takes at any N, its split cap × C); the
    witness table (gathered keys, scales, entries, order keys; with ``direct``, rows read in
    place (:func:`direct_rows`), entries and order keys only); the candidate table the
    screen rescores (the same per candidate slot); the selection buffer and the witnesses
    below τ_w (keys + ids: what the next witnesses are chosen from).
    """
    C = capacity_for(K, key_tile, 2 * K)
    T = B * SLOTS
    cap = max(K, capacity if capacity is not None else WITNESS_FACTOR * K)
    Wp = round_up_to(W, 64)
    Cp = round_up_to(cap, 64)
    table = lambda n: B * n * (0 if direct else D * key_bytes + 4) + B * n * 4 + T * n * 4
    parts = dict(records=T * splits * C * 8, counts=T * splits * 8,
                 screen=(B * (screen_splits or max_screen_splits(B))
                         * ((screen_slots or C) * 8 + 8)) if screen else 0,
                 witness_table=table(Wp), candidate_table=table(Cp) if screen else 0,
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
    first = distinct_visible(ids, jnp.zeros((B,), jnp.int32), lengths)
    wk = witness_keys(prep.ops, prep.kp, prep.scale, key_rows(prep, ids), first, M, prep.tiles,
                      interpret)
    if wk.shape[1] >= K:
        kth = kth_largest(wk if combine is None else combine(wk), K, interpret=interpret)
        theta = jnp.where(kth == INT32_MIN, THETA_NONE, kth)
    else:
        theta = jnp.full((B * SLOTS,), THETA_NONE, jnp.int32)
    wids = pad_axis(jnp.where(first, ids, -1), 1, wk.shape[1], -1)
    wids = jnp.repeat(wids, SLOTS, axis=0)
    return theta, jnp.sum(first, axis=1, dtype=jnp.int32), wk, wids


def screen_records(prep: Prepared, q, w, theta, lengths, K: int, *, splits=None,
                   interpret=None, key_tile=None, norm="auto",
                   warps: int = SCREEN_WARPS, stages: int = SCREEN_STAGES,
                   fp8_mma: bool = False, mma="auto",
                   ahead: bool = True):
    """The screen (one query slot per sequence, M = 1): record buffers of the keys whose upper
    bound clears ``theta`` [B] (order keys of the bounds and ids [B, S, C]; counts ≤ C and
    appended [B, S]; appended > C: that buffer overflowed). The upper bounds are ≥ the
    canonical scores, so every key whose canonical score clears ``theta`` is recorded unless
    a buffer overflowed. ``key_tile`` (None: :func:`screen_key_tile`), ``warps``, ``stages``:
    the kernel's keys per tile, Triton warps and pipeline stages (defaults
    :data:`SCREEN_WARPS`, :data:`SCREEN_STAGES`; 0: the scan's, ``prep.tiles``); the bound
    holds for any (its margin covers any scorer's MMA and summation order). ``ahead``: the
    key scales read a tile ahead, the weights once (:func:`decode_scan`; False, a timing
    study: each tile's scales read in that tile — the same records).

    ``mma``: the operand type of the screen's MMA. ``"auto"``: float16 for FP8 keys — each
    query row scaled by a power of two into float16 (:func:`scaled_f16_pieces`, its weights
    by the inverse), the keys widened fp8 → float16 in registers by one conversion per two
    elements (fp8 → bf16 takes four instructions per two on sm_90) — else bf16; ``"bf16"``:
    the canonical pieces (bf16) for any keys. The margin covers either.

    ``fp8_mma`` is a timing study, never a step's screen: the query rounded to FP8 (clipped
    to its finite range) and multiplied fp8 × fp8 on the tensor cores, without the in-kernel
    widening of the keys to bf16. The margin does not cover the query's rounding nor FP8
    accumulation, so those records are **not** certified (``benchmarks.decode_parts``
    measures what such an MMA would save). It needs FP8 keys.
    """
    if fp8_mma and jnp.dtype(prep.kp.dtype) != FP8:
        raise ValueError(f"screen_records(fp8_mma=True) needs FP8 keys, got {prep.kp.dtype}")
    if interpret is None:
        interpret = interpret_default()
    B = prep.page_table.shape[0]
    BK = scan_tile(prep.page, key_tile or screen_key_tile(q.shape[2]))
    S, C = screen_layout(B, prep.page * prep.page_table.shape[1] // BK, K, BK, splits)
    nb = payload_norm_bound(prep.kp.dtype, prep.kp.shape[2]) if norm == "auto" else norm
    if mma not in ("auto", "bf16"):
        raise ValueError(f"screen_records: mma must be 'auto' or 'bf16', got {mma!r}")
    qs, ws = q[:, 0], w[:, 0]
    keys = (prep.kp, jnp.ones((1,), jnp.float32))
    f16 = None
    if fp8_mma:
        big = float(jnp.finfo(FP8).max)
        qs = jnp.clip(qs.astype(jnp.float32), -big, big).astype(FP8)
    elif mma == "auto" and jnp.dtype(prep.kp.dtype) == FP8:
        f16 = scaled_f16_pieces(qs, ws)
        ws = jnp.ldexp(ws.astype(jnp.float32), -f16[1])
    ops = prepare_operands(qs, ws, None, None, 1, FP8 if fp8_mma else jnp.bfloat16, "kc",
                           widen_fp8=False, lane_sums=False, keys=keys,
                           q_pieces=None if f16 is None else f16[0])
    coef = screen_margin_coefficient(q[:, 0], w[:, 0], prep.kp.dtype, f16)
    return decode_scan(ops.q, ops.w, lengths.astype(jnp.int32), theta, prep.page_table, prep.kp,
                       prep.scale, coef, K=K, S=S, C=C, BK=BK, page=prep.page,
                       tiles=prep.tiles._replace(num_warps=warps or prep.tiles.num_warps,
                                                 num_stages=stages or prep.tiles.num_stages),
                       H=ops.H, pairs=ops.pairs, lane_sums=False,
                       interpret=interpret, contiguous=prep.contiguous, slots=1,
                       norm_bound=nb, fp8_mma=ops.fp8_mma, ahead=ahead)


def gather_candidates(ri, cnt, capacity: int):
    """The recorded ids of every split laid end to end (id order) in ``capacity`` slots per
    query: (ids [T, capacity] (−1 pads), valid, total records [T])."""
    T, S, C = ri.shape
    src, valid, total = record_slots(cnt, C, capacity)
    ids = jnp.take_along_axis(ri.reshape(T, S * C), src, axis=1)
    return jnp.where(valid, ids, -1), valid, total


def key_rows(prep: Prepared, ids):
    """Rows in ``prep.kp`` of each sequence's key ids [B, n] (clipped: mask invalid ones)."""
    safe = jnp.clip(ids, 0, prep.page * prep.page_table.shape[1] - 1)
    return jnp.take_along_axis(prep.page_table, safe // prep.page, axis=1) * prep.page \
        + safe % prep.page


def screens(q, k) -> bool:
    """Whether a step takes the screen: one query per sequence and keys of one MMA piece
    (FP8 or bf16), whose payload norms the scan bounds in registers."""
    return q.shape[1] == 1 and jnp.dtype(k.dtype) in (BF16, FP8)   # one piece: mma_pieces


def exact_step(prep, theta, wk, wids, lengths, B: int, M: int, K: int, cap: int, carry: int,
                splits, interpret):
    """(indices, scores, candidates, overflow [B·M], next (ids, keys)) by the canonical scan.

    The scan fills 4 query slots per sequence; everything after it (the selection buffer,
    its overflow fallback over all records, the next witnesses) reads the M real slots only
    (at M = 1 a quarter of the rows)."""
    r = lambda x: x.reshape(B, SLOTS, *x.shape[1:])[:, :M]
    rm = lambda x: r(x).reshape((B * M,) + x.shape[1:])      # the M real slots only
    rk, ri, cnt, app = (rm(x) for x in scan_records(prep, theta, lengths, M, K, splits=splits,
                                                     interpret=interpret))
    idx, sc, _, over, (bk, bi) = gather_records(rk, ri, cnt, K, cap)
    wit = (rm(wk), rm(wids))     # split buffers end compacted to their Top-K: dedupe by id
    nxt = best_witnesses(*distinct_pool(bk, bi, *wit), carry)
    nxt = lax.cond(jnp.any(over), lambda x: tuple(
        jnp.where(over[:, None], a, b)
        for a, b in zip(record_witnesses(rk, ri, cnt, K, carry, *wit), x)),
        lambda x: x, nxt)
    merged = jnp.any(app > rk.shape[2] - prep.BK, axis=1)   # a buffer compacted mid-scan
    return idx, sc, jnp.sum(app, axis=1), (over | merged).astype(jnp.int32), nxt


def bound_threshold(rk, cnt, cap: int):
    """θ₂ [B]: the least order key with at most ``cap`` of each row's recorded bounds (the
    screen's records: order keys ``rk`` [B, S, C], ``cnt`` [B, S] per split) at or above it;
    and whether one exists (False only when more than ``cap`` bounds share the largest order
    key, which nothing exceeds).

    θ₂ is one above v, the largest order key with more than ``cap`` slots at or above it (the
    (cap + 1)-th largest slot, unused slots counting as ``INT32_MIN``), found digit by digit
    from the top in the keys' unsigned order, :data:`THRESHOLD_DIGIT_BITS` bits a pass: each
    pass counts the slots at or above the 2^bits − 1 prefixes that extend v's by one digit
    and keeps the largest whose count exceeds ``cap`` (the counts fall as the digit grows)."""
    B, S, C = rk.shape
    if S * C <= cap:      # every order key has at most cap slots at or above it: θ₂ the least
        return jnp.full((B,), INT32_MIN, jnp.int32), jnp.ones((B,), bool)
    used = jnp.arange(C, dtype=jnp.int32)[None, None, :] < cnt[:, :, None]
    # unsigned order: the order keys with their top bit flipped, compared as uint32
    keys = lax.bitcast_convert_type(jnp.where(used, rk, INT32_MIN).reshape(B, S * C),
                                    jnp.uint32) ^ jnp.uint32(0x80000000)
    bits = THRESHOLD_DIGIT_BITS
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    v = jnp.zeros((B,), jnp.uint32)      # more than cap slots ≥ v (every slot ≥ 0)
    for shift in range(32 - bits, -1, -bits):
        t = v[:, None] | (digits[None, :] << shift)                          # [B, 2^bits − 1]
        over = jnp.sum(keys[:, :, None] >= t[:, None, :], axis=1) > cap       # falls with t
        v = v | (jnp.sum(over, axis=1, dtype=jnp.uint32) << shift)
    top = v == jnp.uint32(0xFFFFFFFF)    # more than cap slots share the largest order key
    theta = lax.bitcast_convert_type(jnp.where(top, v, v + 1) ^ jnp.uint32(0x80000000), jnp.int32)
    return theta, ~top


def compact_records(rk, ri, cnt, slots: int):
    """Every split's records (order keys ``rk``, ids ``ri`` [B, S, C], ``cnt`` [B, S] per
    split) laid end to end in ``slots`` slots per sequence, split by split: (keys [B, 1,
    slots] (``INT32_MIN`` pads), ids [B, 1, slots] (−1 pads), count [B, 1] (at most
    ``slots``), total records [B]) — the records layout of :func:`bound_threshold` and
    :func:`records_at_least`, one split (:func:`record_slots`, by binary search)."""
    B, S, C = rk.shape
    src, valid, total = record_slots(cnt, C, slots, search=True)
    keys = jnp.where(valid, jnp.take_along_axis(rk.reshape(B, S * C), src, axis=1), INT32_MIN)
    ids = jnp.where(valid, jnp.take_along_axis(ri.reshape(B, S * C), src, axis=1), -1)
    return keys[:, None], ids[:, None], jnp.minimum(total, slots)[:, None], total


def records_at_least(ri, rk, cnt, theta, cap: int):
    """The recorded ids whose key is ≥ ``theta`` [B] (at most ``cap`` of them), laid end to
    end in id order in ``cap`` slots: (ids [B, cap] (−1 pads), valid)."""
    B, S, C = rk.shape
    used = jnp.arange(C, dtype=jnp.int32)[None, None, :] < cnt[:, :, None]
    keep = (used & (rk >= theta[:, None, None])).reshape(B, S * C)
    end = jnp.cumsum(keep, axis=1, dtype=jnp.int32)
    p = jnp.arange(cap, dtype=jnp.int32)
    src = jax.vmap(lambda e: jnp.searchsorted(e, p + 1, side="left",
                                              method="scan_unrolled"))(end)
    valid = p[None, :] < end[:, -1:]
    ids = jnp.take_along_axis(ri.reshape(B, S * C), jnp.minimum(src, S * C - 1), axis=1)
    return jnp.where(valid, ids, -1), valid


def rescored_selection(prep, ids, valid, wk, wids, K: int, carry: int, interpret):
    """Candidates ``ids`` [B, cap] rescored by the canonical tile (the seed kernel), then
    :func:`dosa_jax.decode.select_and_witness`: (canonical keys, indices, Top-K keys, next
    witnesses)."""
    ck = witness_keys(prep.ops, prep.kp, prep.scale, key_rows(prep, ids), valid, 1, prep.tiles,
                      interpret)[::SLOTS]
    ids = pad_axis(ids, 1, ck.shape[1], -1)
    return (ck,) + select_and_witness(ck, ids, wk[::SLOTS], wids[::SLOTS], K, carry)


def screened_step(prep, q, w, theta, wk, wids, lengths, B: int, K: int, cap: int, carry: int,
                   splits, interpret, second_slots=None):
    """The same by the screen (M = 1): keys whose upper bound clears τ_w, rescored by the
    canonical tile (the seed kernel), selected; whether the step cannot certify a sequence
    this way (no τ_w, an overflowing buffer, more candidates than ``cap``); and ``retry``,
    ``(outputs, need) -> (outputs, need)``: the second round for the sequences it can
    answer (a ``lax.cond``, taken when any sequence has more candidates than ``cap`` and
    none lost), the rest still needing the exact scan. :func:`decode_topk` calls ``retry``
    only inside its fallback branch, so a certified step evaluates one predicate.

    **Second round** (a sequence with more candidates than ``cap``, none lost: no screen
    buffer overflowed, and at most ``second_slots`` of them, default
    ``SECOND_ROUND_SLOTS · cap``): its records are laid end to end in ``second_slots`` slots
    (:func:`compact_records`); θ₂ is the least order
    key with at most ``cap`` bounds at or above it (:func:`bound_threshold`); those keys are
    rescored and selected. τ₂, the K-th of their canonical keys, is a lower bound on τ*
    (K visible keys score ≥ τ₂); when τ₂ ≥ θ₂, every key left out has canonical score ≤ its
    bound < θ₂ ≤ τ₂, so the Top-K lies among the rescored keys and ties at τ₂ are all
    inside (id order breaks them): the answer is certified without the canonical scan.
    Such a sequence reports its screen records as candidates and ``overflow`` 1."""
    theta1 = theta[::SLOTS]
    rk, ri, cnt, app = screen_records(prep, q, w, theta1, lengths, K, splits=splits,
                                      interpret=interpret)
    ids, valid, total = gather_candidates(ri, cnt, cap)
    lost = jnp.any(app > ri.shape[2], axis=1)          # a screen buffer overflowed
    need_exact = (theta1 == THETA_NONE) | lost | (total > cap)
    ck, idx, top_key, nxt = rescored_selection(prep, ids, valid, wk, wids, K, carry, interpret)
    cand = jnp.sum(ck >= theta1[:, None], axis=1, dtype=jnp.int32)   # canonical ≥ τ_w
    out = (idx, key_to_score(top_key), cand, jnp.zeros((B,), jnp.int32), nxt)
    slots = min(ri.shape[1] * ri.shape[2], second_slots or SECOND_ROUND_SLOTS * cap)
    second = ~lost & (total > cap) & (total <= slots)

    def second_round(carried):
        o, need = carried
        rk2, ri2, cnt2, _ = compact_records(rk, ri, cnt, slots)
        theta2, exists = bound_threshold(rk2, cnt2, cap)
        ids2, valid2 = records_at_least(ri2, rk2, cnt2, theta2, cap)
        _, idx2, top2, nxt2 = rescored_selection(prep, ids2, valid2, wk, wids, K, carry,
                                                 interpret)
        tau2 = top2[:, K - 1]
        use = second & exists & (tau2 != INT32_MIN) & (tau2 >= theta2)
        o2 = (idx2, key_to_score(top2), total, jnp.ones((B,), jnp.int32), nxt2)
        pick = lambda a, b: jnp.where(use.reshape(use.shape + (1,) * (a.ndim - 1)), a, b)
        return jax.tree_util.tree_map(pick, o2, o), need & ~use

    def retry(o, need):
        return lax.cond(jnp.any(second), second_round, lambda c: c, (o, need))

    return out, need_exact, retry


def exact_rows(exact, need, lengths, tail, screened):
    """The screened step's outputs with the rows that ``need`` [B] it answered by the
    canonical scan (``exact(lengths, *tail)``: :func:`exact_step`), which scans only those
    rows' keys: the others' lengths are 0 to it (no key tile), their outputs the screen's.
    A batch where one sequence's witnesses went stale scans that sequence, not the batch."""
    out = exact(jnp.where(need, lengths, 0), *tail)
    pick = lambda e, o: jnp.where(need.reshape(need.shape + (1,) * (e.ndim - 1)), e, o)
    return jax.tree_util.tree_map(pick, out, screened)


def decode_topk(q, k, w, ids, k_scale, lengths, page_table, config, *, tiles: Tiles = Tiles(),
                key_tile: int = KEY_TILE, splits=None, interpret=None, combine=None,
                screen=None):
    """One decode step by the kernels (validated inputs: q [B, M, H, D], w [B, M, H]).

    Returns (indices [B, M, K], scores [B, M, K], DecodeStats [B, M], next witnesses
    [B, M, W / M]) as :func:`dosa_jax.decode.decode_topk_reference`, indices and scores
    bitwise equal to ``dense_topk`` on the pallas backend. The next witnesses are the best
    of the selection buffer (of all records on overflow) and the witnesses, each id once;
    with ``combine`` (context parallel) they are (ids, order keys), as the reference's.

    ``screen`` (default: :func:`screens`): scan with one query slot and each key's upper
    bound, rescore the candidates with the canonical tile; the sequences whose screen cannot
    certify their candidates (no τ_w, an overflow) are answered by the canonical scan of
    their keys instead (:func:`exact_rows`, under a ``lax.cond`` taken when any sequence
    needs it), so every answer is the canonical one either way.
    """
    B, M = q.shape[:2]
    K = config.top_k
    cap = candidate_capacity(config)
    carry = witness_budget(ids.shape[1], M)
    prep = prepare(q, w, k, k_scale, page_table, tiles=tiles, key_tile=key_tile)
    theta, n_wit, wk, wids = witness_threshold(prep, ids, lengths, M, K, interpret=interpret,
                                               combine=combine)
    exact = functools.partial(exact_step, prep, theta, wk, wids)
    tail = (B, M, K, cap, carry, splits, interpret)
    if screen is None:
        screen = screens(q, k)
    if screen:
        if M != 1:
            raise ValueError(f"the decode screen takes one query per sequence, got M={M}")
        out, need_exact, retry = screened_step(prep, q, w, theta, wk, wids, lengths, B, K,
                                                cap, carry, splits, interpret)

        def fallback(o):     # the second round where it can answer, else the canonical scan
            o, need = retry(o, need_exact)
            return lax.cond(jnp.any(need), lambda o: exact_rows(exact, need, lengths, tail, o),
                            lambda o: o, o)

        idx, sc, cand, over, nxt = lax.cond(jnp.any(need_exact), fallback, lambda o: o, out)
    else:
        idx, sc, cand, over, nxt = exact(lengths, *tail)
    r = lambda x: x.reshape(B, SLOTS, *x.shape[1:])[:, :M]
    rb = lambda x: x.reshape(B, M, *x.shape[1:])
    nxt = tuple(a.reshape(B, M, carry) for a in nxt)
    stats = DecodeStats(visible=jnp.broadcast_to(lengths[:, None], (B, M)).astype(jnp.int32),
                        witnesses=jnp.broadcast_to(n_wit[:, None], (B, M)),
                        tau_witness=r(jnp.where(theta == THETA_NONE, -jnp.inf,
                                                key_to_score(theta))),
                        candidates=rb(cand), overflow=rb(over))
    return rb(idx), rb(sc), stats, (nxt if combine is not None else nxt[0])


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
           "default_splits", "gather_candidates", "gather_records", "key_layout", "key_norm_upper",
           "key_rows", "max_screen_splits", "prepare", "record_witnesses", "scan_records",
           "scan_tile", "screen_key_tile", "screen_layout",
           "SECOND_ROUND_SLOTS", "bound_threshold", "compact_records", "exact_rows", "exact_step",
           "records_at_least",
           "rescored_selection", "screen_margin_coefficient", "screen_records", "screen_upper",
           "screened_step", "screens",
           "direct_rows", "reads_rows_in_place", "witness_keys", "witness_threshold", "workspace_bytes"]
