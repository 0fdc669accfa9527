"""The reference DoSA pipeline (paper Algorithm 1, Theorem 1; DESIGN §3–§10).

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

from dosa_jax import seeds as seeds_mod
from dosa_jax import witnesses
from dosa_jax.dense import dense_topk_reference
from dosa_jax.keys import key_summary, scale_fault
from dosa_jax.planner import build_plan
from dosa_jax.results import Stats
from dosa_jax.sample import plan_sample, strided_sample_ids
from dosa_jax.scorer import score_ids, score_ids_blocked
from dosa_jax.screen import screening_bound, survives
from dosa_jax.selection import select_records
from dosa_jax.tiling import map_query_tiles, round_up_to


class KeyData(NamedTuple):
    """Keys padded to a multiple of the block, with per-key summaries (:mod:`dosa_jax.keys`)."""

    k: jax.Array          # [Npad, D] payloads (input dtype)
    scale: object         # [Npad] float32 or None
    norm_up: jax.Array    # [Npad] n_i ≥ ‖k̄_i‖ (0 on padding, which is never visible)
    bad_prefix: object    # [N + 1] int32 prefix count of invalid scales, None without scales


def prepare_keys(k, k_scale, block: int) -> KeyData:
    """Pad keys to a multiple of ``block`` and compute the key-side summaries once."""
    N = k.shape[0]
    npad = max(round_up_to(N, block), block)
    summary = key_summary(k, k_scale)
    kp = jnp.pad(k, ((0, npad - N), (0, 0)))
    norm = jnp.pad(summary.norm, (0, npad - N))
    sp = None if k_scale is None else jnp.pad(k_scale, (0, npad - N), constant_values=1.0)
    return KeyData(kp, sp, norm, summary.bad_prefix)


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


def plan_tile(q, w, lo, hi, keys: KeyData, config, hint=None, tau_floor=None) -> TilePlan:
    """Stages 1–2 for a query tile: score the seeds, τ, activation frequencies, plan.

    ``hint`` [Tq, M] (optional) are extra witness keys, e.g. the previous decode
    step's selection: rescored for the current query, they join the seeds in τ
    (distinct visible keys only) but not the candidate set — the scan meets them
    again, so the running Top-K never holds a key twice.
    ``tau_floor`` [Tq] (optional) is a lower bound on τ* certified elsewhere (e.g. by
    keys on other devices, :mod:`dosa_jax.context_parallel`): τ = max(τ, floor).
    """
    B = config.key_block
    S_pad = round_up_to(config.seeds(), B)
    layout = seeds_mod.seed_layout(lo, hi, config.seed_strategy, config.seeds(),
                                   config.sink_size, config.local_fraction)
    sid, svalid = seeds_mod.seed_ids(layout, S_pad)
    s_scores = score_ids_blocked(q, w, keys.k, keys.scale, sid, B)
    tau0 = seeds_mod.seed_threshold(s_scores, svalid, config.top_k)
    if tau_floor is not None:
        tau0 = jnp.maximum(tau0, tau_floor)
    # the planner's strided sample (dosa_jax.sample), scored in full by the canonical scorer
    e_ids, e_valid = strided_sample_ids(lo, hi, config.budget_sample,
                                        round_up_to(config.budget_sample, B))
    _, e_dots = score_ids_blocked(q, w, keys.k, keys.scale, e_ids, B, return_head_dots=True)
    smp = plan_sample(e_dots, e_ids, e_valid, keys.norm_up, keys.scale)
    plan, details, budget = build_plan(q.astype(jnp.float32), w, smp.activation, config,
                                       sample_dots=smp.dots, sample_norms=smp.norms,
                                       sample_valid=smp.valid, tau=tau0,
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
        if tau_floor is not None:
            tau0 = jnp.maximum(tau0, tau_floor)
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


def dosa_tile(q, w, lo, hi, keys: KeyData, config, N: int, hint=None, tau_floor=None):
    """Exact Top-K for one tile of queries (q [Tq, H, D]); returns (idx, scores, Stats)."""
    Tq, H, D = q.shape
    K, B = config.top_k, config.key_block
    cap = capacity(config, N)
    npad = keys.k.shape[0]
    SENT = jnp.int32(npad)

    # 1–2. seeds, threshold, plan
    tp = plan_tile(q, w, lo, hi, keys, config, hint, tau_floor)
    layout, sid, svalid, s_scores, tau0, plan, budget = (
        tp.layout, tp.seed_ids, tp.seed_valid, tp.seed_scores, tp.tau, tp.plan, tp.budget)
    n_vis = hi - lo
    n_seed = jnp.sum(svalid, axis=1).astype(jnp.int32)
    bad_scale = scale_fault(keys.bad_prefix, lo, hi)
    prune0 = plan.prune & ~bad_scale
    tau_init = jnp.where(prune0, tau0, -jnp.inf)
    seed_idx, seed_sc = select_records(s_scores, sid, K, valid=svalid)
    rows = jnp.arange(Tq)[:, None]
    screen_block = tile_screen(plan, budget, config, H)
    zeros = jnp.zeros_like(lo)   # carries start from the inputs (shard_map's varying axes)

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

        init = (start, jnp.full_like(lo, -1, shape=(Tq, cap)), zeros,
                jnp.full_like(lo, SENT), jnp.zeros_like(lo, dtype=bool))
        _, buf, cnt, over, fault = lax.while_loop(cond, body, init)
        return buf, cnt, over, fault

    def refine(buf, cnt, tau):
        n_chunks = (jnp.max(cnt) + B - 1) // B

        def body(c, rec):
            ids = lax.dynamic_slice_in_dim(buf, c * B, B, axis=1)
            s = score_ids(q, w, keys.k, keys.scale, ids)
            return lax.dynamic_update_slice_in_dim(rec, s, c * B, axis=1)

        rec = lax.fori_loop(0, n_chunks, body, jnp.full_like(tau, -jnp.inf, shape=(Tq, cap)))
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


def dosa_topk_reference(q, k, w, k_scale, lo, hi, config, *, hint=None, tau_floor=None):
    """Reference (pure jnp) DoSA Top-K over validated inputs: (indices, scores, Stats).

    ``hint`` [T, M] are the caller's witness ids; with ``config.anchor_stride`` the anchor
    queries are answered first by :func:`dosa_jax.dense.dense_topk_reference` and their
    Top-K ids join the witnesses, with ``config.block_witnesses`` the keys of each query's
    best-ranked key blocks (:mod:`dosa_jax.witnesses`). ``tau_floor`` [T] float32
    (optional) is a lower bound on each query's τ* from elsewhere (keys on other devices):
    the threshold starts at max(seed τ, floor), so the answer is then the exact Top-K of
    the seeds and the keys scoring ≥ floor (every key of the true Top-K of a larger key
    set that includes these keys, when floor ≤ its τ*).
    """
    anchors = witnesses.anchor_topk(dense_topk_reference, q, k, w, k_scale, lo, hi, config)
    blocks = witnesses.block_witnesses(dense_topk_reference, q, k, w, k_scale, lo, hi, config)
    hint = witnesses.per_query_witnesses(anchors, config.anchors(q.shape[0]), q.shape[0], hint,
                                         blocks)
    keys = prepare_keys(k, k_scale, config.key_block)
    N = k.shape[0]
    extras = tuple(x for x in (hint, tau_floor) if x is not None)

    def tile(a, b, c, d, *e):
        e = list(e)
        h = e.pop(0) if hint is not None else None
        f = e.pop(0) if tau_floor is not None else None
        return dosa_tile(a, b, c, d, keys, config, N, h, f)

    return map_query_tiles(tile, q, w, lo, hi, config.query_tile, *extras)
