"""What a decode screen with a rounded query would have to rescore: the certified screen's
candidates against those of a screen whose query is rounded to FP8 (for an fp8 × fp8 MMA).

The decode screen (``pallas_kernels.decode.screen_records``) keeps key i when
u_i = a_i + |α_i|·n·coef ≥ τ_w, with n the FP8 payload norm bound
(``payload_norm_bound``) and coef = ``screen_margin_coefficient`` (any two kernel scorers of
the same operand pieces). A screen that multiplies an FP8-rounded query q̂ (per head scaled
by a power of two to the FP8 range, then rounded) must also cover the rounding: ReLU is
1-Lipschitz, so |Σ_h w_h relu(q_h·k) − Σ_h w_h relu(q̂_h·k)| ≤ Σ_h |w_h|·‖q_h − q̂_h‖·‖k‖,
which adds ρ = Σ_h |w_h|·‖q_h − q̂_h‖ to coef. (FP8 accumulation inside the MMA would add
more; it is left out, so the rounded-query counts are lower bounds.)

For each case of the trained indexer at ``--length`` keys and its last ``--queries``
positions, scores in float64 over every visible key: τ* (the K-th largest), and the keys a
screen from τ* could not reject, s_i + m_i ≥ τ* (a lower bound on what it keeps from any
τ_w ≤ τ*), for the certified margin and for the rounded-query margin. Reported per case:
the median over queries of those counts and of the median margin / |τ*|.

    python -m benchmarks.query_rounding_margin --length 131072 --queries 4 --out DIR

Writes ``query_rounding_margin.md`` / ``.json`` to ``--out``; numpy on the host, any device.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

#: (domain, layer, heads) of the default cases: a layer of each kind, both widths.
DEFAULT_CASES = "code:2:32,code:0:32,prose:1:64"


def fp8_rounded_rows(q):
    """q [T, H, D] float32 → the same rounded to FP8 e4m3 per (query, head) row, each row
    scaled by the power of two that puts its largest |entry| in [224, 448) first (all-zero
    rows stay zero)."""
    import jax.numpy as jnp
    from pallas_kernels.common import FP8
    big = float(jnp.finfo(FP8).max)
    mx = np.abs(q).max(axis=-1, keepdims=True)
    e = np.where(mx > 0, np.floor(np.log2(big / np.where(mx > 0, mx, 1.0))), 0.0)
    scaled = (q * np.exp2(e)).astype(np.float32)
    return np.asarray(jnp.asarray(scaled).astype(FP8).astype(jnp.float32)) / np.exp2(e)


def measure(domain: str, layer: int, heads: int, *, length: int, queries: int, K: int) -> dict:
    import jax.numpy as jnp
    from dosa_jax import datasets
    from pallas_kernels import decode as kd
    inp = datasets.trained(domain, layer, length=length, num_queries=queries, heads=heads)
    q = np.asarray(inp.q.astype(jnp.float32))
    w = np.asarray(inp.w, np.float32)
    k = np.asarray(inp.k.astype(jnp.float32), np.float64)
    alpha = np.abs(np.asarray(inp.k_scale, np.float64))
    hi = np.asarray(inp.hi)
    n = kd.payload_norm_bound(inp.k.dtype, k.shape[1])
    coef = np.asarray(kd.screen_margin_coefficient(jnp.asarray(q), jnp.asarray(w), inp.k.dtype),
                      np.float64)
    rho = np.sum(np.abs(w) * np.linalg.norm((q - fp8_rounded_rows(q)).astype(np.float64),
                                            axis=-1), axis=-1)
    rows = []
    for t in range(q.shape[0]):
        vis = int(hi[t])
        x = k[:vis] @ q[t].astype(np.float64).T                         # [vis, H]
        s = (np.maximum(x, 0.0) * w[t].astype(np.float64)).sum(axis=1) * alpha[:vis]
        tau = np.sort(s)[-K] if vis >= K else -np.inf
        m_cert = alpha[:vis] * n * coef[t]
        m_fp8 = alpha[:vis] * n * (coef[t] + rho[t])
        rows.append(dict(visible=vis, tau_star=float(tau),
                         certified=int(np.sum(s + m_cert >= tau)),
                         fp8_query=int(np.sum(s + m_fp8 >= tau)),
                         margin_cert=float(np.median(m_cert) / abs(tau)) if tau not in (0, -np.inf)
                         else None,
                         margin_fp8=float(np.median(m_fp8) / abs(tau)) if tau not in (0, -np.inf)
                         else None))
    med = lambda key: (float(np.median([r[key] for r in rows if r[key] is not None]))
                       if any(r[key] is not None for r in rows) else None)
    return dict(case=f"{domain}{layer}_H{heads}", N=length, queries=len(rows), K=K,
                visible=med("visible"), certified=med("certified"), fp8_query=med("fp8_query"),
                margin_cert=med("margin_cert"), margin_fp8=med("margin_fp8"), per_query=rows)


COLUMNS = [("case", "case"), ("N", "N"), ("queries", "queries"), ("visible", "visible"),
           ("certified", "certified screen"), ("fp8_query", "FP8-rounded query"),
           ("margin_cert", "margin / abs(τ*), certified"),
           ("margin_fp8", "margin / abs(τ*), FP8 query"), ("error", "error")]
NOTES = ["keys a screen from τ* cannot reject (s + m ≥ τ*) and the margin m / |τ*|: medians over "
         "the queries (each query's in the JSON)",
         "the FP8-query margin leaves out FP8 accumulation in the MMA: its counts are lower "
         "bounds",
         "scores in float64 from the stored FP8 keys, bf16 queries"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--K", type=int, default=2048)
    p.add_argument("--cases", default=DEFAULT_CASES, help="domain:layer:heads, comma-separated")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    cases = []
    for item in a.cases.split(","):
        try:
            dom, layer, heads = item.split(":")
            cases.append((dom, int(layer), int(heads)))
        except ValueError:
            p.error(f"--cases: each case is domain:layer:heads, got {item!r}")
    from collections import namedtuple
    from benchmarks.report import Table, run_meta
    meta = run_meta(namedtuple("Args", sorted(vars(a)))(**vars(a)))
    meta["command"] = "python -m benchmarks.query_rounding_margin " + " ".join(
        sys.argv[1:] if argv is None else argv)
    tab = Table("query_rounding_margin", "Query rounding and the decode screen's margin",
                COLUMNS, a.out, meta, notes=NOTES)
    for dom, layer, heads in cases:
        try:
            tab.add(measure(dom, layer, heads, length=a.length, queries=a.queries, K=a.K))
        except Exception as e:  # noqa: BLE001 - one failed case must not lose the others
            tab.add(dict(case=f"{dom}{layer}_H{heads}", error=repr(e)[:300]))
        print(json.dumps({k: v for k, v in tab.rows[-1].items() if k != "per_query"}), flush=True)
    rows = tab.rows
    return rows


if __name__ == "__main__":
    main()
