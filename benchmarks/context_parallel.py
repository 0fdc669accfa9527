"""Context parallel (DESIGN §17): the sharded path's overhead and what the shared τ buys.

Two measurements, one command (``$OUT`` gets ``context_parallel.md`` / ``.json``):

1. **overhead** (the default device, a GPU for the headline shape T = 16K, N = 1M):
   ``sharded_topk`` on a 1-device mesh against plain ``topk``, both on ``--backend``
   (default ``pallas``: the kernels answer the context-parallel local pass too), same
   config; the results must be bitwise equal. Two compilations and 2·(1 + repeats)
   calls of a kernel call (well under a minute each on an H200). A CPU check of the stage:
   ``--length 512 --queries 16 --heads 4 --dim 16 --K 16 --repeats 1 --skip pruning
   --key-dtype float32`` (interpret mode; its kernels cannot take the key scales of FP8
   keys inside ``shard_map``).
2. **pruning** (a CPU mesh of ``--devices`` host devices, in a child process, on the
   trained indexer's inputs at ``--pruning-length`` keys): per device, the survivors of
   screening with the shared τ (global seeds, one all-reduce) against a τ from the
   device's local seeds alone (``context_parallel.local_pass(share_threshold=False)``).
   The trained inputs at N = 128K need the LM forward pass, so the parent builds them
   (on the GPU) and hands them to the child in a file.

    python -m benchmarks.context_parallel --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def _config(K, backend="reference"):
    import dosa_jax
    return dosa_jax.Config(top_k=K, query_tile=64, key_block=512, backend=backend)


def overhead(a) -> dict:
    import jax
    from jax.sharding import Mesh
    import dosa_jax
    from benchmarks.devtime import timeit
    from dosa_jax import synthetic

    x = synthetic.structured(T=a.queries, N=a.length, H=a.heads, D=a.dim, seed=0,
                             key_dtype=a.key_dtype, query_dtype="bfloat16")
    cfg = dosa_jax.Config(top_k=a.K, backend=a.backend)
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    plain = jax.jit(lambda q, k, w, s, lo, hi: dosa_jax.topk(q, k, w, k_scale=s, lo=lo, hi=hi,
                                                             config=cfg))
    sharded = jax.jit(lambda q, k, w, s, lo, hi: dosa_jax.sharded_topk(
        q, k, w, k_scale=s, lo=lo, hi=hi, mesh=mesh, config=cfg))
    args = (x.q, x.k, x.w, x.k_scale, x.lo, x.hi)
    out = {"T": a.queries, "N": a.length, "H": a.heads, "K": a.K, "backend": a.backend,
           "device": str(jax.devices()[0].device_kind)}
    r_p, r_s = plain(*args), sharded(*args)          # compiled and run once: the warmup
    out["bitwise_equal"] = bool(np.array_equal(np.asarray(r_p.indices), np.asarray(r_s.indices))
                                and np.array_equal(np.asarray(r_p.scores).view(np.int32),
                                                   np.asarray(r_s.scores).view(np.int32)))
    # the kernels' statistics carry the call-level cost prediction; the reference's are NaN
    out["kernels_answered_sharded"] = bool(np.isfinite(np.asarray(r_s.stats.predicted_cost)).all())
    for name, fn in (("plain", plain), ("sharded_1dev", sharded)):
        t = timeit(fn, *args, warmup=1, repeats=a.repeats)
        out[name + "_s"] = t.seconds
        out["clock"] = t.clock
    out["overhead"] = out["sharded_1dev_s"] / out["plain_s"] - 1.0
    return out


def pruning_child(path: str, devices: int, K: int) -> list:
    """Per-device survivors with the shared τ and with local seeds only (CPU mesh)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from dosa_jax import context_parallel as cp

    rows = []
    data = np.load(path, allow_pickle=False)
    names = sorted({n.split("/")[0] for n in data.files})
    mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
    cfg = _config(K)
    fns = {share: jax.jit(lambda q, k, w, s, lo, hi, share=share: cp.per_device_stats(
        q, k, w, k_scale=s, lo=lo, hi=hi, mesh=mesh, config=cfg, share_threshold=share))
        for share in (True, False)}
    for name in names:
        g = lambda f: jnp.asarray(data[f"{name}/{f}"])
        q, k, s, w, lo, hi = (g(f) for f in ("q", "k", "k_scale", "w", "lo", "hi"))
        q = q.astype(jnp.bfloat16)                # stored as float32 (exact)
        if k.dtype == jnp.uint8:
            k = jax.lax.bitcast_convert_type(k, jnp.float8_e4m3fn)
        n = k.shape[0] - k.shape[0] % devices     # a whole number of keys per device
        k, s, hi = k[:n], s[:n], jnp.minimum(hi, n)
        t0 = time.time()
        res = {}
        for share in (True, False):
            st = fns[share](q, k, w, s, lo, hi)
            res[share] = [np.asarray(v) for v in (st.survivors, st.screened, st.tau_seed)]
        sv_s, sc_s, tau_s = res[True]
        sv_l, _, tau_l = res[False]
        per_dev = [dict(device=d, screened=int(sc_s[d].sum()), survivors_shared=int(sv_s[d].sum()),
                        survivors_local=int(sv_l[d].sum()),
                        median_tau_shared=float(np.median(tau_s[d])),
                        median_tau_local=float(np.median(tau_l[d]))) for d in range(devices)]
        rows.append(dict(name=name, N=int(n), T=int(q.shape[0]), devices=devices,
                         seconds=time.time() - t0, per_device=per_dev,
                         shared_never_worse=all(r["survivors_shared"] <= r["survivors_local"]
                                                for r in per_dev)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def pruning(a, tmp: str) -> list:
    """Build the trained inputs here (the LM forward pass) and measure on a CPU mesh."""
    from dosa_jax import datasets
    import jax
    import jax.numpy as jnp
    arrays = {}
    for item in a.cases.split(","):
        dom, layer = item.split(":")
        x = datasets.trained(dom, int(layer), length=a.pruning_length,
                             num_queries=a.pruning_queries)
        name = f"{dom}{layer}"
        k = np.asarray(jax.lax.bitcast_convert_type(x.k, jnp.uint8)) \
            if x.k.dtype == jnp.float8_e4m3fn else np.asarray(x.k, np.float32)
        arrays.update({f"{name}/q": np.asarray(x.q, np.float32), f"{name}/k": k,
                       f"{name}/k_scale": np.asarray(x.k_scale), f"{name}/w": np.asarray(x.w),
                       f"{name}/lo": np.asarray(x.lo), f"{name}/hi": np.asarray(x.hi)})
    path = os.path.join(tmp, "trained.npz")
    np.savez(path, **arrays)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + f" --xla_force_host_platform_device_count={a.devices}")
    cmd = [sys.executable, "-m", "benchmarks.context_parallel", "--pruning-child", path,
           "--devices", str(a.devices), "--K", str(a.K)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=a.child_timeout)
        stdout, err = out.stdout, (out.stderr[-3000:] if out.returncode else None)
    except subprocess.TimeoutExpired as e:   # keep the cases that finished
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = f"timed out after {a.child_timeout} s"
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if err:
        rows.append({"error": err})
    return rows


def report(res) -> str:
    lines = ["# Context parallel", ""]
    o = res.get("overhead")
    if o:
        lines += [f"1-device mesh vs plain topk (T={o['T']}, N={o['N']}, H={o['H']}, K={o['K']}, "
                  f"{o['device']}, {o['clock']} clock, median):", "",
                  "| path | seconds |", "| --- | --- |",
                  f"| plain topk, {o['backend']} | {o['plain_s']:.4f} |",
                  f"| sharded_topk on 1 device, {o['backend']} | {o['sharded_1dev_s']:.4f} |", "",
                  f"overhead {o['overhead']:+.2%}; bitwise equal: {o['bitwise_equal']}; "
                  f"kernels answered the sharded call: {o['kernels_answered_sharded']}", ""]
    for r in res.get("pruning", []):
        if "error" in r:
            lines += ["pruning child failed:", "", "```", r["error"], "```"]
            continue
        lines += [f"## {r['name']}: N={r['N']}, T={r['T']}, {r['devices']} CPU devices", "",
                  "| device | screened | survivors (shared τ) | survivors (local τ) | "
                  "median τ shared | median τ local |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {d['device']} | {d['screened']} | {d['survivors_shared']} | "
                  f"{d['survivors_local']} | {d['median_tau_shared']:.4g} | "
                  f"{d['median_tau_local']:.4g} |" for d in r["per_device"]]
        lines += ["", f"shared τ never prunes less on a device: {r['shared_never_worse']}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--length", type=int, default=1 << 20)
    p.add_argument("--queries", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--key-dtype", default="float8_e4m3fn",
                   help="keys of the overhead calls (FP8 with per-key scales by default)")
    p.add_argument("--backend", default="pallas", choices=("pallas", "auto", "reference"),
                   help="backend of both overhead calls")
    p.add_argument("--K", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pruning-length", type=int, default=131072)
    p.add_argument("--pruning-queries", type=int, default=64)
    p.add_argument("--cases", default="code:1,prose:1")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--child-timeout", type=int, default=300)
    p.add_argument("--skip", default="", help="comma list of stages to skip: overhead,pruning")
    p.add_argument("--pruning-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.pruning_child:
        pruning_child(a.pruning_child, a.devices, a.K)
        return
    skip = set(filter(None, a.skip.split(",")))
    res = {}
    out_dir = a.out or "."
    os.makedirs(out_dir, exist_ok=True)

    def save():
        with open(os.path.join(out_dir, "context_parallel.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out_dir, "context_parallel.md"), "w") as f:
            f.write(report(res))

    if "overhead" not in skip:
        res["overhead"] = overhead(a)
        save()
        print(json.dumps(res["overhead"]), flush=True)
    if "pruning" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            res["pruning"] = pruning(a, tmp)
        save()
    print(report(res))


if __name__ == "__main__":
    main()
