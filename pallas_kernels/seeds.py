"""The seed threshold τ on the Pallas backend (Eq. 2): group seed lists, a seed-scoring
kernel, and an exact K-th-largest search — each beside its jnp twin.

τ is the K-th largest score over a set of at least K *distinct visible* keys
(DESIGN §3); any such set is safe, its quality only decides pruning.

1. :func:`group_seed_lists` — one list per refinement group of 4 queries
   (sinks, a strided middle, the local window; ascending distinct ids), each
   entry ``id | mask << 27`` with the mask saying which of the 4 queries see it.
2. :func:`seed_scores` (Pallas Triton) — gathers ``BK`` listed keys at a time,
   scores them for the 4 queries with *the* scoring routine
   (:func:`pallas_kernels.scoring.score_tile`, the tile shape of the dense and
   refinement kernels, so every seed score is bitwise the score those kernels
   give the same (query, key)) and writes each query's order keys into its own
   row ``[T, L]`` (``INT32_MIN`` where the query does not see the slot's key or
   the score is NaN): contiguous stores, no compaction, no threshold.
3. :func:`kth_largest_keys_kernel` (Pallas Triton; twin :func:`kth_largest_keys`,
   jnp) — per row, the largest order key t with ``#{key ≥ t} ≥ K``, i.e. the
   K-th largest eligible key, by a 32-step bitwise descent over the row held in
   registers (the twin: a 4-bit radix descent, 8 passes of 15 counts over the
   row); ``THETA_NONE`` when fewer than K are eligible (no τ: the query does not
   prune).

The seeds need no record buffers: running them through the refinement kernel's
buffers with the online threshold would spend most of their time in compactions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax.seeds import distinct_visible
from dosa_jax.selection import INT32_MIN, order_key
from dosa_jax.tiling import round_up_to
from dosa_jax.witnesses import block_key_ids
from pallas_kernels import records as rec
from pallas_kernels.common import (ID_BITS, THETA_NONE, cdiv, compiler_params, group_ranges,
                                   interpret_default,
                                   kernel_order_key, unpack_entries)
from pallas_kernels.operands import Operands
from pallas_kernels.refine import score_list_tile
from pallas_kernels.scoring import load_query_tile, score_reference
from pallas_kernels.tiles import Tiles

Array = jax.Array

#: List tiles (of BK keys) scored by one program of the seed kernel.
SEED_TILES = 8
#: Bits decided per pass of :func:`kth_largest_keys` (2^bits − 1 counts per pass).
RADIX_BITS = 4
#: Keys by which a group's ranges may differ at either end and still share one layout.
SPREAD = 64


def seed_list_length(size: int, block: int, witnesses: int = 0) -> int:
    """Slots L' of a group seed list: the layout of ``size`` seeds (+ :data:`SPREAD`) and
    ``witnesses`` extra ids, each rounded up to whole tiles of ``block`` keys."""
    return round_up_to(size + SPREAD, block) + (round_up_to(witnesses, block) if witnesses else 0)


def _group_visibility(ids, lo4, hi4, valid):
    """Which of a group's 4 queries see each id: ([G4, 4, n] bool, [G4, n] int32 mask bits)."""
    inside = (ids[:, None, :] >= lo4[:, :, None]) & (ids[:, None, :] < hi4[:, :, None])
    vis = inside & valid[:, None]
    bits = jnp.sum(vis.astype(jnp.int32) << jnp.arange(4, dtype=jnp.int32)[None, :, None], axis=1)
    return vis, bits


# ------------------------------------------------------------------ seed lists

