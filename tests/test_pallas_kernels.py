"""Pallas kernels against their jnp twins (interpret mode on CPU; compiled on a GPU).

Small shapes with small K and tiles so that every mechanism runs: online
threshold compactions (C = K + BK), massive ties, NaN / ±inf / −0.0 scores,
split scans, survivor-list overflow and recovery. Indices are compared exactly
where the twin's scores leave a gap larger than the scorer difference bound;
the Pallas paths are compared with each other bitwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import synthetic
from dosa_jax.config import Config
from dosa_jax.selection import exact_topk as ref_exact_topk
from pallas_kernels import dense, pipeline, records, screen
from pallas_kernels import select as pselect
from pallas_kernels.common import (THETA_NONE, interpret_default, lane_aligned_order, mma_pieces,
                                   on_gpu)
from kernel_checks import (assert_screening_bound_holds_on_every_key, jit_dosa_details_many,
                           unpack_survivors)

ON_GPU = on_gpu()
# one pytest-xdist worker runs this file: its tests share interpret-mode compilations
pytestmark = pytest.mark.xdist_group("pallas_kernels")
TILES = dense.Tiles(BQ=4, BK=16, CH=32, refine_bk=0, compact_chunk=64)   # several chunks per list
# keys as MMA rows, one dot per query (score_tile's and the screen's second layout)
TILES_KH = TILES._replace(layout="kh", screen_layout="kh")
# keys as MMA rows, the queries' heads/rows concatenated (the default); 8 queries and 32 keys per
# screen program (the screen's key tile differs from the scoring tiles')
TILES_KC = TILES._replace(layout="kc", screen_layout="kc", screen_bq=8, screen_bk=32,
                          refine_bk=32)   # refinement tiles of 32 keys on a GPU (dense: 16)


def _assert_topk_close(idx, sc, ridx, rsc, tol=1e-5):
    """Scores equal to tol; index sets equal except keys within tol of the K-th score."""
    idx, sc, ridx, rsc = map(np.asarray, (idx, sc, ridx, rsc))
    fin = np.isfinite(rsc)
    np.testing.assert_allclose(np.where(fin, sc, 0), np.where(fin, rsc, 0), atol=tol, rtol=tol)
    assert np.array_equal(np.isfinite(sc), fin)
    for t in range(idx.shape[0]):
        kth = rsc[t, -1]
        a = set(idx[t][sc[t] > kth + tol]) if np.isfinite(kth) else set(idx[t][idx[t] >= 0])
        b = set(ridx[t][rsc[t] > kth + tol]) if np.isfinite(kth) else set(ridx[t][ridx[t] >= 0])
        assert a == b, f"query {t}: index sets differ away from the K-th score"


@pytest.fixture(scope="module")
def fp8_inputs():
    return synthetic.gaussian(T=8, N=700, H=4, D=32, seed=1, key_dtype="float8_e4m3fn",
                              query_dtype="bfloat16")


@pytest.mark.parametrize("tiles", [TILES, TILES_KH], ids=["hk", "kh"])
def test_dense_matches_twin_with_compactions(fp8_inputs, tiles):
    inp = fp8_inputs
    cfg = Config(top_k=32)
    idx, sc, cand = dense.dense_topk(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, cfg,
                                     tiles=tiles, splits=2, return_candidates=True)
    ridx, rsc = dense.dense_topk_reference(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, cfg)
    _assert_topk_close(idx, sc, ridx, rsc)
    # the online threshold really compacted (more appended than the buffer holds)
    assert int(jnp.max(cand.appended)) > dense.capacity_for(32, TILES.BK)
    # every scan ends with at most K records per buffer: its Top-K (the final selection reads
    # only the first K slots); and no buffer of this run ended empty
    assert int(jnp.max(cand.count)) <= 32
    assert int(jnp.min(cand.count)) >= 1


def test_dense_ties_nonfinite_and_ranges():
    """All keys equal (every score ties): the lowest indices win; empty / short ranges pad."""
    T, N, H, D, K = 8, 300, 4, 32, 32
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    k = jnp.asarray(np.tile(rng.standard_normal((1, D)), (N, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w = w.at[3].set(jnp.nan)                   # NaN scores: never selected
    lo = jnp.asarray([0, 10, 0, 0, 50, 299, 0, 5], jnp.int32)
    hi = jnp.asarray([300, 300, 0, 300, 60, 300, 300, 250], jnp.int32)
    cfg = Config(top_k=K)
    idx, sc = dense.dense_topk(q, k, w, None, lo, hi, cfg, tiles=TILES, splits=2)
    ridx, rsc = dense.dense_topk_reference(q, k, w, None, lo, hi, cfg)
    # every key ties with every other: indices must be exactly the lowest visible ones
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ridx))
    np.testing.assert_allclose(np.asarray(sc), np.asarray(rsc), rtol=1e-6)
    assert np.all(np.asarray(idx[2]) == -1) and np.all(np.asarray(idx[3]) == -1)
    assert list(np.asarray(idx[0, :3])) == [0, 1, 2]


def test_exact_topk_matches_reference_with_ties_nan_and_bad_guess():
    rng = np.random.default_rng(1)
    T, M, k = 5, 3000, 48
    x = rng.standard_normal((T, M)).astype(np.float32)
    x[1] = 1.0                                  # all ties
    x[2, ::7] = np.nan
    x[3, 100:400] = -0.0
    x[3] = np.where(rng.random(M) < 0.5, x[3], -np.inf)
    x[4, ::M // 300] += 10                      # exactly the sampled columns: guess too high
    x = jnp.asarray(x)
    valid = jnp.asarray(rng.random((T, M)) < 0.9)
    # both under jax.jit: one program per call instead of ~40 small ones op by op
    fast = jax.jit(lambda x, v: pselect.exact_topk(x, k, valid=v, min_columns=0, block=64,
                                                   sample=300, return_stats=True))
    ref = jax.jit(lambda x, v: ref_exact_topk(x, k, valid=v))
    for v in (None, valid):
        i, s, st = fast(x, v)
        ri, rs = ref(x, v)
        np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
    assert int(st["fallback_rows"][4]) == 1


@pytest.mark.parametrize("single_piece,layout,bq,lane_sums,absolute,defer,hi_only,pack",
                         [(False, "hk", None, False, False, False, False, False),
                          (True, "kh", None, False, True, False, False, False),
                          (True, "kc", None, True, False, False, False, False),
                          (True, "kc", 8, False, True, False, False, False),
                          (False, "kc", 8, True, True, False, False, False),
                          (True, "kc", 4, True, False, True, True, False),
                          (True, "kc", 8, True, True, True, True, False),
                          (True, "kc", 8, True, True, True, True, True),
                          (True, "kc", 8, False, False, False, False, True)],
                         ids=["two_pieces_hk", "one_piece_kh_absolute", "one_piece_kc_lanes",
                              "one_piece_kc_bq8_query_major_absolute",
                              "two_pieces_kc_bq8_lanes_absolute",
                              "one_piece_kc_lanes_deferred_hi_only",
                              "one_piece_kc_bq8_deferred_hi_only_absolute",
                              "one_piece_kc_bq8_deferred_hi_only_absolute_packed",
                              "one_piece_kc_bq8_query_major_packed"])
def test_screen_matches_twin(single_piece, layout, bq, lane_sums, absolute, defer, hi_only,
                             pack):
    """The screen kernel's survival masks and the compaction's lists against the twins on every
    (query, key): the bound (retained heads, the aggregate as ReLU columns in both forms, the
    kernel's lane-aligned column order or not, the software-pipelined loop), the strict
    rejection, prune off, empty ranges (a whole program of them with 4 queries each); with
    ``pack`` the two groups of an 8-query program share one byte per key."""
    inp = synthetic.structured(T=8, N=500, H=4, D=32, seed=2, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    T = 8
    rng = np.random.default_rng(3)
    R = 2
    q32 = inp.q.astype(jnp.float32)
    rows = q32[:, :R]
    row_w = jnp.asarray(inp.w[:, :R])
    agg = q32[:, R:R + 1] * 0.3
    linear = jnp.asarray(rng.random(T) < 0.5)
    cols, cw, err = screen.aggregate_columns(agg, linear, split=single_piece, absolute=absolute,
                                             hi_only=hi_only)
    assert cols.shape[1] == screen.aggregate_column_count(single_piece, absolute, hi_only)
    if single_piece:   # the pipeline's form: hi, lo exact in bf16, the remainder bounded
        np.testing.assert_array_equal(np.asarray(cols.astype(jnp.bfloat16).astype(jnp.float32)),
                                      np.asarray(cols))
        assert bool(jnp.all(err >= 0))
    # the columns bound the aggregate term from above on every key (Eq. 8, 25; + ‖e‖·‖k‖)
    kf = np.asarray(inp.k.astype(jnp.float32), np.float64)
    z = np.einsum("td,nd->tn", np.asarray(agg[:, 0], np.float64), kf)
    term = np.where(np.asarray(linear)[:, None] & absolute, -z, -np.maximum(z, 0))
    cz = np.einsum("tad,nd->tan", np.asarray(cols, np.float64), kf)
    got_term = np.sum(np.maximum(cz, 0) * np.asarray(cw, np.float64)[:, :, None], axis=1)
    slack = (0 if err is None else np.asarray(err, np.float64)[:, None]
             * np.linalg.norm(kf, axis=1)[None, :])
    assert np.all(got_term + slack >= term - 1e-9 * (1 + np.abs(term)))
    coef = jnp.full((T,), 0.05, jnp.float32)
    eps = jnp.full((T,), 1e-30, jnp.float32)
    tau = jnp.asarray(rng.uniform(-0.5, 1.0, T), jnp.float32)
    prune = jnp.asarray([True] * 7 + [False])
    lo = inp.lo.at[2].set(inp.hi[2])                      # an empty range
    if bq == 4:   # a program (queries 4-7) of empty ranges and ranges inside one key tile: its
        lo = lo.at[4:6].set(inp.hi[4:6])     # second split has no tiles
        lo = lo.at[6:8].set(496)              # (tile 31 of 16 keys: hi = 499, 500)
    ops = dense.prepare_operands(inp.q, inp.w, inp.k, inp.k_scale, 4)
    from dosa_jax.enclosure import key_norm_upper
    knorm = key_norm_upper(inp.k)
    sops = screen.prepare_screen(rows, row_w, cols, cw, coef, eps, tau, prune, ops.k.shape[-1],
                                 single_piece=single_piece, layout=layout, BQs=bq,
                                 lane_sums=lane_sums)
    assert sops.BQs % 4 == 0 and (bq is None or sops.BQs == bq)
    assert layout != "kh" or sops.Rp >= 16
    assert layout == "hk" or sops.BQs * sops.Rp >= 16
    assert sops.rows.shape[0] == (1 if single_piece else 2)
    assert sops.lane_sums == (lane_sums and layout == "kc")
    masks, per_query = screen.screen_masks(sops, lo, inp.hi, ops.k, knorm, ops.scale, splits=2,
                                           BK=16, defer=defer, pack=pack)
    assert masks.shape[0] == (1 if pack else 2)
    packed, count = screen.compact_masks(masks, lo, inp.hi, splits=2, capacity=512, chunk=64,
                                         packed=pack)
    U = screen.screening_bound_reference(rows, row_w, cols, cw, coef, eps, ops.k, knorm,
                                         ops.scale, single_piece=single_piece)
    m = np.asarray(screen.survivors_reference(U, tau, prune, lo, inp.hi))
    got = unpack_survivors(packed, count, T, m.shape[1])   # checks ascending ids
    near = np.abs(np.asarray(U) - np.asarray(tau)[:, None]) <= 1e-5 * (1 + np.abs(np.asarray(U)))
    assert np.all((got == m) | near)
    assert np.array_equal(np.asarray(per_query)[:T].sum(1), got.sum(1))
    assert got[7].sum() == int(inp.hi[7] - lo[7])              # prune off: everything survives
    assert got[2].sum() == 0 and 0 < got.sum() < m.size       # empty range; pruned and kept
    # the compaction kernel against its twin, entry by entry, with a list too short (overflow:
    # the count keeps the true number, the stored entries are the first ones)
    want = screen.compact_masks_reference(masks, lo, inp.hi, 2, chunk=64, packed=pack)
    short, scount = screen.compact_masks(masks, lo, inp.hi, splits=2, capacity=16, chunk=64,
                                         packed=pack)
    for g in range(2):
        for s in range(2):
            assert int(count[g, s]) == len(want[g][s]) == int(scount[g, s])
            np.testing.assert_array_equal(np.asarray(packed[g, s, :len(want[g][s])]), want[g][s])
            n = min(16, len(want[g][s]))
            np.testing.assert_array_equal(np.asarray(short[g, s, :n]), want[g][s][:n])
    assert int(jnp.max(scount)) > 16


@pytest.mark.parametrize("splits,cpp,packed,count_chunks", [
    (1, 1, False, 0), (2, 4, False, 8), (3, 8, False, 2), (2, 4, True, 1), (3, 1, True, 16)])
def test_compaction_writes_every_chunk_at_its_offset(splits, cpp, packed, count_chunks):
    """The two-pass compaction (chunk offsets by a prefix sum, then one write per chunk) against
    its twin, entry by entry: garbage bytes outside each group's range (never read), ranges
    not aligned to chunks, N not a multiple of the chunk, an empty group, a group of one key,
    the high bits of a byte ignored, and lists too short (the count keeps the true number,
    the stored entries are the first ones); ``packed``: two groups' 4 bits per byte, both
    written from one read."""
    rng = np.random.default_rng(splits * 10 + cpp)
    G4, N, CH = (6 if packed else 5), 1000, 64
    rows = G4 // 2 if packed else G4
    masks = rng.integers(-128, 128, (rows, N)).astype(np.int8)
    masks[rng.random((rows, N)) < 0.6] = 0x30 if not packed else 0   # high bits only: no survivor
    if packed:
        masks[rng.random((rows, N)) < 0.3] = 0x0F    # a survivor of group 2p only
    lo = np.zeros(4 * G4, np.int32)
    hi = np.zeros(4 * G4, np.int32)
    lo[0:4], hi[0:4] = [0, 3, 10, 17], [900, 950, 1000, 999]
    lo[4:8], hi[4:8] = [130, 130, 500, 130], [131, 131, 131, 131]   # one key, an empty range
    # group 2: all empty
    lo[12:16], hi[12:16] = [77, 200, 345, 66], [640, 700, 701, 702]
    lo[16:20], hi[16:20] = [999, 998, 999, 999], [1000, 1000, 1000, 1000]
    if packed:
        lo[20:24], hi[20:24] = [500, 501, 0, 700], [1000, 1000, 0, 1000]
    want = screen.compact_masks_reference(masks, lo, hi, splits, chunk=CH, packed=packed)
    for cap in (1024, 16):
        lists, count = screen.compact_masks(jnp.asarray(masks), jnp.asarray(lo), jnp.asarray(hi),
                                            splits=splits, capacity=cap, chunk=CH,
                                            chunks_per_program=cpp, packed=packed,
                                            count_chunks=count_chunks)
        lists, count = np.asarray(lists), np.asarray(count)
        for g in range(G4):
            for s_ in range(splits):
                assert int(count[g, s_]) == len(want[g][s_]), (g, s_, cap)
                n = min(lists.shape[-1], len(want[g][s_]))
                np.testing.assert_array_equal(lists[g, s_, :n], want[g][s_][:n])
        um = screen.unpack_masks(masks) if packed else masks
        assert count[2].sum() == 0 and count[1].sum() == int((um[1, 130] & 0xF) != 0)
    assert max(len(x) for row in want for x in row) > 16          # some list overflowed


@pytest.mark.parametrize("cpp,packed,N", [(1, False, 1000), (8, False, 1024), (2, True, 999),
                                          (16, True, 64)])
def test_chunk_count_kernel_matches_twin(cpp, packed, N):
    """The survivor count kernel against its XLA twin on every (group, chunk): garbage bytes
    (high bits, outside the ranges), ranges not aligned to chunks, empty groups, N not a
    multiple of the chunk, fewer chunks than a program reads; and against numpy."""
    rng = np.random.default_rng(cpp + N)
    G4, CH = 6, 64
    rows = G4 // 2 if packed else G4
    masks = rng.integers(-128, 128, (rows, N)).astype(np.int8)
    masks[rng.random((rows, N)) < 0.5] = 0x30 if not packed else 0
    lo = rng.integers(0, N, 4 * G4).astype(np.int32)
    hi = np.minimum(lo + rng.integers(0, N, 4 * G4), N).astype(np.int32)
    lo[8:12] = hi[8:12]                                  # group 2: all empty
    args = (jnp.asarray(masks), jnp.asarray(lo), jnp.asarray(hi))
    got = np.asarray(screen.chunk_counts(*args, CH=CH, CPP=cpp, packed=packed,
                                         interpret=interpret_default()))
    want = np.asarray(screen.chunk_counts_reference(*args, chunk=CH, packed=packed))
    np.testing.assert_array_equal(got, want)
    um = (screen.unpack_masks(masks) if packed else masks).astype(np.int32) & 0xF
    for g in range(G4):
        l4, h4 = lo[4 * g:4 * g + 4], hi[4 * g:4 * g + 4]
        ne = h4 > l4
        a, b = (l4[ne].min(), h4[ne].max()) if ne.any() else (0, 0)
        keep = np.zeros(N, bool)
        keep[a:b] = um[g, a:b] != 0
        np.testing.assert_array_equal(want[g], np.add.reduceat(keep, np.arange(0, N, CH)))
    assert want[2].sum() == 0 and want.sum() > 0


def test_lane_aligned_order_puts_each_query_in_one_thread():
    """Column c of a kc program holds query 4h + p, column 2m + b, for c = ((h·Rp/2 + m)·4 +
    p)·2 + b: the query is given by c's bits 1–2 (the wgmma accumulator's lane in a quad) and
    h; every logical column appears once."""
    for BQs, Rp in ((4, 2), (8, 16), (16, 8), (8, 32)):
        order = lane_aligned_order(BQs, Rp)
        assert sorted(order.tolist()) == list(range(BQs * Rp))
        c = np.arange(BQs * Rp)
        query = order // Rp
        assert np.array_equal(query % 4, (c >> 1) & 3)
        assert np.array_equal(query // 4, c // (4 * Rp))
    with pytest.raises(ValueError):
        lane_aligned_order(6, 16)


def _check_unprunable_groups_go_straight_to_dense(inp, cfg):
    """A query that cannot prune (fewer than K visible keys: no τ) sends its group of 4 to the
    dense scan without screening; the answer is bitwise the dense one, counted as a recovery.
    Then every query sent straight to dense (survival estimate above any threshold): same answer.
    Called from the bitwise test on its inputs: the calls share its interpret-mode compilations."""
    lo = inp.lo.at[5].set(inp.hi[5] - 20)               # 20 visible keys < K = 32
    args = (inp.q, inp.k, inp.w, inp.k_scale, lo, inp.hi)
    didx, dsc = pipeline.dense_topk(*args, cfg, tiles=TILES, splits=2)
    idx, sc, st, det = pipeline.dosa_topk(*args, cfg, tiles=TILES, splits=2, return_details=True)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    assert list(np.asarray(det["direct"])) == [False] * 4 + [True] * 4
    assert list(np.asarray(st.recoveries)) == [0] * 4 + [1] * 4
    assert int(jnp.sum(st.overflows)) == 0
    assert not bool(st.pruning[5])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "DIRECT_SURVIVAL", -1.0)
        idx2, sc2, st2 = pipeline.dosa_topk(*args, cfg, tiles=TILES, splits=2)
    np.testing.assert_array_equal(np.asarray(idx2), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc2), np.asarray(dsc))
    assert int(jnp.sum(st2.recoveries)) == 8


#: the DoSA == dense tests' configuration and inputs (one set: shared interpret-mode compilations)
# the screening path under test: the call-level dense switch off (tests/test_dense_switch.py
# covers the switch)
BITWISE_CFG = Config(top_k=32, retained_heads=6, seed_size=256, capacity=1024,
                     dense_switch=float("inf"))


@functools.lru_cache(maxsize=None)
def _bitwise_inputs():
    return synthetic.structured(T=8, N=1500, H=8, D=32, seed=3, key_dtype="float8_e4m3fn",
                                query_dtype="bfloat16")


# packed masks end to end: tests/test_screen_classes.py (two budget classes) and the screen
# kernel's twin test above
@pytest.mark.parametrize("tiles", [TILES, TILES_KC], ids=["hk", "kc"])
def test_dosa_pallas_equals_dense_pallas_bitwise(tiles):
    """DoSA == dense bitwise (two scoring and screening layouts), vs the twin, the screening
    bound on every key, τ from the seed kernel; with the hk tiles also groups sent straight
    to dense."""
    inp = _bitwise_inputs()
    cfg = BITWISE_CFG
    idx, sc, st, det = pipeline.dosa_topk(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, cfg,
                                          tiles=tiles, splits=2, return_details=True)
    didx, dsc = pipeline.dense_topk(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, cfg,
                                    tiles=tiles, splits=2)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    ridx, rsc = dense.dense_topk_reference(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, cfg)
    _assert_topk_close(idx, sc, ridx, rsc)
    assert int(jnp.sum(st.recoveries)) == 0
    assert int(jnp.sum(st.pruning)) > 0
    assert float(jnp.mean(st.survivors / st.visible)) < 1.0   # something was pruned
    assert_screening_bound_holds_on_every_key(inp, det)      # one-piece screen rows (bf16 q)
    if tiles == TILES:
        _check_unprunable_groups_go_straight_to_dense(inp, cfg)
    # τ from the seed kernel and the radix search = the twin's K-th seed score
    from pallas_kernels.seeds import group_seed_lists
    from pallas_kernels.scoring import score_reference
    lists, cnt, _ = group_seed_lists(inp.lo, inp.hi, 8, *pipeline.seed_sizes(cfg), TILES.BK)
    member = np.zeros((8, 1500), bool)
    for g in range(2):
        for e in np.asarray(lists)[g, 0, :int(cnt[g, 0])]:
            for b in range(4):
                member[4 * g + b, e & ((1 << 27) - 1)] |= bool((e >> 27) >> b & 1)
    twin = score_reference(mma_pieces(inp.q), inp.w, mma_pieces(inp.k), inp.k_scale)
    tau_twin = records.kth_order_key_reference(twin, jnp.asarray(member), cfg.top_k)
    from dosa_jax.selection import key_to_score
    np.testing.assert_allclose(np.asarray(key_to_score(det["tau_key"])),
                               np.asarray(key_to_score(tau_twin)), rtol=1e-5)


def test_default_tiles_dosa_equals_dense_bitwise():
    """The default tiles (128-key refinement tiles, widened FP8 keys): DoSA ==
    dense bitwise in interpret mode too (there the refinement keeps the dense tiles: XLA's CPU
    dot may sum a 128-row tile in another order; this failed before that rule)."""
    inp = _bitwise_inputs()
    cfg = BITWISE_CFG
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    idx, sc, st = pipeline.dosa_topk(*args, cfg, splits=2)
    didx, dsc = pipeline.dense_topk(*args, cfg, splits=2)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    assert int(jnp.sum(st.pruning)) > 0 and int(jnp.sum(st.recoveries)) == 0


def test_seeded_dense_scan_equals_dense_bitwise():
    """The dense scan started at θ₀ = the K-th seed score: same answer bitwise, fewer records
    appended (the anchor test's inputs, tiles and kernels; T = 6 also pads a group)."""
    inp = _bitwise_inputs()
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    cfg = BITWISE_CFG
    for T in (8, 6):
        a = tuple(x[:T] if x.shape[0] == 8 else x for x in args)
        didx, dsc, dc = pipeline.dense_topk(*a, cfg, tiles=TILES_KC, splits=2, seeded=False,
                                            return_candidates=True)
        sidx, ssc, sc_ = pipeline.dense_topk(*a, cfg, tiles=TILES_KC, splits=2, seeded=True,
                                             return_candidates=True)
        np.testing.assert_array_equal(np.asarray(sidx), np.asarray(didx))
        np.testing.assert_array_equal(np.asarray(ssc), np.asarray(dsc))
        # θ₀ really started above −∞: fewer records appended, and never above τ*
        assert int(jnp.sum(sc_.appended)) < int(jnp.sum(dc.appended))
        from dosa_jax.selection import order_key
        kth = np.asarray(order_key(dsc[:, -1]))
        assert np.all(np.asarray(sc_.theta).min(axis=1) <= kth)


def test_anchor_and_hint_witnesses_keep_dosa_equal_to_dense():
    """Anchors (every 4th query answered densely first) and user hints (duplicates, negative,
    out-of-range and invisible ids) only add witnesses: DoSA == dense bitwise, τ is at least
    the layout seeds' τ (twin) and the τ of a query that is its group's anchor is its τ*.
    (That witnesses lower survival is checked on the reference backend, tests/test_api.py.)"""
    from pallas_kernels import seeds
    from dosa_jax.selection import key_to_score
    # the bitwise test's inputs and tiles (shared interpret-mode compilations); anchors 0, 2, 4, 6
    inp = _bitwise_inputs()
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    cfg = BITWISE_CFG.replace(anchor_stride=2)
    didx, dsc = pipeline.dense_topk(*args, cfg, tiles=TILES_KC, splits=2)
    hint = jnp.concatenate([didx[::-1, :40], jnp.full((8, 3), -5, jnp.int32),
                            jnp.full((8, 2), 1500 + 7, jnp.int32),
                            jnp.full((8, 2), 2 ** 30, jnp.int32)], axis=1)
    idx, sc, st = pipeline.dosa_topk(*args, cfg, tiles=TILES_KC, splits=2, hint=hint)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    assert int(jnp.sum(st.pruning)) >= 6
    lists, cnt, _ = seeds.group_seed_lists(inp.lo, inp.hi, 8, *pipeline.seed_sizes(cfg),
                                           TILES_KC.BK)
    twin = seeds.seed_scores_reference(mma_pieces(inp.q), inp.w, mma_pieces(inp.k), inp.k_scale,
                                       lists, cnt)
    tau0 = np.asarray(key_to_score(seeds.kth_largest_keys(twin, 32)[0]))
    ok = np.asarray(st.pruning)
    assert np.all(np.asarray(st.tau_seed)[ok] >= tau0[ok] - 1e-5 * (1 + np.abs(tau0[ok])))
    assert np.sum(np.asarray(st.tau_seed)[ok] > tau0[ok] + 1e-3) >= 4    # witnesses raised τ
    anchors = ok[::4]     # a group takes its first query's anchor: queries 0 and 4 get their own
    assert anchors.sum() == 2
    np.testing.assert_array_equal(np.asarray(st.tau_seed)[::4][anchors],
                                  np.asarray(dsc)[::4, -1][anchors])


def test_block_witnesses_keep_dosa_equal_to_dense():
    """Block witnesses on the kernels (the block means ranked by the dense kernel, a group
    of 4 taking its queries' union): DoSA == dense bitwise, τ never below the seeds' τ
    without them, raised on some query; the ranked blocks are the reference ranking's
    wherever the two scorers' block-mean scores are not within rounding of each other."""
    from dosa_jax import witnesses
    from dosa_jax.dense import dense_topk_reference
    inp = _bitwise_inputs()
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    cfg = BITWISE_CFG.replace(block_witnesses=128, witness_block=32)
    didx, dsc = pipeline.dense_topk(*args, BITWISE_CFG, tiles=TILES_KC, splits=2)
    _, _, st0 = pipeline.dosa_topk(*args, BITWISE_CFG, tiles=TILES_KC, splits=2)
    idx, sc, st = pipeline.dosa_topk(*args, cfg, tiles=TILES_KC, splits=2)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    ok = np.asarray(st.pruning) & np.asarray(st0.pruning)
    t0, t1 = np.asarray(st0.tau_seed)[ok], np.asarray(st.tau_seed)[ok]
    assert ok.sum() >= 6 and np.all(t1 >= t0) and np.any(t1 > t0 + 1e-3)
    got = pipeline.best_blocks(*args, cfg, tiles=TILES_KC)
    want = witnesses.best_blocks(dense_topk_reference, *args, cfg)
    same = np.mean([set(a.tolist()) == set(b.tolist()) for a, b in zip(np.asarray(got),
                                                                         np.asarray(want))])
    assert got.shape == (8, 4) and same >= 0.75, same
    # a group's witnesses: every key of its group_blocks, each once
    from pallas_kernels.seeds import group_blocks, group_witnesses
    wit = np.asarray(group_witnesses(8, blocks=got, block=32, n_keys=1500))
    gb = np.asarray(group_blocks(got, 8))
    for g in range(2):
        keys = sorted(i for b in gb[g] if b >= 0 for i in range(32 * b, min(32 * b + 32, 1500)))
        assert sorted(int(i) for i in wit[g] if i >= 0) == keys


DENSE_ROW_CHUNKS = {"chunks_of_1": (1, 64), "chunks_of_4": (4, 64),
                    "chunked_below_the_limit": (2, 3), "whole_call_above_it": (4, 1)}
#: the dense-rows test's rows: groups 0, 2 and the ragged 5 of T = 22 queries
DENSE_ROWS = np.isin(np.arange(22), [0, 1, 2, 3, 8, 9, 10, 11, 20, 21])


@functools.lru_cache(maxsize=None)
def _dense_rows_answers():
    """The dense-rows test's inputs, the dense scan's answer, and ``pipeline.dense_rows``
    under every chunking of DENSE_ROW_CHUNKS, with DENSE_ROWS chosen and with no row chosen:
    one program (every chunking compiled together), called with either choice of rows."""
    inp = synthetic.structured(T=22, N=900, H=4, D=32, seed=5, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    cfg = Config(top_k=16)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    T, K = 22, 16
    start = (jnp.full((T,), pipeline.THETA_NONE, jnp.int32), jnp.full((T, K), 7, jnp.int32),
             jnp.full((T, K), 0.5, jnp.float32), jnp.full((T,), -3, jnp.int32))

    def every_chunking(rows, theta, idx0, sc0, rec0, q, k, w, k_scale, lo, hi):
        keyside = pipeline.key_side(k, k_scale, TILES)
        return {name: pipeline.dense_rows(rows, theta, idx0, sc0, rec0, q, w, k, k_scale, lo,
                                          hi, K=K, tiles=TILES, interpret=None,
                                          keyside=keyside, chunk_groups=chunk,
                                          chunked_max=chunked_max)
                for name, (chunk, chunked_max) in DENSE_ROW_CHUNKS.items()}

    f = jax.jit(every_chunking)
    chosen = f(jnp.asarray(DENSE_ROWS), *start, *args)
    none = f(jnp.zeros(T, bool), *start, *args)
    dense_answer = jax.jit(lambda *a: pipeline.dense_topk(*a, cfg, tiles=TILES, splits=2))(*args)
    return start, dense_answer, chosen, none


@pytest.mark.parametrize("name", list(DENSE_ROW_CHUNKS))
def test_dense_rows_replace_only_the_chosen_groups(name):
    """The chosen groups' rows (gathered ``chunk`` groups per dense scan, some chunks partly
    empty, a ragged last group; or, above ``chunked_max`` groups, one scan of the whole call)
    are the dense Top-K from θ₀ with their record counts; the other rows are left as they
    were."""
    (_, idx0, sc0, rec0), (didx, dsc), chosen, none = _dense_rows_answers()
    K, rows = 16, DENSE_ROWS
    idx, sc, n = (np.asarray(x) for x in chosen[name])
    np.testing.assert_array_equal(idx[rows], np.asarray(didx)[rows])
    np.testing.assert_array_equal(sc[rows], np.asarray(dsc)[rows])
    assert np.all(idx[~rows] == 7) and np.all(sc[~rows] == 0.5) and np.all(n[~rows] == -3)
    assert np.all(n[rows] >= K)          # every visible key scanned from no threshold
    # nothing chosen: nothing scanned, nothing changed
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(none[name], (idx0, sc0, rec0)))


def test_group_blocks_keep_the_best_ranks_first():
    """A group's blocks: distinct, rank-interleaved over its 4 queries, cut at twice one
    query's count; −1 blocks and padded queries add nothing."""
    from pallas_kernels.seeds import group_blocks
    blocks = np.array([[5, 1, 9], [5, 2, 8], [6, 1, -1], [7, 3, 4],
                       [0, 1, 2], [0, 1, 2], [-1, -1, -1], [2, 0, 1],
                       [11, 12, 13]], np.int32)            # 9 queries: 3 groups, the last padded
    got = np.asarray(group_blocks(jnp.asarray(blocks), 12))
    assert got.shape == (3, 6)
    np.testing.assert_array_equal(got[0], [5, 6, 7, 1, 2, 3])    # rank 0, then rank 1, cut
    np.testing.assert_array_equal(got[1], [0, 2, 1, -1, -1, -1])
    np.testing.assert_array_equal(got[2], [11, 12, 13, -1, -1, -1])
    wide = np.asarray(group_blocks(jnp.asarray(blocks), 12, share=4))
    np.testing.assert_array_equal(wide[0], [5, 6, 7, 1, 2, 3, 9, 8, 4, -1, -1, -1])


def test_group_witnesses_follow_their_queries():
    """Anchor Top-K rows go to the groups whose first query they precede (stride not a multiple
    of 4 included); hints are unioned per group without repeats."""
    from pallas_kernels.seeds import group_witnesses
    anchor = jnp.arange(5)[:, None] * 100 + jnp.arange(3)[None, :]      # anchors 0, 6, 12, 18, 24
    w = np.asarray(group_witnesses(28, anchor_topk=anchor, anchor_stride=6))
    assert [int(r[0]) // 100 for r in w] == [(4 * g) // 6 for g in range(7)]
    hint = jnp.asarray([[5, 5, -1], [7, 5, 3], [9, 9, 9], [1, 2, 3], [4, 4, 4]], jnp.int32)
    w = np.asarray(group_witnesses(8, hint=hint, anchor_topk=anchor[:2], anchor_stride=6))
    assert sorted(int(x) for x in w[0] if x >= 0) == [0, 1, 2, 3, 5, 7, 9]
    assert sorted(int(x) for x in w[1] if x >= 0) == [0, 1, 2, 4]
    assert group_witnesses(8) is None


def test_compact_front_equals_a_stable_sort_by_keep():
    from pallas_kernels.seeds import compact_front
    rng = np.random.default_rng(8)
    vals = rng.integers(0, 1 << 30, (5, 37)).astype(np.int32)
    keep = rng.random((5, 37)) < np.array([[0.0], [1.0], [0.5], [0.1], [0.9]])
    got = np.asarray(compact_front(jnp.asarray(np.where(keep, vals, -1)), jnp.asarray(keep)))
    order = np.argsort(~keep, axis=1, kind="stable")
    want = np.take_along_axis(np.where(keep, vals, -1), order, axis=1)
    np.testing.assert_array_equal(got, want)


def test_group_seed_lists_with_witnesses_count_each_visible_key_once():
    """Witnesses already in the layout or seen by no query are dropped; every query's entries
    are distinct visible keys, and each visible witness is among them."""
    from pallas_kernels.seeds import distinct_rows, group_seed_lists
    rng = np.random.default_rng(2)
    T, N = 12, 5000
    hi = np.r_[np.arange(4000, 4004), np.arange(200, 204), [0, 3000, 4500, 4999]].astype(np.int32)
    lo = np.r_[np.zeros(8), [0, 2000, 100, 4000]].astype(np.int32)
    raw = np.concatenate([rng.integers(-3, N + 5, (3, 300)), np.tile(np.arange(0, 600, 7), (3, 1))],
                         axis=1)
    # under jax.jit: one program each instead of ~100 small ones op by op (shapes of this test)
    wit = jax.jit(distinct_rows)(jnp.asarray(raw, jnp.int32))
    lists, cnt, seeds = jax.jit(group_seed_lists, static_argnums=(2, 3, 4, 5, 6))(
        jnp.asarray(lo), jnp.asarray(hi), T, 256, 16, 160, 32, wit)
    lists, cnt, seeds, wit = map(np.asarray, (lists, cnt, seeds, wit))
    for t in range(T):
        g, b = divmod(t, 4)
        e = lists[g, 0, :cnt[g, 0]]
        e = e[e >= 0]
        ids = e[(e >> 27) >> b & 1 == 1] & ((1 << 27) - 1)
        assert len(ids) == len(set(ids.tolist())) == seeds[t]
        assert np.all((ids >= lo[t]) & (ids < hi[t]))
        w = wit[g][(wit[g] >= lo[t]) & (wit[g] < hi[t])]
        assert set(w.tolist()) <= set(ids.tolist())


def test_seed_scores_equal_dense_kernel_scores_bitwise():
    """Every seed score is the dense kernel's score of that (query, key), bit for bit (so τ is
    the K-th largest of the scores the screen and refinement are judged by); the twin agrees
    to the scorer bound; slots a query does not see hold INT32_MIN."""
    from dosa_jax.selection import order_key
    from pallas_kernels import seeds
    inp = synthetic.gaussian(T=7, N=300, H=4, D=32, seed=3, key_dtype="float8_e4m3fn",
                             query_dtype="bfloat16")
    lo = jnp.asarray([0, 0, 40, 0, 0, 0, 0], jnp.int32)        # group 0 sees different ranges
    hi = jnp.asarray([300, 299, 298, 0, 300, 250, 300], jnp.int32)
    ops = dense.prepare_operands(inp.q, inp.w, inp.k, inp.k_scale, 4, layout=TILES.layout)
    # the (integer) list builder under jax.jit: one program instead of ~100 small ones
    lists, cnt, _ = jax.jit(seeds.group_seed_lists, static_argnums=(2, 3, 4, 5, 6))(
        lo, hi, 8, 96, 8, 48, TILES.BK)
    got = np.asarray(seeds.seed_scores(ops, lists, cnt, tiles=TILES))
    # the dense kernel with K = N returns every visible key's kernel score
    didx, dsc = dense.dense_topk(inp.q, inp.k, inp.w, inp.k_scale, lo, hi, Config(top_k=300),
                                 tiles=TILES, splits=2)
    full = np.full((7, 300), np.iinfo(np.int32).min, np.int32)
    for t in range(7):
        ok = np.asarray(didx[t]) >= 0
        full[t, np.asarray(didx[t])[ok]] = np.asarray(order_key(dsc[t]))[ok]
    e = np.asarray(lists)[:, 0, :]
    kid = e & ((1 << 27) - 1)
    seen = 0
    for t in range(7):
        g, b = divmod(t, 4)
        for j in range(e.shape[1]):
            sees = j < int(cnt[g, 0]) and e[g, j] >= 0 and (e[g, j] >> 27) >> b & 1
            want = full[t, kid[g, j]] if sees else np.iinfo(np.int32).min
            assert got[t, j] == want, (t, j)
            seen += bool(sees)
    assert seen > 400
    twin = seeds.seed_scores_reference(mma_pieces(inp.q), inp.w, mma_pieces(inp.k), inp.k_scale,
                                       lists, cnt)
    from dosa_jax.selection import key_to_score
    np.testing.assert_allclose(np.asarray(key_to_score(jnp.asarray(got))),
                               np.asarray(key_to_score(twin)), rtol=1e-5, atol=1e-6)


def test_kth_largest_keys_radix_search():
    """The radix descent and its kernel (the bitwise descent) return the K-th largest eligible
    order key (ties, extremes, INT32_MIN entries, rows with fewer than K eligible ->
    THETA_NONE), for several digit widths."""
    from pallas_kernels.seeds import kth_largest_keys, kth_largest_keys_kernel
    rng = np.random.default_rng(0)
    lo32, hi32 = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    rows = [rng.integers(lo32, hi32, 64, dtype=np.int64),
            np.full(64, 7), np.r_[np.full(60, lo32), np.arange(4)],
            np.r_[np.full(32, hi32), np.full(32, lo32 + 1)],
            rng.integers(-3, 3, 64), np.full(64, lo32),
            np.r_[rng.integers(lo32, hi32, 40, dtype=np.int64), np.full(24, lo32)]]
    keys = jnp.asarray(np.stack(rows).astype(np.int32))
    for k in (1, 5, 32, 40, 64):
        want = []
        for r in np.asarray(keys):
            el = np.sort(r[r != lo32])[::-1]
            want.append(el[k - 1] if len(el) >= k else THETA_NONE)
        for bits in (1, 4, 8, "kernel"):
            kth, count = (kth_largest_keys_kernel(keys, k) if bits == "kernel" else
                          kth_largest_keys(keys, k, bits=bits))
            np.testing.assert_array_equal(np.asarray(kth), np.asarray(want, np.int32))
            np.testing.assert_array_equal(np.asarray(count), np.sum(np.asarray(keys) != lo32, 1))
    # rows not a power of two wide (the kernel masks its block's tail as ineligible)
    odd = keys[:, :40]
    for k in (1, 17, 40):
        np.testing.assert_array_equal(np.asarray(kth_largest_keys_kernel(odd, k)[0]),
                                      np.asarray(kth_largest_keys(odd, k)[0]))


OVERFLOW_TILES = {"one_slice": TILES,
                  "three_slices_packed_masks": TILES._replace(refine_slices=3, screen_pack=True)}


@functools.lru_cache(maxsize=None)
def _overflow_answers():
    """The overflow test's inputs and, in one program (compiled together), DoSA under each of
    OVERFLOW_TILES and the dense scan."""
    inp = synthetic.gaussian(T=8, N=700, H=4, D=32, seed=1)
    cfg = Config(top_k=32, retained_heads=2, seed_size=64, capacity=16,   # lists overflow
                 dense_switch=float("inf"))
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    with pytest.MonkeyPatch.context() as mp:   # screen although the sample predicts overflows
        mp.setattr(pipeline, "DIRECT_LIST_USE", float("inf"))
        mp.setattr(pipeline, "DIRECT_SURVIVAL", 2.0)
        *runs, dense_answer = jit_dosa_details_many(
            args, [(cfg, dict(tiles=t, splits=2)) for t in OVERFLOW_TILES.values()],
            dense=(cfg, dict(tiles=TILES, splits=2)))
    return inp, dict(zip(OVERFLOW_TILES, runs)), dense_answer


@pytest.mark.parametrize("name", list(OVERFLOW_TILES))
def test_dosa_overflow_recovers_exactly(name):
    """float32 inputs (two bf16 pieces each) and survivor lists too small: exact via recovery
    (also with each list refined in three slices, the recovery then scanning in as many
    splits, and the screen's masks packed two groups per byte)."""
    inp, runs, (didx, dsc) = _overflow_answers()
    idx, sc, st, det = runs[name]
    assert int(jnp.sum(st.overflows)) > 0
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    assert int(jnp.sum(st.recoveries)) > 0
    assert int(jnp.sum(st.pruning)) > 0
    assert_screening_bound_holds_on_every_key(inp, det)      # two-piece screen rows (float32 q)


def test_refine_slices_and_launch_order_match_twin():
    """The refinement kernel on hand-made survivor lists (one empty, one shorter than a tile,
    long ones that compact their records, lists of splits of different lengths): cut into 1,
    2 or 3 slices per list, launched in list order, longest first or outliers first, the
    selections agree bitwise with each other and with the twin's up to the scorer's
    rounding."""
    from pallas_kernels.refine import launch_order, refine, refine_reference
    from pallas_kernels.scoring import score_reference
    from pallas_kernels.common import ID_BITS
    from dosa_jax.selection import key_to_score, order_key
    inp = synthetic.structured(T=8, N=600, H=8, D=16, seed=11, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    K, S, Cl = 16, 2, 320
    tiles = TILES._replace(layout="kc", refine_bk=0)
    ops = dense.prepare_operands(inp.q, inp.w, inp.k, inp.k_scale, 4, layout="kc")
    rng = np.random.default_rng(5)
    lists = np.full((2, S, Cl), -1, np.int32)
    count = np.zeros((2, S), np.int32)
    member = np.zeros((8, 600), bool)
    sizes = {(0, 0): 0, (0, 1): 9, (1, 0): 290, (1, 1): 150}
    for (g, s), n in sizes.items():
        ids = np.sort(rng.choice(np.arange(300 * s, 300 * s + 300), n, replace=False))
        bits = rng.integers(1, 16, n)
        lists[g, s, :n] = ids | (bits << ID_BITS)
        count[g, s] = n
        for b in range(4):
            member[4 * g + b, ids[(bits >> b) & 1 == 1]] = True
    twin = score_reference(mma_pieces(inp.q), inp.w, mma_pieces(inp.k), inp.k_scale)
    # thresholds: none for two queries, else between two member scores near the 40th largest
    # (away from every score: kernel and twin round differently)
    th = np.full(8, THETA_NONE, np.int32)
    for t in (1, 2, 4, 6, 7):
        sc = np.sort(np.asarray(twin)[t][member[t]])[::-1]
        j = min(39, len(sc) - 2)
        th[t] = int(order_key(jnp.float32((sc[j] + sc[j + 1]) / 2)))
    theta0 = jnp.asarray(th)
    ridx, rsc = refine_reference(twin, jnp.asarray(member),
                                 jnp.where(theta0 == THETA_NONE, -jnp.inf, key_to_score(theta0)),
                                 K)
    # longest first: the (group, split) lists by descending length, ties in list order
    np.testing.assert_array_equal(np.asarray(launch_order(jnp.asarray(count), "longest")),
                                  [2, 3, 1, 0])
    np.testing.assert_array_equal(np.asarray(launch_order(jnp.asarray(count), "list")),
                                  [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(launch_order(jnp.asarray(count), "auto")),
                                  [2, 3, 1, 0])             # few lists: longest first
    many = jnp.arange(2000) % 7
    np.testing.assert_array_equal(np.asarray(launch_order(many, "auto")), np.arange(2000))
    # outliers first: the lists above twice the mean (56.5: 290 and 150), longest first, then
    # the rest in list order
    np.testing.assert_array_equal(
        np.asarray(launch_order(jnp.asarray([0, 9, 1, 1, 150, 290, 0, 1]), "outliers")),
        [5, 4, 0, 1, 2, 3, 6, 7])
    first = None
    for R, order in ((1, "list"), (2, "longest"), (3, "outliers"), (3, "list")):
        cand = refine(ops, jnp.asarray(lists), jnp.asarray(count), theta0, K, capacity=48,
                      tiles=tiles._replace(refine_order=order, refine_slices=R))
        assert cand.key.shape == (8, S * R, 48)
        idx, sc = records.select_from_records(cand.key, cand.ids, cand.count, K)
        _assert_topk_close(idx, sc, ridx, rsc)
        if first is None:
            first = (idx, sc)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(first[0]))
        np.testing.assert_array_equal(np.asarray(sc), np.asarray(first[1]))
        # every member key at or above θ₀ was scored once: appends count them (before any
        # compaction drops one), so no slice skipped or repeated an entry
        ok = member & ~(np.asarray(twin) < np.asarray(
            jnp.where(theta0 == THETA_NONE, -jnp.inf, key_to_score(theta0)))[:, None])
        assert np.all(np.asarray(cand.appended).sum(1) >= np.minimum(ok.sum(1), K))
    with pytest.raises(ValueError, match="slices"):
        refine(ops, jnp.asarray(lists), jnp.asarray(count), theta0, K,
               tiles=tiles._replace(refine_slices=0))


def test_predicted_list_use_is_the_groups_sample_union_times_its_range():
    """Group 0's queries keep disjoint sample positions (union 8 of 8), group 1's the same two
    (2 of 8); an empty query and invalid samples do not count; padding to whole groups."""
    kept = np.zeros((7, 8), bool)
    for t in range(4):
        kept[t, 2 * t:2 * t + 2] = True
    kept[4:7, 3:5] = True
    valid = np.ones((7, 8), bool)
    valid[6, :] = False
    lo = jnp.asarray([0, 10, 20, 30, 100, 100, 5], jnp.int32)
    hi = jnp.asarray([200, 210, 220, 230, 300, 340, 5], jnp.int32)   # query 6: empty
    use = pipeline.predicted_list_use(jnp.asarray(kept), jnp.asarray(valid), lo, hi, 8)
    np.testing.assert_allclose(np.asarray(use), [1.0 * 230, 0.25 * 240])
    # end to end: with no room predicted every pruning group goes straight to dense, exactly
    inp = _bitwise_inputs()
    cfg = BITWISE_CFG
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "DIRECT_LIST_USE", 0.0)
        idx, sc, st, det = pipeline.dosa_topk(*args, cfg, tiles=TILES, splits=2,
                                              return_details=True)
    didx, dsc = pipeline.dense_topk(*args, cfg, tiles=TILES, splits=2)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    assert bool(jnp.all(det["direct"])) and int(jnp.sum(st.recoveries)) == 8
    assert int(jnp.sum(st.overflows)) == 0


def test_dosa_waves_equal_one_wave_bitwise():
    """Queries in waves (lists, plan and records of one wave live at a time): same answer,
    padded tail wave (T=6, waves of 4) included; per-query stats unchanged except
    ``records`` (appends between online-threshold compactions depend on the scan schedule)."""
    inp = synthetic.structured(T=6, N=400, H=8, D=16, seed=7, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    cfg = Config(top_k=16, retained_heads=6, seed_size=64, dense_switch=float("inf"))
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    # one wave and waves of 4 in one program under jax.jit (op by op, these shapes alone
    # compiled ~700 small programs; the two pipelines compile together in about the time of
    # one and a half)
    one, many = jax.jit(lambda *a: (
        pipeline.dosa_topk(*a, cfg, tiles=TILES, splits=1, wave=8),
        pipeline.dosa_topk(*a, cfg, tiles=TILES, splits=1, wave=4)))(*args)
    for a, b in zip(one[:2], many[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for f in one[2]._fields:
        if f != "records":
            np.testing.assert_array_equal(np.asarray(getattr(one[2], f)),
                                          np.asarray(getattr(many[2], f)), err_msg=f)
    assert one[0].shape == (6, 16)
    assert int(jnp.sum(one[2].pruning)) > 0 and int(jnp.sum(one[2].recoveries)) == 0


def test_wave_size_bounds_survivor_lists():
    for T, N in ((16384, 1 << 20), (16384, 1 << 17), (64, 4096), (5, 100)):
        Tw = pipeline.wave_size(T, N)
        assert Tw % 4 == 0 and Tw <= max(256, -(-T // 4) * 4)
        S = dense.default_splits(Tw, N, 4, 64)
        Cs = pipeline.survivor_capacity(N, Tw, S, 2048)
        assert (Tw // 4) * S * Cs * 4 <= 1.01 * (1 << 30) or Tw == 256
    assert pipeline.wave_size(16384, 1 << 20) == 2048


def test_operand_pieces_represent_float32():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 32)), jnp.float32)
    p = mma_pieces(x)
    assert p.shape[0] == 2
    err = jnp.abs(x - (p[0].astype(jnp.float32) + p[1].astype(jnp.float32)))
    assert float(jnp.max(err / jnp.abs(x))) <= 2.0 ** -16


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("tiles", [
    dense.Tiles(BK=64, num_stages=2, layout="hk", screen_layout="hk", refine_bk=0), dense.Tiles(),
    dense.Tiles(BK=128, num_stages=3, layout="kh", screen_layout="kh", screen_bq=8, refine_bk=0),
    dense.Tiles(widen_fp8=False), dense.Tiles(refine_bk=0)],
    ids=["hk", "default", "kh_bq8", "fp8_in_kernel", "refine_bk64"])
def test_gpu_dense_and_dosa_bitwise_and_vs_twin(tiles):
    inp = synthetic.structured(T=256, N=32768, H=32, D=128, seed=5, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    cfg = Config(top_k=2048, dense_switch=float("inf"))     # the screening path
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    idx, sc, st = jax.jit(lambda *a: pipeline.dosa_topk(*a, cfg, tiles=tiles))(*args)
    didx, dsc = jax.jit(lambda *a: pipeline.dense_topk(*a, cfg, tiles=tiles))(*args)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    ridx, rsc = dense.dense_topk_reference(*args, cfg)
    _assert_topk_close(didx, dsc, ridx, rsc, tol=1e-3)
    # several waves (the long-context layout) give the same answer
    widx, wsc, _ = jax.jit(lambda *a: pipeline.dosa_topk(*a, cfg, tiles=tiles, wave=64))(*args)
    np.testing.assert_array_equal(np.asarray(widx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(wsc), np.asarray(dsc))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_widened_fp8_keys_score_bitwise_as_in_kernel_conversion():
    """fp8 keys widened to bf16 before the kernels (the default) give the very scores of
    fp8 tiles converted inside the kernel: the same bf16 operand values, the same MMA."""
    inp = synthetic.structured(T=64, N=8192, H=32, D=128, seed=6, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    cfg = Config(top_k=512)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    out = [jax.jit(lambda *a, t=t: dense.dense_topk(*a, cfg, tiles=t))(*args)
           for t in (dense.Tiles(), dense.Tiles(widen_fp8=False))]
    np.testing.assert_array_equal(np.asarray(out[0][0]), np.asarray(out[1][0]))
    np.testing.assert_array_equal(np.asarray(out[0][1]), np.asarray(out[1][1]))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_exact_topk_equals_reference():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 1 << 18), jnp.float32)
    x = x.at[:, ::101].set(jnp.nan)
    i, s = pselect.exact_topk(x, 2048)
    ri, rs = ref_exact_topk(x, 2048)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))


def test_theta_none_is_below_every_eligible_key():
    from dosa_jax.selection import order_key
    assert int(order_key(jnp.float32(-jnp.inf))) >= THETA_NONE


def test_bad_tiles_are_rejected_naming_the_field():
    inp = synthetic.gaussian(T=4, N=256, H=4, D=16, seed=0)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, Config(top_k=8))
    for bad, field in ((TILES._replace(layout="xy"), "tiles.layout"),
                       (TILES._replace(BK=8), "tiles.BK"),
                       (TILES._replace(BK=48), "tiles.BK"),
                       (TILES._replace(screen_bq=6), "tiles.screen_bq"),
                       (TILES._replace(screen_bk=24), "tiles.screen_bk"),
                       (TILES_KC._replace(refine_bk=24), "tiles.refine_bk"),
                       (TILES._replace(layout="hk", refine_bk=32), "tiles.refine_bk"),
                       (TILES._replace(screen_layout="rows"), "tiles.screen_layout"),
                       (TILES._replace(refine_slices=0), "tiles.refine_slices"),
                       (TILES._replace(refine_warps=3), "tiles.refine_warps"),
                       (TILES._replace(refine_stages=-1), "tiles.refine_stages"),
                       (TILES._replace(refine_order="random"), "tiles.refine_order"),
                       (TILES._replace(compact_chunk=1000), "tiles.compact_chunk"),
                       (TILES._replace(compact_chunk=8), "tiles.compact_chunk"),
                       (TILES._replace(compact_chunks=0), "tiles.compact_chunks"),
                       (TILES._replace(budget_share="group"), "tiles.budget_share")):
        with pytest.raises(ValueError, match=field):
            pipeline.dosa_topk(*args, tiles=bad)
    with pytest.raises(ValueError, match="tiles.BQ"):
        pipeline.dosa_topk(*args, tiles=TILES._replace(BQ=8))
    with pytest.raises(NotImplementedError, match="guided_witnesses"):
        pipeline.dosa_topk(*args[:-1], Config(top_k=8, guided_witnesses=4), tiles=TILES)
    with pytest.raises(ValueError, match="tiles.layout"):
        pipeline.dense_topk(*args, tiles=TILES._replace(layout="xy"))
