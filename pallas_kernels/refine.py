"""Refinement of survivors (Pallas Triton), and the jnp twin.

A program takes one refinement group (4 consecutive queries, paper Sec. 3)
and one split of its survivor list (``id | mask << 27``, ascending ids),
gathers ``BK`` surviving keys at a time by integer-array indexing, scores them
for all 4 queries with *the* scoring routine
(:func:`pallas_kernels.scoring.score_tile`, same tile shape as the dense
kernel, hence bitwise the same scores), and appends, for each query whose
mask bit is set, records with ``s ≥ τ`` (order key ≥ θ₀) to that query's
buffer with the online threshold of :mod:`pallas_kernels.records`. One key
load serves the 4 queries whenever the key survived for any of them.

Programs take the lists in a launch order (:func:`launch_order`: the longest first when a
call has few lists, so that the long ones do not end the kernel alone) and may cut each list
into slices with their own record buffers (``Tiles.refine_slices``).

The seeds (τ, Eq. 2) are scored by :mod:`pallas_kernels.seeds` with the same
routine and list format, without record buffers.

Backend: Triton (gather by integer arrays, ``cumsum``, masked stores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dosa_jax.selection import INT32_MIN, select_by_position
from pallas_kernels import records as rec
from pallas_kernels.common import (THETA_NONE, compiler_params, interpret_default,
                                   kernel_order_key, unpack_entries)
from pallas_kernels.operands import Candidates, Operands, capacity_for
from pallas_kernels.scoring import load_query_tile, score_tile
from pallas_kernels.tiles import REFINE_ORDERS, Tiles

Array = jax.Array


def score_list_tile(sv_ref, start, slot, n_list, k_refs, sc_ref, qp, wv, *, tiles: Tiles, H: int,
                    pairs, lane_sums: bool):
    """Inside a kernel: gather the keys of list slots ``slot`` [BK] (entries at ``start + slot``,
    valid below ``n_list``) and score them for the group's BQ queries with the shared routine.

    Returns (key ids [BK], mine [BQ, BK]: the query sees the key, scores [BQ, BK]).
    """
    inl = slot < n_list
    e = rec._plgpu().load(sv_ref.at[rec.masked_index(start + slot, inl, sv_ref.shape[0])],
                          mask=inl, other=-1)
    valid, kid, bits = unpack_entries(e, inl)
    dcol = jnp.arange(k_refs[0].shape[1], dtype=jnp.int32)
    kp = [k_ref[kid[:, None], dcol[None, :]] for k_ref in k_refs]
    scale = rec._plgpu().load(sc_ref.at[kid], mask=valid, other=1.0)
    sc = score_tile(qp, wv, kp, scale, BQ=tiles.BQ, H=H, pairs=pairs, layout=tiles.layout,
                    lane_sums=lane_sums)
    qsel = jnp.arange(tiles.BQ, dtype=jnp.int32)
    mine = (((bits[None, :] >> qsel[:, None]) & 1) != 0) & valid[None, :]
    return kid, mine, sc


def _refine_kernel(*refs, Pq: int, Pk: int, tiles: Tiles, H: int, S: int, R: int, Cl: int,
                   C: int, K: int, pairs, lane_sums: bool, interpret: bool):
    q_refs = refs[:Pq]
    w_ref, th_ref, sv_ref, sn_ref, od_ref = refs[Pq:Pq + 5]
    k_refs = refs[Pq + 5:Pq + 5 + Pk]
    sc_ref = refs[Pq + 5 + Pk]
    rk_ref, ri_ref, cnt_ref, tho_ref, app_ref = refs[Pq + 6 + Pk:]
    BQ, BK, CH = tiles.BQ, tiles.BK, tiles.CH
    # program -> (list of group g, split s; by the launch order), slice r of that list
    pid = pl.program_id(0)
    gs = jnp.max(od_ref[pl.ds(pid // R, 1)])
    r = pid % R
    g = gs // S
    s = gs % S
    size = rk_ref.shape[0]
    qp, wv = load_query_tile(q_refs, w_ref, g, BQ=BQ, H=H, layout=tiles.layout)
    theta0 = th_ref[pl.ds(g * BQ, BQ)]
    t_ids = g * BQ + jnp.arange(BQ, dtype=jnp.int32)
    oidx = (t_ids * S + s) * R + r          # this slice's record buffer of each query
    base = oidx * C
    lbase = gs * Cl
    n_list = jnp.minimum(sn_ref[pl.ds(gs, 1)], Cl)   # [1]
    # slice r: entries [r·L, min((r+1)·L, n)) with L = ⌈n/R⌉ rounded up to whole tiles
    span = (((n_list + R - 1) // R + BK - 1) // BK) * BK
    first = r * span
    end = jnp.minimum(first + span, n_list)         # [1]
    lanes = jnp.arange(BK, dtype=jnp.int32)
    nchunk = (jnp.max(jnp.maximum(end - first, 0)) + BK - 1) // BK

    def tile(c, state):
        kid, mine, sc = score_list_tile(sv_ref, lbase, first + c * BK + lanes, end, k_refs,
                                        sc_ref, qp, wv, tiles=tiles, H=H, pairs=pairs,
                                        lane_sums=lane_sums)
        key = kernel_order_key(sc)
        elig = mine & (key != INT32_MIN)
        idb = jnp.broadcast_to(kid[None, :], (BQ, BK))
        count, theta, strict = state
        count, n = rec.append(rk_ref, ri_ref, base, count, rec.theta_accept(theta, strict),
                              key, idb, elig, C=C, size=size)
        return (count, theta, strict), n

    state, appended = rec.scan_tiles(jnp.int32(0), nchunk, tile, theta0, rk_ref, ri_ref, base, K,
                                     C=C, BK=BK, CH=CH, size=size, interpret=interpret)
    count, theta, _ = state
    cnt_ref[oidx] = count
    tho_ref[oidx] = theta
    app_ref[oidx] = appended


#: ``"outliers"``: a list longer than this many times the mean list is launched first.
OUTLIER_FACTOR = 2.0
#: ``"auto"``: longest first up to this many lists per call (about 4 per resident program
#: slot of a 132-SM GPU with 2 programs per SM), list order above: with many lists the
#: neighbouring groups' similar keys matter more than the long lists' tail.
AUTO_LONGEST_LISTS = 1024


def launch_order(list_count: Array, order: str) -> Array:
    """The (group, split) lists [G4·S] in launch order (the GPU starts programs about in id
    order): ``"list"`` as they come (neighbouring groups, which keep similar keys, run
    together); ``"longest"`` longest first, so that the long lists do not end the kernel
    alone; ``"outliers"`` the lists longer than :data:`OUTLIER_FACTOR` times the mean first
    (longest first), then the rest in list order; ``"auto"`` longest first for at most
    :data:`AUTO_LONGEST_LISTS` lists, else list order. Ties keep list order."""
    if order not in REFINE_ORDERS:
        raise ValueError(f"order must be one of {REFINE_ORDERS}, got {order!r}")
    n = list_count.reshape(-1).astype(jnp.int32)
    ids = jnp.arange(n.shape[0], dtype=jnp.int32)
    if order == "auto":
        order = "longest" if n.shape[0] <= AUTO_LONGEST_LISTS else "list"
    if order == "list":
        return ids
    if order == "outliers":
        mean = jnp.mean(n.astype(jnp.float32))
        n = jnp.where(n.astype(jnp.float32) > OUTLIER_FACTOR * mean, n, 0)
    return jnp.lexsort((ids, -n)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("K", "capacity", "tiles", "interpret", "T", "H", "pairs",
                                             "lane_sums", "R"))
def _refine_call(q, w, theta0, lists, list_count, k, scale, *, K, capacity, tiles,
                 interpret, T, H, pairs, lane_sums, R):
    G4, S, Cl = lists.shape
    Tpad = G4 * tiles.BQ
    C = capacity
    SR = S * R
    size = Tpad * SR * C
    kern = functools.partial(_refine_kernel, Pq=q.shape[0], Pk=k.shape[0], tiles=tiles, H=H,
                             S=S, R=R, Cl=Cl, C=C, K=K, pairs=pairs, lane_sums=lane_sums,
                             interpret=interpret)
    order = launch_order(jnp.minimum(list_count, Cl), tiles.refine_order)
    i32 = jnp.int32
    rk, ri, cnt, th, app = pl.pallas_call(
        kern, grid=(G4 * S * R,),
        out_shape=(jax.ShapeDtypeStruct((size,), i32), jax.ShapeDtypeStruct((size,), i32),
                   jax.ShapeDtypeStruct((Tpad * SR,), i32), jax.ShapeDtypeStruct((Tpad * SR,), i32),
                   jax.ShapeDtypeStruct((Tpad * SR,), i32)),
        compiler_params=compiler_params(tiles.refine_warps or tiles.num_warps,
                                        tiles.refine_stages or tiles.num_stages),
        interpret=interpret, name="dosa_refine")(
            *q, w, theta0, lists.reshape(-1), list_count.reshape(-1), order, *k, scale)
    return Candidates(rk.reshape(Tpad, SR, C)[:T], ri.reshape(Tpad, SR, C)[:T],
                      cnt.reshape(Tpad, SR)[:T], th.reshape(Tpad, SR)[:T],
                      app.reshape(Tpad, SR)[:T])


def refine(ops: Operands, lists: Array, list_count: Array, theta0: Array, K: int, *,
           capacity=None, tiles: Tiles = Tiles(), interpret=None) -> Candidates:
    """Score the keys of packed lists [G4, S, Cl] for their queries; keep order key ≥ θ₀.

    ``ops`` must be prepared with ``tiles.BQ == 4`` (the group size of the lists). Each list
    is cut into R = ``tiles.refine_slices`` consecutive slices of whole tiles, one program
    and one record buffer each: the candidates come as [T, S·R, C], buffer ``s·R + r``
    holding slice r of split s (ascending id ranges, as
    :func:`pallas_kernels.records.select_from_records` needs).
    """
    if tiles.BQ != 4:
        raise ValueError("refinement groups are 4 queries (tiles.BQ must be 4)")
    if interpret is None:
        interpret = interpret_default()
    R = tiles.refine_slices
    if R < 1:
        raise ValueError(f"tiles.refine_slices must be >= 1, got {R}")
    if tiles.refine_bk and not interpret:
        # on the GPU a kc score does not depend on the tile's key count (checked bitwise by the
        # GPU tests); interpret mode's dot (XLA on CPU) may sum in another order for another
        # tile height, so there the refinement keeps the dense kernel's tiles
        tiles = tiles._replace(BK=tiles.refine_bk)
    T = ops.T
    Tpad = ops.q.shape[1] // ops.H
    if lists.shape[0] * 4 != Tpad:
        raise ValueError(f"internal: {lists.shape[0]} lists for {Tpad} padded queries")
    theta0 = jnp.pad(theta0.astype(jnp.int32), (0, Tpad - T), constant_values=THETA_NONE)
    C = capacity_for(K, tiles.BK, capacity)
    return _refine_call(ops.q, ops.w, theta0, lists, list_count, ops.k, ops.scale, K=K,
                        capacity=C, tiles=tiles,
                        interpret=interpret, T=T, H=ops.H, pairs=ops.pairs,
                        lane_sums=ops.lane_sums, R=R)


def refine_reference(scores: Array, member: Array, theta0_scores: Array, K: int):
    """jnp twin of the refinement's function: Top-K over members with s ≥ θ₀.

    Args:
      scores: [T, N] (twin scorer); member: [T, N] bool (key in the query's list);
      theta0_scores: [T] float32 threshold.
    """
    ok = member & ~(scores < theta0_scores[:, None]) & ~jnp.isnan(scores)
    return select_by_position(scores, K, ok)
