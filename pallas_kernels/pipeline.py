"""DoSA on the Pallas kernels (``Config(backend="pallas")``), and the dense path.

Data flows one way (STYLE.md): operands → (anchors: dense kernel) → seeds
(:mod:`pallas_kernels.seeds`: seed-scoring kernel, K-th search, τ) → plan
(``dosa_jax.planner.build_plan``, query side) → screen kernels, one per budget
class (U < τ rejects; survival bytes per group of 4 and key; :func:`screen_by_budget`)
→ compaction of the bytes into survivor lists → refine kernel (s ≥ τ records, online
threshold) → recovery of overflowed groups (dense kernel with θ₀ = τ) → exact selection
of the records.

Exactness: a key leaves only by ``U_kernel < τ`` (screening, where
``U_kernel ≥ s_kernel`` by the plan plus :mod:`pallas_kernels.numerics`) or
by ranking below K held records (online threshold, tie order score desc /
id asc). Every score is produced by :func:`pallas_kernels.scoring.score_tile`
in a 4-query tile, the same routine and shape as :func:`dense_topk`, so
``dosa_topk`` and ``dense_topk`` agree bitwise. A survivor list that
overflows its capacity is detected (its count keeps growing) and its 4
queries are answered by a full dense scan (counted as an overflow and a
recovery): no candidate is ever lost. A group with a query that cannot prune
(no τ, a failed guard) or whose sample predicts survival above
:data:`DIRECT_SURVIVAL` skips the screen and goes to that dense scan at once
(counted as a recovery); so can a group whose sample predicts a survivor list
fuller than :data:`DIRECT_LIST_USE` of its capacity (:func:`predicted_list_use`;
off by default).

The planner's sample (activation frequencies, budget) is a strided sample of
each query's visible range scored in float32 and scaled by α_i, as in the
reference pipeline; the seeds are a biased sample (mostly the local window).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from dosa_jax import numerics as nm
from dosa_jax import witnesses as witnesses_mod
from dosa_jax.budget import estimated_survival, sample_survivors
from dosa_jax.keys import key_summary, scale_fault
from dosa_jax.planner import build_plan
from dosa_jax.results import Stats
from dosa_jax.sample import plan_sample, sample_tau_gap, strided_sample_ids
from dosa_jax.selection import INT32_MIN, key_to_score, order_key
from dosa_jax.tiling import round_up_to
from pallas_kernels import dense as dense_mod
from pallas_kernels import numerics as knum
from pallas_kernels import records as rec
from pallas_kernels.common import (MAX_KEYS, THETA_NONE, group_ranges, interpret_default,
                                   next_pow2)
from pallas_kernels.operands import capacity_for, prepare_key_operands, prepare_operands
from pallas_kernels.refine import refine
from pallas_kernels.screen import (Survivors, aggregate_column_count, aggregate_columns,
                                   can_pack, compact_masks, prepare_screen, screen_masks,
                                   screen_queries_per_program, screen_rows)
from pallas_kernels.seeds import group_seed_lists, group_witnesses, seed_threshold
from pallas_kernels.tiles import Tiles, check_tiles

#: Survivor-list budget (entries, int32) over all groups and splits: 1 GiB.
SURVIVOR_BUDGET = 1 << 28
#: κ of the automatic budget's cost (r + d_a)/H + κ·m on this backend
#: (:func:`dosa_jax.planner.build_plan`; ``Config.survivor_cost`` overrides it). 3: the
#: time after the screen grows ≈ 3× the screen's per unit of r/H, and on the H200 at
#: T = 16K, N = 1M κ = 3 against 1 raised dense/DoSA on 9 of 16 trained layers, slowed none.
SURVIVOR_COST = 3.0


def survivor_cost(config) -> float:
    """κ of ``config``'s automatic budget on this backend: ``config.survivor_cost``, else
    :data:`SURVIVOR_COST`."""
    return SURVIVOR_COST if config.survivor_cost is None else config.survivor_cost


def _check_size(N: int):
    if N >= MAX_KEYS:
        raise ValueError(f"backend='pallas' supports N < {MAX_KEYS} keys, got {N}")


def survivor_capacity(N: int, T: int, splits: int, K: int, capacity=None) -> int:
    """Survivor slots per (group of 4, split): half the split's keys, within the budget.

    ``T`` is the number of queries whose lists are live at once (one wave,
    :func:`wave_size`). A group whose survivors exceed the slots is recovered by
    a dense scan (counted), so the capacity decides speed, never the answer.
    """
    if capacity is not None:
        return round_up_to(max(capacity, 16), 16)
    span = -(-N // splits)
    groups = max(1, -(-T // 4))
    cap = min(max(span // 2, 2 * K), SURVIVOR_BUDGET // (groups * splits))
    return round_up_to(max(cap, 256), 16)


def wave_size(T: int, N: int) -> int:
    """Queries screened and refined together: the survivor lists of one wave fit
    :data:`SURVIVOR_BUDGET` at half of N per group (T·N/2 int32 entries over groups of 4).

    Waves run one after another (``lax.map``); every wave is answered exactly as
    a call on its queries alone would be, so waves change memory, not results.
    """
    per_query = max(1, -(-N // 8))              # int32 entries per query at N/2 per group of 4
    w = max(256, SURVIVOR_BUDGET // per_query)
    w = 1 << (w.bit_length() - 1)               # a power of two (whole groups and tiles)
    return int(min(w, round_up_to(T, 4)))


def seed_sizes(config):
    """(seeds S, sinks a, local window b) of the group seed lists for the config's strategy."""
    S0 = config.seeds()
    a = min(config.sink_size, S0)
    b = min(int(round(config.local_fraction * S0)), S0 - a)
    if config.seed_strategy == "local":
        a, b = 0, S0
    elif config.seed_strategy == "sinks":
        a, b = S0, 0
    elif config.seed_strategy == "strided":
        a, b = 0, 0
    return S0, a, b


def screen_friendly(config, H: int, A: int = 1):
    """The config with every budget replaced by :func:`screen_friendly_budget` (A aggregate rows)."""
    if isinstance(config.retained_heads, int):
        r = min(max(config.retained_heads, 1), max(H - 1, 1))
        return config.replace(retained_heads=screen_friendly_budget(r, A, H))
    return config.replace(budget_candidates=tuple(sorted(
        {screen_friendly_budget(b, A, H) for b in config.budgets(H)})))


#: A query whose estimated survival (planner sample) exceeds this is scanned densely
#: from θ₀ = τ at once: screening it would cost more than it saves, and its group's
#: survivor list (N/2 slots) would likely overflow and be rescanned anyway.
DIRECT_SURVIVAL = 0.5


#: A group whose predicted survivor count (:func:`predicted_list_use`) exceeds this share of
#: its list capacity (all splits) is scanned densely from θ₀ = τ at once instead of screened.
#: Off (+inf) by default: the prediction also sends groups that would not have overflowed to
#: a rescan (one program per group over all keys), whose latency outweighs the overflows saved.
DIRECT_LIST_USE = float("inf")


#: The call runs the dense scan for every query (seeded from τ) when the predicted ratio of
#: DoSA's time to the dense scan's (:func:`predicted_cost_ratio`) exceeds this: screening
#: cannot pay on such a call, and the decision costs only the planner's sample of a few
#: groups. ``Config.dense_switch`` overrides it (``inf``: never). The model is fitted to the
#: measured ratio itself, so break-even is 1.
DENSE_SWITCH = 1.0
#: The cost model's constants, in units of the dense scan's cost per (query, key): the
#: screen's cost per plan row (the rows r + A of a query's class, over H), the refinement's
#: per key of a group's survivor union, the dense pass's per key of the groups it scans, and
#: the work per query that does not grow with its range (planning, seed selection, record
#: gathering), in keys of the dense scan per head. Values and the measurement that chose them
#: (a least-squares fit to the always-screened time over the dense time of every matrix case
#: at N = 128K and 1M, H = 32 and 64): BENCHMARKS.md (matrix).
SCREEN_ROW_COST = 0.56
REFINE_KEY_COST = 2.54
DENSE_PASS_COST = 1.30
PER_QUERY_COST = 564.0