def group_seed_lists(lo: Array, hi: Array, Tpad: int, size: int, sinks: int, local: int,
                     block: int, witnesses=None):
    """Shared seed list of each group of 4 queries: sinks, strided middle, local window,
    then the group's extra witnesses.

    The layout's entries are distinct keys in ascending order; each entry's mask
    marks the queries of the group that see it. A query sees at least
    ``min(size, |Ω_t|)`` layout seeds when the group's ranges differ by at most
    ``64`` keys at either end (causal prefill: 3); otherwise it may see fewer (its
    τ is then −∞ if < K: no pruning, still exact).

    Args:
      witnesses: None or [G4, W] int32 key ids, *distinct within each row*
        (:func:`distinct_rows`), −1 for none: e.g. an anchor query's Top-K or
        user hints. Ids already in the layout and ids no query of the group sees
        are dropped (a key counts once), the rest follow the layout in slots
        ``[L, L + W)`` (−1 holes are skipped by the seed kernel).

    Returns:
      (packed [G4, 1, L'] int32, count [G4, 1] int32 (list slots to read; entries
      −1 inside are empty), seeds per query [Tpad] int32).
    """
    T = lo.shape[0]
    lo = jnp.pad(lo, (0, Tpad - T))
    hi = jnp.pad(hi, (0, Tpad - T))
    G4 = Tpad // 4
    lo4, hi4 = lo.reshape(G4, 4), hi.reshape(G4, 4)
    ne, lo_min, hi_max, hi_min = group_ranges(lo4, hi4)
    a = min(sinks, size)
    b = min(local, size - a)
    c = size - a - b
    L = seed_list_length(size, block)
    j = jnp.arange(L, dtype=jnp.int32)[None, :]
    small = (hi_max - lo_min) <= L
    loc_start = jnp.maximum(hi_min - b, hi_max - b - SPREAD)
    mid_lo = lo_min + a
    mid_n = jnp.maximum(loc_start - mid_lo, 0)
    stride = jnp.maximum(mid_n // max(c, 1), 1)
    c_eff = jnp.minimum(c, mid_n)
    n_loc = hi_max - loc_start
    ids = jnp.where(j < a, lo_min[:, None] + j,
                    jnp.where(j < a + c_eff[:, None], mid_lo[:, None] + (j - a) * stride[:, None],
                              loc_start[:, None] + (j - a - c_eff[:, None])))
    ok = j < (a + c_eff + n_loc)[:, None]
    ids = jnp.where(small[:, None], lo_min[:, None] + j, ids)
    ok = jnp.where(small[:, None], j < (hi_max - lo_min)[:, None], ok)
    ok = ok & jnp.any(ne, axis=1)[:, None]
    vis, bits = _group_visibility(ids, lo4, hi4, ok)
    keep = ok & (bits > 0)
    packed = compact_front(jnp.where(keep, ids | (bits << ID_BITS), -1), keep)
    count = jnp.sum(keep, axis=1).astype(jnp.int32)
    seeds = jnp.sum(vis, axis=2).reshape(Tpad).astype(jnp.int32)
    if witnesses is not None:
        wid = witnesses.astype(jnp.int32)
        c, lm, hm, ls, st = (x[:, None] for x in (c_eff, lo_min, hi_max, loc_start, stride))
        off = wid - (lm + a)
        in_layout = jnp.where(
            small[:, None], (wid >= lm) & (wid < hm),
            ((wid >= lm) & (wid < lm + a)) | ((wid >= ls) & (wid < hm))
            | ((off >= 0) & (off < c * st) & (off % st == 0)))
        wvis, wbits = _group_visibility(wid, lo4, hi4, (wid >= 0) & ~in_layout)
        Lw = seed_list_length(size, block, wid.shape[1])
        went = jnp.pad(jnp.where(wbits > 0, wid | (wbits << ID_BITS), -1),
                       ((0, 0), (0, Lw - L - wid.shape[1])), constant_values=-1)
        packed = jnp.concatenate([packed, went], axis=1)
        count = jnp.full_like(count, Lw)
        seeds = seeds + jnp.sum(wvis, axis=2).reshape(Tpad).astype(jnp.int32)
    return packed[:, None, :], count[:, None], seeds


def compact_front(values: Array, keep: Array) -> Array:
    """Each row's kept values moved to its front in their order, −1 after them ([G, L] int32).

    A prefix sum gives every kept value its slot and one scatter writes it: the same result as
    a stable sort of the rows by ``~keep`` (a segmented sort of every group's seed list)
    without sorting.
    """
    G, L = values.shape
    pos = jnp.cumsum(keep.astype(jnp.int32), axis=1) - 1
    rows = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32)[:, None], (G, L))
    return jnp.full((G, L), -1, jnp.int32).at[rows, jnp.where(keep, pos, L)].set(
        values.astype(jnp.int32), mode="drop")


