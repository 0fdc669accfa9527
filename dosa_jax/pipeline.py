"""The reference DoSA pipeline (paper Algorithm 1, Theorem 1; SPEC §3–§10).

Per tile of queries:

1. **seeds** — score a layout of ≥ K distinct visible keys with the canonical
   scorer; τ = their K-th score (Eq. 2); the seeds start the running Top-K.
2. **plan** — activation frequencies, budget, certificate rows and numeric
   enclosure (``dosa_jax.planner``).
3. **rounds** — each round scans the key blocks from the query's resume
   position: screening rejects keys with ``U^num < τ`` (strict); survivors go
   into a candidate buffer of fixed capacity. When the buffer is full, the
   first survivor that did not fit becomes the next round's resume position —
   candidates are never dropped, they wait for the next round. The buffer is
   then refined (full score, keep ``s ≥ τ``) and merged exactly into the
   running Top-K (``select_records``, tie order score desc / index asc), after
   which τ may rise to the running K-th score (still ≤ τ*).
4. **faults** — a plan with non-finite values, an invalid key scale in the
   visible range (``α ≤ 0``, NaN, inf) or a non-finite bound met during the scan
   disables pruning for that query: it is answered by full-domain recovery
   (τ = −∞, running Top-K reset to the seeds, the scan restarted from ``lo`` so
   that keys rejected before the fault was seen are scored too). Counted.

Every score comes from ``scorer.score_ids`` on [Tq, key_block] blocks — the
same routine as the dense path — so ``topk == dense_topk`` bitwise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax import enclosure as enc
from dosa_jax import seeds as seeds_mod
from dosa_jax.bounds.heads import activation_frequencies
from dosa_jax.planner import build_plan
from dosa_jax.scorer import score_ids, score_ids_blocked
from dosa_jax.screen import screening_bound, survives
from dosa_jax.selection import select_records


class Stats(NamedTuple):
    """Per-query statistics ([T] arrays) returned in ``TopKResult.stats``.

    visible: |Ω|. seeds: seed keys scored. screened: non-seed visible keys
    (each screened once unless recovered). survivors: keys that passed
    screening and were fully scored. records: survivors with s ≥ τ. rounds:
    scan rounds (1 without overflow). overflows: rounds that ended with a full
    candidate buffer (resolved by exact merging). recoveries: full-domain
    recoveries after a fault. pruning: whether rejection was enabled at the
    end. budget: retained heads r. tau_seed: seed threshold τ (−inf when not
    pruning). tau_final: K-th selected score (τ* when ≥ K eligible keys).
    dense: the query was answered by the dense scan from θ₀ = τ because the plan
    predicted that screening could not pay (its group's sampled survival, or the
    whole call's predicted cost; ``Config.dense_switch``); exact either way.
    predicted_cost: the call's predicted ratio of DoSA's time to the dense scan's
    (the same on every query; NaN where no prediction was made).
    """

    visible: jax.Array
    seeds: jax.Array
    screened: jax.Array
    survivors: jax.Array
    records: jax.Array
    rounds: jax.Array
    overflows: jax.Array
    recoveries: jax.Array
    pruning: jax.Array
    budget: jax.Array
    tau_seed: jax.Array
    tau_final: jax.Array
    dense: jax.Array
    predicted_cost: jax.Array


class KeyData(NamedTuple):
    """Keys padded to a multiple of the block, with per-key summaries."""

    k: jax.Array          # [Npad, D] payloads (input dtype)
    scale: object         # [Npad] float32 or None
    norm_up: jax.Array    # [Npad] n_i ≥ ‖k̄_i‖
    bad_prefix: jax.Array  # [N + 1] int32 prefix count of invalid scales


def round_up_to(x: int, m: int) -> int:
    return -(-x // m) * m


def prepare_keys(k, k_scale, block: int) -> KeyData:
    """Pad keys to a multiple of ``block`` and compute the key-side summaries once."""
    N = k.shape[0]
    npad = max(round_up_to(N, block), block)
    kp = jnp.pad(k, ((0, npad - N), (0, 0)))
    norm = enc.key_norm_upper(kp)
    if k_scale is None:
        return KeyData(kp, None, norm, jnp.zeros((N + 1,), jnp.int32))
    sp = jnp.pad(k_scale, (0, npad - N), constant_values=1.0)
    bad = (~enc.scale_is_valid(k_scale)).astype(jnp.int32)
    prefix = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad, dtype=jnp.int32)])
    return KeyData(kp, sp, norm, prefix)


def capacity(config, N: int) -> int:
    """Candidate buffer per query: Config.capacity or N/4 (≥ 2K and one block, ≤ 65536)."""
    B = config.key_block
    cap = config.capacity if config.capacity is not None else min(max(N // 4, 2 * config.top_k), 65536)
    return max(round_up_to(cap, B), B)


class TilePlan(NamedTuple):
    """Seeds, threshold and screening plan of one query tile (stages 1–2)."""

    layout: seeds_mod.SeedLayout
    seed_ids: jax.Array     # [Tq, S_pad]
    seed_valid: jax.Array   # [Tq, S_pad]
    seed_scores: jax.Array  # [Tq, S_pad]
    tau: jax.Array          # [Tq] seed threshold (Eq. 2)
    plan: object            # ScreeningPlan
    details: object         # PlanDetails
    budget: jax.Array       # [Tq]


def plan_tile(q, w, lo, hi, keys: KeyData, config, hint=None) -> TilePlan:
    """Stages 1–2 for a query tile: score the seeds, τ, activation frequencies, plan.

    ``hint`` [Tq, M] (optional) are extra witness keys, e.g. the previous decode
    step's selection: rescored for the current query, they join the seeds in τ
    (distinct visible keys only) but not the candidate set — the scan meets them
    again, so the running Top-K never holds a key twice.
    """
    B = config.key_block
    S_pad = round_up_to(config.seeds(), B)
    npad = keys.k.shape[0]
    layout = seeds_mod.seed_layout(lo, hi, config.seed_strategy, config.seeds(),
                                   config.sink_size, config.local_fraction)
    sid, svalid = seeds_mod.seed_ids(layout, S_pad)
    s_scores = score_ids_blocked(q, w, keys.k, keys.scale, sid, B)
    tau0 = seeds_mod.seed_threshold(s_scores, svalid, config.top_k)
    # Seeds are a biased sample (local and sink keys score high and share activation
    # patterns): p_h (head choice, majority support) and the automatic budget's survival
    # estimate use a strided sample of the visible range, scored in full (small). This
    # holds for a fixed budget too: p_h from the local window chose worse supports
    # (benchmarks/results/2026-11-29_cpu_slack_analysis.md).
    e_lay = seeds_mod.seed_layout(lo, hi, "strided", config.budget_sample, 0, 0.0)
    e_ids, sample = seeds_mod.seed_ids(e_lay, round_up_to(config.budget_sample, B))
    _, e_dots = score_ids_blocked(q, w, keys.k, keys.scale, e_ids, B, return_head_dots=True)
    sample = jnp.where(jnp.any(sample, axis=1, keepdims=True), sample, e_ids >= 0)
    p = jax.vmap(activation_frequencies)(e_dots, sample)
    s_norm = jnp.take(keys.norm_up, jnp.clip(e_ids, 0, npad - 1))
    s_dots = e_dots
    if keys.scale is not None:  # the head dots are on payloads: U in score units is α·U(k̄)
        s_alpha = jnp.take(keys.scale, jnp.clip(e_ids, 0, npad - 1))
        s_dots = s_dots * s_alpha[..., None]
        s_norm = s_norm * s_alpha
        sample = sample & enc.scale_is_valid(s_alpha)
    plan, details, budget = build_plan(q.astype(jnp.float32), w, p, config, sample_dots=s_dots,
                                       sample_norms=s_norm, sample_valid=sample, tau=tau0,
                                       survivor_weight=config.survivor_cost or 1.0)
    witnesses = [] if hint is None else [hint.astype(jnp.int32)]
    if config.guided_witnesses:
        witnesses.append(guided_witnesses(plan, lo, hi, keys, config))
    if witnesses:
        # extra witnesses join the seeds in τ only (distinct visible keys; Eq. 2)
        extra = jnp.concatenate(witnesses, axis=1)
        M = round_up_to(extra.shape[1], B)
        extra = jnp.pad(extra, ((0, 0), (0, M - extra.shape[1])), constant_values=-1)
        e_scores = score_ids_blocked(q, w, keys.k, keys.scale, extra, B)
        ok = seeds_mod.distinct_visible(jnp.concatenate([sid, extra], axis=1), lo, hi)
        tau0 = seeds_mod.seed_threshold(jnp.concatenate([s_scores, e_scores], axis=1), ok,
                                        config.top_k)
    return TilePlan(layout, sid, svalid, s_scores, tau0, plan, details, budget)


def guided_witnesses(plan, lo, hi, keys: KeyData, config):
    """Certificate-guided witnesses: the ``guided_witnesses`` keys with the largest
    bound U^num among a strided sample of ``guided_sample`` keys (cheap: r + d_a dot
    products each). High U tends to mean high s, so scoring them in full gives a
    threshold far above the seeds' where locality fails; any keys would be safe.
    """
    G = config.guided_sample
    lay = seeds_mod.seed_layout(lo, hi, "strided", G, 0, 0.0)
    ids, valid = seeds_mod.seed_ids(lay, G)
    npad = keys.k.shape[0]
    cid = jnp.clip(ids, 0, npad - 1)
    bound = screening_bound(plan, jnp.take(keys.k, cid, axis=0), jnp.take(keys.norm_up, cid),
                            None if keys.scale is None else jnp.take(keys.scale, cid))
    bound = jnp.where(valid & ~jnp.isnan(bound), bound, -jnp.inf)
    top = lax.top_k(bound, min(config.guided_witnesses, G))[1]
    return jnp.where(jnp.take_along_axis(valid, top, axis=1),
                     jnp.take_along_axis(ids, top, axis=1), -1)


def dosa_tile(q, w, lo, hi, keys: KeyData, config, N: int, hint=None):
    """Exact Top-K for one tile of queries (q [Tq, H, D]); returns (idx, scores, Stats)."""
    Tq, H, D = q.shape
    K, B = config.top_k, config.key_block
    cap = capacity(config, N)
    npad = keys.k.shape[0]
    SENT = jnp.int32(npad)

    # 1–2. seeds, threshold, plan
    tp = plan_tile(q, w, lo, hi, keys, config, hint)
    layout, sid, svalid, s_scores, tau0, plan, budget = (
        tp.layout, tp.seed_ids, tp.seed_valid, tp.seed_scores, tp.tau, tp.plan, tp.budget)
    n_vis = hi - lo
    n_seed = jnp.sum(svalid, axis=1).astype(jnp.int32)
    bad_scale = (keys.bad_prefix[hi] - keys.bad_prefix[lo]) > 0
    prune0 = plan.prune & ~bad_scale
    tau_init = jnp.where(prune0, tau0, -jnp.inf)
    seed_idx, seed_sc = select_records(s_scores, sid, K, valid=svalid)
    rows = jnp.arange(Tq)[:, None]
    screen_block = tile_screen(plan, budget, config, H)
    zeros = jnp.zeros((Tq,), jnp.int32)

    def scan_round(resume, tau, prune):
        active = resume < SENT
        start = jnp.min(jnp.where(active, resume, SENT)) // B
        b_end = (jnp.max(jnp.where(active, hi, 0)) + B - 1) // B
        lo_eff = jnp.maximum(lo, resume)[:, None]

        def cond(c):
            b, _, _, over, _ = c
            return (b < b_end) & ~jnp.all(~active | (over < SENT))

        def body(c):
            b, buf, cnt, over, fault = c
            ids = b * B + jnp.arange(B, dtype=jnp.int32)
            kb = lax.dynamic_slice_in_dim(keys.k, b * B, B)
            nb = lax.dynamic_slice_in_dim(keys.norm_up, b * B, B)
            ab = None if keys.scale is None else lax.dynamic_slice_in_dim(keys.scale, b * B, B)
            bound = screen_block(kb, nb, ab)
            idb = jnp.broadcast_to(ids[None, :], (Tq, B))
            vis = (active[:, None] & (idb >= lo_eff) & (idb < hi[:, None])
                   & ~seeds_mod.is_seed(idb, layout))
            fault = fault | (prune & jnp.any(vis & ~jnp.isfinite(bound), axis=1))
            surv = vis & survives(bound, tau)
            pos = cnt[:, None] + jnp.cumsum(surv.astype(jnp.int32), axis=1) - 1
            store = surv & (pos < cap)
            buf = buf.at[rows, jnp.where(store, pos, cap)].set(idb, mode="drop")
            over = jnp.minimum(over, jnp.min(jnp.where(surv & ~store, idb, SENT), axis=1))
            cnt = cnt + jnp.sum(store, axis=1).astype(jnp.int32)
            return b + 1, buf, cnt, over, fault

        init = (start, jnp.full((Tq, cap), -1, jnp.int32), zeros,
                jnp.full((Tq,), SENT, jnp.int32), jnp.zeros((Tq,), bool))
        _, buf, cnt, over, fault = lax.while_loop(cond, body, init)
        return buf, cnt, over, fault

    def refine(buf, cnt, tau):
        n_chunks = (jnp.max(cnt) + B - 1) // B

        def body(c, rec):
            ids = lax.dynamic_slice_in_dim(buf, c * B, B, axis=1)
            s = score_ids(q, w, keys.k, keys.scale, ids)
            return lax.dynamic_update_slice_in_dim(rec, s, c * B, axis=1)

        rec = lax.fori_loop(0, n_chunks, body, jnp.full((Tq, cap), -jnp.inf, jnp.float32))
        keep = (buf >= 0) & ~(rec < tau[:, None])
        return rec, keep

    class St(NamedTuple):
        run_idx: jax.Array
        run_sc: jax.Array
        tau: jax.Array
        resume: jax.Array
        prune: jax.Array
        survivors: jax.Array
        records: jax.Array
        rounds: jax.Array
        overflows: jax.Array
        recoveries: jax.Array

    def round_body(st: St) -> St:
        active = st.resume < SENT
        buf, cnt, over, fault = scan_round(st.resume, st.tau, st.prune)
        rec, keep = refine(buf, cnt, st.tau)
        run_idx, run_sc = select_records(
            jnp.concatenate([st.run_sc, rec], axis=1), jnp.concatenate([st.run_idx, buf], axis=1),
            K, valid=jnp.concatenate([st.run_idx >= 0, keep], axis=1))
        tau = st.tau
        if config.raise_threshold:
            kth_ok = run_idx[:, K - 1] >= 0
            tau = jnp.where(st.prune & kth_ok, jnp.maximum(tau, run_sc[:, K - 1]), tau)
        recover = fault & st.prune
        resume = jnp.where(active, over, SENT)
        return St(
            run_idx=jnp.where(recover[:, None], seed_idx, run_idx),
            run_sc=jnp.where(recover[:, None], seed_sc, run_sc),
            tau=jnp.where(recover, -jnp.inf, tau),
            resume=jnp.where(recover, lo, resume),
            prune=st.prune & ~recover,
            survivors=st.survivors + cnt,
            records=st.records + jnp.sum(keep & ~jnp.isnan(rec), axis=1).astype(jnp.int32),
            rounds=st.rounds + active.astype(jnp.int32),
            overflows=st.overflows + (active & (over < SENT) & ~recover).astype(jnp.int32),
            recoveries=st.recoveries + recover.astype(jnp.int32),
        )

    st0 = St(seed_idx, seed_sc, tau_init, jnp.where(n_vis > n_seed, lo, SENT), prune0,
             zeros, zeros, zeros, zeros, zeros)
    st = lax.while_loop(lambda s: jnp.any(s.resume < SENT), round_body, st0)
    kth = st.run_idx[:, K - 1] >= 0
    stats = Stats(visible=n_vis, seeds=n_seed, screened=n_vis - n_seed, survivors=st.survivors,
                  records=st.records, rounds=st.rounds, overflows=st.overflows,
                  recoveries=st.recoveries, pruning=st.prune, budget=budget,
                  tau_seed=tau_init, tau_final=jnp.where(kth, st.run_sc[:, K - 1], -jnp.inf),
                  dense=jnp.zeros_like(st.prune),
                  predicted_cost=jnp.full(n_vis.shape, jnp.nan, jnp.float32))
    return st.run_idx, st.run_sc, stats


def tile_screen(plan, budget, config, H: int):
    """Screening of a key block for the tile, computing only the rows the tile needs.

    Plan rows hold each query's retained heads first (head order), then zero
    padding, so the first ``max(budget)`` rows cover every query of the tile.
    ``lax.switch`` picks the smallest candidate budget ≥ that, making the
    screening GEMM cost (r_tile + d_a) rows instead of the largest candidate's.
    """
    cands = config.budgets(H)
    if len(cands) == 1:
        return lambda kb, nb, ab: screening_bound(plan, kb, nb, ab)
    need = jnp.max(budget)
    branch = jnp.sum(jnp.asarray(cands, jnp.int32) < need).astype(jnp.int32)
    branch = jnp.minimum(branch, len(cands) - 1)

    def for_rows(R):
        sub = plan._replace(rows=plan.rows[:, :R], row_weights=plan.row_weights[:, :R])
        return lambda kb, nb, ab: screening_bound(sub, kb, nb, ab)

    fns = [for_rows(R) for R in cands]
    return lambda kb, nb, ab: lax.switch(branch, fns, kb, nb, ab)


def map_query_tiles(fn, q, w, lo, hi, tile: int, *extra):
    """Apply ``fn(q, w, lo, hi, *extra)`` over query tiles of size ``tile`` (padding with
    empty queries); ``extra`` are further per-query arrays (leading axis T)."""
    T = q.shape[0]
    tq = max(1, min(tile, T))
    tpad = round_up_to(T, tq)
    pad = lambda x, v=0: jnp.pad(x, ((0, tpad - T),) + ((0, 0),) * (x.ndim - 1), constant_values=v)
    if tpad != T:
        q, w, lo, hi = pad(q), pad(w), pad(lo), pad(hi)
        extra = tuple(pad(x, -1) for x in extra)
    nt = tpad // tq
    split = lambda x: x.reshape((nt, tq) + x.shape[1:])
    args = (split(q), split(w), split(lo), split(hi)) + tuple(split(x) for x in extra)
    out = lax.map(lambda a: fn(*a), args)
    return jax.tree_util.tree_map(lambda x: x.reshape((tpad,) + x.shape[2:])[:T], out)


def dosa_topk_reference(q, k, w, k_scale, lo, hi, config, hint=None):
    """Reference (pure jnp) DoSA Top-K over validated inputs."""
    keys = prepare_keys(k, k_scale, config.key_block)
    N = k.shape[0]
    if hint is None:
        return map_query_tiles(lambda a, b, c, d: dosa_tile(a, b, c, d, keys, config, N),
                               q, w, lo, hi, config.query_tile)
    return map_query_tiles(lambda a, b, c, d, e: dosa_tile(a, b, c, d, keys, config, N, e),
                           q, w, lo, hi, config.query_tile, hint)
