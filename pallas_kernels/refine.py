"""Refinement of survivors and seed scoring (Pallas Triton), and the jnp twin.

A program takes one refinement group (4 consecutive queries, paper Sec. 3)
and one split of its survivor list (``id | mask << 27``, ascending ids),
gathers ``BK`` surviving keys at a time by integer-array indexing, scores them
for all 4 queries with *the* scoring routine
(:func:`pallas_kernels.scoring.score_tile`, same tile shape as the dense
kernel, hence bitwise the same scores), and appends, for each query whose
mask bit is set, records with ``s ≥ τ`` (order key ≥ θ₀) to that query's
buffer with the online threshold of :mod:`pallas_kernels.records`. One key
load serves the 4 queries whenever the key survived for any of them.

The same kernel scores the seeds (``θ₀`` = none, ``final_threshold``): the
group's seed list is shared, the mask says which queries see each seed, and
the K-th largest seed score of each query (τ, Eq. 2) comes out as the final
threshold.

Backend: Triton (gather by integer arrays, ``cumsum``, masked stores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dosa_jax.selection import INT32_MIN
from pallas_kernels import records as rec
from pallas_kernels.common import (ID_BITS, ID_MASK, THETA_NONE, compiler_params,
                                   interpret_default, kernel_order_key, round_up)
from pallas_kernels.dense import Candidates, Operands, Tiles, capacity_for
from pallas_kernels.scoring import load_query_tile, score_tile

Array = jax.Array


def _refine_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, H: int, S: int, Cl: int, C: int,
                   K: int, pairs, final_threshold: bool, interpret: bool):
    q_refs = refs[:Pq]
    w_ref, th_ref, sv_ref, sn_ref = refs[Pq:Pq + 4]
    k_refs = refs[Pq + 4:Pq + 4 + Pk]
    sc_ref = refs[Pq + 4 + Pk]
    rk_ref, ri_ref, cnt_ref, tho_ref, app_ref = refs[Pq + 5 + Pk:]
    BQ, BK, CH = tiles.BQ, tiles.BK, tiles.CH
    g = pl.program_id(0)
    s = pl.program_id(1)
    size = rk_ref.shape[0]
    lsize = sv_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, g, BQ=BQ, H=H, layout=tiles.layout)
    theta0 = th_ref[pl.ds(g * BQ, BQ)]
    t_ids = g * BQ + jnp.arange(BQ, dtype=jnp.int32)
    base = (t_ids * S + s) * C
    lbase = (g * S + s) * Cl
    n_list = jnp.minimum(sn_ref[pl.ds(g * S + s, 1)], Cl)   # [1]
    lanes = jnp.arange(BK, dtype=jnp.int32)
    Dp = q_refs[0].shape[1]
    dcol = jnp.arange(Dp, dtype=jnp.int32)
    qsel = jnp.arange(BQ, dtype=jnp.int32)
    nchunk = (jnp.max(n_list) + BK - 1) // BK

    def tile(c, state):
        slot = c * BK + lanes
        valid = slot < n_list
        e = rec._plgpu().load(sv_ref.at[rec.masked_index(lbase + slot, valid, lsize)],
                              mask=valid, other=-1)
        valid = valid & (e >= 0)
        kid = jnp.where(valid, e & ID_MASK, 0)
        bits = jnp.where(valid, e >> ID_BITS, 0)
        # kid is clamped to 0 on invalid lanes: every gather address is in bounds
        kp = [k_ref[kid[:, None], dcol[None, :]] for k_ref in k_refs]
        scale = rec._plgpu().load(sc_ref.at[kid], mask=valid, other=1.0)
        sc = score_tile(qp, wv, kp, scale, BQ=BQ, H=H, pairs=pairs, layout=tiles.layout)
        key = kernel_order_key(sc)
        mine = ((bits[None, :] >> qsel[:, None]) & 1) != 0
        elig = mine & valid[None, :] & (key != INT32_MIN)
        idb = jnp.broadcast_to(kid[None, :], (BQ, BK))
        count, theta, strict = state
        count, n = rec.append(rk_ref, ri_ref, base, count, rec.theta_accept(theta, strict),
                              key, idb, elig, C=C, size=size)
        return (count, theta, strict), n

    state, appended = rec.scan_tiles(jnp.int32(0), nchunk, tile, theta0, rk_ref, ri_ref, base, K,
                                     C=C, BK=BK, CH=CH, size=size, interpret=interpret)
    count, theta, _ = state
    if final_threshold:
        rec.barrier(interpret)
        t = rec.kth_largest(rk_ref, base, count, K, CH=CH, size=size)
        theta = jnp.where(count >= K, jnp.maximum(theta, t), theta)
    oidx = t_ids * S + s
    cnt_ref[oidx] = count
    tho_ref[oidx] = theta
    app_ref[oidx] = appended


@functools.partial(jax.jit, static_argnames=("K", "capacity", "tiles", "final_threshold",
                                             "interpret", "T", "H", "pairs"))
def _refine_call(q, w, theta0, lists, list_count, k, scale, *, K, capacity, tiles,
                 final_threshold, interpret, T, H, pairs):
    G4, S, Cl = lists.shape
    Tpad = G4 * tiles.BQ
    C = capacity
    size = Tpad * S * C
    kern = functools.partial(_refine_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, H=H,
                             S=S, Cl=Cl, C=C, K=K, pairs=pairs, final_threshold=final_threshold,
                             interpret=interpret)
    i32 = jnp.int32
    rk, ri, cnt, th, app = pl.pallas_call(
        kern, grid=(G4, S),
        out_shape=(jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                   jax.ShapeDtypeStruct((Tpad * S,), i32), jax.ShapeDtypeStruct((Tpad * S,), i32),
                   jax.ShapeDtypeStruct((Tpad * S,), i32)),
        compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=interpret, name="dosa_refine")(
            *q, w, theta0, lists.reshape(-1), list_count.reshape(-1), *k, scale)
    return Candidates(rk.reshape(Tpad, S, C)[:T], ri.reshape(Tpad, S, C)[:T],
                      cnt.reshape(Tpad, S)[:T], th.reshape(Tpad, S)[:T],
                      app.reshape(Tpad, S)[:T])


def refine(ops: Operands, lists: Array, list_count: Array, theta0: Array, K: int, *,
           capacity=None, tiles: Tiles = Tiles(), final_threshold: bool = False,
           interpret=None) -> Candidates:
    """Score the keys of packed lists [G4, S, Cl] for their queries; keep order key ≥ θ₀.

    ``ops`` must be prepared with ``tiles.BQ == 4`` (the group size of the lists).
    """
    if tiles.BQ != 4:
        raise ValueError("refinement groups are 4 queries (tiles.BQ must be 4)")
    if interpret is None:
        interpret = interpret_default()
    T = ops.T
    Tpad = ops.q.shape[1] // ops.H
    if lists.shape[0] * 4 != Tpad:
        raise ValueError(f"internal: {lists.shape[0]} lists for {Tpad} padded queries")
    theta0 = jnp.pad(theta0.astype(jnp.int32), (0, Tpad - T), constant_values=THETA_NONE)
    C = capacity_for(K, tiles.BK, capacity)
    return _refine_call(ops.q, ops.w, theta0, lists, list_count, ops.k, ops.scale, K=K,
                        capacity=C, tiles=tiles, final_threshold=final_threshold,
                        interpret=interpret, T=T, H=ops.H, pairs=ops.pairs)


# ------------------------------------------------------------------ seed lists

def group_seed_lists(lo: Array, hi: Array, Tpad: int, size: int, sinks: int, local: int,
                     block: int):
    """Shared seed list of each group of 4 queries: sinks, strided middle, local window.

    Every entry is a distinct key in ascending order; its mask marks the queries
    of the group that see it. A query sees at least ``min(size, |Ω_t|)`` seeds
    when the group's ranges differ by at most ``64`` keys at either end (causal
    prefill: 3); otherwise it may see fewer (its τ is then −∞ if < K: no
    pruning, still exact).

    Returns:
      (packed [G4, 1, L] int32, count [G4, 1] int32, seeds per query [Tpad] int32).
    """
    T = lo.shape[0]
    lo = jnp.pad(lo, (0, Tpad - T))
    hi = jnp.pad(hi, (0, Tpad - T))
    G4 = Tpad // 4
    lo4, hi4 = lo.reshape(G4, 4), hi.reshape(G4, 4)
    ne = hi4 > lo4
    lo_min = jnp.min(jnp.where(ne, lo4, 2 ** 31 - 1), axis=1)
    hi_max = jnp.max(jnp.where(ne, hi4, 0), axis=1)
    hi_min = jnp.min(jnp.where(ne, hi4, 2 ** 31 - 1), axis=1)
    spread = 64
    a = min(sinks, size)
    b = min(local, size - a)
    c = size - a - b
    L = round_up(size + spread, block)
    j = jnp.arange(L, dtype=jnp.int32)[None, :]
    small = (hi_max - lo_min) <= L
    loc_start = jnp.maximum(hi_min - b, hi_max - b - spread)
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
    vis = (ids[:, None, :] >= lo4[:, :, None]) & (ids[:, None, :] < hi4[:, :, None]) & ok[:, None]
    bits = jnp.sum(vis.astype(jnp.int32) << jnp.arange(4, dtype=jnp.int32)[None, :, None], axis=1)
    keep = ok & (bits > 0)
    # compact kept entries to the front (keeps ascending order)
    order = jnp.argsort(~keep, axis=1, stable=True)
    packed = jnp.take_along_axis(jnp.where(keep, ids | (bits << ID_BITS), -1), order, axis=1)
    count = jnp.sum(keep, axis=1).astype(jnp.int32)
    seeds = jnp.sum(vis, axis=2).reshape(Tpad).astype(jnp.int32)
    return packed[:, None, :], count[:, None], seeds


def refine_reference(scores: Array, member: Array, theta0_scores: Array, K: int):
    """jnp twin of the refinement's function: Top-K over members with s ≥ θ₀.

    Args:
      scores: [T, N] (twin scorer); member: [T, N] bool (key in the query's list);
      theta0_scores: [T] float32 threshold.
    """
    from dosa_jax.selection import select_by_position
    ok = member & ~(scores < theta0_scores[:, None]) & ~jnp.isnan(scores)
    return select_by_position(scores, K, ok)
