"""What block witnesses, the budget's survivor price and the key splits cost and buy on the
kernels: DoSA with the call-level dense switch off, beside the dense scan, with the stage and
fallback shares that explain the time.

For each trained case (H = 32) at T causal queries over N keys: the dense scan
(``dosa_jax.dense_topk``), then one DoSA call per (W, κ, S) in ``--widths`` ×
``--survivor-costs`` × ``--splits``: ``topk`` with ``Config(block_witnesses=W,
survivor_cost=κ, dense_switch=inf)`` (W = 0: the default seeds; κ empty: the backend's
default), or with S > 0 key splits ``pallas_kernels.pipeline.dosa_topk(splits=S)`` directly
(S = 0: the pipeline's own choice). Each answer is checked bitwise against the dense scan's (of
the kernels when S > 0) and timed on the device clock (median of ``--repeats`` after one
warm-up). The call up to the end of three stages is timed alone
(``pallas_kernels.pipeline.dosa_topk(stop_after=...)``: "seeds" is block ranking, seed scoring
and the K-th search; "screen" adds the plan, the screen and the compaction; "refine" adds the
refinement). From the call's stats: survival over all queries and over those not rescanned,
records (survivors scoring ≥ τ) over the visible keys of those not rescanned, the share of
each automatic budget among those not rescanned, the shares of queries whose lists
overflowed, that were rescanned, and that went to the dense pass, the mean automatic budget,
the median τ/τ* and the mean seed count; beside them the switch's cost terms and predicted
DoSA/dense (``call_cost_terms``, ``predicted_cost_ratio``), which the switch compares with its
threshold.

    python -m benchmarks.witness_timing --cases code1,prose1 --widths 0,4096 --out DIR

Writes ``witness_timing.json`` and ``witness_timing.md`` to ``--out`` (rewritten after every
row). Meant for the GPU (the kernel backend); on the CPU the kernels run interpreted, so use
small ``--length`` / ``--queries`` there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import numpy as np


COLS = ("case", "W", "kappa", "splits", "eq", "ms", "dense_ms", "seeds_ms", "screen_ms",
        "refine_ms", "surv_all", "surv_screened", "records", "overflow", "recovered", "dense",
        "budget_mean", "tau_over", "seeds_mean", "budgets", "terms", "predicted")


@functools.lru_cache(maxsize=None)
def _paths(W: int, kappa, splits: int = 0):
    """(DoSA, its stages up to seeds, screen and refine, its cost terms) as jitted functions
    of (q, k, w, k_scale, lo, hi) for one (W, κ, key splits): built once, so every case of the
    same shapes reuses their compilations. ``splits`` 0: the public ``topk`` (the pipeline's
    own split count); > 0: ``pallas_kernels.pipeline.dosa_topk`` with that many key splits of
    the screen and the refinement (the inputs are the trained data, valid as ``topk`` checks)."""
    import jax
    import dosa_jax
    from pallas_kernels import pipeline as pp
    cfg = dosa_jax.Config(top_k=2048, backend="auto", block_witnesses=W,
                          dense_switch=float("inf"), survivor_cost=kappa)
    S = splits or None
    if splits:
        f = jax.jit(lambda q, k, w, s, lo, hi: tuple(pp.dosa_topk(
            q, k, w, s, lo, hi, cfg, splits=S)))
    else:
        f = jax.jit(lambda q, k, w, s, lo, hi: tuple(dosa_jax.topk(
            q, k, w, k_scale=s, lo=lo, hi=hi, config=cfg)))
    stage = lambda name: jax.jit(lambda q, k, w, s, lo, hi: pp.dosa_topk(
        q, k, w, s, lo, hi, cfg, splits=S, stop_after=name)["count"])
    f_terms = jax.jit(lambda q, k, w, s, lo, hi: pp.call_cost_terms(q, k, w, s, lo, hi, cfg,
                                                                    splits=S))
    return f, tuple(stage(n) for n in STAGES), f_terms


#: The stages timed alone, each from the call's start (their differences are the stage costs).
STAGES = ("seeds", "screen", "refine")


@functools.lru_cache(maxsize=None)
def _dense(kernels: bool = False):
    """The dense scan, jitted: the public ``dense_topk`` (``backend="auto"``), or with
    ``kernels`` the Pallas kernels' own (what a direct ``pallas_kernels.pipeline.dosa_topk`` call
    is compared with; the same function as the public one on a GPU)."""
    import jax
    import dosa_jax
    cfg = dosa_jax.Config(top_k=2048)
    if kernels:
        from pallas_kernels import pipeline as pp
        return jax.jit(lambda q, k, w, s, lo, hi: pp.dense_topk(q, k, w, s, lo, hi, cfg))
    return jax.jit(lambda q, k, w, s, lo, hi: dosa_jax.dense_topk(
        q, k, w, k_scale=s, lo=lo, hi=hi, config=cfg)[:2])


def measure(case_name: str, widths, *, T: int, N: int, repeats: int, kappas=(None,),
            splits=(0,), stages: bool = True, weights: str = "committed"):
    from benchmarks.devtime import timeit
    from benchmarks.presets import args_of, trained_inputs
    from benchmarks.shapes import Case
    from pallas_kernels import pipeline as pp

    domain, layer = case_name[:-1], int(case_name[-1])
    inp, _ = trained_inputs(Case(domain, layer, 32), T, N, weights)
    a = args_of(inp)
    dense = _dense()
    ei, es = dense(*a)
    tau_star = np.asarray(es)[:, -1]
    t_dense = timeit(dense, *a, warmup=1, repeats=repeats).seconds
    kernel_dense = None      # the kernels' dense answer, computed once for the rows with S > 0
    for W, kappa, S in ((W, kp, S) for W in widths for kp in kappas for S in splits):
        f, f_stages, f_terms = _paths(W, kappa, S)
        i, sc, st = f(*a)
        if S and kernel_dense is None:
            kernel_dense = _dense(kernels=True)(*a)
        ri, rs = kernel_dense if S else (ei, es)
        eq = bool(np.array_equal(np.asarray(i), np.asarray(ri))
                  and np.array_equal(np.asarray(sc).view(np.int32), np.asarray(rs).view(np.int32)))
        t = timeit(f, *a, warmup=1, repeats=repeats).seconds
        t_stage = ([timeit(g, *a, warmup=1, repeats=repeats).seconds * 1e3 for g in f_stages]
                   if stages else [None] * len(STAGES))
        terms = np.asarray(f_terms(*a))
        tau = np.asarray(st.tau_seed)
        ok = np.isfinite(tau) & (tau_star > 0)
        rec = np.asarray(st.recoveries) > 0
        surv = np.asarray(st.survivors, np.float64)
        vis = np.asarray(st.visible, np.float64)
        yield dict(case=case_name, W=W, kappa=kappa, splits=S, eq=eq, ms=t * 1e3,
                   dense_ms=t_dense * 1e3,
                   **{f"{n}_ms": x for n, x in zip(STAGES, t_stage)},
                   surv_all=surv.sum() / vis.sum(),
                   surv_screened=surv[~rec].sum() / max(vis[~rec].sum(), 1),
                   records=float(np.asarray(st.records, np.float64)[~rec].sum()
                                 / max(vis[~rec].sum(), 1)),
                   overflow=float(np.mean(np.asarray(st.overflows) > 0)),
                   recovered=float(rec.mean()), dense=float(np.mean(np.asarray(st.dense))),
                   budget_mean=float(np.mean(np.asarray(st.budget))),
                   budgets=budget_shares(np.asarray(st.budget)[~rec]),
                   tau_over=float(np.median(tau[ok] / tau_star[ok])) if ok.any() else None,
                   seeds_mean=float(np.mean(np.asarray(st.seeds))),
                   terms=[round(float(x), 4) for x in terms],
                   predicted=float(pp.predicted_cost_ratio(terms)))
        del i, sc, st


def budget_shares(budget) -> str:
    """"r:share" of each automatic budget among the queries, ascending r (e.g. "7:0.95 15:0.05")."""
    r, n = np.unique(budget, return_counts=True)
    return " ".join(f"{int(a)}:{b / max(budget.size, 1):.3f}" for a, b in zip(r, n))


def markdown(rows, header: str) -> str:
    fmt = lambda v: ("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
    lines = [f"# Block witnesses on the kernels (dense switch off)\n", header, "",
             "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in COLS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="code1,prose1", help="e.g. code1,prose3 (H = 32)")
    ap.add_argument("--widths", default="0,4096", help="block witness counts W (0: none)")
    ap.add_argument("--survivor-costs", default="",
                    help="κ values of the automatic budget (Config.survivor_cost), e.g. 1,2,4; "
                         "empty: the backend's default")
    ap.add_argument("--splits", default="0",
                    help="key splits of the screen and refinement, e.g. 0,2,3 (0: the pipeline's)")
    ap.add_argument("--no-stages", action="store_true",
                    help="leave the stages untimed (their columns '-'; fewer compilations)")
    ap.add_argument("--length", type=int, default=1 << 20, help="keys N")
    ap.add_argument("--queries", type=int, default=16384, help="causal queries T")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", choices=("committed", "slack"), default="committed",
                    help="the indexers (datasets.trained weights=): committed or slack")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    import jax
    widths = [int(x) for x in args.widths.split(",")]
    kappas = [float(x) for x in args.survivor_costs.split(",")] if args.survivor_costs else [None]
    splits = [int(x) for x in args.splits.split(",")]
    if any(S < 0 for S in splits):
        ap.error(f"--splits must be >= 0, got {args.splits}")
    os.makedirs(args.out, exist_ok=True)
    header = (f"T={args.queries} causal, N={args.length}, K=2048, FP8 keys, H=32; "
              f"{jax.devices()[0].device_kind}; jax {jax.__version__}; commit "
              f"{os.environ.get('DOSA_COMMIT', 'unknown')}; median of {args.repeats} timed "
              f"calls after 1 warm-up; indexer weights: {args.weights}")
    rows = []
    for c in args.cases.split(","):
        for r in measure(c, widths, T=args.queries, N=args.length, repeats=args.repeats,
                         kappas=kappas, splits=splits, stages=not args.no_stages,
                         weights=args.weights):
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "witness_timing.json"), "w") as f:
                json.dump(dict(header=header, rows=rows), f, indent=1)
            with open(os.path.join(args.out, "witness_timing.md"), "w") as f:
                f.write(markdown(rows, header))
    return rows


if __name__ == "__main__":
    main()
