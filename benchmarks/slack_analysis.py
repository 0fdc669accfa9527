"""Why the trained indexer prunes less than the paper: slack vs budget vs seeds (CPU).

For one (domain, layer) dump at length N (the last T positions are causal
queries, H = 32, FP8 keys), and for each budget setting (the automatic budget
and fixed r), this runs stages 1–2 of the pipeline (``pipeline.plan_tile``:
seeds, τ, plan) and then, on every visible key of every query:

* U^num (``screen.screening_bound``, what screening compares with τ), the
  canonical score s (``dosa_jax.score``) and τ* (``dense_topk``);
* the Eq. 14 slack terms (``diagnostics.slack_decomposition``) with the plan's
  actual positive allowance E (the decomposition is stated for the triangle
  E_P; the difference (E − E_P)‖k‖ is added to the positive term), so that

      U^num − s = positive + uncovered_negative + cancellation + numeric

  with ``numeric`` = U^num − U^real (the App. C enclosure; the tiny difference
  between the analysis score and the canonical scorer is lumped into it).

Survivors (screened keys with U^num ≥ τ) are split into s ≥ τ* (the Top-K
itself), τ ≤ s < τ* (kept by any certificate at this τ: seed deficit) and
s < τ (kept only because of certificate slack). For the last group: each
term's share of the slack, how often it is the largest term, and how many of
those keys a bound without that term would reject (U^num − term < τ).

    python -m benchmarks.slack_analysis --domain code --layers 0,1 --length 131072 --queries 16 \
        --budgets auto,p4,p8,p12,p16,p20,p24,p31,16,24 --out /tmp/slack_code01.json
    python -m benchmarks.slack_analysis --report /tmp/slack_code01.json ...   # markdown tables

``--weights`` (``committed``, ``slack`` or a weights file's path) and ``--heads`` pick the
indexers (``datasets.trained``); rows of other weights or widths are labelled in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dosa_jax
from dosa_jax import budget as budget_mod
from dosa_jax import datasets, diagnostics, planner
from dosa_jax import seeds as seeds_mod
from dosa_jax.bounds import positive
from dosa_jax.bounds.certificate import original_score
from dosa_jax.pipeline import plan_tile, prepare_keys
from dosa_jax.screen import screening_bound

HIGHEST = lax.Precision.HIGHEST


def analyse(q, k, w, k_scale, lo, hi, S, config, fixed_r=None):
    """Per (query, key): U^num and the four slack terms; per query: τ, r, screened mask.

    ``fixed_r``: with an automatic-budget ``config``, replace its plan by the plan
    of budget ``fixed_r`` built from the *same* activation frequencies p_h (the
    strided budget sample). ``Config(retained_heads=r)`` instead measures p_h on
    the seeds (``pipeline.plan_tile``), which changes the negative support A.
    """
    T, H, _ = q.shape
    n = k.shape[0]
    keys = prepare_keys(k, k_scale, config.key_block)
    tp = plan_tile(q, w, lo, hi, keys, config)
    if fixed_r is not None:
        def one_plan(qt, wt, pt):
            mask = planner.retained_mask(qt, wt, pt, fixed_r, config)
            return planner.plan_for_mask(qt, wt, pt, mask, config, fixed_r)

        plan, det = jax.vmap(one_plan)(q.astype(jnp.float32), w, tp.details.activation)
        tp = tp._replace(plan=plan, details=det, budget=jnp.full((T,), fixed_r, jnp.int32))
    kr = k.astype(jnp.float32) * k_scale[:, None]          # α_i k̄_i (exact: α is 2^e)
    kn = jnp.sqrt(jnp.sum(kr * kr, axis=-1))
    ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (T, n))
    screened = (ids >= lo[:, None]) & (ids < hi[:, None]) & ~seeds_mod.is_seed(ids, tp.layout)

    def one(t):
        plan_t = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, t, 0, True), tp.plan)
        det = jax.tree_util.tree_map(lambda a: a[t], tp.details)
        u_num = screening_bound(plan_t, keys.k, keys.norm_up, keys.scale)[0, :n]
        qt, wt = q[t].astype(jnp.float32), w[t]
        x = jnp.einsum("nd,hd->nh", kr, qt, precision=HIGHEST)
        anchor, beta, resid = positive.anchor_projection(qt, det.retained, det.omitted_pos,
                                                         config.positive_projection)
        rn = jnp.sqrt(jnp.sum(resid * resid, axis=-1))
        terms = diagnostics.slack_decomposition(x, kn, wt, det.omitted_pos, det.omitted_neg,
                                                det.support, anchor, beta, rn)
        e_tri = positive.triangle_allowance(wt, resid, det.omitted_pos)
        pos = terms.positive + (det.residual - e_tri) * kn
        u_real = diagnostics.real_certificate_on_keys(x, kn, det)
        real_gap = jnp.max(jnp.abs((u_real - original_score(x, wt))
                                   - (pos + terms.uncovered_negative + terms.cancellation)))
        num = u_num - S[t] - (pos + terms.uncovered_negative + terms.cancellation)
        return u_num, pos, terms.uncovered_negative, terms.cancellation, num, real_gap

    u_num, pos, unc, canc, num, gap = lax.map(one, jnp.arange(T))
    return dict(tau=tp.tau, budget=tp.budget, screened=screened, u_num=u_num, pos=pos, unc=unc,
                canc=canc, num=num, real_gap=gap, n_pos=jnp.sum(w > 0, axis=1))


analyse_jit = jax.jit(analyse, static_argnames=("config", "fixed_r"))
TERMS = ("pos", "unc", "canc", "num")
TERM_NAMES = {"pos": "positive residual δ_P", "unc": "uncovered negatives N\\A",
              "canc": "aggregate cancellation", "num": "numeric enclosure"}


def summarise(a, S, tau_star, H):
    a = {k_: np.asarray(v) for k_, v in a.items()}
    tau, scr = a["tau"], a["screened"]
    u, s = a["u_num"], S
    n_scr = scr.sum(1)
    n_vis = np.isfinite(S).sum(1)
    surv = scr & ~(u < tau[:, None])
    m = surv.sum() / n_scr.sum()
    top = surv & (s >= tau_star[:, None])
    deficit = surv & (s >= tau[:, None]) & (s < tau_star[:, None])
    slack = surv & (s < tau[:, None])
    out = dict(survival=float(m),
               survival_top=float(top.sum() / n_scr.sum()),
               survival_seed_deficit=float(deficit.sum() / n_scr.sum()),
               survival_slack=float(slack.sum() / n_scr.sum()),
               exact_floor=float((scr & (s >= tau[:, None])).sum() / n_scr.sum()),
               survival_at_tau_star=float((scr & ~(u < tau_star[:, None])).sum() / n_scr.sum()),
               budget=dict(zip(*(x.tolist() for x in np.unique(a["budget"], return_counts=True)))),
               real_decomposition_max_err=float(a["real_gap"].max()))
    f = (n_vis - n_scr) / n_vis
    mq = surv.sum(1) / n_scr
    out["cost_ratio"] = float(np.mean(budget_mod.cost_ratio(f, mq, a["budget"], 1, H)))
    tot = sum(a[t] for t in TERMS)[slack]
    vals = {t: a[t][slack] for t in TERMS}
    excess = (u - tau[:, None])[slack]            # how far above τ each slack survivor's bound is
    out["slack_share"] = {t: float(vals[t].sum() / tot.sum()) for t in TERMS} if slack.any() else {}
    stack = np.stack([vals[t] for t in TERMS])
    out["slack_largest"] = ({t: float(np.mean(np.argmax(stack, 0) == i)) for i, t in enumerate(TERMS)}
                            if slack.any() else {})
    out["rejected_without"] = ({t: float(np.mean(vals[t] > excess)) for t in TERMS} if slack.any() else {})
    if slack.any():
        out["rejected_without"]["unc+canc"] = float(np.mean(vals["unc"] + vals["canc"] > excess))
        out["rejected_without"]["pos+num"] = float(np.mean(vals["pos"] + vals["num"] > excess))
        out["median_excess_over_tau"] = float(np.median(excess))
        out["median_slack_total"] = float(np.median(tot))
    out["n_pos_heads"] = dict(zip(*(x.tolist() for x in np.unique(a["n_pos"], return_counts=True))))
    return out


def layer_label(r) -> str:
    """A row's layer, with its indexer width and weights when not H = 32 of the committed
    weights (rows of several weights files or widths side by side)."""
    extra = [f"H={r['heads']}"] if r.get("heads", 32) != 32 else []
    if r.get("weights", "committed") != "committed":
        extra.append(os.path.basename(r["weights"]))
    return f"{r['layer']}" + (f" ({', '.join(extra)})" if extra else "")


def report(paths):
    """Markdown tables from the JSON files written by ``main``."""
    rows = [r for p_ in paths for r in json.load(open(p_))]
    rows.sort(key=lambda r: (r["domain"], r["layer"], r.get("heads", 32), r.get("weights", "")))
    pct = lambda x: f"{100 * x:.1f}"
    out = ["Survivors at the default config (automatic budget), split by score; % of screened keys:", "",
           "| domain | layer | survival | pruned | s ≥ τ* (Top-K) | τ ≤ s < τ* (seed deficit) | s < τ (slack) "
           "| survival if τ = τ* | r chosen (queries) | \\|H+\\| per query | cost D_DoSA/D_base |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["configs"]["r=auto"]
        hp = [int(k) for k in c["n_pos_heads"]]
        out.append(f"| {r['domain']} | {layer_label(r)} | {pct(c['survival'])} | {pct(1 - c['survival'])} | "
                   f"{pct(c['survival_top'])} | {pct(c['survival_seed_deficit'])} | {pct(c['survival_slack'])} | "
                   f"{pct(c['survival_at_tau_star'])} | "
                   + ", ".join(f"{k}: {v}" for k, v in c["budget"].items())
                   + f" | {min(hp)}–{max(hp)} | {c['cost_ratio']:.3f} |")
    out += ["", "Slack survivors (s < τ ≤ U^num) at the default config: each term's share of their total "
            "slack U^num − s / fraction of them a bound without that term would reject:", "",
            "| domain | layer | positive residual δ_P | uncovered negatives N\\A | aggregate cancellation "
            "| both negative terms | numeric enclosure |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["configs"]["r=auto"]
        sh, rw = c["slack_share"], c["rejected_without"]
        out.append(f"| {r['domain']} | {layer_label(r)} | {sh['pos']:.2f} / {rw['pos']:.2f} | {sh['unc']:.2f} / "
                   f"{rw['unc']:.2f} | {sh['canc']:.2f} / {rw['canc']:.2f} | {sh['unc'] + sh['canc']:.2f} / "
                   f"{rw['unc+canc']:.2f} | {sh['num']:.3f} / {rw['num']:.2f} |")
    budgets = [k for k in rows[0]["configs"] if "strided p" in k]

    def budget_table(intro, last_head, cell, last_cell):
        """One row per (domain, layer): the automatic budget, each forced budget, a last column."""
        t = ["", intro, "", "| domain | layer | auto | " + " | ".join(b.split(" ")[0] for b in budgets)
             + f" | {last_head} |", "| --- | --- | --- |" + " --- |" * len(budgets) + " --- |"]
        for r in rows:
            cs = r["configs"]
            t.append(f"| {r['domain']} | {layer_label(r)} | {cell(cs['r=auto'])} | "
                     + " | ".join(cell(cs[b]) for b in budgets) + f" | {last_cell(cs['r=auto'])} |")
        return t

    out += budget_table("Survival % (cost D_DoSA/D_base) for a budget r forced on every query, same seeds, "
                        "τ and p_h as the automatic budget (strided sample); last column: the floor s ≥ τ:",
                        "floor s ≥ τ", lambda c: f"{pct(c['survival'])} ({c['cost_ratio']:.2f})",
                        lambda c: pct(c["exact_floor"]))
    out += budget_table("The same budgets with a perfect threshold: survival % if τ were τ* (U^num ≥ τ*); "
                        "last column: the Top-K itself (s ≥ τ*):", "s ≥ τ*",
                        lambda c: pct(c["survival_at_tau_star"]), lambda c: pct(c["survival_top"]))
    seedp = [k for k in rows[0]["configs"] if "seed p" in k]
    if seedp:
        out += ["", "`Config(retained_heads=r)` as the library runs it (p_h measured on the seeds) vs the "
                "same r with the strided p_h; survival % / share of the slack from uncovered negatives:", "",
                "| domain | layer | " + " | ".join(f"{k} | {k.split(' ')[0]} (strided p)" for k in seedp) + " |",
                "| --- | --- |" + " --- | --- |" * len(seedp)]
        for r in rows:
            cs = r["configs"]
            cells = []
            for k in seedp:
                ks = k.split(" ")[0] + " (strided p)"
                for c in (cs[k], cs.get(ks)):
                    cells.append("–" if c is None else
                                 f"{pct(c['survival'])} / {c['slack_share'].get('unc', 0):.2f}")
            out.append(f"| {r['domain']} | {layer_label(r)} | " + " | ".join(cells) + " |")
    extra = [k for k in rows[0]["configs"] if k.startswith("auto+")]
    if extra:
        out += ["", "Seed variants at the automatic budget: survival % / seed-deficit survivors % / slack "
                "survivors %:", "", "| domain | layer | default (S = 4096) | " + " | ".join(extra) + " |",
                "| --- | --- | --- |" + " --- |" * len(extra)]
        for r in rows:
            cs = r["configs"]
            cell = lambda c: (f"{pct(c['survival'])} / {pct(c['survival_seed_deficit'])} / "
                              f"{pct(c['survival_slack'])}")
            out.append(f"| {r['domain']} | {layer_label(r)} | {cell(cs['r=auto'])} | "
                       + " | ".join(cell(cs[k]) for k in extra) + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--domain", default="code")
    p.add_argument("--layers", default="0,1,2,3")
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--K", type=int, default=2048)
    p.add_argument("--budgets", default="auto,8,16,24,31",
                   help="'auto', r (Config(retained_heads=r): p_h from the seeds) or pR "
                        "(budget R with the automatic budget's strided-sample p_h)")
    p.add_argument("--extra", default="guided,seed8k", help="seed variants at the auto budget")
    p.add_argument("--heads", type=int, default=32, help="indexer width H (32 or 64)")
    p.add_argument("--weights", default="committed",
                   help="datasets.trained weights: committed, slack or a weights file's path")
    p.add_argument("--out")
    p.add_argument("--report", nargs="+", help="print markdown tables from these JSON files and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report(a.report))
        return
    base = dosa_jax.Config(top_k=a.K, query_tile=16, key_block=512)
    cfgs = {}
    for b in a.budgets.split(","):
        if b == "auto":
            cfgs["r=auto"] = (base, None)
        elif b.startswith("p"):
            cfgs[f"r={b[1:]} (strided p)"] = (base, int(b[1:]))
        else:
            cfgs[f"r={b} (seed p)"] = (base.replace(retained_heads=int(b)), None)
    for e in filter(None, a.extra.split(",")):
        if e == "guided":
            cfgs["auto+guided2048"] = (base.replace(guided_witnesses=2048), None)
        elif e == "seed8k":
            cfgs["auto+seed8192"] = (base.replace(seed_size=8192), None)
    results = []
    score = jax.jit(dosa_jax.score, static_argnames=("config",))
    dense = jax.jit(dosa_jax.dense_topk, static_argnames=("config",))
    for layer in [int(x) for x in a.layers.split(",")]:
        t0 = time.time()
        inp = datasets.trained(a.domain, layer, length=a.length, num_queries=a.queries,
                               heads=a.heads, weights=a.weights)
        kw = inp.as_kwargs()
        H = inp.q.shape[1]
        t_gen = time.time() - t0
        S = np.asarray(score(**kw, config=base))
        tau_star = np.asarray(dense(**kw, config=base).scores)[:, -1]
        row = dict(domain=a.domain, layer=layer, heads=H, weights=a.weights, N=a.length,
                   T=a.queries, K=a.K, H=H,
                   generate_s=round(t_gen, 1), tau_star=tau_star.tolist(), configs={})
        for name, (cfg, fixed_r) in cfgs.items():
            t1 = time.time()
            res = analyse_jit(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi, jnp.asarray(S), config=cfg,
                              fixed_r=fixed_r)
            summ = summarise(res, S, tau_star, H)
            summ["tau"] = np.asarray(res["tau"]).tolist()
            summ["seconds"] = round(time.time() - t1, 1)
            row["configs"][name] = summ
            print(f"{a.domain} L{layer} {name:20s} surv {summ['survival']:.4f} "
                  f"(top {summ['survival_top']:.4f}, deficit {summ['survival_seed_deficit']:.4f}, "
                  f"slack {summ['survival_slack']:.4f}) surv@τ* {summ['survival_at_tau_star']:.4f} "
                  f"cost {summ['cost_ratio']:.3f} r {summ['budget']} share "
                  + " ".join(f"{t}={v:.2f}" for t, v in summ["slack_share"].items())
                  + " | rejected w/o " + " ".join(f"{t}={v:.2f}" for t, v in summ["rejected_without"].items())
                  + f" [{summ['seconds']}s]", flush=True)
        results.append(row)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
        print(f"{a.domain} L{layer}: {time.time() - t0:.0f}s total (generate {t_gen:.0f}s)", flush=True)
    return results


if __name__ == "__main__":
    main()