def default_dense_switch(interpret=None) -> float:
    """The switch of a call with ``Config.dense_switch=None``: :data:`DENSE_SWITCH` on the GPU,
    +inf (always screen) when the kernels are interpreted (``interpret``, default: no GPU). The
    cost model prices the GPU's kernels, not the interpreter's, and a run in interpret mode is a
    check, which should exercise the screening kernels."""
    if interpret is None:
        interpret = interpret_default()
    return float("inf") if interpret else DENSE_SWITCH


#: Groups of 4 queries sampled for the call-level decisions (strided over the call).
SWITCH_SAMPLE_GROUPS = 256

#: Block witnesses per query of a call with ``Config.block_witnesses=None`` that passes the
#: gate (:func:`block_witness_gate`, :func:`use_block_witnesses`).
AUTO_BLOCK_WITNESSES = 4096
#: The gate, in keys per block witness: a call adds W = :data:`AUTO_BLOCK_WITNESSES` block
#: witnesses when its τ gap (:func:`sampled_tau_gap`: the mean share of a query's keys that
#: score at or above its seed τ beyond its K, keys that survive whatever the bound only
#: because τ < τ*) times its mean key range exceeds this many keys per witness, i.e. when
#: gap > gate · W / range. The keys above τ are what a τ near τ* removes from the
#: refinement (their count grows with the range); what block witnesses cost is a dense scan
#: of range / ``witness_block`` block means and seed rows of 2·W more keys per group (per
#: query, about constant). ``Config.block_witness_gate`` overrides it. The value and the
#: measurement that chose it: BENCHMARKS.md (matrix, block witnesses).
BLOCK_WITNESS_GATE = 5.0


def block_witness_gate(config, interpret=None) -> float:
    """The gate of a call with ``Config.block_witnesses=None``: ``config.block_witness_gate``,
    else :data:`BLOCK_WITNESS_GATE` on the GPU and +inf (no automatic block witnesses) when
    the kernels are interpreted: like the dense switch, the gate prices the GPU's kernels, and
    a check in interpret mode should not pay a second seed stage it did not ask for."""
    if config.block_witness_gate is not None:
        return float(config.block_witness_gate)
    if interpret is None:
        interpret = interpret_default()
    return float("inf") if interpret else BLOCK_WITNESS_GATE


class Witnesses(NamedTuple):
    """Each group of 4 queries' witness ids for τ, with the call's choice of block witnesses:
    the seeds take ``ids`` ([G4, W] int32, −1 for none) where ``use_ids`` (a traced scalar
    bool) holds, else ``plain`` (the same groups' ids without block witnesses, or None)."""

    ids: jax.Array
    plain: Optional[jax.Array]
    use_ids: jax.Array


def predicted_cost_terms(direct_g, rows_g, use_g, range_g, H: int):
    """The cost model's four work terms [4] from a sample of groups of 4 queries, the first
    three in units of the dense scan's work over the sampled groups' ranges (Σ range_g, with
    ``range_g`` = max hi − min lo of a group):

        screen:     Σ_screened (rows_g / H)·range_g / Σ range_g   (plan rows r + A per key)
        refine:     Σ_screened use_g / Σ range_g                   (keys of the survivor unions)
        dense:      Σ_dense range_g / Σ range_g                    (scanned from θ₀ = τ)
        per query:  H / mean range_g over the groups that see keys (work per query that does
                    not grow with the range, relative to the dense scan's per query)

    ``rows_g`` is the plan rows of the group's widest query, ``use_g`` its predicted
    survivor union (:func:`predicted_list_use`), ``direct_g`` the dense-group rule.
    """
    rng = jnp.maximum(range_g, 0).astype(jnp.float32)
    total = jnp.maximum(jnp.sum(rng), 1.0)
    seeing = jnp.sum(rng > 0).astype(jnp.float32)
    screened = ~direct_g
    return jnp.stack([
        jnp.sum(jnp.where(screened, (rows_g.astype(jnp.float32) / H) * rng, 0.0)) / total,
        jnp.sum(jnp.where(screened, use_g.astype(jnp.float32), 0.0)) / total,
        jnp.sum(jnp.where(screened, 0.0, rng)) / total,
        jnp.where(seeing > 0, H * seeing / total, 0.0)])


def predicted_cost_ratio(terms, *, screen_row_cost: float = SCREEN_ROW_COST,
                         refine_key_cost: float = REFINE_KEY_COST,
                         dense_pass_cost: float = DENSE_PASS_COST,
                         per_query_cost: float = PER_QUERY_COST):
    """Predicted time of DoSA over the dense scan's from :func:`predicted_cost_terms`.

    The cost form of Eq. 18–21 with measured per-kernel weights:
    a·screen + κ·refine + d·dense + f·(per query), with a = ``screen_row_cost``,
    κ = ``refine_key_cost``, d = ``dense_pass_cost``, f = ``per_query_cost``. A speed
    heuristic only: it decides which exact path answers, never the answer.
    """
    return (screen_row_cost * terms[0] + refine_key_cost * terms[1]
            + dense_pass_cost * terms[2] + per_query_cost * terms[3])


def predicted_list_use(kept, valid, lo, hi, Tpad4: int):
    """Predicted entries of each group's survivor list [G4] from the planner's sample.

    ``kept`` [T, P]: sample key j of query t survives (:func:`dosa_jax.budget.sample_survivors`);
    the sample is strided over each query's own range, so sample j of a group's queries lies
    at about the same position when their ranges are alike (causal neighbours). The group's
    union survival is estimated as the share of sample positions j kept by *any* of its
    queries, times the group's range (min lo to max hi). A speed heuristic only: a wrong
    guess costs time (a needless dense scan, or an overflow that is rescanned), never the
    answer.
    """
    T = kept.shape[0]
    pad = Tpad4 - T
    G4 = Tpad4 // 4
    k4 = jnp.pad(kept, ((0, pad), (0, 0))).reshape(G4, 4, -1)
    v4 = jnp.pad(valid, ((0, pad), (0, 0))).reshape(G4, 4, -1)
    union = jnp.sum(jnp.any(k4, axis=1), axis=1) / jnp.maximum(
        jnp.sum(jnp.any(v4, axis=1), axis=1), 1)
    _, glo, ghi, _ = group_ranges(jnp.pad(lo, (0, pad)).reshape(G4, 4),
                                  jnp.pad(hi, (0, pad)).reshape(G4, 4))
    return union * jnp.maximum(ghi - glo, 0).astype(jnp.float32)


def _score_key(theta):
    """Order-key threshold -> float (THETA_NONE -> -inf)."""
    return jnp.where(theta > THETA_NONE, key_to_score(theta), -jnp.inf)


def floor_key(tau_floor):
    """[T] order keys of a τ floor (float32 scores): THETA_NONE where the floor is −inf or
    NaN (no floor), else the score's order key (``dosa_jax.selection.order_key``)."""
    f = jnp.asarray(tau_floor, jnp.float32)
    return jnp.where(f > -jnp.inf, order_key(f), THETA_NONE).astype(jnp.int32)