def distinct_rows(ids: Array) -> Array:
    """Each row's non-negative ids with repeats and negatives replaced by −1
    (:func:`dosa_jax.seeds.distinct_visible` over [0, 2^31 − 1))."""
    ids = ids.astype(jnp.int32)
    rows = ids.shape[0]
    first = distinct_visible(ids, jnp.zeros((rows,), jnp.int32),
                             jnp.full((rows,), jnp.iinfo(jnp.int32).max, jnp.int32))
    return jnp.where(first, ids, -1)


#: A group of 4 keeps at most this many times one query's m best blocks (:func:`group_blocks`).
GROUP_BLOCK_SHARE = 2


def group_blocks(blocks: Array, Tpad: int, share: int = GROUP_BLOCK_SHARE) -> Array:
    """Each group of 4 queries' blocks [Tpad / 4, share·m] (−1 for none) from the queries'
    best blocks ``blocks`` [T, m] (best first, −1 for none): the distinct blocks of the
    rank-interleaved sequence (the 4 queries' best, then their second best, …), first
    occurrences in that order, cut after ``share``·m.

    Neighbouring queries rank mostly the same blocks, so the cut drops only the tail of
    rarely shared low-ranked blocks; it keeps the seed rows short (the seed kernel scores
    every slot, and rows up to :data:`KTH_MAX_ROW` have their K-th found in registers).
    Dropping a witness moves τ, never the answer.
    """
    G4 = Tpad // 4
    m = blocks.shape[1]
    b = jnp.pad(blocks.astype(jnp.int32), ((0, Tpad - blocks.shape[0]), (0, 0)),
                constant_values=-1)
    ranked = b.reshape(G4, 4, m).transpose(0, 2, 1).reshape(G4, 4 * m)
    u = distinct_rows(ranked)
    return compact_front(u, u >= 0)[:, :min(share * m, 4 * m)]


