"""Certificate screening (Eq. 9, 26) as a Pallas Triton kernel, and its jnp twin.

One shape serves all scoring stages (SPEC §13): per program, ``BQs`` queries'
plan rows (``Rp`` rows per query: the retained heads with folded weights w̃_j,
then the negative-aggregate rows, zero rows to a power of two) are multiplied
against a key tile on the tensor cores — stacked into one [BQs·Rp, D] matrix
(layout ``"hk"``), one [BK, D]×[D, Rp] dot per query (``"kh"``, keys as MMA
rows) or one [BK, D]×[D, BQs·Rp] dot for all of them (``"kc"``, the default:
DoSA at T=16K, N=1M took 927 ms with it against 1280 ms with ``"kh"`` on the
H200, BENCHMARKS.md session 4) — and the bound is evaluated per (query, key):

    Û = Σ_r w̃_r relu(y_r) − relu(Σ_a z_a)          (− Σ_a z_a in the absolute form)
    U = α_i (Û + n_i·coef + ε_raw),  then nudged up by |U|·2^-21

with ``n_i ≥ ‖k̄_i‖`` and ``coef = E + C + C_kernel`` (the plan's residual and
error plus this backend's arithmetic, :mod:`pallas_kernels.numerics`). With
bf16 or FP8 queries the rows are one bf16 MMA piece (the retained rows are
exact; the aggregate is split into hi + lo rows, :func:`split_aggregate_bf16`,
its remainder in ``coef``); float32 queries keep two pieces per row. A key
is rejected only on ``U < τ`` (strict; NaN never rejects); ``prune = 0``
disables rejection for a query. Survivors of the ``BQs/4`` refinement groups
of the program (4 queries, paper Sec. 3) are appended to per-group lists as
``id | mask << 27`` (the mask says for which of the 4 queries the key
survived) at ``count + cumsum − 1``: deterministic, ascending ids, no atomics.
The count keeps growing past the list's capacity: an overflowing group is
detected (never silently truncated) and its queries are recovered exactly.

Queries with similar budgets share tiles (paper Sec. 3):
:func:`pallas_kernels.pipeline.screen_by_budget` runs this kernel once per
budget class, each program in the class of its largest budget with ``Rp``
rows per query for that budget, all classes writing one set of lists
(``packed_into``). Before, every program was as wide as the largest candidate
budget: 32 rows per query at H = 32, the dense scan's MMA width, although
the automatic budget chose 14 (BENCHMARKS.md, session 7).

Backend: Triton (``cumsum`` and masked stores at computed positions).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax import numerics as nm
from pallas_kernels import records as rec
from pallas_kernels.common import (ID_BITS, compiler_params, interpret_default, keys_rows_dot,
                                   next_pow2, pad_axis, piece_pairs, round_up, row_pieces,
                                   rows_keys_dot, split_key_tiles)

Array = jax.Array
#: Relative upward nudge of the final bound (covers the last roundings: α·v, the sum).
UP_NUDGE = 2.0 ** -21
#: Absolute upward floor after scaling (underflow of α·v).
UP_FLOOR = 2.0 ** -126
GROUP = 4   # queries per refinement group (bits in a survivor record)


class ScreenOperands(NamedTuple):
    """Kernel-ready screening rows ([Pr, Tpad*Rp, Dp] pieces) and per-row/per-query vectors."""

    rows: Array        # [Pr, Tpad*Rp, Dp] MMA pieces
    row_w: Array       # [Tpad*Rp] float32 w̃ (0 for aggregate / padding rows)
    agg_m: Array       # [Tpad*Rp] float32 1 for aggregate rows
    linear: Array      # [Tpad] int32
    coef: Array        # [Tpad] float32
    eps: Array         # [Tpad] float32
    tau: Array         # [Tpad] float32
    prune: Array       # [Tpad] int32
    Rp: int
    BQs: int
    layout: str = "hk"


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
    """Rows per query in the screen's MMA: R retained + A aggregate rows, to a power of two
    (at least 16 in ``"kh"``, where one query's rows are the dot's N dimension)."""
    Rp = next_pow2(R + A)
    return max(Rp, 16) if layout == "kh" else Rp


def split_aggregate_bf16(aggregate: Array):
    """Aggregate rows a = hi + lo (+ e) as two bf16-exact rows each, and ‖e‖ bounded upward.

    The screen sums the aggregate rows' dots *before* the ReLU (Eq. 8), so two rows
    hi, lo give ``(hi + lo)·k̄``; the residual e = a − hi − lo (|e| ≤ 2^-16 |a|)
    moves z by at most ‖e‖ n_i, which joins the coefficient. With the retained
    rows exact in bf16 (bf16 or FP8 queries) the whole plan is then one MMA piece.

    Returns:
      ([T, 2A, D] float32 rows exactly representable in bf16, [T] float32 ‖e‖ upper).
    """
    a = aggregate.astype(jnp.float32)
    hi = nm.rounded_to(a, jnp.bfloat16)      # (a bare astype round trip is dropped under jit)
    lo = nm.rounded_to(a - hi, jnp.bfloat16)
    e = (a - hi) - lo                                  # both subtractions exact in float32
    err = jnp.sum(nm.norm_upper(e), axis=-1)
    return jnp.concatenate([hi, lo], axis=1), nm.inflate(err, aggregate.shape[1] + 1)


def prepare_screen(rows, row_w, aggregate, linear, coef, eps, tau, prune, Dp: int, BQs=None,
                   single_piece: bool = False, layout: str = "hk"):
    """Stack retained rows and aggregate rows per query; pad to Rp rows, Dp columns, BQs queries.

    Args:
      rows: [T, R, D] float32; row_w: [T, R]; aggregate: [T, A, D]; the rest [T].
      single_piece: feed the rows as one bf16 piece (one MMA per key tile instead of
        two); ``coef`` must then include their rounding
        (:func:`pallas_kernels.numerics.kernel_coefficient` with the same flag).
    """
    T, R, D = rows.shape
    A = aggregate.shape[1]
    Rp = screen_rows(R, A, layout)
    BQs = screen_queries_per_program(Rp, T, layout, BQs)
    Tpad = round_up(T, BQs)
    allr = jnp.concatenate([rows.astype(jnp.float32), aggregate.astype(jnp.float32)], axis=1)
    allr = pad_axis(pad_axis(pad_axis(allr, 1, Rp), 2, Dp), 0, Tpad)
    pieces = row_pieces(allr, single_piece)  # [Pr, Tpad, Rp, Dp]
    rw = pad_axis(pad_axis(jnp.concatenate(
        [row_w.astype(jnp.float32), jnp.zeros((T, A), jnp.float32)], axis=1), 1, Rp), 0, Tpad)
    am = pad_axis(pad_axis(jnp.concatenate(
        [jnp.zeros((T, R), jnp.float32), jnp.ones((T, A), jnp.float32)], axis=1), 1, Rp), 0, Tpad)
    padq = lambda x, v=0: pad_axis(x, 0, Tpad, v)
    return ScreenOperands(
        rows=pieces.reshape(pieces.shape[0], Tpad * Rp, Dp), row_w=rw.reshape(-1),
        agg_m=am.reshape(-1), linear=padq(linear.astype(jnp.int32)),
        coef=padq(coef.astype(jnp.float32)), eps=padq(eps.astype(jnp.float32)),
        tau=padq(tau.astype(jnp.float32), jnp.inf), prune=padq(prune.astype(jnp.int32)),
        Rp=Rp, BQs=BQs, layout=layout)


def bound_tile(r_pieces, row_w, agg_m, k_pieces, knorm, scale, linear, coef, eps, *,
               BQs: int, Rp: int, pairs, layout: str = "hk", keys_major: bool = False):
    """U for a tile inside a kernel: [BQs, BK] float32 ([BK, BQs] with ``keys_major``, "kc" only).

    ``"hk"``: one dot [BQs*Rp, D] × [D, BK], sums across the accumulator's rows.
    ``"kh"``: per query one dot [BK, D] × [D, Rp] (``r_pieces[a]``, ``row_w``, ``agg_m``
    are lists over the BQs queries), sums along the columns a thread holds.
    ``"kc"``: one dot [BK, D] × [D, BQs*Rp] (all queries' rows as columns), sums over each
    query's Rp columns, then the [BK, BQs] sums are transposed.
    """
    if layout == "kh":
        bk = k_pieces[0].shape[0]
        qi = lax.broadcasted_iota(jnp.int32, (BQs, bk), 0)
        pos = jnp.zeros((BQs, bk), jnp.float32)
        z = jnp.zeros((BQs, bk), jnp.float32)
        for i in range(BQs):
            y = keys_rows_dot(k_pieces, [rp[i] for rp in r_pieces], pairs)   # [BK, Rp]
            pi = jnp.sum(jnp.maximum(y, 0.0) * row_w[i][None, :], axis=1)
            zi = jnp.sum(y * agg_m[i][None, :], axis=1)
            pos = jnp.where(qi == i, jnp.broadcast_to(pi[None, :], (BQs, bk)), pos)
            z = jnp.where(qi == i, jnp.broadcast_to(zi[None, :], (BQs, bk)), z)
    elif layout == "kc":
        y = keys_rows_dot(k_pieces, r_pieces, pairs)                  # [BK, BQs*Rp]
        bk = y.shape[0]
        pos = jnp.sum((jnp.maximum(y, 0.0) * row_w[None, :]).reshape(bk, BQs, Rp), axis=2)
        z = jnp.sum((y * agg_m[None, :]).reshape(bk, BQs, Rp), axis=2)   # [BK, BQs]
        if keys_major:   # the bound in the accumulator's orientation (no transpose)
            return _bound_from_sums(pos, z, knorm, scale, linear, coef, eps, keys_major=True)
        pos, z = pos.T, z.T
    else:
        y = rows_keys_dot(r_pieces, k_pieces, pairs)                  # [BQs*Rp, BK]
        bk = y.shape[-1]
        pos = jnp.sum((jnp.maximum(y, 0.0) * row_w[:, None]).reshape(BQs, Rp, bk), axis=1)
        z = jnp.sum((y * agg_m[:, None]).reshape(BQs, Rp, bk), axis=1)
    return _bound_from_sums(pos, z, knorm, scale, linear, coef, eps, keys_major=False)


def _along(keys_major: bool):
    """Broadcasts of per-query and per-key vectors onto a [BQs, BK] tile ([BK, BQs] keys-major)."""
    if keys_major:
        return (lambda x: x[None, :]), (lambda x: x[:, None])
    return (lambda x: x[:, None]), (lambda x: x[None, :])


def _bound_from_sums(pos, z, knorm, scale, linear, coef, eps, *, keys_major: bool):
    """U from the row sums (Eq. 9, 26): α_i (Σ w̃ relu(y) − relu(z) + n_i·coef + ε), nudged up."""
    per_q, per_k = _along(keys_major)
    neg = jnp.where(per_q(linear) != 0, z, jnp.maximum(z, 0.0))
    v = (pos - neg) + (per_k(knorm) * per_q(coef) + per_q(eps))
    v = v * per_k(scale)
    return v + jnp.abs(v) * UP_NUDGE + UP_FLOOR


def _screen_kernel(*refs, Pr: int, Pk: int, BQs: int, Rp: int, BK: int, N: int, S: int, Cs: int,
                   pairs, layout: str, keys_major: bool):
    r_refs = refs[:Pr]
    (rw_ref, am_ref, lin_ref, coef_ref, eps_ref, tau_ref, pr_ref, lo_ref, hi_ref) = refs[Pr:Pr + 9]
    k_refs = refs[Pr + 9:Pr + 9 + Pk]
    kn_ref, sc_ref = refs[Pr + 9 + Pk:Pr + 11 + Pk]
    sv_ref, cnt_ref, qs_ref = refs[-3:]   # (an aliased survivor-list input may come before)
    G = BQs // GROUP
    g = pl.program_id(0)
    s = pl.program_id(1)
    size = sv_ref.shape[0]
    if layout == "kh":
        qrows = [pl.ds((g * BQs + i) * Rp, Rp) for i in range(BQs)]
        rp = [[r_ref[r, :] for r in qrows] for r_ref in r_refs]
        rw = [rw_ref[r] for r in qrows]
        am = [am_ref[r] for r in qrows]
    else:
        rp = [r_ref[pl.ds(g * BQs * Rp, BQs * Rp), :] for r_ref in r_refs]
        # held in registers for the scan: reloading them per tile (174 -> 140 registers at
        # Rp = 16) measured 6 % slower on the H200 (session 7)
        rw = rw_ref[pl.ds(g * BQs * Rp, BQs * Rp)]
        am = am_ref[pl.ds(g * BQs * Rp, BQs * Rp)]
    qsl = pl.ds(g * BQs, BQs)
    lin, coef, eps, tau = lin_ref[qsl], coef_ref[qsl], eps_ref[qsl], tau_ref[qsl]
    prune = pr_ref[qsl] != 0
    lo, hi = lo_ref[qsl], hi_ref[qsl]
    nonempty = hi > lo
    klo = jnp.min(jnp.where(nonempty, lo, jnp.int32(2 ** 31 - 1)))
    khi = jnp.max(jnp.where(nonempty, hi, 0))
    start, stop = split_key_tiles(klo, khi, BK, S, s)
    lanes = jnp.arange(BK, dtype=jnp.int32)
    groups = g * G + jnp.arange(G, dtype=jnp.int32)
    base = (groups * S + s) * Cs
    qbit = (jnp.int32(1) << (jnp.arange(BQs, dtype=jnp.int32) % GROUP))
    keys_major = keys_major and layout == "kc"
    si_shape = (BK, BQs) if keys_major else (BQs, BK)
    per_q, per_k = _along(keys_major)

    def body(j, carry):
        cnt, qs = carry
        ids = j * BK + lanes
        inb = ids < N
        kp = [rec._plgpu().load(k_ref.at[pl.ds(j * BK, BK), :], mask=inb[:, None])
              for k_ref in k_refs]
        kn = rec._plgpu().load(kn_ref.at[pl.ds(j * BK, BK)], mask=inb, other=0.0)
        sc = rec._plgpu().load(sc_ref.at[pl.ds(j * BK, BK)], mask=inb, other=1.0)
        U = bound_tile(rp, rw, am, kp, kn, sc, lin, coef, eps, BQs=BQs, Rp=Rp, pairs=pairs,
                       layout=layout, keys_major=keys_major)
        vis = (per_k(ids) >= per_q(lo)) & (per_k(ids) < per_q(hi))
        surv = vis & (~(U < per_q(tau)) | ~per_q(prune))
        si = surv.astype(jnp.int32)
        if keys_major:   # [BK, BQs]: the query-axis sums stay in the MMA layout's threads
            bits = jnp.sum((si * qbit[None, :]).reshape(BK, G, GROUP), axis=2).T   # [G, BK]
        else:
            bits = jnp.sum((si * qbit[:, None]).reshape(G, GROUP, BK), axis=1)
        anyq = bits > 0
        ai = anyq.astype(jnp.int32)
        n = jnp.sum(ai, axis=1)

        def write():
            pos = cnt[:, None] + jnp.cumsum(ai, axis=1) - 1
            ok = anyq & (pos < Cs)
            rec.store_slots(sv_ref, base, pos, ids[None, :] | (bits << ID_BITS), ok, size)

        lax.cond(jnp.max(n) > 0, write, lambda: None)
        return cnt + n, qs + si      # per-query counts summed once, after the loop

    cnt, qs = lax.fori_loop(start, stop, body,
                            (jnp.zeros((G,), jnp.int32), jnp.zeros(si_shape, jnp.int32)))
    cnt_ref[groups * S + s] = cnt
    qs_ref[(g * BQs + jnp.arange(BQs, dtype=jnp.int32)) * S + s] = jnp.sum(
        qs, axis=0 if keys_major else 1)


class Survivors(NamedTuple):
    """Screening output: per refinement group of 4 queries and split."""

    packed: Array     # [G4, S, Cs] int32 id | mask << 27 (ascending ids)
    count: Array      # [G4, S] int32 true survivors (may exceed Cs: overflow)
    per_query: Array  # [T, S] int32 survivors per query


@functools.partial(jax.jit, static_argnames=("BQs", "Rp", "BK", "S", "Cs", "pairs", "num_warps",
                                             "num_stages", "interpret", "T", "layout",
                                             "keys_major"), donate_argnames=("packed_into",))
def _screen_call(rows, row_w, agg_m, linear, coef, eps, tau, prune, lo, hi, k, knorm, scale,
                 packed_into=None, *, BQs, Rp, BK, S, Cs, pairs, num_warps, num_stages,
                 interpret, T, layout, keys_major):
    Tpad = lo.shape[0]
    G4 = Tpad // GROUP
    N = k.shape[1]
    kern = functools.partial(_screen_kernel, Pr=rows.shape[0], Pk=k.shape[0], BQs=BQs, Rp=Rp,
                             BK=BK, N=N, S=S, Cs=Cs, pairs=pairs, layout=layout,
                             keys_major=keys_major)
    i32 = jnp.int32
    args = (*rows, row_w, agg_m, linear, coef, eps, tau, prune, lo, hi, *k, knorm, scale)
    aliases = {}
    if packed_into is not None:   # write this call's groups into another call's lists
        aliases = {len(args): 0}
        args = args + (packed_into.reshape(-1),)
    sv, cnt, qs = pl.pallas_call(
        kern, grid=(Tpad // BQs, S),
        out_shape=(jax.ShapeDtypeStruct((G4 * S * Cs,), i32),
                   jax.ShapeDtypeStruct((G4 * S,), i32), jax.ShapeDtypeStruct((Tpad * S,), i32)),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        input_output_aliases=aliases, name="dosa_screen")(*args)
    return Survivors(sv.reshape(G4, S, Cs), cnt.reshape(G4, S), qs.reshape(Tpad, S)[:T])


def screen(sops: ScreenOperands, lo, hi, k_pieces, knorm, scale, *, splits: int, capacity: int,
           BK: int = 64, num_warps: int = 4, num_stages: int = 2, keys_major: bool = True,
           interpret=None, packed_into=None) -> Survivors:
    """Run the screening kernel.

    Args:
      sops: :func:`prepare_screen` output; lo, hi: [T] ranges;
      k_pieces: [Pk, N, Dp] key MMA pieces; knorm: [N] n_i ≥ ‖k̄_i‖; scale: [N] α_i.
      capacity: survivor slots per (group, split).
      keys_major: ("kc") evaluate the bound in the accumulator's [BK, BQs] orientation.
      packed_into: survivor lists of an earlier call with the same groups, splits and
        capacity, updated in place (its buffer is donated): groups with no visible key
        here keep their entries (their counts here are 0; the caller merges counts).
    """
    if interpret is None:
        interpret = interpret_default()
    T = lo.shape[0]
    Tpad = sops.linear.shape[0]
    lo = jnp.pad(lo.astype(jnp.int32), (0, Tpad - T))
    hi = jnp.pad(hi.astype(jnp.int32), (0, Tpad - T))
    pairs = piece_pairs(sops.rows.shape[0], k_pieces.shape[0])
    return _screen_call(sops.rows, sops.row_w, sops.agg_m, sops.linear, sops.coef, sops.eps,
                        sops.tau, sops.prune, lo, hi, k_pieces, knorm, scale, packed_into,
                        BQs=sops.BQs,
                        Rp=sops.Rp, BK=BK, S=splits, Cs=round_up(capacity, 16), pairs=pairs,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret, T=T,
                        layout=sops.layout, keys_major=bool(keys_major))


def screening_bound_reference(rows, row_w, aggregate, linear, coef, eps, k_pieces, knorm,
                              scale, single_piece: bool = False) -> Array:
    """jnp twin of :func:`bound_tile` on full arrays: U [T, N] with the same operand pieces."""
    T, R, D = rows.shape
    allr = jnp.concatenate([rows, aggregate], axis=1).astype(jnp.float32)
    Dp = k_pieces.shape[-1]
    allr = pad_axis(allr, 2, Dp)
    rp = row_pieces(allr, single_piece)
    y = None
    for a, b in piece_pairs(rp.shape[0], k_pieces.shape[0]):
        d = jnp.einsum("trd,nd->tnr", rp[a].astype(jnp.float32), k_pieces[b].astype(jnp.float32),
                       precision=lax.Precision.HIGHEST)
        y = d if y is None else y + d
    pos = jnp.sum(jnp.maximum(y[..., :R], 0.0) * row_w[:, None, :], axis=-1)
    z = jnp.sum(y[..., R:], axis=-1)
    neg = jnp.where(linear[:, None], z, jnp.maximum(z, 0.0))
    v = (pos - neg) + (knorm[None, :] * coef[:, None] + eps[:, None])
    v = v * scale[None, :]
    return v + jnp.abs(v) * UP_NUDGE + UP_FLOOR


def survivors_reference(U: Array, tau: Array, prune: Array, lo: Array, hi: Array) -> Array:
    """[T, N] survival mask of the twin (visible and not ``U < τ`` or not pruning)."""
    ids = jnp.arange(U.shape[1], dtype=jnp.int32)[None, :]
    vis = (ids >= lo[:, None]) & (ids < hi[:, None])
    return vis & (~(U < tau[:, None]) | ~prune[:, None])
