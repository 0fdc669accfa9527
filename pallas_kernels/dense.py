"""The dense fused indexer (Pallas Triton) and its jnp twin — ``dense_topk`` on the GPU.

Full-head scoring of every visible key with an online threshold filter and
compact writeback, never materialising the [T, N] score matrix (the analogue
of the paper's LiteTopK baseline; SPEC §14 (b)). Grid: (query groups of
``BQ``, key splits ``S``). A program loads its ``BQ·H`` query rows once, walks
its key tiles (``BK`` keys, contiguous loads), scores them with the shared
:func:`pallas_kernels.scoring.score_tile`, and appends records whose order key
clears its running threshold into its per-query buffers
(:mod:`pallas_kernels.records`: online K-th-largest threshold, in-place
compaction, no candidate ever dropped). Exact selection of the records
(score desc, id asc) finishes ``dense_topk``.

Backend: Triton, because the epilogue needs ``cumsum`` and masked stores at
computed positions (SPEC §13); Mosaic GPU has neither. The same kernel serves
the DoSA recovery path (``theta0 = τ``, survivors of a failed screen).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dosa_jax.selection import INT32_MIN, order_key, select_by_position
from pallas_kernels import records as rec
from pallas_kernels.common import (THETA_NONE, compiler_params, group_range, in_lane_order,
                                   interpret_default, kernel_order_key, lane_sums_apply,
                                   mma_pieces, next_pow2, pad_axis, piece_pairs, round_up,
                                   split_key_tiles)
from pallas_kernels.scoring import load_query_tile, score_reference, score_tile

Array = jax.Array


class Tiles(NamedTuple):
    """Static tile configuration of the scoring kernels (dense, refine, seeds) and the screen.

    Dense and refinement must use the *same* ``BQ``, ``num_warps`` and ``layout`` so that their
    scores agree bitwise (one ``Tiles`` serves a whole call); with the ``kc`` layout the
    refinement's key count per tile may differ (``refine_bk``, checked bitwise on the GPU).

    Defaults are the fastest configuration measured on the H200 (sessions 4 and 6,
    BENCHMARKS.md): the ``kc`` layout (one [BK, D]×[D, 4·H] MMA per key tile for the 4
    queries), 64-key tiles (128 in the refinement), 3 pipeline stages, the ``kc`` screen of 4
    queries evaluated keys-major, FP8 keys widened to bf16 before the kernels. At T=16K, N=1M
    DoSA took 1280 ms with session 3's ``kh``/128 tiles, 927 ms with session 4's, 661 ms with
    these; 8-query screens, 32- and 128-key screen tiles, 8 screen warps, 2 pipeline stages and
    prefetching the next tile's per-key operands were slower. Session 9 put each query's columns
    in one thread (``lane_sums``, ``screen_lane_sums``; T=4096, N=1M: DoSA 124 -> 71 ms, seeded
    dense 128 -> 97 ms) and measured again, slower than the defaults: 2 pipeline stages, 8-warp
    screens (8 or 16 queries, 64- or 128-key tiles), 128-key screen tiles, 64-key refinement
    tiles, 128-key dense tiles. Session 10 deferred the screen's wgmma wait past the previous
    tile's epilogue, shared the budget within each screening program and wrote the aggregate
    as one column (T=4096, N=1M: DoSA 71.1 -> 62.9 ms); 2 screen stages (3 programs per SM by
    shared memory) measured slower (45.9 -> 51.5 ms screen). Session 11 launched the
    refinement's programs longest survivor list first when a call has few lists (T=4096, N=1M:
    DoSA 63.2 -> 59.5 ms); slices of lists, 8 refinement warps and 2 refinement stages were
    slower or no faster. Session 12 compacted the survivor masks in parallel chunks
    (``compact_chunk``, ``compact_chunks``) and took the planner's sample dots as bf16 MMAs
    (``plan_sample_mma``; T=4096, N=1M: DoSA 55.8 -> 55.3 ms). Session 13 counted each chunk's
    survivors with a kernel (``count_chunks``; T=16K, N=1M: 2.04 -> 1.54 ms per call).
    """

    BQ: int = 4          # queries per program (refinement group size, paper Sec. 3)
    BK: int = 64         # keys per tile
    # record slots per pass of the threshold search and the compaction. 256 measured fastest
    # on the H200 with the windowed search (session 8, T=4096, N=1M, 3K + BK slots: seeded
    # dense 111 ms, DoSA 123 ms; 512: 135 / 126 ms; 128: slower); the dense kernel needs 193
    # registers with 256 (205 with the scan's final compaction; ptxas, standalone Triton 3.6),
    # 255 and spills with 512
    CH: int = 256
    num_warps: int = 4
    num_stages: int = 3
    layout: str = "kc"   # MMA layout of the scoring tile (:func:`pallas_kernels.scoring.score_tile`)
    # the screening kernel (DoSA only; its bound need not match any score bitwise)
    screen_layout: str = "kc"
    # queries per screening program (0: the layout's default). 8 measured fastest on the H200
    # once programs run in their budget class (session 7, T=4096, N=1M: DoSA 153 -> 134 ms;
    # 16 queries with 8 warps 144 ms, with 4 warps 328 ms)
    screen_bq: int = 8
    screen_warps: int = 4
    # "kc" screen: each query's columns in the lanes of one thread (in-thread column sums, no
    # shuffles; common.lane_aligned_order), else query-major columns (session 8's order)
    screen_lane_sums: bool = True
    screen_bk: int = 0       # keys per screening tile (0: BK)
    # keys per refinement tile ("kc" layout only; 0: BK). 128 measured fastest on the H200
    # (session 6: DoSA at T=4096, N=1M 177 -> 167 ms; the dense scan itself is slower with
    # 128-key tiles). A key's kc score does not depend on the tile's key count (each key is
    # one MMA row, its head sum runs along the row): the GPU tests check DoSA with
    # refine_bk != BK bitwise against the dense kernel
    refine_bk: int = 128
    # FP8 keys (and queries) widened to bf16 once before the kernels (exact; common.mma_pieces)
    # instead of converted tile by tile inside them
    widen_fp8: bool = True
    # record slots per (query, split) of the dense and refinement kernels (0: 3K + BK,
    # :func:`capacity_for`); at least K + BK is always used
    record_slots: int = 0
    # "kc" scoring tiles: the queries' head rows in common.lane_aligned_order, so that each
    # query's head sum runs inside one thread (no shuffles); scores keep one fixed order
    lane_sums: bool = True
    # screen pipeline stages (0: num_stages); 2 stages leave shared memory for 3 screen
    # programs per SM
    screen_stages: int = 0
    # "kc" screen software-pipelined by hand: tile j's MMA is issued before tile j-1's
    # epilogue (ptxas interleaves that epilogue with the HGMMAs before the wait), one more
    # accumulator in registers (165 -> 238 at 8 x 16 columns; tiles wider than 128 columns
    # keep the plain loop). H200, T=4096, N=1M (session 10): screen 45.9 -> 43.9 ms
    screen_defer: bool = True
    # the automatic budget chosen once per screening program (its queries share the budget
    # the kernel pays for anyway) instead of per query. Session 10: DoSA 68.8 -> 66.0 ms
    shared_budget: bool = True
    # bf16/FP8 queries: the negative aggregate as one column (its bf16 hi; a − hi charged to
    # the coefficient) instead of two (hi, −lo): one more retained head in the same columns
    # (r = 15 in 16). Session 10: survival 7.6 -> 6.2 %, DoSA 66.0 -> 62.9 ms
    aggregate_hi_only: bool = True
    # refinement programs per survivor list: each takes a slice of whole tiles of its list and
    # keeps its own record buffers. H200, T=4096, N=1M (session 11, longest first): 1 slice
    # 59.8 ms, 2 slices 64.2, 4 slices 72.0 (each buffer's records and final compaction cost
    # more than the balance gains)
    refine_slices: int = 1
    # launch order of the refinement programs (:func:`pallas_kernels.refine.launch_order`:
    # "list", "longest" first, the "outliers" first, or "auto": longest first for a wave of
    # few lists, list order for many). Session 11, T=4096, N=1M (512 lists): list order
    # 63.2 ms, longest first 59.5 ms; T=16K, N=128K (4096 lists): 66.3 / 67.9 ms
    refine_order: str = "auto"
    # warps and pipeline stages of the refinement kernel (0: num_warps / num_stages); a kc
    # score is one MMA row's head sum in one thread, whatever the warps (checked bitwise on the
    # GPU against the dense kernel)
    refine_warps: int = 0
    refine_stages: int = 0
    # the survivor compaction (pallas_kernels.screen.compact_masks): keys per chunk (the lists'
    # splits are cut at chunk boundaries) and chunks per program (loaded together)
    compact_chunk: int = 2048
    compact_chunks: int = 2
    # chunks per program of the compaction's survivor count (pallas_kernels.screen.chunk_counts,
    # one read of the masks); 0: the XLA reduction (1.65-2.0 ms per call at T=16K, N=1M)
    count_chunks: int = 8
    # the screen writes one byte per key for each pair of groups (4 bits each) instead of one per
    # group, and the compaction reads it once for both: half the mask bytes. Applies when every
    # budget class screens "kc" programs of 8 queries (screen.can_pack); else one byte per group.
    # Measured slower on the H200 (session 12, T=16K, N=1M: DoSA 220.1 ms unpacked, 221.2 packed
    # with 1 chunk per program, 222.7 with 2; the packed compaction needs 162 / 232 registers)
    screen_pack: bool = False
    # the planner's sample dots (pallas_kernels.pipeline._plan_sample) as one bf16 MMA with
    # float32 accumulation when queries and keys are exact in bf16 (products exact, sums in
    # float32 in the MMA's order) instead of float32 HIGHEST dots; a heuristic input only
    # (head frequencies, the budget's survival estimate), never part of a bound
    plan_sample_mma: bool = True


#: MMA layouts of the scoring and screening tiles (:func:`pallas_kernels.scoring.score_tile`).
LAYOUTS = ("hk", "kh", "kc")


def check_tiles(tiles: Tiles) -> Tiles:
    """Reject tile configurations the kernels cannot run, naming the field."""
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a pallas_kernels.dense.Tiles, got {type(tiles).__name__}")
    for f in ("layout", "screen_layout"):
        if getattr(tiles, f) not in LAYOUTS:
            raise ValueError(f"tiles.{f} must be one of {LAYOUTS}, got {getattr(tiles, f)!r}")
    for f in ("BQ", "BK", "CH"):
        v = getattr(tiles, f)
        if v < 1 or v & (v - 1):
            raise ValueError(f"tiles.{f} must be a power of two, got {v}")
    if tiles.BK < 16:
        raise ValueError(f"tiles.BK must be >= 16 (an MMA dimension), got {tiles.BK}")
    for f in ("screen_bk", "refine_bk"):
        v = getattr(tiles, f)
        if v and (v < 16 or v & (v - 1)):
            raise ValueError(f"tiles.{f} must be 0 or a power of two >= 16, got {v}")
    if tiles.refine_bk and tiles.layout != "kc":
        raise ValueError(f"tiles.refine_bk={tiles.refine_bk} needs tiles.layout='kc' (keys as MMA "
                         "rows: scores that do not depend on the tile's key count); with "
                         f"layout={tiles.layout!r} set tiles.refine_bk=0")
    if tiles.record_slots < 0:
        raise ValueError(f"tiles.record_slots must be >= 0 (0: default), got {tiles.record_slots}")
    if not isinstance(tiles.refine_slices, int) or tiles.refine_slices < 1:
        raise ValueError(f"tiles.refine_slices must be an int >= 1, got {tiles.refine_slices!r}")
    if tiles.screen_bq < 0 or tiles.screen_bq % 4:
        raise ValueError(f"tiles.screen_bq must be 0 or a multiple of 4, got {tiles.screen_bq}")
    if tiles.num_warps not in (1, 2, 4, 8, 16) or tiles.screen_warps not in (1, 2, 4, 8, 16):
        raise ValueError("tiles.num_warps and tiles.screen_warps must be 1, 2, 4, 8 or 16")
    from pallas_kernels.refine import REFINE_ORDERS
    if tiles.refine_order not in REFINE_ORDERS:
        raise ValueError(f"tiles.refine_order must be one of {REFINE_ORDERS}, got "
                         f"{tiles.refine_order!r}")
    if tiles.refine_warps not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"tiles.refine_warps must be 0, 1, 2, 4, 8 or 16, got {tiles.refine_warps}")
    if tiles.refine_stages < 0 or tiles.screen_stages < 0:
        raise ValueError("tiles.refine_stages and tiles.screen_stages must be >= 0 (0: num_stages)")
    for f in ("compact_chunk", "compact_chunks"):
        v = getattr(tiles, f)
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"tiles.{f} must be a power of two >= 1, got {v!r}")
    if tiles.compact_chunk < 16:
        raise ValueError(f"tiles.compact_chunk must be >= 16, got {tiles.compact_chunk}")
    c = tiles.count_chunks
    if not isinstance(c, int) or c < 0 or c & (c - 1):
        raise ValueError(f"tiles.count_chunks must be 0 or a power of two, got {c!r}")
    return tiles


class Candidates(NamedTuple):
    """Record buffers of a scoring scan ([T, S, C] / [T, S])."""

    key: Array      # int32 order keys
    ids: Array      # int32 key ids
    count: Array    # int32 valid records per (query, split)
    theta: Array    # int32 order key: final threshold (≤ τ* when ≥ K witnesses were held)
    appended: Array  # int32 records appended (work statistic)


class Operands(NamedTuple):
    """Kernel-ready operands: MMA pieces and padded shapes."""

    q: Array        # [Pq, Tpad*Hp, Dp]
    w: Array        # [Tpad*Hp] float32
    k: Array        # [Pk, N, Dp]
    scale: Array    # [N] float32
    T: int
    H: int          # padded heads Hp
    pairs: tuple
    fp8_mma: bool = False
    lane_sums: bool = False   # q/w rows in common.lane_aligned_order per group of BQ ("kc")


def prepare_key_operands(k, k_scale, mma_dtype=jnp.bfloat16, widen_fp8: bool = True):
    """The key side of :func:`prepare_operands`: (MMA pieces [Pk, N, Dp], scale [N] float32).

    Computed once per call and shared by the waves of :func:`pallas_kernels.pipeline.dosa_topk`
    (XLA does not hoist the fp8 → bf16 widening, which doubles the bytes, out of a loop).
    """
    Dp = max(16, next_pow2(k.shape[-1]))
    kp = pad_axis(mma_pieces(k, mma_dtype, widen_fp8), 2, Dp)
    scale = (jnp.ones((k.shape[0],), jnp.float32) if k_scale is None
             else k_scale.astype(jnp.float32))
    return kp, scale


def prepare_operands(q, w, k, k_scale, BQ: int, mma_dtype=jnp.bfloat16,
                     layout: str = "hk", widen_fp8: bool = True,
                     lane_sums: bool = False, keys=None) -> Operands:
    """Pieces, pads (heads to a power of two with zero weights, D to ≥ 16, T to BQ).

    ``layout="kh"`` multiplies keys by one query's H heads, so H is padded to ≥ 16.
    ``widen_fp8``: FP8 operands of a bf16 MMA become bf16 pieces here
    (:func:`pallas_kernels.common.mma_pieces`).
    ``lane_sums`` (``"kc"``): each group's BQ·H query rows and weights in
    :func:`pallas_kernels.common.lane_aligned_order` (the kernels follow ``ops.lane_sums``).
    ``keys``: :func:`prepare_key_operands` of the same ``k``, ``k_scale``, ``mma_dtype`` and
    ``widen_fp8``, computed before (``k`` is then only read for its shape).
    """
    T, H, D = q.shape
    Hp = next_pow2(max(H, 1))
    while BQ * Hp < 16 or (layout == "kh" and Hp < 16):
        Hp *= 2
    Dp = max(16, next_pow2(D))
    Tpad = round_up(max(T, 1), BQ)
    qp = mma_pieces(q, mma_dtype, widen_fp8)
    kp, scale = keys if keys is not None else prepare_key_operands(k, k_scale, mma_dtype,
                                                                   widen_fp8)
    qp = pad_axis(pad_axis(pad_axis(qp, 3, Dp), 2, Hp), 1, Tpad)
    wp = pad_axis(pad_axis(w.astype(jnp.float32), 1, Hp), 0, Tpad)
    qp = qp.reshape(qp.shape[0], Tpad * Hp, Dp)
    wp = wp.reshape(Tpad * Hp)
    lane_sums = bool(lane_sums) and layout == "kc" and lane_sums_apply(BQ, Hp)
    if lane_sums:
        qp = in_lane_order(qp, BQ, Hp)
        wp = in_lane_order(wp[None, :, None], BQ, Hp)[0, :, 0]
    return Operands(q=qp, w=wp, k=kp, scale=scale, T=T, H=Hp,
                    pairs=piece_pairs(qp.shape[0], kp.shape[0]),
                    fp8_mma=jnp.dtype(mma_dtype) == jnp.dtype(jnp.float8_e4m3fn),
                    lane_sums=lane_sums)


def _dense_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, H: int, N: int, S: int, C: int, K: int,
                  pairs, fp8_mma: bool, lane_sums: bool, interpret: bool):
    q_refs, (w_ref, lo_ref, hi_ref, th_ref), k_refs, (sc_ref,), outs = (
        refs[:Pq], refs[Pq:Pq + 4], refs[Pq + 4:Pq + 4 + Pk], refs[Pq + 4 + Pk:Pq + 5 + Pk],
        refs[Pq + 5 + Pk:])
    rk_ref, ri_ref, cnt_ref, tho_ref, app_ref = outs
    BQ, BK, CH = tiles.BQ, tiles.BK, tiles.CH
    g = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, g, BQ=BQ, H=H, layout=tiles.layout)
    lo = lo_ref[pl.ds(g * BQ, BQ)]
    hi = hi_ref[pl.ds(g * BQ, BQ)]
    theta0 = th_ref[pl.ds(g * BQ, BQ)]
    t_ids = g * BQ + jnp.arange(BQ, dtype=jnp.int32)
    base = (t_ids * S + s) * C

    klo, khi = group_range(lo, hi)
    start, stop = split_key_tiles(klo, khi, BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)

    def tile(j, state):
        ids = j * BK + lanes
        inb = ids < N
        kp = [k_ref[pl.ds(j * BK, BK), :] for k_ref in k_refs] if N % BK == 0 else [
            rec._plgpu().load(k_ref.at[pl.ds(j * BK, BK), :], mask=inb[:, None])
            for k_ref in k_refs]
        scale = rec._plgpu().load(sc_ref.at[pl.ds(j * BK, BK)], mask=inb, other=1.0)
        sc = score_tile(qp, wv, kp, scale, BQ=BQ, H=H, pairs=pairs, fp8_mma=fp8_mma,
                        layout=tiles.layout, lane_sums=lane_sums)
        key = kernel_order_key(sc)
        idb = jnp.broadcast_to(ids[None, :], (BQ, BK))
        elig = (idb >= lo[:, None]) & (idb < hi[:, None]) & (key != INT32_MIN)
        count, theta, strict = state
        count, n = rec.append(rk_ref, ri_ref, base, count, rec.theta_accept(theta, strict),
                              key, idb, elig, C=C, size=size)
        return (count, theta, strict), n

    state, appended = rec.scan_tiles(start, stop, tile, theta0, rk_ref, ri_ref, base, K, C=C,
                                     BK=BK, CH=CH, size=size, interpret=interpret)
    count, theta, _ = state
    oidx = t_ids * S + s
    cnt_ref[oidx] = count
    tho_ref[oidx] = theta
    app_ref[oidx] = appended


def capacity_for(K: int, BK: int, capacity=None) -> int:
    """Record slots per (query, split).

    At least K + BK, so that a compaction (to at most K + slack records,
    :func:`pallas_kernels.records.compaction_slack`) always frees room for the
    next tile; by default 3K + BK, so that a compaction keeps at most 2K
    records and happens only after ≥ K new ones. With exactly K + BK every tile
    that appends anything after the first fill triggers a compaction: correct,
    but it made the first H200 runs ~20× slower than the XLA baseline; K + K/2 + BK
    (sessions 1–7) measured slower than 3K + BK in session 8 (seeded dense at
    T=4096, N=1M: 121 vs 111 ms with 256-slot chunks; BENCHMARKS.md).
    """
    c = max(K + BK, capacity if capacity is not None else 3 * K + BK)
    return round_up(c, 16)


@functools.partial(jax.jit, static_argnames=("K", "splits", "capacity", "tiles", "interpret",
                                             "T", "H", "pairs", "fp8_mma", "lane_sums"))
def _dense_call(q, w, lo, hi, theta0, k, scale, *, K, splits, capacity, tiles, interpret,
                T, H, pairs, fp8_mma, lane_sums):
    BQ = tiles.BQ
    Tpad = lo.shape[0]
    G = Tpad // BQ
    S = splits
    C = capacity
    N = k.shape[1]
    size = Tpad * S * C
    kern = functools.partial(_dense_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, H=H, N=N,
                             S=S, C=C, K=K, pairs=pairs, fp8_mma=fp8_mma, lane_sums=lane_sums,
                             interpret=interpret)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                 jax.ShapeDtypeStruct((Tpad * S,), i32), jax.ShapeDtypeStruct((Tpad * S,), i32),
                 jax.ShapeDtypeStruct((Tpad * S,), i32))
    rk, ri, cnt, th, app = pl.pallas_call(
        kern, out_shape=out_shape, grid=(G, S),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_dense_scan")(*q, w, lo, hi, theta0, *k, scale)
    return Candidates(rk.reshape(Tpad, S, C)[:T], ri.reshape(Tpad, S, C)[:T],
                      cnt.reshape(Tpad, S)[:T], th.reshape(Tpad, S)[:T],
                      app.reshape(Tpad, S)[:T])


def dense_candidates(ops: Operands, lo, hi, theta0, K: int, *, splits: int = 1, capacity=None,
                     tiles: Tiles = Tiles(), interpret=None) -> Candidates:
    """Run the dense scan: records holding every key of the exact Top-K of each query.

    Args:
      ops: :func:`prepare_operands` output.
      lo, hi: [T] int32 visible ranges (clipped); theta0: [T] int32 initial order-key
        threshold (``THETA_NONE``: none; a valid lower bound on τ* otherwise).
    """
    if interpret is None:
        interpret = interpret_default()
    T = ops.T
    Tpad = ops.q.shape[1] // ops.H
    pad = Tpad - T
    lo = jnp.pad(lo.astype(jnp.int32), (0, pad))
    hi = jnp.pad(hi.astype(jnp.int32), (0, pad))
    theta0 = jnp.pad(theta0.astype(jnp.int32), (0, pad), constant_values=THETA_NONE)
    C = capacity_for(K, tiles.BK, capacity if capacity is not None else tiles.record_slots or None)
    return _dense_call(ops.q, ops.w, lo, hi, theta0, ops.k, ops.scale, K=K, splits=splits,
                       capacity=C, tiles=tiles, interpret=interpret, T=T, H=ops.H,
                       pairs=ops.pairs, fp8_mma=ops.fp8_mma, lane_sums=ops.lane_sums)


def default_splits(T: int, N: int, BQ: int, BK: int) -> int:
    """Key splits so that the grid has enough programs (≥ ~4 per SM of 132) and each split
    still walks many tiles."""
    groups = max(1, -(-T // BQ))
    want = max(1, 528 // groups)
    max_by_work = max(1, N // (BK * 64))
    return int(max(1, min(want, max_by_work, 64)))


def dense_topk(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(), splits=None,
               mma_dtype=jnp.bfloat16, interpret=None, return_candidates=False):
    """Exact Top-K by the dense fused Pallas indexer (validated inputs).

    Returns (indices [T, K] int32, scores [T, K] float32) in contract order.
    """
    check_tiles(tiles)
    ops = prepare_operands(q, w, k, k_scale, tiles.BQ, mma_dtype, tiles.layout, tiles.widen_fp8,
                           tiles.lane_sums)
    theta0 = jnp.full((q.shape[0],), THETA_NONE, jnp.int32)
    return topk_from_operands(ops, lo, hi, theta0, config.top_k, splits=splits, tiles=tiles,
                              interpret=interpret, return_candidates=return_candidates)


def topk_from_operands(ops: Operands, lo, hi, theta0, K: int, *, splits=None,
                       tiles: Tiles = Tiles(), interpret=None, return_candidates=False):
    """The dense scan of prepared operands from thresholds ``theta0`` ([T] order keys, each a
    valid lower bound on τ* or ``THETA_NONE``), then exact selection of the records."""
    S = splits or default_splits(ops.T, ops.k.shape[1], tiles.BQ, tiles.BK)
    cand = dense_candidates(ops, lo, hi, theta0, K, splits=S, tiles=tiles, interpret=interpret)
    idx, sc = rec.select_from_records(cand.key, cand.ids, cand.count, K)
    if return_candidates:
        return idx, sc, cand
    return idx, sc


def dense_topk_reference(q, k, w, k_scale, lo, hi, config, *, mma_dtype=jnp.bfloat16):
    """jnp twin of :func:`dense_topk`: the same scoring function (operand pieces, float32
    accumulation) on the full [T, N] matrix, then exact selection."""
    qp = mma_pieces(q, mma_dtype)
    kp = mma_pieces(k, mma_dtype)
    s = score_reference(qp, w.astype(jnp.float32), kp, k_scale)
    ids = jnp.arange(k.shape[0], dtype=jnp.int32)[None, :]
    valid = (ids >= lo[:, None]) & (ids < hi[:, None])
    return select_by_position(s, config.top_k, valid)


__all__ = ["Tiles", "check_tiles", "Candidates", "Operands", "prepare_operands", "dense_candidates",
           "topk_from_operands",
           "dense_topk", "dense_topk_reference", "capacity_for", "default_splits",
           "order_key"]
