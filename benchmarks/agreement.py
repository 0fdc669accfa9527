"""Reference vs Pallas selections on one device, against the rounding contract (DESIGN §12).

For trained indexers (code and prose, layers 0–3, H = 32, FP8 keys; one bf16-key case),
random inputs (gaussian FP8 and float32 keys, structured FP8) and an adversarial near-tie
case, both backends' ``dense_topk`` run on the same queries (a strided subset of the T
causal prefill queries); every id selected by one backend only must lie within
``2·max(β_ref, β_pallas) + 2β₆₄`` of the float64 K-th score (:mod:`dosa_jax.agreement`).
Prints a Markdown table (also to ``$OUT/agreement.md`` when ``OUT`` is set) and exits
non-zero if the contract fails anywhere.

    python -m benchmarks.agreement            # GPU: T=4096, N=128K, 256 queries, K=2048
    python -m benchmarks.agreement --quick    # CPU smoke run (small shapes, interpret mode)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

import dosa_jax
from dosa_jax import agreement as ag
from dosa_jax import datasets


def query_subset(inp, n: int):
    """``n`` queries strided over the T queries (all when T ≤ n)."""
    T = inp.q.shape[0]
    step = max(1, T // n)
    sl = slice(0, step * min(n, T), step)
    return dataclasses.replace(inp, q=inp.q[sl], w=inp.w[sl], lo=inp.lo[sl], hi=inp.hi[sl])


def cases(a):
    """(name, key dtype, thunk returning IndexerInputs, K) for the run."""
    if a.quick:
        small = dict(T=16, N=2048, H=8, D=64)
        return [
            ("trained code L0", "fp8", lambda: datasets.trained("code", 0, num_queries=16), 128),
            ("gaussian", "fp8", lambda: datasets.gaussian(**small, key_dtype="float8_e4m3fn"), 64),
            ("near-tie", "f32", lambda: ag.near_tie_inputs(key_dtype="float32"), 64),
        ]
    T, N, K = a.queries, a.length, a.top_k
    out = []
    for dom in a.domains.split(","):
        for layer in (int(x) for x in a.layers.split(",")):
            out.append((f"trained {dom} L{layer}", "fp8",
                        lambda d=dom, l=layer: datasets.trained(d, l, length=N, num_queries=T,
                                                                heads=a.heads), K))
    out.append(("trained code L0", "bf16",
                lambda: datasets.trained("code", 0, length=N, num_queries=T, heads=a.heads,
                                         key_dtype="bfloat16"), K))
    big = dict(T=T, N=N, H=a.heads, D=128)
    out += [
        ("gaussian", "fp8", lambda: datasets.gaussian(**big, key_dtype="float8_e4m3fn"), K),
        ("gaussian", "f32", lambda: datasets.gaussian(**big, key_dtype="float32"), K),
        ("structured", "fp8", lambda: datasets.structured(**big, key_dtype="float8_e4m3fn"), K),
        ("near-tie", "f32", lambda: ag.near_tie_inputs(T=a.subset, N=N, H=a.heads, D=128,
                                                       top_k=K, n_tied=1024), K),
    ]
    return out


def measure(inp, K: int):
    """One row: both backends' dense_topk, the float64 check, timings."""
    kw = inp.as_kwargs()
    idx, secs = {}, {}
    for be in ("reference", "pallas"):
        t0 = time.perf_counter()
        res = dosa_jax.dense_topk(config=dosa_jax.Config(top_k=K, backend=be), **kw)
        idx[be] = np.asarray(jax.block_until_ready(res.indices))
        secs[be] = time.perf_counter() - t0
    t0 = time.perf_counter()
    s64 = ag.exact_scores(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    cmp, radius = ag.compare_backends(inp.q, inp.k, inp.w, idx["reference"], idx["pallas"], K,
                                      inp.k_scale, inp.lo, inp.hi, scores=s64)
    secs["check"] = time.perf_counter() - t0
    kth = np.abs(ag.kth_score(s64, K))
    rel = {be: float(np.median(np.asarray(ag.score_rounding_bound(
        inp.q, inp.k, inp.w, inp.k_scale, be), np.float64) / np.where(kth > 0, kth, np.inf)))
        for be in ag.BACKENDS}
    return cmp, radius, rel, secs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small CPU smoke run")
    p.add_argument("--length", type=int, default=131072, help="N keys")
    p.add_argument("--queries", type=int, default=4096, help="T causal prefill queries")
    p.add_argument("--subset", type=int, default=256, help="queries checked, strided over T")
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", default="0,1,2,3")
    p.add_argument("--domains", default="code,prose")
    a = p.parse_args(argv)
    device = jax.devices()[0].device_kind
    head = ("| input | keys | T checked | N | H | K | queries differing | ids differing "
            "| max \\|s−kth\\|/radius | median β_ref/\\|kth\\| | median β_pallas/\\|kth\\| "
            "| contract | ref s | pallas s | check s |")
    lines = [f"Backend agreement on {device} (jax {jax.__version__}): dense_topk of both "
             f"backends on {a.subset if not a.quick else 16} queries strided over the causal "
             "prefill chunk; radius 2·max(β_ref, β_pallas) + 2β₆₄ around the float64 K-th "
             "score; times include compilation (ref s, pallas s) and the float64 check.",
             "", head,
             "|" + "---|" * 15]
    print("\n".join(lines), flush=True)
    failed = []
    t_all = time.perf_counter()
    for name, kd, make, K in cases(a):
        inp = query_subset(make(), a.subset)
        T, H, _ = inp.q.shape
        cmp, radius, rel, secs = measure(inp, K)
        row = (f"| {name} | {kd} | {T} | {inp.k.shape[0]} | {H} | {K} "
               f"| {int(np.sum(cmp.differing > 0))}/{T} | {cmp.fraction:.2e} "
               f"| {float(np.max(cmp.max_ratio)):.2e} | {rel['reference']:.1e} "
               f"| {rel['pallas']:.1e} | {'holds' if cmp.holds else 'FAILS'} "
               f"| {secs['reference']:.1f} | {secs['pallas']:.1f} | {secs['check']:.1f} |")
        print(row, flush=True)
        lines.append(row)
        if not cmp.holds:
            failed.append((name, kd, np.flatnonzero(~cmp.within)[:8].tolist()))
    lines += ["", f"total {time.perf_counter() - t_all:.0f} s"]
    print(lines[-1])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "agreement.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if failed:
        print(f"contract violated (input, keys, first failing queries): {failed}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
