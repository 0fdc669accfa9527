"""The main job: ``python -m dosa_jax`` runs DoSA and the dense baseline on built-in
data, checks that they agree, and prints survival, τ/τ*, retained heads and timings.

Default data: the committed trained-indexer fixture when present
(``dosa_jax.datasets.trained``), else the ``structured`` synthetic generator.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np


def log(msg):
    print(f"[dosa_jax {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_data(args):
    from dosa_jax import synthetic
    if args.data == "trained":
        try:
            from dosa_jax import datasets
            return datasets.trained(args.domain, args.layer, num_queries=args.T)
        except Exception as e:  # fixture missing: say so, fall back to synthetic
            log(f"trained fixture unavailable ({type(e).__name__}: {e}); using structured synthetic data")
    kind = "gaussian" if args.data == "gaussian" else "structured"
    return synthetic.synthetic(kind, T=args.T, N=args.N, H=args.H, D=args.D, seed=args.seed,
                               key_dtype=args.key_dtype)


def timed(fn, repeats):
    out = fn()
    jax.block_until_ready(out.indices)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out.indices)
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times)), times


def main(argv=None):
    import dosa_jax

    p = argparse.ArgumentParser(prog="python -m dosa_jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["default", "trained", "structured", "gaussian"], default="default")
    p.add_argument("--domain", default="code", help="trained data: 'code' or 'prose'")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--T", type=int, default=64, help="queries (synthetic data)")
    p.add_argument("--N", type=int, default=8192, help="keys (synthetic data)")
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--K", type=int, default=512, help="top_k")
    p.add_argument("--key-dtype", default="float32", choices=["float32", "bfloat16", "float8_e4m3fn"])
    p.add_argument("--retained", default="auto", help="retained heads r or 'auto'")
    p.add_argument("--seed-strategy", default="union")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.data == "default":
        args.data = "trained"

    log(f"jax {jax.__version__} on {jax.default_backend()}; loading data ({args.data})")
    inp = load_data(args)
    T, H, D = inp.q.shape
    N = inp.k.shape[0]
    K = min(args.K, N)
    retained = args.retained if args.retained == "auto" else int(args.retained)
    cfg = dosa_jax.Config(top_k=K, retained_heads=retained, seed_strategy=args.seed_strategy)
    log(f"data: {inp.meta.get('kind', inp.meta)}  T={T} N={N} H={H} D={D} K={K} "
        f"keys={inp.k.dtype}{' +scale' if inp.k_scale is not None else ''}")
    kw = inp.as_kwargs()
    dosa = jax.jit(dosa_jax.topk)
    dense = jax.jit(dosa_jax.dense_topk)
    log("compiling and timing DoSA ...")
    r, t_dosa, _ = timed(lambda: dosa(**kw, config=cfg), args.repeats)
    log("compiling and timing the dense baseline ...")
    d, t_dense, _ = timed(lambda: dense(**kw, config=cfg), args.repeats)
    same_idx = bool(np.array_equal(np.asarray(r.indices), np.asarray(d.indices)))
    same_sc = bool(np.array_equal(np.asarray(r.scores), np.asarray(d.scores)))
    st = r.stats
    screened = int(np.sum(st.screened))
    surv = int(np.sum(st.survivors))
    tau, tau_star = np.asarray(st.tau_seed), np.asarray(st.tau_final)
    ok = np.isfinite(tau) & np.isfinite(tau_star) & (tau_star != 0)
    ratio = tau[ok] / tau_star[ok]
    budgets = np.bincount(np.asarray(st.budget), minlength=H)
    print()
    print(f"  DoSA == dense (indices, bitwise): {same_idx}   (scores: {same_sc})")
    print(f"  survival rate: {surv}/{screened} = {surv / max(screened, 1):.4f}  "
          f"(pruned {1 - surv / max(screened, 1):.2%} of screened keys)")
    if ratio.size:
        print(f"  tau/tau*: median {np.median(ratio):.3f}  [p10 {np.percentile(ratio, 10):.3f}, "
              f"p90 {np.percentile(ratio, 90):.3f}]  ({ratio.size} queries with finite, nonzero tau*)")
    print("  retained heads r: " + ", ".join(f"r={i}: {c}" for i, c in enumerate(budgets) if c))
    print(f"  rounds/query: mean {np.mean(st.rounds):.2f}; overflows {int(np.sum(st.overflows))}; "
          f"recoveries {int(np.sum(st.recoveries))}")
    print(f"  time (median of {args.repeats}, after compile): DoSA {t_dosa * 1e3:.1f} ms, "
          f"dense {t_dense * 1e3:.1f} ms, ratio dense/DoSA {t_dense / t_dosa:.2f}x")
    return 0 if same_idx and same_sc else 1


if __name__ == "__main__":
    sys.exit(main())
