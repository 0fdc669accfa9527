"""Static tile configuration of the Pallas kernels (:class:`Tiles`) and its validation.

One ``Tiles`` serves a whole call. Its defaults are tuned values (the
measurements that chose them are in BENCHMARKS.md); every field changes speed
only, never an answer, except that dense and refinement must share ``BQ``,
``num_warps`` and ``layout`` for their scores to agree bitwise.
"""

from __future__ import annotations

from typing import NamedTuple

#: MMA layouts of the scoring and screening tiles (:func:`pallas_kernels.scoring.score_tile`).
LAYOUTS = ("hk", "kh", "kc")
#: Launch orders of the refinement programs (:func:`pallas_kernels.refine.launch_order`).
REFINE_ORDERS = ("auto", "list", "longest", "outliers")


class Tiles(NamedTuple):
    """Static tile configuration of the scoring kernels (dense, refine, seeds) and the screen.

    Dense and refinement must use the *same* ``BQ``, ``num_warps`` and ``layout`` so that their
    scores agree bitwise; with the ``kc`` layout the refinement's key count per tile may differ
    (``refine_bk``): a key's ``kc`` score is one MMA row's head sum, whatever the tile height.

    The defaults: the ``kc`` layout (one [BK, D]×[D, 4·H] MMA per key tile for the 4
    queries, each query's head sum inside one thread), 64-key tiles (128 in the refinement),
    3 pipeline stages, ``kc`` screens of 8 queries with a software-pipelined epilogue, one
    automatic budget per wave (one screen kernel per wave), FP8 keys widened to bf16 before
    the kernels.
    """

    BQ: int = 4          # queries per program (refinement group size, paper Sec. 3)
    BK: int = 64         # keys per tile
    # record slots per pass of the threshold search and the compaction (more slots need more
    # registers in the dense kernel; 512 spills)
    CH: int = 256
    num_warps: int = 4
    num_stages: int = 3
    layout: str = "kc"   # MMA layout of the scoring tile (:func:`pallas_kernels.scoring.score_tile`)
    # the screening kernel (DoSA only; its bound need not match any score bitwise)
    screen_layout: str = "kc"
    # queries per screening program (0: the layout's default)
    screen_bq: int = 8
    screen_warps: int = 4
    # "kc" screen: each query's columns in the lanes of one thread (in-thread column sums, no
    # shuffles; common.lane_aligned_order), else query-major columns
    screen_lane_sums: bool = True
    screen_bk: int = 0       # keys per screening tile (0: BK)
    # keys per refinement tile ("kc" layout only; 0: BK). A key's kc score does not depend on
    # the tile's key count (each key is one MMA row, its head sum runs along the row)
    refine_bk: int = 128
    # FP8 keys (and queries) widened to bf16 once before the kernels (exact; common.mma_pieces)
    # instead of converted tile by tile inside them
    widen_fp8: bool = True
    # record slots per (query, split) of the dense and refinement kernels (0: 3K + BK,
    # :func:`pallas_kernels.operands.capacity_for`); at least K + BK is always used
    record_slots: int = 0
    # "kc" scoring tiles: the queries' head rows in common.lane_aligned_order, so that each
    # query's head sum runs inside one thread (no shuffles); scores keep one fixed order
    lane_sums: bool = True
    # screen pipeline stages (0: num_stages); 2 stages leave shared memory for 3 screen
    # programs per SM
    screen_stages: int = 0
    # "kc" screen software-pipelined by hand: tile j's MMA is issued before tile j-1's
    # epilogue, one more accumulator in registers (tiles wider than 128 columns keep the
    # plain loop)
    screen_defer: bool = True
    # which queries share one automatic budget: "wave" (every query of a wave: one screen
    # class, one kernel, per wave), "program" (each screening program's queries: the budget
    # its kernel pays for anyway) or "query". A class kernel takes at least one program's
    # scan of its whole key range however few programs it holds (one key split at long
    # context), so every class present in a wave costs about that latency: a wave whose
    # programs mix two classes pays both kernels in full (BUDGET_SHARES)
    budget_share: str = "wave"
    # bf16/FP8 queries: the negative aggregate as one column (its bf16 hi; a − hi charged to
    # the coefficient) instead of two (hi, −lo): one more retained head in the same columns
    aggregate_hi_only: bool = True
    # refinement programs per survivor list: each takes a slice of whole tiles of its list and
    # keeps its own record buffers
    refine_slices: int = 1
    # launch order of the refinement programs (:func:`pallas_kernels.refine.launch_order`:
    # "list", "longest" first, the "outliers" first, or "auto": longest first for a wave of
    # few lists, list order for many)
    refine_order: str = "auto"
    # warps and pipeline stages of the refinement kernel (0: num_warps / num_stages); a kc
    # score is one MMA row's head sum in one thread, whatever the warps
    refine_warps: int = 0
    refine_stages: int = 0
    # the survivor compaction (pallas_kernels.screen.compact_masks): keys per chunk (the lists'
    # splits are cut at chunk boundaries) and chunks per program (loaded together)
    compact_chunk: int = 2048
    compact_chunks: int = 2
    # chunks per program of the compaction's survivor count (pallas_kernels.screen.chunk_counts,
    # one read of the masks); 0: the XLA reduction
    count_chunks: int = 8
    # the screen writes one byte per key for each pair of groups (4 bits each) instead of one per
    # group, and the compaction reads it once for both: half the mask bytes. Applies when every
    # budget class screens "kc" programs of 8 queries (screen.can_pack); else one byte per group.
    # Off by default: the packed compaction needs more registers and was not faster
    screen_pack: bool = False
    # the planner's sample dots (pallas_kernels.pipeline.plan_sample_dots) as one bf16 MMA with
    # float32 accumulation when queries and keys are exact in bf16 (products exact, sums in
    # float32 in the MMA's order) instead of float32 HIGHEST dots; a heuristic input only
    # (head frequencies, the budget's survival estimate), never part of a bound
    plan_sample_mma: bool = True


#: The values of ``Tiles.budget_share``.
BUDGET_SHARES = ("wave", "program", "query")


def check_tiles(tiles: Tiles) -> Tiles:
    """Reject tile configurations the kernels cannot run, naming the field."""
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a pallas_kernels.tiles.Tiles, got {type(tiles).__name__}")
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
    if tiles.budget_share not in BUDGET_SHARES:
        raise ValueError(f"tiles.budget_share must be one of {BUDGET_SHARES}, got "
                         f"{tiles.budget_share!r}")
    if tiles.screen_bq < 0 or tiles.screen_bq % 4:
        raise ValueError(f"tiles.screen_bq must be 0 or a multiple of 4, got {tiles.screen_bq}")
    if tiles.num_warps not in (1, 2, 4, 8, 16) or tiles.screen_warps not in (1, 2, 4, 8, 16):
        raise ValueError("tiles.num_warps and tiles.screen_warps must be 1, 2, 4, 8 or 16")
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
