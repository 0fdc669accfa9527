"""Certificate screening (Eq. 9, 26) as Pallas Triton kernels, and their jnp twins.

One shape serves all scoring stages (DESIGN §13): per program, ``BQs`` queries'
plan columns (``Rp`` per query: the retained heads with folded weights w̃_j,
then the negative-aggregate columns, zero columns to a power of two) are
multiplied against a key tile on the tensor cores — stacked into one
[BQs·Rp, D] matrix (layout ``"hk"``), one [BK, D]×[D, Rp] dot per query
(``"kh"``, keys as MMA rows) or one [BK, D]×[D, BQs·Rp] dot for all of them
(``"kc"``, the default and the fastest) — and the bound is
evaluated per (query, key) with *the scorer's epilogue*:

    Û = Σ_c w_c relu(y_c)                      (every column, aggregate ones included)
    U = α_i (Û + n_i·coef + ε_raw),  then nudged up by |U|·2^-21

with ``n_i ≥ ‖k̄_i‖`` and ``coef = E + C + C_kernel`` (the plan's residual and
error plus this backend's arithmetic, :mod:`pallas_kernels.numerics`). The
negative aggregate (Eq. 8) enters as ReLU columns with weights ±1
(:func:`aggregate_columns`): ``−relu(a·k) ≤ −relu(hi·k) + relu(−lo·k) + ‖e‖ n_i``
for ``a = hi + lo + e`` (ReLU is 1-Lipschitz), and the absolute form's
``−a·k`` (Eq. 25) as ``−relu(x) + relu(−x)`` per piece; so the screen sums one
kind of term, as the scorer does, instead of a second masked row sum for the
aggregate. With bf16 or FP8 queries the rows are one bf16 MMA piece
(the retained rows are exact; the aggregate is split into hi + lo, or by default
its hi alone, ``hi_only``, so r = 15 heads fit 16 columns; the
remainder e in ``coef``); float32 queries keep two pieces per row.

``defer`` (the default in :class:`pallas_kernels.tiles.Tiles`, ``"kc"`` tiles of at
most :data:`DEFER_COLUMNS` columns) software-pipelines the key loop by hand: tile
j's MMA is issued before tile j − 1's bound is evaluated from the carried
accumulator, so the wgmma runs during that epilogue (ptxas interleaves the two
before the wait).

``"kc"`` puts each query's columns where one thread holds them
(:func:`pallas_kernels.common.lane_aligned_order`, ``lane_sums``): a Hopper ``wgmma`` accumulator
gives thread ``t`` of a warp the columns ``8j + 2(t mod 4) + {0, 1}``, so the
query of column c is chosen by c's bits 1–2 (the lane within a quad) and one
high bit, and its Rp columns by bit 0 and the other high bits; the column sum
of a query is then additions inside one thread, with no shuffle.

A key is rejected only on ``U < τ`` (strict; NaN never rejects);
``prune = 0`` disables rejection for a query (τ = −∞ in the kernel). The
screen writes, for every refinement group of 4 queries (paper Sec. 3) and
every key of the program's tiles, one byte: the 4-bit mask of the group's
queries for which the key survived (:func:`screen_masks`; fixed positions, no
compaction, no atomics). :func:`compact_masks` then turns each group's bytes
into a survivor list ``id | mask << 27`` at ``count + cumsum − 1``
(deterministic, ascending ids); its count keeps growing past the list's
capacity, so an overflowing group is detected (never silently truncated) and
its queries are recovered exactly. The compaction is a separate kernel so that
none of its work (a cross-warp scan, layout conversions, scattered stores) sits
on the critical path of every key tile (almost every tile has a survivor).

Queries with similar budgets share tiles (paper Sec. 3):
:func:`pallas_kernels.pipeline.screen_by_budget` runs the screen kernel once
per budget class, each program in the class of its largest budget with ``Rp``
columns per query for that budget, all classes writing one mask buffer
(``masks_into``), then one compaction.

Backend: Triton (``cumsum``, masked stores at computed positions).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax import numerics as nm
from dosa_jax.tiling import round_up_to
from pallas_kernels import records as rec
from pallas_kernels.common import (GROUP, ID_BITS, column_sums, compiler_params, group_range,
                                   group_ranges,
                                   in_lane_order, interpret_default, keys_rows_dot,
                                   lane_sums_apply, next_pow2,
                                   pad_axis, piece_pairs, row_pieces, rows_keys_dot,
                                   split_key_tiles)

Array = jax.Array
#: Relative upward nudge of the final bound (covers the last roundings: α·v, the sum).
UP_NUDGE = 2.0 ** -21
#: Absolute upward floor after scaling (underflow of α·v).
UP_FLOOR = 2.0 ** -126
#: Widest "kc" screen tile (BQs·Rp columns) that ``defer`` pipelines: a second [BK, 256]
#: accumulator spills (255 registers, 1.9 KB of spills at 8 x 32 columns; standalone Triton 3.6)
DEFER_COLUMNS = 128
#: Queries per screening program whose masks can be packed (two groups of 4 per byte).
PACKED_QUERIES = 2 * GROUP
#: Keys per chunk of the compaction (the unit its offsets are computed for; the survivor
#: lists' splits are cut at chunk boundaries).
COMPACT_CHUNK = 2048
#: Chunks written by one compaction program (all loaded first; a power of two).
COMPACT_CHUNKS_PER_PROGRAM = 2
#: Chunks per program of the survivor count kernel (:func:`chunk_counts`; 0: XLA reduction).
COUNT_CHUNKS_PER_PROGRAM = 8


class ScreenOperands(NamedTuple):
    """Kernel-ready screening columns ([Pr, Tpad*Rp, Dp] pieces) and per-column/per-query
    vectors."""

    rows: Array        # [Pr, Tpad*Rp, Dp] MMA pieces (per program in the layout's column order)
    row_w: Array       # [Tpad*Rp] float32 column weights (w̃, ±1 aggregate, 0 padding)
    coef: Array        # [Tpad] float32
    eps: Array         # [Tpad] float32
    tau: Array         # [Tpad] float32 (−inf where the query does not prune)
    Rp: int
    BQs: int
    layout: str = "hk"
    lane_sums: bool = False


def screen_queries_per_program(Rp: int, T: int, layout: str = "hk", BQs=None) -> int:
    """Queries per screening program, a multiple of the group of 4.

    ``"hk"``: enough to fill ≥ 64 MMA rows. ``"kh"`` (one dot per query) and ``"kc"``
    (one dot for all queries): ``BQs`` (default 4); more queries share each key tile's load.
    """
    if BQs:
        if BQs % GROUP:
            raise ValueError(f"screen queries per program must be a multiple of {GROUP}, got {BQs}")
        return int(min(BQs, max(GROUP, next_pow2(T))))
    if layout in ("kh", "kc"):
        return max(GROUP, next_pow2(-(-16 // Rp)))
    bq = max(GROUP, next_pow2(max(1, 64 // Rp)))
    bq = min(bq, max(GROUP, next_pow2(T)))
    while bq * Rp < 16:
        bq *= 2
    return bq


def screen_rows(R: int, A: int, layout: str = "hk") -> int:
    """Columns per query in the screen's MMA: R retained + A aggregate, to a power of two
    (at least 16 in ``"kh"``, where one query's columns are the dot's N dimension)."""
    Rp = next_pow2(R + A)
    return max(Rp, 16) if layout == "kh" else Rp


def aggregate_column_count(split: bool, absolute: bool, hi_only: bool = False) -> int:
    """Aggregate columns per query (:func:`aggregate_columns`)."""
    return (2 if split and not hi_only else 1) * (2 if absolute else 1)


def aggregate_columns(aggregate: Array, linear: Array, *, split: bool, absolute: bool,
                      hi_only: bool = False):
    """The negative aggregate (Eq. 8, 25) as ReLU columns with weights ±1.

    The plan subtracts ``relu(a·k)`` (or ``a·k`` for queries in the absolute form,
    ``linear``) for one aggregate row a per query. With ``split`` (bf16/FP8 queries:
    the screen's rows are one bf16 piece) ``a = hi + lo + e`` with hi, lo exact in bf16
    and ``|e| ≤ 2^-16 |a|``; ReLU is 1-Lipschitz, so

        −relu(a·k) ≤ −relu(hi·k) + relu(−lo·k) + ‖e‖·‖k‖,

    and ``−x = −relu(x) + relu(−x)`` writes the absolute form's ``−a·k`` in ReLU
    columns too. Columns (``absolute`` adds the negated pieces; unused weights are 0):

    * split, basic: [hi, −lo] with [−1, +1];
    * split, absolute: [hi, −hi, lo, −lo] with [−1, +1, −1, +1] (linear) or [−1, 0, 0, +1];
    * no split: [a] with [−1]; absolute: [a, −a] with [−1, +1] (linear) or [−1, 0].

    Negation is exact, so every column is as exact in bf16 as its piece.

    ``hi_only`` (with ``split``): the hi piece alone, its remainder ``e = a − hi``
    (``|e| ≤ 2^-9 |a|``) charged as ‖e‖·‖k‖ — one column instead of two, so one more
    retained head fits the same power of two (r = 15 in 16 columns):

    * hi only, basic: [hi] with [−1]; absolute: [hi, −hi] with [−1, +1] (linear) or [−1, 0].

    Args:
      aggregate: [T, 1, D] float32; linear: [T] bool.
    Returns:
      (columns [T, A, D] float32, weights [T, A] float32, ‖e‖ upper bound [T] or None).
    """
    if aggregate.shape[1] != 1:
        raise ValueError(f"internal: one aggregate row per query expected, got {aggregate.shape}")
    a = aggregate[:, 0].astype(jnp.float32)
    lin = linear.astype(bool)
    one = jnp.ones(lin.shape, jnp.float32)
    err = None
    if split:
        hi = nm.rounded_to(a, jnp.bfloat16)      # (a bare astype round trip is dropped under jit)
        if hi_only:
            e = a - hi                                     # exact in float32
        else:
            lo = nm.rounded_to(a - hi, jnp.bfloat16)
            e = (a - hi) - lo                              # both subtractions exact in float32
        err = nm.inflate(nm.norm_upper(e), 2)
        if hi_only:
            cols, ws = ([hi, -hi], [-one, jnp.where(lin, 1.0, 0.0)]) if absolute else ([hi], [-one])
        elif absolute:
            cols = [hi, -hi, lo, -lo]
            ws = [-one, jnp.where(lin, 1.0, 0.0), jnp.where(lin, -1.0, 0.0), one]
        else:
            cols, ws = [hi, -lo], [-one, one]
    elif absolute:
        cols, ws = [a, -a], [-one, jnp.where(lin, 1.0, 0.0)]
    else:
        cols, ws = [a], [-one]
    return jnp.stack(cols, axis=1), jnp.stack(ws, axis=1).astype(jnp.float32), err


def prepare_screen(rows, row_w, agg_cols, agg_w, coef, eps, tau, prune, Dp: int, BQs=None,
                   single_piece: bool = False, layout: str = "hk", lane_sums: bool = False):
    """Stack retained and aggregate columns per query; pad to Rp columns, Dp, BQs queries.

    Args:
      rows: [T, R, D] float32; row_w: [T, R]; agg_cols: [T, A, D], agg_w: [T, A]
        (:func:`aggregate_columns`); coef, eps, tau: [T] float32; prune: [T] bool.
      single_piece: feed the columns as one bf16 piece (one MMA per key tile instead of
        two); ``coef`` must then include their rounding
        (:func:`pallas_kernels.numerics.kernel_coefficient` with the same flag).
      lane_sums: (``"kc"``) columns in :func:`pallas_kernels.common.lane_aligned_order`
        (in-thread sums).
    """
    T, R, D = rows.shape
    A = agg_cols.shape[1]
    Rp = screen_rows(R, A, layout)
    BQs = screen_queries_per_program(Rp, T, layout, BQs)
    lane_sums = bool(lane_sums) and layout == "kc" and lane_sums_apply(BQs, Rp)
    Tpad = round_up_to(T, BQs)
    allr = jnp.concatenate([rows.astype(jnp.float32), agg_cols.astype(jnp.float32)], axis=1)
    allr = pad_axis(pad_axis(pad_axis(allr, 1, Rp), 2, Dp), 0, Tpad)
    rw = pad_axis(pad_axis(jnp.concatenate(
        [row_w.astype(jnp.float32), agg_w.astype(jnp.float32)], axis=1), 1, Rp), 0, Tpad)
    pieces = row_pieces(allr, single_piece)  # [Pr, Tpad, Rp, Dp]
    pieces = pieces.reshape(pieces.shape[0], Tpad * Rp, Dp)
    rw = rw.reshape(-1)
    if lane_sums:   # reorder each program's BQs·Rp columns
        pieces = in_lane_order(pieces, BQs, Rp)
        rw = in_lane_order(rw[None, :, None], BQs, Rp)[0, :, 0]
    padq = lambda x, v=0: pad_axis(x, 0, Tpad, v)
    tau = jnp.where(prune.astype(bool), tau.astype(jnp.float32), -jnp.inf)
    return ScreenOperands(
        rows=pieces, row_w=rw, coef=padq(coef.astype(jnp.float32)),
        eps=padq(eps.astype(jnp.float32)), tau=padq(tau, jnp.inf), Rp=Rp, BQs=BQs,
        layout=layout, lane_sums=lane_sums)


def bound_tile(r_pieces, row_w, k_pieces, knorm, scale, coef, eps, *, BQs: int, Rp: int, pairs,
               layout: str = "hk", lane_sums: bool = False):
    """U for a tile inside a kernel: [BQs, BK] float32 (``"hk"``, ``"kh"``) or [BK, G, 4]
    (``"kc"``, keys-major: the accumulator's orientation, queries as G groups of 4).

    ``"hk"``: one dot [BQs*Rp, D] × [D, BK], sums across the accumulator's rows.
    ``"kh"``: per query one dot [BK, D] × [D, Rp] (``r_pieces[a]``, ``row_w`` are lists over
    the BQs queries), sums along the columns a thread holds.
    ``"kc"``: one dot [BK, D] × [D, BQs*Rp] (all queries' columns),
    :func:`pallas_kernels.common.column_sums`.
    ``coef``, ``eps``: [BQs] ("hk", "kh") or [G, 4] ("kc").
    """
    if layout == "kh":
        bk = k_pieces[0].shape[0]
        qi = lax.broadcasted_iota(jnp.int32, (BQs, bk), 0)
        pos = jnp.zeros((BQs, bk), jnp.float32)
        for i in range(BQs):
            y = keys_rows_dot(k_pieces, [rp[i] for rp in r_pieces], pairs)   # [BK, Rp]
            pi = jnp.sum(jnp.maximum(y, 0.0) * row_w[i][None, :], axis=1)
            pos = jnp.where(qi == i, jnp.broadcast_to(pi[None, :], (BQs, bk)), pos)
    elif layout == "kc":
        y = keys_rows_dot(k_pieces, r_pieces, pairs)                  # [BK, BQs*Rp]
        return _kc_bound(y, row_w, knorm, scale, coef, eps, BQs=BQs, Rp=Rp,
                         lane_sums=lane_sums)
    else:
        y = rows_keys_dot(r_pieces, k_pieces, pairs)                  # [BQs*Rp, BK]
        bk = y.shape[-1]
        pos = jnp.sum((jnp.maximum(y, 0.0) * row_w[:, None]).reshape(BQs, Rp, bk), axis=1)
    return _nudged_bound(pos, knorm[None, :], coef[:, None], eps[:, None], scale[None, :])


def _kc_bound(y, row_w, knorm, scale, coef, eps, *, BQs: int, Rp: int, lane_sums: bool):
    """U [BK, G, 4] of a ``"kc"`` tile from its column dots y [BK, BQs·Rp]."""
    pos = column_sums(jnp.maximum(y, 0.0) * row_w[None, :], BQs, Rp, lane_sums)
    return _nudged_bound(pos, knorm[:, None, None], coef[None], eps[None], scale[:, None, None])


def _nudged_bound(pos, knorm, coef, eps, scale):
    """U = α (Û + n·coef + ε), nudged up by |U|·2^-21 + 2^-126 (Eq. 26; operands broadcast)."""
    v = (pos + (knorm * coef + eps)) * scale
    return v + jnp.abs(v) * UP_NUDGE + UP_FLOOR


def _screen_kernel(*refs, Pr: int, Pk: int, BQs: int, Rp: int, BK: int, N: int, S: int,
                   pairs, layout: str, lane_sums: bool, defer: bool = False, pack: bool = False):
    r_refs = refs[:Pr]
    (rw_ref, coef_ref, eps_ref, tau_ref, lo_ref, hi_ref) = refs[Pr:Pr + 6]
    k_refs = refs[Pr + 6:Pr + 6 + Pk]
    kn_ref, sc_ref = refs[Pr + 6 + Pk:Pr + 8 + Pk]
    mk_ref, qs_ref = refs[-2:]   # (an aliased mask input may come before)
    G = BQs // GROUP
    g = pl.program_id(0)
    s = pl.program_id(1)
    size = mk_ref.shape[0]
    if layout == "kh":
        qrows = [pl.ds((g * BQs + i) * Rp, Rp) for i in range(BQs)]
        rp = [[r_ref[r, :] for r in qrows] for r_ref in r_refs]
        rw = [rw_ref[r] for r in qrows]
    else:
        rp = [r_ref[pl.ds(g * BQs * Rp, BQs * Rp), :] for r_ref in r_refs]
        # held in registers for the scan (reloading them per tile saves registers but was
        # slower)
        rw = rw_ref[pl.ds(g * BQs * Rp, BQs * Rp)]
    qsl = pl.ds(g * BQs, BQs)
    coef, eps, tau = coef_ref[qsl], eps_ref[qsl], tau_ref[qsl]
    lo, hi = lo_ref[qsl], hi_ref[qsl]
    klo, khi = group_range(lo, hi)
    start, stop = split_key_tiles(klo, khi, BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)
    groups = g * G + jnp.arange(G, dtype=jnp.int32)
    qbit = jnp.int32(1) << (jnp.arange(BQs, dtype=jnp.int32) % GROUP)
    if pack:   # kc, 8 queries: group 2p's bits in the low nibble, group 2p + 1's in the high
        qbit = jnp.int32(1) << jnp.arange(BQs, dtype=jnp.int32)
    kc = layout == "kc"
    if kc:   # per-query vectors as [G, 4] (the bound's [BK, G, 4] orientation)
        coef, eps, tau = (x.reshape(G, GROUP) for x in (coef, eps, tau))
        lo, hi, qbit = (x.reshape(G, GROUP) for x in (lo, hi, qbit))
    si_shape = (BK, G, GROUP) if kc else (BQs, BK)

    def load(j):
        inb = j * BK + lanes < N
        kp = [rec._plgpu().load(k_ref.at[pl.ds(j * BK, BK), :], mask=inb[:, None])
              for k_ref in k_refs]
        kn = rec._plgpu().load(kn_ref.at[pl.ds(j * BK, BK)], mask=inb, other=0.0)
        sc = rec._plgpu().load(sc_ref.at[pl.ds(j * BK, BK)], mask=inb, other=1.0)
        return kp, kn, sc

    def finish(j, U, qs, live=True):
        """Survival bits of tile j from its bound U; ``live`` False: write nothing."""
        ids = j * BK + lanes
        inb = (ids < N) & live
        if kc:
            idq = ids[:, None, None]
            surv = (idq >= lo[None]) & (idq < hi[None]) & ~(U < tau[None])
            si = surv.astype(jnp.int32)
            bits = jnp.sum(si * qbit[None], axis=2)                       # [BK, G]
            if pack:   # one byte per key for the program's two groups, at row g
                bits = jnp.sum(bits, axis=1, keepdims=True)                # [BK, 1]
                bits = jnp.where(bits > 127, bits - 256, bits)             # as int8
                idx = g * N + ids[:, None]
            else:
                idx = groups[None, :] * N + ids[:, None]
            ok = jnp.broadcast_to(inb[:, None], idx.shape)
        else:
            vis = (ids[None, :] >= lo[:, None]) & (ids[None, :] < hi[:, None])
            surv = vis & ~(U < tau[:, None])
            si = surv.astype(jnp.int32)
            bits = jnp.sum((si * qbit[:, None]).reshape(G, GROUP, BK), axis=1)   # [G, BK]
            idx = groups[:, None] * N + ids[None, :]
            ok = jnp.broadcast_to(inb[None, :], idx.shape)
        rec._plgpu().store(mk_ref.at[rec.masked_index(idx, ok, size)], bits.astype(jnp.int8),
                           mask=ok)
        return qs + jnp.where(live, si, 0)   # per-query counts summed once, after the loop

    if defer:
        # software-pipelined: tile j's MMA is issued before tile j-1's epilogue, so that the
        # wgmma can run while the previous tile's bound is evaluated (kc layout only)
        def mma(j):
            kp, kn, sc = load(j)
            return keys_rows_dot(kp, rp, pairs), kn, sc

        def body(j, carry):
            qs, y, kn, sc = carry
            nxt = mma(j)
            U = _kc_bound(y, rw, kn, sc, coef, eps, BQs=BQs, Rp=Rp, lane_sums=lane_sums)
            return (finish(j - 1, U, qs),) + nxt

        y0, kn0, sc0 = mma(jnp.where(stop > start, start, 0))   # (tile 0: in bounds)
        qs, y, kn, sc = lax.fori_loop(start + 1, stop, body,
                                      (jnp.zeros(si_shape, jnp.int32), y0, kn0, sc0))
        U = _kc_bound(y, rw, kn, sc, coef, eps, BQs=BQs, Rp=Rp, lane_sums=lane_sums)
        qs = finish(stop - 1, U, qs, live=stop > start)
    else:
        def body(j, qs):
            kp, kn, sc = load(j)
            U = bound_tile(rp, rw, kp, kn, sc, coef, eps, BQs=BQs, Rp=Rp, pairs=pairs,
                           layout=layout, lane_sums=lane_sums)
            return finish(j, U, qs)

        qs = lax.fori_loop(start, stop, body, jnp.zeros(si_shape, jnp.int32))
    qidx = g * BQs + jnp.arange(BQs, dtype=jnp.int32)
    if kc:
        qidx = qidx.reshape(G, GROUP)
    qs_ref[qidx * S + s] = jnp.sum(qs, axis=0 if kc else 1)


class Survivors(NamedTuple):
    """Screening output: per refinement group of 4 queries and split."""

    packed: Array     # [G4, S, Cs] int32 id | mask << 27 (ascending ids)
    count: Array      # [G4, S] int32 true survivors (may exceed Cs: overflow)
    per_query: Array  # [T, S] int32 survivors per query


@functools.partial(jax.jit, static_argnames=("BQs", "Rp", "BK", "S", "pairs", "num_warps",
                                             "num_stages", "interpret", "layout", "lane_sums",
                                             "defer", "pack"),
                   donate_argnames=("masks_into",))
def _screen_call(rows, row_w, coef, eps, tau, lo, hi, k, knorm, scale, masks_into=None, *,
                 BQs, Rp, BK, S, pairs, num_warps, num_stages, interpret, layout, lane_sums,
                 defer=False, pack=False):
    Tpad = lo.shape[0]
    G4 = Tpad // GROUP
    N = k.shape[1]
    rows_out = Tpad // PACKED_QUERIES if pack else G4
    kern = functools.partial(_screen_kernel, Pr=rows.shape[0], Pk=k.shape[0], BQs=BQs, Rp=Rp,
                             BK=BK, N=N, S=S, pairs=pairs, layout=layout, lane_sums=lane_sums,
                             defer=defer and layout == "kc" and BQs * Rp <= DEFER_COLUMNS,
                             pack=pack)
    args = (*rows, row_w, coef, eps, tau, lo, hi, *k, knorm, scale)
    aliases = {}
    if masks_into is not None:   # write this call's programs into another call's masks
        aliases = {len(args): 0}
        args = args + (masks_into.reshape(-1),)
    mk, qs = pl.pallas_call(
        kern, grid=(Tpad // BQs, S),
        out_shape=(jax.ShapeDtypeStruct((rows_out * N,), jnp.int8),
                   jax.ShapeDtypeStruct((Tpad * S,), jnp.int32)),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        input_output_aliases=aliases, name="dosa_screen")(*args)
    return mk.reshape(rows_out, N), qs.reshape(Tpad, S)


def can_pack(layout: str, BQs: int) -> bool:
    """Whether a screen of this layout and program size can write packed masks (two groups'
    4-bit masks in one byte per key: ``"kc"`` programs of exactly :data:`PACKED_QUERIES`)."""
    return layout == "kc" and BQs == PACKED_QUERIES


def screen_masks(sops: ScreenOperands, lo, hi, k_pieces, knorm, scale, *, splits: int,
                 BK: int = 64, num_warps: int = 4, num_stages: int = 2, interpret=None,
                 masks_into=None, defer: bool = False, pack: bool = False):
    """Run the screening kernel: survival masks per group of 4 and key.

    ``pack`` (:func:`can_pack` must hold): one byte per key for each pair of groups, group
    2p's 4 bits low and group 2p + 1's high (masks [G4/2, N]): half the bytes written here
    and read by the compaction (:func:`compact_masks` with ``packed=True``).

    Args:
      sops: :func:`prepare_screen` output; lo, hi: [T] ranges;
      k_pieces: [Pk, N, Dp] key MMA pieces; knorm: [N] n_i ≥ ‖k̄_i‖; scale: [N] α_i.
      masks_into: the masks of an earlier call with the same queries and keys, updated in
        place (its buffer is donated): only the programs with visible keys here write.
    Returns:
      (masks [G4, N] int8: bit b set where query 4g + b keeps the key, written on every key
      tile of the group's program, per-query survivor counts [Tpad, splits] int32).
    """
    if interpret is None:
        interpret = interpret_default()
    Tpad = sops.coef.shape[0]
    T = lo.shape[0]
    if (Tpad // GROUP) * k_pieces.shape[1] >= 2 ** 31:
        raise ValueError(f"screen masks of {Tpad // GROUP} groups x {k_pieces.shape[1]} keys "
                         "exceed int32 offsets: screen fewer queries at once (waves)")
    if pack and not can_pack(sops.layout, sops.BQs):
        raise ValueError(f"packed masks need the 'kc' screen with {PACKED_QUERIES} queries per "
                         f"program, got layout={sops.layout!r}, BQs={sops.BQs}")
    lo = jnp.pad(lo.astype(jnp.int32), (0, Tpad - T))
    hi = jnp.pad(hi.astype(jnp.int32), (0, Tpad - T))
    pairs = piece_pairs(sops.rows.shape[0], k_pieces.shape[0])
    return _screen_call(sops.rows, sops.row_w, sops.coef, sops.eps, sops.tau, lo, hi, k_pieces,
                        knorm, scale, masks_into, BQs=sops.BQs, Rp=sops.Rp, BK=BK, S=splits,
                        pairs=pairs, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret, layout=sops.layout, lane_sums=sops.lane_sums,
                        defer=defer, pack=bool(pack))


def _load_chunks(mk_ref, r, p, *, N: int, CH: int, CPP: int):
    """Inside a kernel: chunks p·CPP … p·CPP + CPP − 1 of mask row r as (key ids [CH], bytes
    [CH] int32). Each chunk is loaded whole (a load mask constant over 16 bytes: vectorised
    loads); the bytes outside a group's range, which its program did not write, are dropped by
    the callers after the load."""
    lanes = jnp.arange(CH, dtype=jnp.int32)
    chunks = []
    for c in range(CPP):
        ids = (p * CPP + c) * CH + lanes
        b = rec._plgpu().load(mk_ref.at[pl.ds(r * N + (p * CPP + c) * CH, CH)],
                              mask=ids < N, other=0)
        chunks.append((ids, b.astype(jnp.int32)))
    return chunks


def _compact_kernel(mk_ref, lo_ref, hi_ref, base_ref, off_ref, sv_ref, *, N: int, Cs: int,
                    CH: int, CPP: int, nchp: int, R: int):
    """Program (r, p): chunks p·CPP … p·CPP + CPP − 1 of mask row r, written for each of the
    row's R groups (R = 2: packed masks, group 2r in the low nibble) at its offsets.

    All CPP chunks are loaded before the first is written (contiguous, vectorised loads:
    more bytes in flight per program), with their offsets in one load."""
    r = pl.program_id(0)
    p = pl.program_id(1)
    size = sv_ref.shape[0]
    sel = jnp.arange(CPP, dtype=jnp.int32)
    chunks = _load_chunks(mk_ref, r, p, N=N, CH=CH, CPP=CPP)
    for h in range(R):
        g = r * R + h
        klo, khi = group_range(lo_ref[pl.ds(g * GROUP, GROUP)], hi_ref[pl.ds(g * GROUP, GROUP)])
        at = pl.ds(g * nchp + p * CPP, CPP)
        bases = base_ref[at]                               # −1: the chunk is in no list
        offs = off_ref[at]
        for c, (ids, b) in enumerate(chunks):
            base = jnp.sum(jnp.where(sel == c, bases, 0))
            off = jnp.sum(jnp.where(sel == c, offs, 0))
            ok = (ids >= klo) & (ids < khi) & (base >= 0)
            bg = jnp.where(ok, (b >> (4 * h)) & 0xF, 0)
            keep = bg != 0
            pos = off + jnp.cumsum(keep.astype(jnp.int32)) - 1
            w = keep & (pos < Cs)
            rec._plgpu().store(sv_ref.at[rec.masked_index(base + pos, w, size)],
                               ids | (bg << ID_BITS), mask=w)


def chunk_counts_reference(masks: Array, lo, hi, *, chunk: int, packed: bool = False):
    """Survivors of every (group, chunk) [G4, nch] (XLA; twin of :func:`chunk_counts`): the keys
    of the chunk inside the group's range (the union of its 4 queries' [lo, hi)) whose 4 bits
    are not all zero. ``packed``: masks [G4/2, N], group 2p's bits in the low nibble of row p,
    group 2p + 1's in the high one; lo, hi: [4·G4]."""
    N = masks.shape[1]
    G4 = masks.shape[0] * (2 if packed else 1)
    CH = chunk
    nch = -(-N // CH)
    _, klo, khi, _ = group_ranges(lo.reshape(G4, GROUP), hi.reshape(G4, GROUP))

    def kept(m, first, h, every):   # [rows, n, CH] bytes of chunks first… -> survivors
        ids = (first + jnp.arange(m.shape[1], dtype=jnp.int32)[:, None]) * CH + jnp.arange(
            m.shape[2], dtype=jnp.int32)[None, :]
        a, z = klo[h::every], khi[h::every]                 # the groups of nibble h
        inr = (ids[None] >= a[:, None, None]) & (ids[None] < z[:, None, None])
        nib = (m.astype(jnp.int32) >> (4 * h)) & 0xF
        return jnp.sum(inr & (nib != 0), axis=2, dtype=jnp.int32)

    R = 2 if packed else 1
    full = N // CH
    rows = []
    for h in range(R):
        parts = []
        if full:
            parts.append(kept(masks[:, :full * CH].reshape(masks.shape[0], full, CH), 0, h, R))
        if N % CH:
            parts.append(kept(masks[:, full * CH:][:, None, :], full, h, R))
        rows.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1))
    return rows[0] if R == 1 else jnp.stack(rows, axis=1).reshape(G4, nch)    # [G4, nch]


def _count_kernel(mk_ref, lo_ref, hi_ref, cnt_ref, *, N: int, CH: int, CPP: int, nchp: int,
                  R: int):
    """Program (r, p): the survivors of chunks p·CPP … p·CPP + CPP − 1 of mask row r for each of
    the row's R groups (the loads of :func:`_compact_kernel`), one CPP-vector store per group."""
    r = pl.program_id(0)
    p = pl.program_id(1)
    sel = jnp.arange(CPP, dtype=jnp.int32)
    chunks = _load_chunks(mk_ref, r, p, N=N, CH=CH, CPP=CPP)
    for h in range(R):
        g = r * R + h
        klo, khi = group_range(lo_ref[pl.ds(g * GROUP, GROUP)], hi_ref[pl.ds(g * GROUP, GROUP)])
        out = jnp.zeros((CPP,), jnp.int32)
        for c, (ids, b) in enumerate(chunks):
            keep = (ids >= klo) & (ids < khi) & (((b >> (4 * h)) & 0xF) != 0)
            out = jnp.where(sel == c, jnp.sum(keep.astype(jnp.int32)), out)
        cnt_ref[pl.ds(g * nchp + p * CPP, CPP)] = out


@functools.partial(jax.jit, static_argnames=("CH", "CPP", "packed", "interpret"))
def chunk_counts(masks: Array, lo, hi, *, CH: int, CPP: int, packed: bool = False,
                 interpret: bool = False):
    """:func:`chunk_counts_reference` as a Pallas Triton kernel (grid: mask rows × programs of
    CPP chunks): one read of the masks with 16-byte loads. lo, hi: [4·G4] int32."""
    N = masks.shape[1]
    R = 2 if packed else 1
    G4 = masks.shape[0] * R
    nch = -(-N // CH)
    nprog = -(-nch // CPP)
    nchp = nprog * CPP
    kern = functools.partial(_count_kernel, N=N, CH=CH, CPP=CPP, nchp=nchp, R=R)
    cnt = pl.pallas_call(
        kern, grid=(masks.shape[0], nprog),
        out_shape=jax.ShapeDtypeStruct((G4 * nchp,), jnp.int32),
        compiler_params=compiler_params(4, 2), interpret=interpret,
        name="dosa_count_survivors")(masks.reshape(-1), lo, hi)
    return cnt.reshape(G4, nchp)[:, :nch]


def chunk_offsets(cnt: Array, lo, hi, *, splits: int, capacity: int, chunk: int):
    """Where each chunk of each group's mask bytes goes in the survivor lists (XLA).

    A group's range (the union of its 4 queries' [lo, hi)) is cut into chunks of ``chunk``
    keys (``chunk``-aligned, as :func:`pallas_kernels.common.split_key_tiles` cuts it into
    the splits' chunks). From every (group, chunk)'s survivors ``cnt`` [G4, nch]
    (:func:`chunk_counts`), the chunk's list (``(g·S + s)·Cs``, −1 outside the range) and its
    offset in it (the survivors of the split's earlier chunks) follow by an exclusive prefix
    sum. Returns (base [G4, nch], offset [G4, nch], count [G4, S]: the true survivors of each
    list, which may exceed ``capacity``).
    """
    G4, nch = cnt.shape
    S = splits
    CH = chunk
    _, klo, khi, _ = group_ranges(lo.reshape(G4, GROUP), hi.reshape(G4, GROUP))
    pre = jnp.concatenate([jnp.zeros((G4, 1), jnp.int32),
                           jnp.cumsum(cnt, axis=1, dtype=jnp.int32)], axis=1)  # [G4, nch + 1]
    # each split's chunks [start, stop) [G4, S], as the kernels cut a range into splits
    start, stop = split_key_tiles(klo[:, None], khi[:, None], CH, S,
                                  jnp.arange(S, dtype=jnp.int32)[None, :])
    start = jnp.clip(start, 0, nch)
    stop = jnp.clip(jnp.maximum(stop, start), 0, nch)
    j = jnp.arange(nch, dtype=jnp.int32)[None, :, None]
    in_split = (j >= start[:, None, :]) & (j < stop[:, None, :])          # [G4, nch, S]
    inside = jnp.any(in_split, axis=2)
    sj = jnp.argmax(in_split, axis=2).astype(jnp.int32)                  # the chunk's split
    g = jnp.arange(G4, dtype=jnp.int32)[:, None]
    base = jnp.where(inside, (g * S + sj) * capacity, -1)
    off = pre[:, :nch] - jnp.take_along_axis(pre, jnp.take_along_axis(start, sj, axis=1), axis=1)
    count = jnp.take_along_axis(pre, stop, axis=1) - jnp.take_along_axis(pre, start, axis=1)
    return base.astype(jnp.int32), off.astype(jnp.int32), count.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("S", "Cs", "CH", "CPP", "CCPP", "packed",
                                             "interpret"))
def _compact_call(masks, lo, hi, *, S, Cs, CH, CPP, CCPP, packed, interpret):
    N = masks.shape[1]
    R = 2 if packed else 1
    G4 = masks.shape[0] * R
    cnt = (chunk_counts(masks, lo, hi, CH=CH, CPP=CCPP, packed=packed, interpret=interpret)
           if CCPP else chunk_counts_reference(masks, lo, hi, chunk=CH, packed=packed))
    base, off, count = chunk_offsets(cnt, lo, hi, splits=S, capacity=Cs, chunk=CH)
    nch = base.shape[1]
    nprog = -(-nch // CPP)
    nchp = nprog * CPP
    base = jnp.pad(base, ((0, 0), (0, nchp - nch)), constant_values=-1).reshape(-1)
    off = jnp.pad(off, ((0, 0), (0, nchp - nch))).reshape(-1)
    kern = functools.partial(_compact_kernel, N=N, Cs=Cs, CH=CH, CPP=CPP, nchp=nchp, R=R)
    sv = pl.pallas_call(
        kern, grid=(masks.shape[0], nprog),
        out_shape=jax.ShapeDtypeStruct((G4 * S * Cs,), jnp.int32),
        compiler_params=compiler_params(4, 2), interpret=interpret,
        name="dosa_compact_survivors")(masks.reshape(-1), lo, hi, base, off)
    return sv.reshape(G4, S, Cs), count


def compact_masks(masks: Array, lo, hi, *, splits: int, capacity: int, chunk: int = COMPACT_CHUNK,
                  chunks_per_program: int = COMPACT_CHUNKS_PER_PROGRAM, packed: bool = False,
                  count_chunks: int = COUNT_CHUNKS_PER_PROGRAM, interpret=None):
    """Survivor lists from screening masks (Pallas Triton; twin :func:`compact_masks_reference`).

    Group g's list split s holds, in ascending order, ``id | bits << 27`` for every key of
    the group's range (the union of its 4 queries' [lo, hi)) in the split's part with
    nonzero bits; the count is the true number (it may exceed ``capacity``: overflow).

    Two passes, both parallel over the keys: :func:`chunk_counts` counts every chunk's
    survivors (a kernel reading ``count_chunks`` chunks per program; 0: the XLA reduction
    :func:`chunk_counts_reference`) and :func:`chunk_offsets` turns the counts into offsets
    (a prefix sum over chunks), then the kernel writes each chunk at its offset,
    ``chunks_per_program`` chunks per program. Every chunk is independent, so the pass is
    not latency-bound as one program per (group, split) carrying its count would be.

    ``packed``: masks [G4/2, N] of :func:`screen_masks` with ``pack=True``; a program reads
    each chunk once for both groups of its byte row.

    Args:
      masks: [G4, N] int8 (:func:`screen_masks`); lo, hi: [T] the screening ranges.
    Returns: (packed [G4, splits, Cs] int32, count [G4, splits] int32).
    """
    for name, v in (("chunk", chunk), ("chunks_per_program", chunks_per_program),
                    ("count_chunks", count_chunks or 1)):
        if int(v) < 1 or int(v) & (int(v) - 1):
            raise ValueError(f"compact_masks: {name} must be a power of two >= 1, got {v}")
    if interpret is None:
        interpret = interpret_default()
    G4 = masks.shape[0] * (2 if packed else 1)
    lo = pad_axis(lo.astype(jnp.int32), 0, G4 * GROUP)
    hi = pad_axis(hi.astype(jnp.int32), 0, G4 * GROUP)
    return _compact_call(masks, lo, hi, S=splits, Cs=round_up_to(capacity, 16), CH=chunk,
                         CPP=int(chunks_per_program), CCPP=int(count_chunks), packed=bool(packed),
                         interpret=interpret)


def screening_bound_reference(rows, row_w, agg_cols, agg_w, coef, eps, k_pieces, knorm, scale,
                              single_piece: bool = False) -> Array:
    """jnp twin of :func:`bound_tile` on full arrays: U [T, N] with the same operand pieces."""
    allr = jnp.concatenate([rows, agg_cols], axis=1).astype(jnp.float32)
    allw = jnp.concatenate([row_w, agg_w], axis=1).astype(jnp.float32)
    Dp = k_pieces.shape[-1]
    allr = pad_axis(allr, 2, Dp)
    rp = row_pieces(allr, single_piece)
    y = None
    for a, b in piece_pairs(rp.shape[0], k_pieces.shape[0]):
        d = jnp.einsum("trd,nd->tnr", rp[a].astype(jnp.float32), k_pieces[b].astype(jnp.float32),
                       precision=lax.Precision.HIGHEST)
        y = d if y is None else y + d
    pos = jnp.sum(jnp.maximum(y, 0.0) * allw[:, None, :], axis=-1)
    return _nudged_bound(pos, knorm[None, :], coef[:, None], eps[:, None], scale[None, :])


def survivors_reference(U: Array, tau: Array, prune: Array, lo: Array, hi: Array) -> Array:
    """[T, N] survival mask of the twin (visible and not ``U < τ`` or not pruning)."""
    ids = jnp.arange(U.shape[1], dtype=jnp.int32)[None, :]
    vis = (ids >= lo[:, None]) & (ids < hi[:, None])
    return vis & (~(U < tau[:, None]) | ~prune[:, None])


def unpack_masks(masks) -> np.ndarray:
    """numpy: packed masks [G4/2, N] (:func:`screen_masks` with ``pack``) -> [G4, N], one
    group's 4 bits per byte (group 2p from the low nibble of row p)."""
    m = np.asarray(masks).astype(np.int32) & 0xFF
    return np.stack([m & 0xF, m >> 4], axis=1).reshape(-1, m.shape[1]).astype(np.int8)


def compact_masks_reference(masks: Array, lo: Array, hi: Array, splits: int,
                            chunk: int = COMPACT_CHUNK, packed: bool = False):
    """numpy twin of :func:`compact_masks` (full lists, no capacity): per (group, split) the
    array of entries ``id | bits << 27``."""
    masks, lo, hi = np.asarray(masks), np.asarray(lo), np.asarray(hi)
    if packed:
        masks = unpack_masks(masks)
    G4, N = masks.shape
    out = []
    for g in range(G4):
        l4, h4 = lo[4 * g:4 * g + 4], hi[4 * g:4 * g + 4]
        ne = h4 > l4
        klo, khi = (int(l4[ne].min()), int(h4[ne].max())) if ne.any() else (2 ** 31 - 1, 0)
        tile0 = klo // chunk
        ntile = max(-(-khi // chunk) - tile0, 0)
        per = -(-ntile // splits)
        row = []
        for s in range(splits):
            a = max((tile0 + s * per) * chunk, klo)
            b = min(min(tile0 + s * per + per, tile0 + ntile) * chunk, khi)
            ids = np.arange(a, max(a, b))
            bits = masks[g, ids].astype(np.int32) & 0xF
            row.append((ids[bits != 0] | (bits[bits != 0] << ID_BITS)).astype(np.int32))
        out.append(row)
    return out