def group_witnesses(Tpad: int, hint=None, anchor_topk=None, anchor_stride: int = 0, *,
                    blocks=None, block: int = 0, n_keys: int = 0):
    """Witness ids of each group of 4 queries ([G4, W], distinct per row, −1 for none).

    ``anchor_topk`` [A, K]: the exact Top-K of queries 0, s, 2s, … (s = anchor_stride);
    a group takes its first query's anchor (an anchor at or before every query of the
    group). ``hint`` [T, M]: user witnesses; a group takes the union of its queries'.
    ``blocks`` [T, m]: each query's best key blocks of ``block`` keys
    (:func:`dosa_jax.witnesses.best_blocks`, −1 for none) over ``n_keys`` keys; a group
    takes every key of its :func:`group_blocks`.
    """
    G4 = Tpad // 4
    parts = []
    if blocks is not None:
        parts.append(block_key_ids(group_blocks(blocks, Tpad), block, n_keys))
    if anchor_topk is not None:
        a = jnp.minimum(jnp.arange(G4) * 4 // anchor_stride, anchor_topk.shape[0] - 1)
        parts.append(anchor_topk[a])
    if hint is not None:
        h = jnp.pad(hint.astype(jnp.int32), ((0, Tpad - hint.shape[0]), (0, 0)),
                    constant_values=-1)
        parts.append(h.reshape(G4, -1))
    if not parts:
        return None
    if len(parts) == 1 and hint is None:
        return parts[0]          # one query's Top-K, or one union of blocks: distinct already
    return distinct_rows(jnp.concatenate(parts, axis=1))


# ------------------------------------------------------------------ seed scores

def _seed_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, H: int, L: int, pairs, lane_sums: bool):
    q_refs = refs[:Pq]
    w_ref, sv_ref, sn_ref = refs[Pq:Pq + 3]
    k_refs = refs[Pq + 3:Pq + 3 + Pk]
    sc_ref, out_ref = refs[Pq + 3 + Pk:]
    BQ, BK = tiles.BQ, tiles.BK
    g = pl.program_id(0)
    p = pl.program_id(1)
    size = out_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, g, BQ=BQ, H=H, layout=tiles.layout)
    n_list = jnp.minimum(sn_ref[pl.ds(g, 1)], L)   # [1]
    lanes = jnp.arange(BK, dtype=jnp.int32)
    rows = (g * BQ + jnp.arange(BQ, dtype=jnp.int32)) * L   # each query's row of order keys
    everywhere = jnp.ones((BQ, BK), bool)

    def tile(c, carry):
        slot = c * BK + lanes
        _, mine, sc = score_list_tile(sv_ref, g * L, slot, n_list, k_refs, sc_ref, qp, wv,
                                      tiles=tiles, H=H, pairs=pairs, lane_sums=lane_sums)
        key = jnp.where(mine, kernel_order_key(sc), INT32_MIN)
        rec.store_slots(out_ref, rows, slot[None, :], key, everywhere, size)
        return carry

    start = p * SEED_TILES
    lax.fori_loop(start, jnp.minimum(start + SEED_TILES, L // BK), tile, 0)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "T", "H", "pairs", "lane_sums"))
def _seed_call(q, w, lists, list_count, k, scale, *, tiles, interpret, T, H, pairs, lane_sums):
    G4, _, L = lists.shape
    Tpad = G4 * tiles.BQ
    kern = functools.partial(_seed_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, H=H, L=L,
                             pairs=pairs, lane_sums=lane_sums)
    out = pl.pallas_call(
        kern, grid=(G4, cdiv(L // tiles.BK, SEED_TILES)),
        out_shape=jax.ShapeDtypeStruct((Tpad * L,), jnp.int32),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_seed_scores")(
            *q, w, lists.reshape(-1), list_count.reshape(-1), *k, scale)
    return out.reshape(Tpad, L)[:T]


def seed_scores(ops: Operands, lists: Array, list_count: Array, *, tiles: Tiles = Tiles(),
                interpret=None) -> Array:
    """Order keys of every query's seeds: [T, L] int32, slot j of query t's row holding the
    key of its group's list entry j (``INT32_MIN`` where t does not see it, or NaN).

    ``ops`` must be prepared with ``tiles.BQ == 4`` (the group size of the lists);
    ``L`` (the lists' last axis) must be a multiple of ``tiles.BK``.
    """
    if tiles.BQ != 4:
        raise ValueError("seed lists serve groups of 4 queries (tiles.BQ must be 4)")
    if lists.shape[-1] % tiles.BK:
        raise ValueError(f"internal: seed list length {lists.shape[-1]} is not a multiple of "
                         f"tiles.BK={tiles.BK}")
    if interpret is None:
        interpret = interpret_default()
    return _seed_call(ops.q, ops.w, lists, list_count, ops.k, ops.scale, tiles=tiles,
                      interpret=interpret, T=ops.T, H=ops.H, pairs=ops.pairs,
                      lane_sums=ops.lane_sums)


def seed_scores_reference(q_pieces: Array, w: Array, k_pieces: Array, scale, lists: Array,
                          list_count: Array) -> Array:
    """jnp twin of :func:`seed_scores` (the twin scorer on full arrays; small shapes)."""
    T = q_pieces.shape[1]
    G4, _, L = lists.shape
    s = order_key(score_reference(q_pieces, w, k_pieces, scale))          # [T, N]
    e = lists[:, 0, :]
    valid, kid, bits = unpack_entries(e, jnp.arange(L)[None, :] < list_count)
    t = jnp.arange(G4 * 4)[:T]
    g = t // 4
    mine = (((bits[g] >> (t % 4)[:, None]) & 1) != 0) & valid[g]
    return jnp.where(mine, jnp.take_along_axis(s, kid[g], axis=1), INT32_MIN)


# ------------------------------------------------------------------ K-th largest

def kth_largest_keys(keys: Array, k: int, *, bits: int = RADIX_BITS):
    """K-th largest order key of each row (``INT32_MIN`` entries are not eligible).

    The largest t with ``#{key ≥ t} ≥ k``, decided ``bits`` bits at a time from
    the top (unsigned order: ``key ^ 0x80000000``): per pass, 2^bits − 1 counts
    over the row. Same answer as the twin
    :func:`pallas_kernels.records.kth_order_key_reference`.

    Returns:
      (K-th largest key [...] int32, ``THETA_NONE`` where fewer than k are eligible;
      eligible count [...] int32).
    """
    if 32 % bits:
        raise ValueError(f"bits must divide 32, got {bits}")
    u = lax.bitcast_convert_type(keys.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(0x80000000)
    t = jnp.zeros(keys.shape[:-1], jnp.uint32)
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    for p in range(32 - bits, -1, -bits):
        cand = t[..., None] | (digits << p)                                  # [..., 2^b - 1]
        n = jnp.sum((u[..., :, None] >= cand[..., None, :]).astype(jnp.int32), axis=-2)
        t = t | (jnp.sum((n >= k).astype(jnp.uint32), axis=-1) << p)   # counts fall with d
    kth = lax.bitcast_convert_type(t ^ jnp.uint32(0x80000000), jnp.int32)
    count = jnp.sum((keys != INT32_MIN).astype(jnp.int32), axis=-1)
    return jnp.where(count >= k, kth, jnp.int32(THETA_NONE)), count


#: Widest row (power of two) :func:`kth_largest_keys_kernel` keeps in registers (4 warps:
#: 64 int32 per thread at 8192, 8 warps above); wider rows fall back to the jnp descent.
KTH_MAX_ROW = 16384


def _kth_kernel(k_ref, kth_ref, cnt_ref, *, L: int, LP: int, K: int):
    r = pl.program_id(0)
    cols = jnp.arange(LP, dtype=jnp.int32)
    inb = cols < L
    x = rec._plgpu().load(k_ref.at[rec.masked_index(r * L + cols, inb, k_ref.shape[0])],
                          mask=inb, other=INT32_MIN)                        # row r, [LP]
    sign = jnp.int32(INT32_MIN)

    def bit(i, t):   # decide bit 31 − i of the unsigned order (key ^ 0x80000000)
        cand = t | lax.shift_left(jnp.int32(1), 31 - i)
        n = jnp.sum((x >= (cand ^ sign)).astype(jnp.int32))                # #{key ≥ cand}
        return jnp.where(n >= K, cand, t)

    t = lax.fori_loop(0, 32, bit, jnp.int32(0))
    count = jnp.sum((x != INT32_MIN).astype(jnp.int32))
    kth_ref[pl.ds(r, 1)] = jnp.full((1,), jnp.where(count >= K, t ^ sign, jnp.int32(THETA_NONE)),
                                    jnp.int32)
    cnt_ref[pl.ds(r, 1)] = jnp.full((1,), count, jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def _kth_call(keys, *, k, interpret):
    T, L = keys.shape
    LP = max(16, 1 << (L - 1).bit_length())
    kern = functools.partial(_kth_kernel, L=L, LP=LP, K=k)
    return pl.pallas_call(
        kern, grid=(T,),
        out_shape=(jax.ShapeDtypeStruct((T,), jnp.int32), jax.ShapeDtypeStruct((T,), jnp.int32)),
        compiler_params=compiler_params(4 if LP <= 8192 else 8, 1), interpret=interpret,
        name="dosa_kth_largest")(keys.reshape(-1))


def kth_largest_keys_kernel(keys: Array, k: int, *, interpret=None):
    """:func:`kth_largest_keys` as a Pallas Triton kernel (its twin): one program per row, the
    row in registers, a 32-step bitwise descent (one count over the row per bit, in the
    unsigned order ``key ^ 0x80000000`` compared as signed keys). Same answers, bit for bit.

    The jnp descent needs 8 passes of 15 counts, each an XLA reduction over the [T, L] keys;
    the kernel reads each row once. Rows wider than :data:`KTH_MAX_ROW` use the jnp descent.
    """
    keys = keys.astype(jnp.int32)
    if (keys.ndim != 2 or keys.shape[-1] > KTH_MAX_ROW or keys.shape[0] == 0
            or keys.size >= 2 ** 31):
        return kth_largest_keys(keys, k)
    if interpret is None:
        interpret = interpret_default()
    return _kth_call(keys, k=int(k), interpret=interpret)


def seed_threshold(ops: Operands, lists: Array, list_count: Array, K: int, *,
                   tiles: Tiles = Tiles(), interpret=None):
    """τ of every query as an order key (Eq. 2) and its eligible seed count ([T] each).

    ``THETA_NONE`` (and a count < K) where the query sees fewer than K eligible seeds.
    """
    keys = seed_scores(ops, lists, list_count, tiles=tiles, interpret=interpret)
    return kth_largest_keys_kernel(keys, K, interpret=interpret)