def floored_tau_key(tau_key, have_tau, tau_floor):
    """(τ keys, have τ) with the seed threshold raised to the floor: max(τ, floor) where the
    seeds give a τ, the floor alone where they do not (``tau_floor`` None: unchanged).

    The floor is a lower bound on τ* certified elsewhere (keys on other devices,
    :mod:`dosa_jax.context_parallel`): the answer is then the exact Top-K of the keys
    scoring ≥ floor, which holds every key of the larger key set's Top-K found here."""
    if tau_floor is None:
        return tau_key, have_tau
    fk = floor_key(tau_floor)
    return (jnp.maximum(jnp.where(have_tau, tau_key, THETA_NONE), fk),
            have_tau | (fk > THETA_NONE))


#: Queries per chunk of the planner's sample dots (one XLA dot per chunk; a ``lax.map`` over
#: chunks when there are several).
PLAN_SAMPLE_CHUNK = 2048
_BF16_EXACT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))


def plan_sample_dots(q, k, lo, hi, config, mma: bool = True):
    """Payload head dots of the planner's strided sample (:mod:`dosa_jax.sample`), by XLA.

    ``mma`` (``Tiles.plan_sample_mma``) with bf16/FP8 queries and keys: one bf16 dot with
    float32 accumulation per chunk of :data:`PLAN_SAMPLE_CHUNK` queries (exact products)
    instead of float32 HIGHEST dots of 256-query chunks. The ids are in range (clipped), so
    the gathers need no bounds select. The dots only steer the plan (which heads, which
    budget); no bound uses them.
    Returns (dots [T, P, H], ids [T, P] clipped into range, valid [T, P]).
    """
    T = q.shape[0]
    P = round_up_to(config.budget_sample, 8)
    ids, valid = strided_sample_ids(lo, hi, config.budget_sample, P)
    ids = jnp.clip(ids, 0, k.shape[0] - 1)
    mma = mma and jnp.dtype(q.dtype) in _BF16_EXACT and jnp.dtype(k.dtype) in _BF16_EXACT

    def chunk(args):
        qc, idc = args
        if mma:
            kk = jnp.take(k, idc, axis=0, mode="clip").astype(jnp.bfloat16)   # [c, P, D], exact
            return jnp.einsum("thd,tpd->tph", qc.astype(jnp.bfloat16), kk,
                              preferred_element_type=jnp.float32)
        kk = jnp.take(k, idc, axis=0, mode="clip").astype(jnp.float32)    # [c, P, D]
        return jnp.einsum("thd,tpd->tph", qc.astype(jnp.float32), kk,
                          precision=lax.Precision.HIGHEST)
    c = min(PLAN_SAMPLE_CHUNK if mma else 256, round_up_to(T, 8))
    Tp = round_up_to(T, c)
    qp = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0)))
    ip = jnp.pad(ids, ((0, Tp - T), (0, 0)))
    if Tp == c:   # one chunk: no loop, no stacked copy of its output
        dots = chunk((qp, ip))[:T]
    else:
        dots = lax.map(chunk, (qp.reshape(Tp // c, c, *q.shape[1:]), ip.reshape(Tp // c, c, -1)))
        dots = dots.reshape(Tp, P, q.shape[1])[:T]
    return dots, ids, valid


def screen_friendly_budget(r: int, A: int, H: int) -> int:
    """A budget whose plan rows r + A fill a power of two (no padded MMA rows).

    Rounds r up to ``next_pow2(r + A) − A`` when that does not cross the power of
    two above r (the rows are padded to it anyway: retaining more heads is free),
    down to ``next_pow2(r) − A`` when it would (r = 16, A = 2 would need 32 rows).
    Correctness holds for any retained set (DESIGN §4).
    """
    up = next_pow2(r + A)
    r2 = up - A if up == next_pow2(r) else next_pow2(r) - A
    return int(min(max(r2, 1), max(H - 1, 1)))


def dosa_topk(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(), splits=None,
              interpret=None, return_details: bool = False, wave=None, stop_after=None,
              hint=None, tau_floor=None):
    """Exact DoSA Top-K on the Pallas kernels (validated inputs, as ``dosa_jax.topk``).

    The queries run in waves of ``wave`` (default :func:`wave_size`): the
    survivor lists, records and plan of one wave are live at a time, which bounds
    the workspace at long context and keeps the lists large enough not to overflow.

    ``hint`` [T, M]: extra witness ids for τ (``dosa_jax.topk``); with
    ``config.anchor_stride`` the anchor queries are answered densely first (all of
    them in one scan, before the waves) and their Top-K ids join the witnesses
    (:func:`anchor_topk`, :func:`pallas_kernels.seeds.group_witnesses`); with
    ``config.block_witnesses`` each query's best-ranked key blocks join them
    (:func:`best_blocks`; a group of 4 takes the keys of its queries' union of blocks); with
    ``block_witnesses=None`` the call's gate chooses (:func:`_call_setup`).

    ``tau_floor`` [T] float32 (optional): a lower bound on each query's τ* from elsewhere
    (keys on other devices): every threshold — the screen's τ, the refinement's and the
    dense scans' θ₀ — starts at max(seed τ, floor) (:func:`floored_tau_key`; a −inf or NaN
    floor is no floor). The answer is then the exact Top-K of the keys scoring ≥ floor
    (fewer than K, padded with −1 / −inf, when fewer keys reach it), as the reference
    pipeline's once its seeds below the floor are left out.

    ``stop_after`` (``"seeds"``, ``"screen"`` or ``"refine"``) returns the
    intermediate arrays of that stage instead of the answer: the benchmark times
    the stages by difference. Not an answer; never use it for results.

    Returns (indices [T, K] int32, scores [T, K] float32, Stats).
    """
    T = q.shape[0]
    N = k.shape[0]
    _check_size(N)
    check_tiles(tiles)
    if config.guided_witnesses:
        raise NotImplementedError("Config.guided_witnesses is implemented by the reference backend "
                                  "only; on backend='pallas' use anchor_stride or hint")
    if tiles.BQ != 4:
        raise ValueError(f"DoSA refines groups of 4 queries: tiles.BQ must be 4, got {tiles.BQ}")
    Tw = wave_size(T, N) if wave is None else int(min(max(wave, 4), round_up_to(T, 4)))
    if Tw % 4:
        raise ValueError(f"wave must be a multiple of 4, got {wave}")
    floor = None if tau_floor is None else jnp.asarray(tau_floor, jnp.float32).reshape(T)
    wave_kw = dict(tiles=tiles, splits=splits, interpret=interpret)
    setup = _call_setup(q, k, w, k_scale, lo, hi, config, hint, tau_floor=floor, **wave_kw)
    wit, keyside, lo, hi = setup.witnesses, setup.keyside, setup.lo, setup.hi
    config = config.replace(block_witnesses=0)   # resolved: the witnesses hold the blocks
    wave_kw.update(keyside=keyside)
    if return_details or stop_after is not None:
        if Tw < T:
            if return_details:
                raise ValueError("return_details needs a single wave (wave >= T)")
            return _in_waves(lambda *a, **kw: _dosa_wave(*a, stop_after=stop_after, **kw, **wave_kw),
                             q, k, w, k_scale, lo, hi, config, Tw, wit, floor)
        return _dosa_wave(q, k, w, k_scale, lo, hi, config, return_details=return_details,
                          stop_after=stop_after, witnesses=wit, tau_floor=floor, **wave_kw)

    def screened(_):
        idx, sc, stats, direct, theta = _in_waves(
            lambda *a, **kw: _dosa_wave(*a, defer_direct=True, **kw, **wave_kw),
            q, k, w, k_scale, lo, hi, config, Tw, wit, floor)
        return _dense_pass(idx, sc, stats, direct, theta, q, w, k, k_scale, lo, hi, K=config.top_k,
                           tiles=tiles, interpret=interpret, keyside=keyside)

    switch = (default_dense_switch(interpret) if config.dense_switch is None
              else config.dense_switch)
    if switch == float("inf"):
        return screened(None)
    ratio = predicted_cost_ratio(_switch_terms(q, k, w, k_scale, lo, hi, config, setup,
                                               tau_floor=floor, **wave_kw))

    def dense(_):
        return _dense_call(q, w, k, k_scale, lo, hi, config, tiles=tiles, interpret=interpret,
                           keyside=keyside, witnesses=wit, tau_floor=floor)

    idx, sc, stats = lax.cond(ratio > switch, dense, screened, None)
    return idx, sc, stats._replace(predicted_cost=jnp.full((T,), ratio, jnp.float32))


class CallSetup(NamedTuple):
    """What every wave of a call shares (:func:`_call_setup`): the groups' witnesses (an
    array [G4, W], None, or :class:`Witnesses` when the call chooses its block witnesses),
    the key-side operands, the int32 ranges, and, when the gate ran, the plan of the
    sampled groups without block witnesses (:func:`sampled_plan`)."""

    witnesses: object
    keyside: "KeySide"
    lo: jax.Array
    hi: jax.Array
    plain_plan: Optional[dict] = None


def _call_setup(q, k, w, k_scale, lo, hi, config, hint, *, tiles, splits=None, interpret=None,
                tau_floor=None) -> CallSetup:
    """The witnesses of each group (hints, anchors' Top-K and block witnesses), the key-side
    operands (once per call, outside the waves' loop) and the int32 ranges. With
    ``config.block_witnesses=None`` and a finite :func:`block_witness_gate`, the call's
    sampled plan without block witnesses decides whether they join
    (:func:`use_block_witnesses`; the blocks are ranked only when they do)."""
    T, N = q.shape[0], k.shape[0]
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    keyside = key_side(k, k_scale, tiles)
    anchors = anchor_topk(q, k, w, k_scale, lo, hi, config, tiles=tiles, interpret=interpret)
    group = lambda blocks: group_witnesses(round_up_to(T, 4), hint, anchors, config.anchors(T),
                                           blocks=blocks, block=config.witness_block, n_keys=N)
    gate = block_witness_gate(config, interpret)
    if config.block_witnesses is not None or not AUTO_BLOCK_WITNESSES or gate == float("inf"):
        blocks = best_blocks(q, k, w, k_scale, lo, hi, config, tiles=tiles, interpret=interpret)
        return CallSetup(group(blocks), keyside, lo, hi)
    plain_cfg = config.replace(block_witnesses=0)
    plain = group(None)
    plan = sampled_plan(q, k, w, k_scale, lo, hi, plain_cfg, witnesses=plain,
                        tau_floor=tau_floor, tiles=tiles, splits=splits, interpret=interpret,
                        keyside=keyside)
    _, _, use = gate_decision(plan, gate)
    cfg_w = config.replace(block_witnesses=AUTO_BLOCK_WITNESSES)
    m = min(AUTO_BLOCK_WITNESSES // config.witness_block, -(-N // config.witness_block))
    blocks = lax.cond(use, lambda: best_blocks(q, k, w, k_scale, lo, hi, cfg_w, tiles=tiles,
                                               interpret=interpret),
                      lambda: jnp.full((T, m), -1, jnp.int32))
    return CallSetup(Witnesses(group(blocks), plain, use), keyside, lo, hi, plan)


def use_block_witnesses(tau_gap, mean_range, gate: float, W: int):
    """Whether a call adds ``W`` block witnesses (a traced bool): its τ gap (the share of a
    query's keys above its seed τ beyond its K) times its mean key range exceeds ``gate``
    keys per witness: the keys that a τ near τ* would take out of the refinement outnumber
    ``gate``·W, the cost of ranking the blocks and seeding from 2·W more keys per group."""
    return tau_gap * mean_range > gate * W


def gate_decision(plan, gate: float):
    """(τ gap, mean key range, use) of a call from its plain :func:`sampled_plan`: whether
    :func:`use_block_witnesses` adds :data:`AUTO_BLOCK_WITNESSES` at ``gate``."""
    gap, rng = sampled_tau_gap(plan), sampled_mean_range(plan)
    return gap, rng, use_block_witnesses(gap, rng, gate, AUTO_BLOCK_WITNESSES)


def plan_cost_terms(plan, H: int):
    """:func:`predicted_cost_terms` from a :func:`sampled_plan`."""
    return predicted_cost_terms(plan["direct_g"], plan["rows_g"], plan["use_g"], plan["range_g"],
                                H)


def _switch_terms(q, k, w, k_scale, lo, hi, config, setup: CallSetup, *, tau_floor, **wave_kw):
    """The dense switch's cost terms of the call: from the gate's plain plan when the call
    goes without block witnesses (no second sampled plan), else from the plan with them."""
    wit = setup.witnesses
    full = lambda ids: predicted_call_terms(q, k, w, k_scale, lo, hi, config, witnesses=ids,
                                            tau_floor=tau_floor, **wave_kw)
    if setup.plain_plan is None:
        return full(wit)
    plain = plan_cost_terms(setup.plain_plan, q.shape[1])
    return lax.cond(wit.use_ids, lambda: full(wit.ids), lambda: plain)


def call_cost_terms(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(), splits=None,
                    interpret=None, hint=None):
    """:func:`predicted_cost_terms` of a :func:`dosa_topk` call (what its dense switch
    weighs), for calibrating the cost model's constants (``benchmarks`` matrix)."""
    check_tiles(tiles)
    kw = dict(tiles=tiles, splits=splits, interpret=interpret)
    setup = _call_setup(q, k, w, k_scale, lo, hi, config, hint, **kw)
    return _switch_terms(q, k, w, k_scale, setup.lo, setup.hi,
                         config.replace(block_witnesses=0), setup, tau_floor=None,
                         keyside=setup.keyside, **kw)


def call_block_witness_gate(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(),
                            splits=None, interpret=None, hint=None):
    """What the gate of ``Config.block_witnesses=None`` weighs for a call, as float32 [3]:
    its τ gap without block witnesses (:func:`sampled_tau_gap`), its sampled mean key range
    and whether :func:`use_block_witnesses` adds them at :func:`block_witness_gate` (``config``'s
    gate; with none set, the GPU's :data:`BLOCK_WITNESS_GATE` also in interpret mode) —
    the ``benchmarks`` matrix's columns."""
    check_tiles(tiles)
    plain = config.replace(block_witnesses=0)
    kw = dict(tiles=tiles, splits=splits, interpret=interpret)
    setup = _call_setup(q, k, w, k_scale, lo, hi, plain, hint, **kw)
    plan = sampled_plan(q, k, w, k_scale, setup.lo, setup.hi, plain, witnesses=setup.witnesses,
                        keyside=setup.keyside, **kw)
    gap, rng, use = gate_decision(plan, block_witness_gate(config, interpret=False))
    return jnp.stack([gap, rng, use.astype(jnp.float32)])


def _in_waves(fn, q, k, w, k_scale, lo, hi, config, Tw: int, wit, floor=None):
    """``fn(q, k, w, k_scale, lo, hi, config, witnesses=..., tau_floor=...)`` on waves of
    ``Tw`` queries (``lax.map``, one wave's lists live at a time), outputs concatenated over
    the queries."""
    T = q.shape[0]
    if Tw >= T:
        return fn(q, k, w, k_scale, lo, hi, config, witnesses=wit, tau_floor=floor)
    n = -(-T // Tw)
    pad = n * Tw - T

    def per_wave(a):      # [G4, W] -> per wave [Tw/4, W] (padded queries: no witnesses)
        if a is None:
            return None
        a = jnp.pad(a, ((0, n * Tw // 4 - a.shape[0]), (0, 0)), constant_values=-1)
        return a.reshape(n, Tw // 4, -1)
    use = wit.use_ids if isinstance(wit, Witnesses) else None
    wit = (per_wave(wit.ids), per_wave(wit.plain)) if use is not None else (per_wave(wit), None)
    padq = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
    # padded queries see nothing (empty range): they are answered and dropped
    waves = (padq(q).reshape((n, Tw) + q.shape[1:]), padq(w).reshape((n, Tw) + w.shape[1:]),
             padq(lo).reshape(n, Tw), padq(hi).reshape(n, Tw), wit,
             None if floor is None else padq(floor).reshape(n, Tw))

    def one(args):
        qw, ww, low, hiw, (ws, wp), fw = args
        ws = ws if use is None else Witnesses(ws, wp, use)
        return fn(qw, k, ww, k_scale, low, hiw, config, witnesses=ws, tau_floor=fw)

    out = lax.map(one, waves)
    return jax.tree_util.tree_map(lambda a: a.reshape((n * Tw,) + a.shape[2:])[:T], out)


def sampled_plan(q, k, w, k_scale, lo, hi, config, *, witnesses, tau_floor=None, **wave_kw):
    """The plans of every g-th group of 4 queries of the call (about
    :data:`SWITCH_SAMPLE_GROUPS` groups): their seeds, τ, planner sample, budgets, dense-group
    rule, predicted survivor unions and τ gaps, as their waves would build them (the
    ``stop_after="plan"`` dict of :func:`_dosa_wave`; queries past T have empty ranges)."""
    T = q.shape[0]
    G4 = -(-T // 4)
    groups = np.arange(0, G4, max(1, G4 // SWITCH_SAMPLE_GROUPS))
    qi = (groups[:, None] * 4 + np.arange(4)).reshape(-1)
    real = jnp.asarray(qi < T)
    qi = np.minimum(qi, T - 1)
    wit = None if witnesses is None else witnesses[groups]     # [G4, W] ids (no Witnesses)
    return _dosa_wave(q[qi], k, w[qi], k_scale, jnp.where(real, lo[qi], 0),
                      jnp.where(real, hi[qi], 0), config, stop_after="plan", witnesses=wit,
                      tau_floor=None if tau_floor is None else tau_floor[qi], **wave_kw)


def predicted_call_terms(q, k, w, k_scale, lo, hi, config, *, witnesses, tau_floor=None,
                         **wave_kw):
    """:func:`predicted_cost_terms` of the call from its :func:`sampled_plan`."""
    return plan_cost_terms(sampled_plan(q, k, w, k_scale, lo, hi, config, witnesses=witnesses,
                                        tau_floor=tau_floor, **wave_kw), q.shape[1])


def sampled_tau_gap(plan) -> jax.Array:
    """The call's τ gap from its :func:`sampled_plan`: the mean, over the sampled queries that
    see keys, of the share of a query's keys scoring ≥ its τ beyond its K, as its planner
    sample estimates it (0 for a query without τ). Such keys survive any bound; a τ nearer τ*
    (:data:`AUTO_BLOCK_WITNESSES`) removes them."""
    seen = plan["range_q"] > 0
    return jnp.sum(jnp.where(seen, plan["tau_gap_q"], 0.0)) / jnp.maximum(jnp.sum(seen), 1)


def sampled_mean_range(plan) -> jax.Array:
    """The mean key range (hi − lo) of the sampled queries that see keys, float32, from a
    :func:`sampled_plan`."""
    r = plan["range_q"].astype(jnp.float32)
    return jnp.sum(r) / jnp.maximum(jnp.sum(r > 0), 1)


def _dense_pass(idx, sc, stats, direct, theta, q, w, k, k_scale, lo, hi, *, K: int,
                tiles: Tiles, interpret, keyside: "KeySide"):
    """Answer the queries of ``direct`` groups by the dense scan over the whole call from their
    θ₀ (:func:`dense_rows`), exact."""
    idx, sc, records = dense_rows(direct, theta, idx, sc, stats.records, q, w, k, k_scale, lo, hi,
                                  K=K, tiles=tiles, interpret=interpret, keyside=keyside)
    return idx, sc, stats._replace(
        records=records, tau_final=jnp.where(idx[:, K - 1] >= 0, sc[:, K - 1], -jnp.inf))


#: Groups of 4 queries per dense scan of :func:`dense_rows`' chunks: few enough that the scan
#: splits the keys finely (:func:`pallas_kernels.dense.default_splits`: 33 splits for 16
#: groups), so a handful of chosen groups is not one long program per group over every key.
DENSE_ROW_GROUPS = 16
#: Above this many chosen groups :func:`dense_rows` scans the whole call at once instead (one
#: program per chosen group over its range fills the GPU by then; estimated from H200 calls
#: at N = 1M (BENCHMARKS.md): a chunk of 16 groups ≈ 2.4 ms, one whole-call scan ≈ 190 ms
#: however few groups).
DENSE_ROW_CHUNKED_MAX = 512


def dense_rows(rows, theta, idx, sc, records, q, w, k, k_scale, lo, hi, *, K: int, tiles: Tiles,
               interpret, keyside: "KeySide", chunk_groups: int = DENSE_ROW_GROUPS,
               chunked_max: int = DENSE_ROW_CHUNKED_MAX):
    """The rows ``rows`` [T] bool (whole groups of 4) of (idx, sc, records) replaced by the
    dense scan's exact Top-K from θ₀ = ``theta`` [T] (order keys, each a lower bound on the
    query's τ* or ``THETA_NONE``) and its record counts; the other rows unchanged.

    Up to ``chunked_max`` chosen groups are gathered ``chunk_groups`` at a time and each
    chunk is one dense scan of its few queries with the keys split over many programs, so
    the time follows the number of chosen groups (a loop of ⌈groups / chunk⌉ scans, none
    when no row is chosen). More chosen groups are answered by one scan of the whole call
    with the other groups' ranges empty (one program per group and key split). With no row
    chosen the call costs one conditional (no loop is entered).
    """
    T = q.shape[0]
    Tp = round_up_to(T, 4)
    G4 = Tp // 4
    R = max(1, min(chunk_groups, G4))
    rows = rows.astype(bool)
    rows_g = jnp.any(jnp.pad(rows, (0, Tp - T)).reshape(G4, 4), axis=1)
    n_groups = jnp.sum(rows_g.astype(jnp.int32))
    lanes = jnp.arange(4, dtype=jnp.int32)
    prep = functools.partial(prepare_operands, BQ=tiles.BQ, layout=tiles.layout,
                             widen_fp8=tiles.widen_fp8, lane_sums=tiles.lane_sums,
                             keys=keyside.operands)

    def chunked(carry):
        n_chunks = -(-min(G4, max(chunked_max, 1)) // R)
        order = jnp.nonzero(rows_g, size=n_chunks * R, fill_value=G4)[0].astype(jnp.int32)

        def chunk(i, carry):
            idx, sc, records = carry
            g = lax.dynamic_slice(order, (i * R,), (R,))
            qi = (g[:, None] * 4 + lanes[None, :]).reshape(-1)
            qc = jnp.minimum(qi, T - 1)
            valid = (qi < T) & rows[qc]
            d_idx, d_sc, cand = dense_mod.topk_from_operands(
                prep(q[qc], w[qc], k, k_scale), jnp.where(valid, lo[qc], 0),
                jnp.where(valid, hi[qc], 0), theta[qc], K, tiles=tiles, interpret=interpret,
                return_candidates=True)
            at = jnp.where(valid, qc, T)          # rows not chosen: dropped
            n = jnp.sum(cand.appended[:4 * R], axis=1).astype(records.dtype)
            return (idx.at[at].set(d_idx, mode="drop"), sc.at[at].set(d_sc, mode="drop"),
                    records.at[at].set(n, mode="drop"))

        return lax.fori_loop(0, (n_groups + R - 1) // R, chunk, carry)

    def whole(carry):
        idx, sc, records = carry
        d_idx, d_sc, cand = dense_mod.topk_from_operands(
            prep(q, w, k, k_scale), jnp.where(rows, lo, 0), jnp.where(rows, hi, 0), theta, K,
            tiles=tiles, interpret=interpret, return_candidates=True)
        n = jnp.sum(cand.appended[:T], axis=1).astype(records.dtype)
        return (jnp.where(rows[:, None], d_idx, idx), jnp.where(rows[:, None], d_sc, sc),
                jnp.where(rows, n, records))

    def some(carry):
        if chunked_max >= G4:
            return chunked(carry)
        return lax.cond(n_groups > chunked_max, whole, chunked, carry)

    # nothing chosen (the usual case): one predicate, as cheap as a call without rescans
    return lax.cond(n_groups > 0, some, lambda c: c, (idx, sc, records))


def _dense_call(q, w, k, k_scale, lo, hi, config, *, tiles: Tiles, interpret, keyside: "KeySide",
                witnesses, tau_floor=None):
    """Every query by the dense scan from θ₀ = its seed τ (witnesses included; raised to
    ``tau_floor``), exact; the call-level decision's path when screening cannot pay
    (``Stats.dense`` set)."""
    T, K = q.shape[0], config.top_k
    ops = prepare_operands(q, w, k, k_scale, tiles.BQ, layout=tiles.layout,
                           widen_fp8=tiles.widen_fp8, lane_sums=tiles.lane_sums,
                           keys=keyside.operands)
    tau_key, n_eligible, n_seeds = seed_tau_key(ops, lo, hi, config, tiles=tiles,
                                                interpret=interpret, witnesses=witnesses)
    tau_key, have_tau = floored_tau_key(tau_key, n_eligible >= K, tau_floor)
    theta0 = jnp.where(have_tau, tau_key, THETA_NONE)
    idx, sc, cand = dense_mod.topk_from_operands(ops, lo, hi, theta0, K, tiles=tiles,
                                                 interpret=interpret, return_candidates=True)
    n_vis = hi - lo
    zero = jnp.zeros((T,), jnp.int32)
    nonempty = n_vis > 0
    stats = Stats(visible=n_vis, seeds=n_seeds[:T], screened=n_vis, survivors=n_vis,
                  records=jnp.sum(cand.appended[:T], axis=1), rounds=jnp.ones((T,), jnp.int32),
                  overflows=zero, recoveries=zero, pruning=jnp.zeros((T,), bool),
                  budget=zero, tau_seed=jnp.full((T,), -jnp.inf, jnp.float32),
                  tau_final=jnp.where(idx[:, K - 1] >= 0, sc[:, K - 1], -jnp.inf),
                  dense=nonempty, predicted_cost=jnp.full((T,), jnp.nan, jnp.float32))
    return idx, sc, stats


def budget_block(classes, A: int, T: int, tiles: Tiles) -> int:
    """Consecutive queries of a wave of ``T`` that share one automatic budget
    (``tiles.budget_share``): all ``T`` ("wave"), the largest screening program of the
    classes ("program") or 1 ("query")."""
    if tiles.budget_share == "wave":
        return max(T, 1)
    if tiles.budget_share == "program":
        return max(_class_program_queries(classes, A, T, tiles).values())
    return 1


def _class_program_queries(classes, A: int, T: int, tiles: Tiles) -> dict:
    """Queries per screening program of each budget class (a power of two)."""
    return {c: screen_queries_per_program(screen_rows(c, A, tiles.screen_layout), T,
                                          tiles.screen_layout, tiles.screen_bq or None)
            for c in classes}


def screen_by_budget(plan, budget, classes, agg_cols, agg_w, coef, eps, tau, prune, lo, hi, ops,
                     knorm, *, splits: int, capacity: int, single_piece: bool, tiles: Tiles,
                     interpret=None) -> Survivors:
    """The screen with queries of similar budgets sharing tiles (paper Sec. 3).

    The plan rows are sized for the largest candidate budget; a query with budget r
    has nonzero rows only in its first r. Each screening program (``BQs`` queries, a
    multiple of the refinement group) runs in the kernel of its *class*: the largest
    budget among its screening queries, with the plan rows cut to that budget (``Rp``
    = r + A columns, a power of two by :func:`screen_friendly_budget`). One kernel per
    candidate budget; programs of other classes see no keys there and the kernels
    write one mask buffer in turn, which one compaction turns into survivor lists.
    The MMA width and the bound's epilogue then follow the budgets actually chosen (the
    largest candidate had made every program as wide as the dense scan). The bound of a
    query is the same function with fewer zero rows; the enclosure (``coef``) is sized
    for the largest budget.

    Args:
      plan: the planner's ScreeningPlan ([T, R, D] rows); budget: [T] chosen budgets;
      classes: the candidate budgets (static, all ≤ R); agg_cols, agg_w: the aggregate
        columns (:func:`pallas_kernels.screen.aggregate_columns`); lo, hi: [T] screening
        ranges (empty for queries that skip the screen).
    """
    T = lo.shape[0]
    Dp = ops.k.shape[-1]
    classes = tuple(sorted(set(int(c) for c in classes)))
    A = agg_cols.shape[1]
    bqs = _class_program_queries(classes, A, T, tiles)

    def operands(c, Tq):   # the plan rows cut to budget c (all of them for the largest class)
        padq = lambda a, v=0: jnp.pad(a, ((0, Tq - T),) + ((0, 0),) * (a.ndim - 1),
                                      constant_values=v)
        return prepare_screen(padq(plan.rows[:, :c]), padq(plan.row_weights[:, :c]),
                              padq(agg_cols), padq(agg_w), padq(coef), padq(eps),
                              padq(tau, jnp.inf), padq(prune), Dp, single_piece=single_piece,
                              layout=tiles.screen_layout, BQs=bqs[c],
                              lane_sums=tiles.screen_lane_sums)

    # packed masks (two groups per byte) when every class's programs are "kc" 8-query ones
    pack = tiles.screen_pack and all(can_pack(tiles.screen_layout, b) for b in bqs.values())
    kw = dict(splits=splits, BK=tiles.screen_bk or tiles.BK, num_warps=tiles.screen_warps,
              num_stages=tiles.screen_stages or tiles.num_stages, interpret=interpret,
              defer=tiles.screen_defer, pack=pack)
    run = lambda sops, l, h, into=None: screen_masks(sops, l, h, ops.k, knorm, ops.scale,
                                                     masks_into=into, **kw)
    if len(classes) == 1:
        masks, per_query = run(operands(classes[0], T), lo, hi)
    else:
        # programs: blocks of the largest program size of the classes (sizes are powers of two)
        B = max(bqs.values())
        Tb = round_up_to(T, B)
        pad = lambda a: jnp.pad(a, (0, Tb - T))
        screening = hi > lo
        qb = jnp.where(screening, budget, classes[0])
        need = jnp.max(pad(qb).reshape(Tb // B, B), axis=1)
        # the smallest class holding the program's largest budget (the largest class holds every
        # budget: the plan rows are sized for it), so no program is left out of every kernel
        cls = jnp.asarray(classes, jnp.int32)
        blk = cls[jnp.minimum(jnp.searchsorted(cls, need), len(classes) - 1)]
        blk = jnp.repeat(blk, B)                                           # [Tb] program class
        masks = per_query = None
        for c in classes:
            on = blk == c
            masks, pq = run(operands(c, Tb), jnp.where(on, pad(lo), 0), jnp.where(on, pad(hi), 0),
                            masks)
            per_query = pq if per_query is None else jnp.where(on[:, None], pq, per_query)
    packed, count = compact_masks(masks, lo, hi, splits=splits, capacity=capacity,
                                  chunk=tiles.compact_chunk,
                                  chunks_per_program=tiles.compact_chunks, packed=pack,
                                  count_chunks=tiles.count_chunks,
                                  interpret=interpret)
    return Survivors(packed, count, per_query[:T])


def seed_tau_key(ops, lo, hi, config, *, tiles: Tiles, interpret=None, witnesses=None):
    """τ of every query as an order key from its group's seed list (Eq. 2; the layout of
    ``config``'s strategy, then ``witnesses``), scored by the seed kernel with the shared
    routine; a :class:`Witnesses` picks its ids or the plain ones by ``lax.cond`` (the other
    seed stage is compiled, not run). Returns (τ keys [T], eligible seeds [T], seeds per
    query)."""
    if isinstance(witnesses, Witnesses):
        one = lambda wit: seed_tau_key(ops, lo, hi, config, tiles=tiles, interpret=interpret,
                                       witnesses=wit)
        return lax.cond(witnesses.use_ids, lambda: one(witnesses.ids),
                        lambda: one(witnesses.plain))
    S0, a, b = seed_sizes(config)
    lists, lcount, n_seeds = group_seed_lists(lo, hi, ops.q.shape[1] // ops.H, S0, a, b,
                                              tiles.BK, witnesses)
    tau_key, n_eligible = seed_threshold(ops, lists, lcount, config.top_k, tiles=tiles,
                                         interpret=interpret)
    return tau_key, n_eligible, n_seeds


def anchor_topk(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles, interpret=None):
    """Exact Top-K ids [A, K] of the anchor queries (:func:`dosa_jax.witnesses.anchor_topk`)
    by the dense kernel, or None when anchors are off for T queries.

    Each key split spans ≥ 32·K keys: a split's record buffer must take K records before
    its threshold rises, so much shorter splits spend most of the scan in compactions.
    """
    s = config.anchors(q.shape[0])
    if not s:
        return None
    A, N = -(-q.shape[0] // s), k.shape[0]
    S = max(1, min(dense_mod.default_splits(A, N, tiles.BQ, tiles.BK),
                   N // (32 * config.top_k)))
    dense = lambda *a: dense_mod.dense_topk(*a, tiles=tiles, splits=S, interpret=interpret)
    return witnesses_mod.anchor_topk(dense, q, k, w, k_scale, lo, hi, config)


def best_blocks(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles, interpret=None):
    """Each query's best key blocks [T, m] (:func:`dosa_jax.witnesses.best_blocks`), the
    block means ranked by the dense kernel; None when ``config.block_witnesses`` is 0."""
    if not config.block_witnesses:
        return None
    dense = lambda *a: dense_mod.dense_topk(*a, tiles=tiles, interpret=interpret)
    return witnesses_mod.best_blocks(dense, q, k, w, k_scale, lo, hi, config)


class KeySide(NamedTuple):
    """What DoSA computes from the keys alone, once per call (not once per wave)."""

    operands: tuple         # prepare_key_operands: (MMA pieces [Pk, N, Dp], scale [N])
    norm: jax.Array         # [N] n_i ≥ ‖k̄_i‖ (dosa_jax.keys.key_summary)
    bad_prefix: object      # [N + 1] int32 prefix count of invalid scales, None without scales


def key_side(k, k_scale, tiles: Tiles) -> "KeySide":
    """:class:`KeySide` of the keys (widened pieces, and :func:`dosa_jax.keys.key_summary`)."""
    summary = key_summary(k, k_scale)
    return KeySide(prepare_key_operands(k, k_scale, widen_fp8=tiles.widen_fp8),
                   summary.norm, summary.bad_prefix)


def _dosa_wave(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles, splits, interpret,
               keyside: "KeySide", return_details: bool = False, stop_after=None,
               witnesses=None, defer_direct: bool = False, tau_floor=None):
    """One wave of :func:`dosa_topk` (all of its queries' lists live at once), with the
    call's :func:`key_side`."""
    K = config.top_k
    T, H, D = q.shape
    N = k.shape[0]
    # the screen's rows are one bf16 MMA piece when the retained rows q_j are exact in
    # bf16 (bf16 or FP8 queries); the negative aggregate then takes two rows (hi, lo)
    single = jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))
    absolute = config.certificate_form == "absolute"
    hi_only = single and tiles.aggregate_hi_only
    A = aggregate_column_count(single, absolute, hi_only)
    config = screen_friendly(config, H, A=A)
    S = splits or dense_mod.default_splits(T, N, tiles.BQ, tiles.BK)
    ops = prepare_operands(q, w, k, k_scale, tiles.BQ, layout=tiles.layout,
                           widen_fp8=tiles.widen_fp8, lane_sums=tiles.lane_sums,
                           keys=keyside.operands)
    Tpad4 = ops.q.shape[1] // ops.H
    G4 = Tpad4 // 4
    lo = lo.astype(jnp.int32)
    hi = hi.astype(jnp.int32)

    # 1. seeds: τ = K-th largest seed score (Eq. 2), scored by the shared routine
    tau_key, n_eligible, n_seeds = seed_tau_key(ops, lo, hi, config, tiles=tiles,
                                                interpret=interpret, witnesses=witnesses)
    tau_key, have_tau = floored_tau_key(tau_key, n_eligible >= K, tau_floor)
    tau = jnp.where(have_tau, _score_key(tau_key), -jnp.inf)
    if stop_after == "seeds":
        return dict(tau=tau, count=n_eligible)

    # 2. plan (query side) + this backend's arithmetic allowance
    knorm = keyside.norm
    sample = plan_sample(*plan_sample_dots(q, k, lo, hi, config, mma=tiles.plan_sample_mma),
                         knorm, k_scale)
    p, sdots, snorm, svalid = sample
    # the automatic budget, priced for this backend: one budget for the whole wave (one
    # screen class per wave: each class present costs its kernel's full latency) or per
    # screening program (tiles.budget_share), survivors weighted by κ
    B = budget_block(config.budgets(H), A, T, tiles)
    kappa = survivor_cost(config)
    plan, details, budget = build_plan(q.astype(jnp.float32), w, p, config, sample_dots=sdots,
                                       sample_norms=snorm, sample_valid=svalid, tau=tau,
                                       program_queries=B, survivor_weight=kappa)
    # the negative aggregate as ReLU columns with weights ±1 (split into bf16 hi + lo with
    # bf16/FP8 queries), summed by the screen like the retained heads
    agg_cols, agg_w, agg_err = aggregate_columns(plan.aggregate, plan.aggregate_linear,
                                                 split=single, absolute=absolute,
                                                 hi_only=hi_only)
    eps = nm.upper_sum(plan.eps_raw, jnp.float32(
        4.0 * D * agg_cols.shape[1] * nm.ETA32))   # the extra columns' flushed results
    coef = knum.kernel_coefficient(q, w, plan, k.dtype, single_piece=single, aggregate=agg_cols,
                                   aggregate_error=agg_err)
    bad_scale = scale_fault(keyside.bad_prefix, lo, hi)
    prune = (plan.prune & have_tau & ~bad_scale & jnp.isfinite(coef) & jnp.isfinite(tau)
             & jnp.isfinite(eps))
    # a query that cannot prune is scanned densely from θ₀ = its floor (certified elsewhere)
    theta_tau = jnp.where(prune, tau_key,
                          THETA_NONE if tau_floor is None else floor_key(tau_floor))
    # queries that cannot prune, or whose sample says most keys survive, go straight to
    # the dense scan (from θ₀ = τ) with their group of 4: exact either way, only faster
    est = jax.vmap(estimated_survival)(sdots, snorm, svalid, tau, details)
    nonempty = hi > lo
    direct_q = nonempty & (~prune | (est > DIRECT_SURVIVAL))
    direct_g = jnp.any(jnp.pad(direct_q, (0, Tpad4 - T)).reshape(G4, 4), axis=1)
    # a group whose survivor list would likely overflow may go too (its union, not any one
    # query, fills the list); the rule is off by default (DIRECT_LIST_USE) and then costs nothing
    Cs = survivor_capacity(N, T, S, K, config.capacity)
    use = None
    if DIRECT_LIST_USE != float("inf") or stop_after == "plan":
        kept = jax.vmap(sample_survivors)(sdots, snorm, svalid, tau, details)   # [T, P]
        use = predicted_list_use(kept, svalid, lo, hi, Tpad4)
    if DIRECT_LIST_USE != float("inf"):
        direct_g = direct_g | (use > DIRECT_LIST_USE * Cs * S)
    direct = jnp.repeat(direct_g, 4)[:T]
    if stop_after == "plan":   # the call-level decision's inputs (:func:`predicted_cost_ratio`)
        rows = jnp.where(nonempty, budget + A, 0)
        rows_g = jnp.max(jnp.pad(rows, (0, Tpad4 - T)).reshape(G4, 4), axis=1)
        _, glo, ghi, _ = group_ranges(jnp.pad(lo, (0, Tpad4 - T)).reshape(G4, 4),
                                      jnp.pad(hi, (0, Tpad4 - T)).reshape(G4, 4))
        return dict(direct_g=direct_g, rows_g=rows_g, use_g=use, range_g=ghi - glo,
                    range_q=jnp.where(nonempty, hi - lo, 0),
                    tau_gap_q=jnp.where(prune, sample_tau_gap(sdots, svalid, w, tau, hi - lo, K),
                                        0.0))

    # 3. screen (direct groups see no keys here), one kernel per budget class
    slo = jnp.where(direct, 0, lo)
    shi = jnp.where(direct, 0, hi)
    surv = screen_by_budget(plan, budget, config.budgets(H), agg_cols, agg_w, coef, eps, tau,
                            prune, slo, shi, ops, knorm, splits=S, capacity=Cs,
                            single_piece=single, tiles=tiles, interpret=interpret)
    slists, scount = surv.packed[:G4], surv.count[:G4]
    overflow_g = jnp.any(scount > slists.shape[-1], axis=1)
    if stop_after == "screen":
        return dict(tau=tau, count=jnp.repeat(scount, 4, axis=0)[:T],
                    overflow=jnp.repeat(overflow_g, 4)[:T], direct=direct, budget=budget)

    # 4. refine survivors: s ≥ τ records, online threshold (record buffers of the recovery's
    # size, also when the refinement tiles are longer than the dense ones)
    C = capacity_for(K, max(tiles.BK, tiles.refine_bk), tiles.record_slots or None)
    cand = refine(ops, slists, scount, theta_tau, K, capacity=C, tiles=tiles, interpret=interpret)
    if stop_after == "refine":
        return dict(tau=tau, count=cand.count[:T], key=cand.key[:T])

    # 5. exact selection of the records; then recovery: overflowed (and, without
    # ``defer_direct``, direct) groups are answered by the dense scan from θ₀ = τ (exact,
    # counted); with ``defer_direct`` the direct groups are left to the caller's one dense
    # pass over the whole call
    overflow = jnp.repeat(overflow_g, 4)[:T]
    recover = overflow if defer_direct else overflow | direct
    idx, sc = rec.select_from_records(cand.key, cand.ids, cand.count, K)
    idx, sc, n_records = dense_rows(recover, theta_tau, idx, sc, jnp.sum(cand.appended, axis=1),
                                    q, w, k, k_scale, lo, hi, K=K, tiles=tiles,
                                    interpret=interpret, keyside=keyside)

    n_vis = hi - lo
    kth = idx[:, K - 1] >= 0
    rint = (recover | direct).astype(jnp.int32)
    survivors = jnp.sum(surv.per_query, axis=1)
    stats = Stats(visible=n_vis, seeds=n_seeds[:T], screened=n_vis,
                  survivors=jnp.where(recover | direct, n_vis, survivors),
                  records=n_records, rounds=1 + rint,
                  overflows=overflow.astype(jnp.int32), recoveries=rint, pruning=prune,
                  budget=budget,
                  tau_seed=jnp.where(prune, tau, -jnp.inf),
                  tau_final=jnp.where(kth, sc[:, K - 1], -jnp.inf),
                  dense=direct, predicted_cost=jnp.full((T,), jnp.nan, jnp.float32))
    if defer_direct:
        return idx, sc, stats, direct, theta_tau
    if return_details:
        return idx, sc, stats, dict(plan=plan, coef=coef, eps=eps, surv=surv, cand=cand,
                                    tau_key=tau_key, Cs=Cs, splits=S, direct=direct,
                                    estimated_survival=est, predicted_list_use=use,
                                    aggregate_columns=agg_cols,
                                    aggregate_weights=agg_w, single_piece=single)
    return idx, sc, stats


def dense_topk(q, k, w, k_scale, lo, hi, config, *, tiles: Tiles = Tiles(), splits=None,
               interpret=None, seeded=None, return_candidates: bool = False):
    """Exact Top-K by the dense fused Pallas indexer (``dosa_jax.dense_topk``, pallas backend).

    Same scoring routine and tile as :func:`dosa_topk`: indices and scores agree bitwise.

    ``seeded``: start each query's online threshold at θ₀ = the K-th largest score of its
    seed set (``config``'s seeds, scored by the seed kernel with the same routine) instead of
    −∞. θ₀ is the K-th largest of K real scores of visible keys, so θ₀ ≤ τ* and the answer is
    the same (the threshold accepts keys ≥ θ₀); the scan appends and compacts far less.
    ``None`` (default): seeded when ``tiles.BQ`` is 4 (the seed lists' group); this is
    the baseline DoSA is compared against.
    ``return_candidates``: also return the scan's record buffers (``dense.Candidates``).
    """
    _check_size(k.shape[0])
    if seeded is None:
        seeded = tiles.BQ == 4
    if not seeded:
        return dense_mod.dense_topk(q, k, w, k_scale, lo, hi, config, tiles=tiles,
                                    splits=splits, interpret=interpret,
                                    return_candidates=return_candidates)
    check_tiles(tiles)
    lo = lo.astype(jnp.int32)
    hi = hi.astype(jnp.int32)
    ops = prepare_operands(q, w, k, k_scale, tiles.BQ, layout=tiles.layout,
                           widen_fp8=tiles.widen_fp8, lane_sums=tiles.lane_sums)
    tau_key, n_eligible, _ = seed_tau_key(ops, lo, hi, config, tiles=tiles, interpret=interpret)
    theta0 = jnp.where(n_eligible >= config.top_k, tau_key, THETA_NONE)
    return dense_mod.topk_from_operands(ops, lo, hi, theta0, config.top_k, splits=splits,
                                        tiles=tiles, interpret=interpret,
                                        return_candidates=return_candidates)


__all__ = ["dosa_topk", "dense_topk", "survivor_capacity", "wave_size", "INT32_MIN"]
