"""What block witnesses buy: survival with the default seeds, with ``Config.block_witnesses``
and with perfect witnesses (τ = τ*), per trained layer.

For each (domain, layer) of the trained indexer at ``--length`` keys (the last
``--queries`` positions as causal queries): one ``topk`` call with the default seeds, one
per witness count W in ``--widths`` (``Config(block_witnesses=W, witness_block=B)``), and
one with the exact Top-K ids as the hint (τ = τ*, the best any witness can do). Each call's
answer is checked bitwise against ``dense_topk``. Reported: survival (survivors / visible,
all queries) and the median τ/τ* over queries with τ* > 0, and the share of the seed
threshold's gap to τ* that the witnesses close, (τ_W − τ) / (τ* − τ) (median).

    python -m benchmarks.block_witnesses --length 131072 --queries 64 --out DIR

Writes ``block_witnesses.md`` / ``.json`` to ``--out``. Survival is a count, the same on
every device; the default backend is the reference (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def measure(domain: str, layer: int, *, length: int, queries: int, widths, block: int,
            backend: str, heads: int = 32, survivor_cost=None) -> dict:
    import jax
    import dosa_jax
    from dosa_jax import datasets

    x = datasets.trained(domain, layer, length=length, num_queries=queries, heads=heads)
    cfg = dosa_jax.Config(top_k=2048, backend=backend, survivor_cost=survivor_cost)

    def run(c, hint=None):
        return jax.jit(lambda q, k, w, s, lo, hi, h: dosa_jax.topk(
            q, k, w, k_scale=s, lo=lo, hi=hi, config=c, hint=h))(
                x.q, x.k, x.w, x.k_scale, x.lo, x.hi, hint)

    dense = jax.jit(lambda q, k, w, s, lo, hi: dosa_jax.dense_topk(
        q, k, w, k_scale=s, lo=lo, hi=hi, config=cfg))(x.q, x.k, x.w, x.k_scale, x.lo, x.hi)
    d_idx, d_sc = np.asarray(dense.indices), np.asarray(dense.scores)
    tau_star = d_sc[:, -1].astype(np.float64)
    pos = tau_star > 0

    def summary(r, base_tau=None):
        if not (np.array_equal(np.asarray(r.indices), d_idx)
                and np.array_equal(np.asarray(r.scores).view(np.int32), d_sc.view(np.int32))):
            raise AssertionError(f"{domain}{layer}: topk != dense_topk")
        st = r.stats
        tau = np.asarray(st.tau_seed, np.float64)
        out = dict(survival=float(np.sum(st.survivors) / np.sum(st.visible)),
                   tau_over_tau_star=float(np.median(tau[pos] / tau_star[pos])) if pos.any()
                   else None)
        if base_tau is not None:
            gap = tau_star - base_tau
            ok = gap > 0
            out["gap_closed"] = float(np.median((tau[ok] - base_tau[ok]) / gap[ok])) \
                if ok.any() else None
        return out

    t0 = time.time()
    base = run(cfg)
    row = dict(case=f"{domain}{layer}", N=length, T=queries, H=heads, block=block,
               kappa=survivor_cost, seeds=summary(base))
    base_tau = np.asarray(base.stats.tau_seed, np.float64)
    for W in widths:
        row[f"W{W}"] = summary(run(cfg.replace(block_witnesses=W, witness_block=block)),
                               base_tau)
    row["perfect"] = summary(run(cfg, dense.indices), base_tau)
    row["seconds"] = time.time() - t0
    return row


def report(rows, widths) -> str:
    head = ["case", "seeds"] + [f"W = {W}" for W in widths] + ["τ = τ*"]
    lines = ["# Block witnesses", "", "survivor cost κ: " + ", ".join(sorted(
                 {"backend's" if r.get("kappa") is None else f"{r['kappa']:g}" for r in rows})),
             "",
             "survival (survivors / visible) · median τ/τ* · median share of the seed τ's gap "
             "to τ* closed", "", "| " + " | ".join(head) + " |",
             "|" + " --- |" * len(head)]
    fmt = lambda s: (f"{s['survival']:.4f} · "
                     + ("-" if s["tau_over_tau_star"] is None else f"{s['tau_over_tau_star']:.2f}")
                     + ("" if s.get("gap_closed") is None else f" · {s['gap_closed']:.2f}"))
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |")
            continue
        cells = [f"{r['case']} (N={r['N']}, T={r['T']})", fmt(r["seeds"])]
        cells += [fmt(r[f"W{W}"]) for W in widths] + [fmt(r["perfect"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--cases", default="code:0,code:1,code:2,code:3,prose:0,prose:1,prose:2,"
                                      "prose:3")
    p.add_argument("--widths", default="2048,4096,8192",
                   help="witness counts W (multiples of --block)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=32, choices=(32, 64))
    p.add_argument("--backend", default="reference", choices=("reference", "pallas", "auto"))
    p.add_argument("--survivor-cost", type=float, default=None,
                   help="the automatic budget's survivor weight κ (default: the backend's own)")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    widths = [int(v) for v in a.widths.split(",") if v]
    if any(W < a.block or W % a.block for W in widths):
        p.error(f"--widths must be multiples of --block ({a.block}), got {widths}")
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for item in a.cases.split(","):
        dom, layer = item.split(":")
        try:
            rows.append(measure(dom, int(layer), length=a.length, queries=a.queries,
                                widths=widths, block=a.block, backend=a.backend,
                                heads=a.heads, survivor_cost=a.survivor_cost))
        except Exception as e:  # noqa: BLE001 - one failed case must not lose the others
            rows.append(dict(case=f"{dom}{layer}", error=repr(e)[:300]))
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(a.out, "block_witnesses.json"), "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)
        with open(os.path.join(a.out, "block_witnesses.md"), "w") as f:
            f.write(report(rows, widths))
    print(report(rows, widths))


if __name__ == "__main__":
    main()
