"""One command that checks, then times, every indexer path on the GPU (SPEC §14).

    python -m benchmarks.run --shapes prefill_T4k_N128k_H32,prefill_T16k_N1024k_H32 \
        --out $OUT [--data structured|gaussian] [--sections peak,mma,select,shapes]

For each named shape (``benchmarks.shapes``), in the same process:
correctness first (DoSA-pallas vs dense-pallas bitwise; both vs the XLA
baseline's indices), then the median of ≥ 10 timed runs after warm-up
(``block_until_ready`` around each call) of
(a) the XLA baseline — jnp scoring (bf16 operands, float32 accumulation,
    chunked over queries) + ``lax.top_k``;
(b) the dense fused Pallas indexer (bf16 MMA; the fp8-MMA variant too);
(c) DoSA with ``backend="pallas"``;
plus ``exact_topk`` vs ``lax.top_k`` on [256, 1M] rows and the XLA fp8/bf16
matmul peak. Inputs are never zeros. Writes ``bench.md`` and ``bench.json``
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.shapes import QUICK, SHAPES


#: Seeds per query for the DoSA runs (Config.seed_size): 8·K, τ close to τ* on the
#: structured data (the default 2·K gives τ ≈ the median seed score there).
BENCH_SEEDS = 16384


def log(*a):
    print(*a, flush=True)


#: How the last :func:`timeit` timed: clock ("device": CUPTI activity spans, see
#: :mod:`benchmarks.devtime`; "wall": perf_counter around block_until_ready) and both medians.
LAST_TIMING: dict = {}


def timeit(fn, *args, warmup=2, iters=10):
    """Median time (s) of ``fn(*args)`` after warm-up, and the per-call times.

    On a GPU the calls run inside a profiler trace and the device time of each call
    (first GPU activity start to last end, :func:`benchmarks.devtime.device_times`)
    is the figure; elsewhere, or with ``DOSA_TIMING=wall``, the wall time around
    ``block_until_ready`` of the same calls. :data:`LAST_TIMING` keeps both medians.
    """
    from benchmarks.devtime import device_times
    if os.environ.get("DOSA_TIMING", "device") == "wall" or jax.default_backend() != "gpu":
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        dev = None
    else:
        dev, ts = device_times(fn, *args, warmup=warmup, iters=iters)
    LAST_TIMING.clear()
    LAST_TIMING.update(clock="device" if dev else "wall", wall_median=statistics.median(ts),
                       device_median=statistics.median(dev) if dev else None)
    return (statistics.median(dev), dev) if dev else (statistics.median(ts), ts)


# ------------------------------------------------------------------ peaks

def peak_section(res):
    n = 8192
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    out = {}
    for name, dt in (("fp8", jnp.float8_e4m3fn), ("bf16", jnp.bfloat16)):
        x, y = a.astype(dt), b.astype(dt)
        f = jax.jit(lambda x, y: jnp.dot(x, y.T, preferred_element_type=jnp.float32)
                    if dt == jnp.float8_e4m3fn else jnp.dot(x, y.T))
        t, _ = timeit(f, x, y, warmup=3, iters=20)
        out[f"matmul_{name}_tflops"] = 2 * n ** 3 / t / 1e12
    big = jax.random.normal(key, (1 << 28,), jnp.float32)
    t, _ = timeit(jax.jit(lambda x: x * 1.0001), big, iters=20)
    out["copy_TBps"] = 2 * big.size * 4 / t / 1e12
    res["peak"] = out
    log("peak", out)


def mma_section(res):
    from benchmarks.mma_error import measure
    res["mma_error"] = {str(jnp.dtype(d)): measure(d) for d in (jnp.bfloat16, jnp.float8_e4m3fn)}
    log("mma_error", json.dumps(res["mma_error"]))


def select_section(res, T=256, M=1 << 20, k=2048, variants=()):
    from dosa_jax.selection import exact_topk as ref_topk
    from pallas_kernels.select import exact_topk
    x = jax.random.normal(jax.random.PRNGKey(3), (T, M), jnp.float32)
    f_ref = jax.jit(lambda x: ref_topk(x, k))
    f_new = jax.jit(lambda x: exact_topk(x, k))
    f_lax = jax.jit(lambda x: lax.top_k(x, k))
    i1, s1 = f_ref(x)
    i2, s2 = f_new(x)
    ok = bool(jnp.all(i1 == i2) & jnp.all(s1 == s2))
    # ties and NaN: a harder row set
    y = jnp.round(x * 4) / 4
    y = y.at[:, ::97].set(jnp.nan)
    j1, t1 = f_ref(y)
    j2, t2 = f_new(y)
    ok_ties = bool(jnp.all(j1 == j2) & jnp.all(t1 == t2))
    wall = {}
    t_lax, _ = timeit(f_lax, x, warmup=5, iters=30)
    wall["lax_top_k_ms"] = LAST_TIMING["wall_median"] * 1e3
    t_ref, _ = timeit(f_ref, x, warmup=5, iters=30)
    t_new, _ = timeit(f_new, x, warmup=5, iters=30)
    wall["pallas_ms"] = LAST_TIMING["wall_median"] * 1e3
    res["select"] = dict(shape=[T, M], k=k, equal=ok, equal_ties_nan=ok_ties,
                         lax_top_k_ms=t_lax * 1e3, reference_ms=t_ref * 1e3,
                         pallas_ms=t_new * 1e3, speedup_vs_lax=t_lax / t_new, wall=wall,
                         speedup_vs_lax_wall=wall["lax_top_k_ms"] / wall["pallas_ms"])
    var = {}
    for v in variants:   # exact_topk's block / splits (0: default), timed in the same run
        bk, sp = (int(x) for x in v.split(":"))
        f_v = jax.jit(lambda x, b=bk, s_=sp: exact_topk(x, k, block=b, splits=s_ or None))
        iv, sv = f_v(x)
        jv, tv = f_v(y)
        same = bool(jnp.all(iv == i1) & jnp.all(sv == s1) & jnp.all(jv == j1) & jnp.all(tv == t1))
        t_v, _ = timeit(f_v, x, warmup=5, iters=30)
        var[v] = dict(ms=t_v * 1e3, speedup_vs_lax=t_lax / t_v, equal=same)
    res["select"]["variants"] = var
    res["select"]["clock"] = LAST_TIMING.get("clock")
    res["select"]["stages_ms"] = select_stages(x, k)
    log("select", res["select"])


def select_stages(x, k, iters=30):
    """exact_topk's default path cut into its stages, each timed alone (ms): the sampled
    guess θ₀, the filter kernel, the final selection over the record slots; and a
    streaming read of the same rows (``max`` per row) as the memory-bound floor."""
    from pallas_kernels import records as rec
    from pallas_kernels import select as sel
    T, M = x.shape
    p = sel.filter_plan(T, M, k)
    f_guess = jax.jit(lambda x: sel.guess_threshold(x, k, p))
    f_filter = jax.jit(lambda x, th: sel.filter_rows(x, None, th, k=k, plan=p, interpret=False))
    f_final = jax.jit(lambda rk, ri, cnt: rec.select_from_records(rk, ri, cnt, k))
    th = f_guess(x)
    rk, ri, cnt, _ = f_filter(x, th)
    out = dict(plan=p, records_mean=float(jnp.mean(jnp.sum(cnt, axis=1))))
    out["guess"] = timeit(f_guess, x, warmup=3, iters=iters)[0] * 1e3
    out["filter"] = timeit(f_filter, x, th, warmup=3, iters=iters)[0] * 1e3
    out["final"] = timeit(f_final, rk, ri, cnt, warmup=3, iters=iters)[0] * 1e3
    out["read_floor"] = timeit(jax.jit(lambda x: jnp.max(x, axis=1)), x, warmup=3,
                               iters=iters)[0] * 1e3
    return out


# ------------------------------------------------------------------ shapes

def make_inputs(shape, data: str, seed=0):
    """``data``: ``structured``/``gaussian`` (synthetic) or ``trained:<domain>:<layer>``
    (the trained indexer's dump of the first N held-out tokens; H must be 32 or 64)."""
    from dosa_jax import datasets, synthetic
    if data.startswith("trained"):
        _, dom, layer = data.split(":")
        return datasets.trained(dom, int(layer), length=shape.N, num_queries=shape.T,
                                heads=shape.H, key_dtype="float8_e4m3fn", query_dtype="bfloat16",
                                source="generate")
    gen = getattr(synthetic, data)
    inp = gen(T=shape.T, N=shape.N, H=shape.H, D=shape.D, seed=seed, causal=shape.causal,
              key_dtype="float8_e4m3fn", query_dtype="bfloat16")
    return inp


def xla_baseline(q, k, w, k_scale, lo, hi, K, chunk):
    """jnp scoring (bf16 operands, f32 accumulation) + lax.top_k, chunked over queries."""
    T, H, D = q.shape
    N = k.shape[0]
    kb = k.astype(jnp.bfloat16)
    ids = jnp.arange(N, dtype=jnp.int32)[None, :]

    def one(args):
        qc, wc, loc, hic = args
        x = jnp.einsum("thd,nd->thn", qc.astype(jnp.bfloat16), kb,
                       preferred_element_type=jnp.float32)
        s = jnp.einsum("thn,th->tn", jnp.maximum(x, 0.0), wc,
                       precision=lax.Precision.HIGHEST) * k_scale[None, :]  # f32, no TF32
        s = jnp.where((ids >= loc[:, None]) & (ids < hic[:, None]), s, -jnp.inf)
        return lax.top_k(s, K)

    n = T // chunk
    sp = lambda a: a.reshape((n, chunk) + a.shape[1:])
    v, i = lax.map(one, (sp(q), sp(w), sp(lo), sp(hi)))
    return i.reshape(T, K), v.reshape(T, K)


def workspace_bytes(det, T, K, BK=64):
    from pallas_kernels.dense import capacity_for
    S = det["splits"]
    C = capacity_for(K, BK)
    G4 = -(-T // 4)
    surv = G4 * S * det["Cs"] * 4
    records = T * S * C * 8
    seeds = (T + G4) * det["seeds_list"] * 4     # order keys [T, L] and the lists [G4, L]
    masks = G4 * det["N"]                        # the screen's survival bytes [G4, N]
    return dict(survivor_lists=surv, records=records, seeds=seeds, screen_masks=masks,
                total=surv + records + seeds + masks)


class DosaOptions(NamedTuple):
    """The DoSA Config fields a benchmark spec sets: seeds per query, anchor stride,
    retained-head budget (0: the default ``"auto"``)."""

    seeds: int = BENCH_SEEDS
    anchor: int = 0
    budget: int = 0
    survivor_cost: float = 0.0   # 0: the backend's default

    def config(self, K: int):
        from dosa_jax.config import Config
        return Config(top_k=K, backend="pallas", seed_size=self.seeds, anchor_stride=self.anchor,
                      retained_heads=self.budget or "auto",
                      survivor_cost=self.survivor_cost or None)

    def __str__(self):
        if self.survivor_cost:
            return f"{self.seeds}/{self.anchor}/{self.budget}/{self.survivor_cost:g}"
        if self.budget:
            return f"{self.seeds}/{self.anchor}/{self.budget}"
        return f"{self.seeds}/{self.anchor}" if self.anchor else str(self.seeds)


def parse_tiles(spec):
    """``layout:BK:warps:stages[:screen_layout:screen_bq:screen_warps[:screen_lane_sums[:screen_bk``
    ``[:widen_fp8[:refine_bk[:CH[:record_slots[:lane_sums]]]]]]]]``[/seeds[/anchor_stride[/budget``
    ``[/survivor_cost]]]]``
    -> (Tiles, DosaOptions). Or ``field=value+field=value...`` (any ``Tiles`` fields, on the
    defaults; booleans as 0/1) before the ``/``.

    E.g. ``kh:128:4:3:kh:8:4/8192``, ``/8192/64`` (default tiles, 8192 seeds, anchors every
    64 queries), ``/8192/0/6`` (retained-head budget r = 6 for every query); BQ is 4 (the
    refinement group); '' -> defaults.
    """
    from pallas_kernels import dense as dense_mod
    spec, _, opts = spec.partition("/")
    seeds, _, anchor = opts.partition("/")
    anchor, _, budget = anchor.partition("/")
    budget, _, kappa = budget.partition("/")
    seeds = DosaOptions(int(seeds) if seeds else BENCH_SEEDS, int(anchor) if anchor else 0,
                        int(budget) if budget else 0, float(kappa) if kappa else 0.0)
    if not spec:
        return dense_mod.Tiles(), seeds
    if "=" in spec:   # field=value+field=value... on the default tiles
        t = dense_mod.Tiles()
        for item in spec.split("+"):
            key, _, val = item.partition("=")
            if key not in t._fields:
                raise ValueError(f"tiles spec: unknown Tiles field {key!r} in {spec!r}")
            cur = getattr(t, key)
            t = t._replace(**{key: bool(int(val)) if isinstance(cur, bool) else
                              type(cur)(val)})
        return t, seeds
    f = spec.split(":")
    t = dense_mod.Tiles(BQ=4, BK=int(f[1]), num_warps=int(f[2]), num_stages=int(f[3]), layout=f[0],
                        refine_bk=dense_mod.Tiles().refine_bk if f[0] == "kc" else 0)
    if len(f) > 4:
        t = t._replace(screen_layout=f[4], screen_bq=int(f[5]), screen_warps=int(f[6]))
    if len(f) > 7:
        t = t._replace(screen_lane_sums=bool(int(f[7])))
    if len(f) > 8:
        t = t._replace(screen_bk=int(f[8]))
    if len(f) > 9:
        t = t._replace(widen_fp8=bool(int(f[9])))
    if len(f) > 10:
        t = t._replace(refine_bk=int(f[10]))
    if len(f) > 11:
        t = t._replace(CH=int(f[11]))
    if len(f) > 12:
        t = t._replace(record_slots=int(f[12]))
    if len(f) > 13:
        t = t._replace(lane_sums=bool(int(f[13])))
    return t, seeds


#: The Tiles fields of the positional spec, in order (BQ is always 4); the last three are
#: left out of a name while they hold their defaults.
POSITIONAL_FIELDS = ("layout", "BK", "num_warps", "num_stages", "screen_layout", "screen_bq",
                     "screen_warps", "screen_lane_sums", "screen_bk", "widen_fp8", "refine_bk",
                     "CH", "record_slots", "lane_sums")


def tiles_name(t, seeds=None):
    """The spec of :func:`parse_tiles` for tiles ``t`` (trailing default fields left out; the
    ``field=value`` form when a field past the positional spec is not its default)."""
    from pallas_kernels import dense as dense_mod
    d = dense_mod.Tiles()
    as_spec = lambda v: int(v) if isinstance(v, bool) else v
    if any(getattr(t, k) != getattr(d, k) for k in t._fields
           if k not in POSITIONAL_FIELDS + ("BQ",)):
        name = "+".join(f"{k}={as_spec(v)}" for k, v in t._asdict().items()
                        if v != getattr(d, k))
    else:
        f = [as_spec(getattr(t, k)) for k in POSITIONAL_FIELDS]
        while len(f) > 11 and f[-1] == as_spec(getattr(d, POSITIONAL_FIELDS[len(f) - 1])):
            f.pop()
        name = ":".join(str(x) for x in f)
    return name if seeds is None else f"{name}/{seeds}"


def _best(res, section):
    cfgs = {k_: v for k_, v in res.get(section, {}).get("configs", {}).items() if "ms" in v}
    if not cfgs:
        raise RuntimeError(f"best configuration: no successful {section} section before it")
    return min(cfgs, key=lambda k_: cfgs[k_]["ms"])


def shape_section(res, shape, data, iters, with_xla=True, tiles_spec="", stages=True):
    from pallas_kernels import dense as dense_mod
    from pallas_kernels import pipeline
    if tiles_spec == "best":     # the fastest dense configuration of this run's sweep
        tiles_spec = _best(res, "sweep")
    elif tiles_spec == "dbest":  # the fastest DoSA configuration of this run's DoSA sweep
        tiles_spec = _best(res, "dosa_sweep")
    tiles, seeds = parse_tiles(tiles_spec)
    out = dict(shape=shape._asdict(), data=data, tiles=tiles_name(tiles, seeds))
    t0 = time.time()
    inp = make_inputs(shape, data)
    q, k, w, sc, lo, hi = inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi
    jax.block_until_ready((q, k, w, sc))
    out["input_s"] = time.time() - t0
    K = shape.K
    cfg = seeds.config(K)
    visible = int(np.sum(np.asarray(hi, np.int64) - np.asarray(lo, np.int64)))
    flops = 2.0 * shape.H * shape.D * visible
    out["flops"] = flops

    f_dosa = jax.jit(lambda *a: pipeline.dosa_topk(*a, cfg, tiles=tiles))
    f_dense = jax.jit(lambda *a: pipeline.dense_topk(*a, cfg, tiles=tiles))   # seeded (default)
    f_dense0 = jax.jit(lambda *a: pipeline.dense_topk(*a, cfg, tiles=tiles, seeded=False))
    f_dense8 = jax.jit(lambda q, *a: dense_mod.dense_topk(q.astype(jnp.float8_e4m3fn), *a, cfg,
                                                        mma_dtype=jnp.float8_e4m3fn))
    chunk = max(1, min(shape.T, (1 << 29) // (shape.H * shape.N)))
    f_xla = jax.jit(lambda q, k, w, sc, lo, hi: xla_baseline(q, k, w, sc, lo, hi, K, chunk))
    args = (q, k, w, sc, lo, hi)

    # correctness first
    di, ds, st = f_dosa(*args)
    ei, es = f_dense(*args)
    out["dosa_eq_dense_indices"] = bool(jnp.all(di == ei))
    out["dosa_eq_dense_scores"] = bool(jnp.all((ds == es) | (jnp.isnan(ds) & jnp.isnan(es))))
    ui, us = f_dense0(*args)
    out["unseeded_dense_eq_dense"] = bool(jnp.all(ui == ei) & jnp.all(us == es))
    del ui, us
    surv = np.asarray(st.survivors, np.float64)
    vis = np.asarray(st.visible, np.float64)
    out["survival"] = float(surv.sum() / max(vis.sum(), 1))
    tau = np.asarray(st.tau_seed, np.float64)
    taus = np.asarray(st.tau_final, np.float64)
    okr = np.isfinite(tau) & np.isfinite(taus) & (taus > 0)
    out["tau_over_tau_star"] = float(np.median(tau[okr] / taus[okr])) if okr.any() else None
    out["tau_star_positive_frac"] = float(np.mean(taus > 0))
    out["tau_below_tau_star_median"] = float(np.median((taus - tau)[np.isfinite(tau)])) \
        if np.isfinite(tau).any() else None
    out["wave"] = pipeline.wave_size(shape.T, shape.N)
    out["recoveries"] = int(np.asarray(st.recoveries).sum())
    out["pruning_queries"] = int(np.asarray(st.pruning).sum())
    out["budget_mean"] = float(np.asarray(st.budget).mean())
    out["budget_hist"] = {int(b): int(c) for b, c in zip(*np.unique(np.asarray(st.budget),
                                                                     return_counts=True))}
    out["overflows"] = int(np.asarray(st.overflows).sum())
    Tw = pipeline.wave_size(shape.T, shape.N)
    S = dense_mod.default_splits(Tw, shape.N, 4, tiles.BK)
    from pallas_kernels.seeds import seed_list_length
    out["workspace"] = workspace_bytes(      # one wave's lists, records and seed lists
        dict(splits=S, Cs=pipeline.survivor_capacity(shape.N, Tw, S, K), N=shape.N,
             seeds_list=seed_list_length(cfg.seeds(), tiles.BK, K if cfg.anchors(Tw) else 0)),
        Tw, K)
    try:  # what XLA allocates for the DoSA call beyond inputs and outputs (measured, not computed)
        ma = f_dosa.lower(*args).compile().memory_analysis()
        out["workspace_xla_temp_bytes"] = int(ma.temp_size_in_bytes)
        out["workspace_xla_output_bytes"] = int(ma.output_size_in_bytes)
    except Exception as e:  # noqa: BLE001
        out["workspace_xla_error"] = repr(e)[:300]
    if with_xla:
        xi, xs = f_xla(*args)
        # indices agree except where the k-th score gap is within the scorer difference
        agree = jnp.mean(jnp.sort(xi, axis=1) == jnp.sort(ei, axis=1))
        out["xla_index_agreement"] = float(agree)
        out["xla_max_score_diff"] = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(xs), xs, 0)
                                                          - jnp.where(jnp.isfinite(es), es, 0))))
    log(shape.name, "correctness", {k_: v for k_, v in out.items() if k_ != "shape"})

    times, walls = {}, {}

    def tm(name, f, **kw):
        times[name], _ = timeit(f, *args, iters=iters, **kw)
        walls[name] = LAST_TIMING["wall_median"] * 1e3
        out["clock"] = LAST_TIMING["clock"]

    tm("dense_pallas", f_dense)
    tm("dosa_pallas", f_dosa)
    tm("dense_pallas_unseeded", f_dense0)   # the online threshold from −inf (sessions 1–6)
    # DoSA's stages by difference: the pipeline cut after seeds / screen / refine
    for stage in (("seeds", "screen", "refine") if stages else ()):
        try:
            f_stage = jax.jit(lambda *a, s_=stage: pipeline.dosa_topk(*a, cfg, tiles=tiles,
                                                                      stop_after=s_))
            if stage == "screen":
                cut = f_stage(*args)
                out["overflow_queries"] = int(jnp.sum(cut["overflow"]))
                out["direct_queries"] = int(jnp.sum(cut["direct"]))
            tm(f"dosa_until_{stage}", f_stage)
        except Exception as e:  # noqa: BLE001
            out[f"stage_{stage}_error"] = repr(e)[:300]
    if shape.N <= 131072:   # the fp8-MMA variant is a throughput probe; skipped at 1M (time)
        try:
            tm("dense_pallas_fp8mma", f_dense8)
        except Exception as e:  # noqa: BLE001
            out["fp8mma_error"] = repr(e)[:300]
        try:   # the same, compiled with maxNumImpreciseAcc on its FP8 dots (wgmma, not mma.sync)
            from benchmarks.fp8_dot import fast_fp8_accumulation
            with fast_fp8_accumulation():
                f_fast = f_dense8.lower(*args).compile()
            tm("dense_pallas_fp8mma_fastacc", f_fast)
        except Exception as e:  # noqa: BLE001
            out["fp8mma_fastacc_error"] = repr(e)[:300]
    if with_xla:
        tm("xla_baseline", f_xla, warmup=1)
    out["times_ms"] = {k_: v * 1e3 for k_, v in times.items()}
    out["wall_ms"] = walls     # the same calls timed on the host, for comparison
    out["tflops"] = {k_: flops / v / 1e12 for k_, v in times.items()}
    if not with_xla:   # the same shape's baseline from this run (other tiles), if any
        for o in res.get("shapes", {}).values():
            if o["shape"]["name"] == shape.name and "xla_baseline" in o.get("times_ms", {}):
                times["xla_baseline"] = o["times_ms"]["xla_baseline"] / 1e3
                out["xla_from"] = o["tiles"]
                out["times_ms"]["xla_baseline"] = o["times_ms"]["xla_baseline"]
                with_xla = True
                break
    if with_xla:
        out["dosa_vs_xla"] = times["xla_baseline"] / times["dosa_pallas"]
        out["dense_vs_xla"] = times["xla_baseline"] / times["dense_pallas"]
    out["dosa_vs_dense"] = times["dense_pallas"] / times["dosa_pallas"]
    log(shape.name, "times", out["times_ms"], "tflops", out["tflops"])
    key = shape.name if not tiles_spec else f"{shape.name}@{tiles_name(tiles, seeds)}"
    res.setdefault("shapes", {})[key] = out


def sweep_section(res, shape, data, iters, specs):
    """Dense scan tile configurations: time, and agreement with the first configuration
    (indices; scores may differ in the last bits between MMA layouts)."""
    from dosa_jax.config import Config
    from pallas_kernels import dense as dense_mod
    inp = make_inputs(shape, data)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    cfg = Config(top_k=shape.K)
    flops = 2.0 * shape.H * shape.D * int(jnp.sum(inp.hi - inp.lo))
    base = None
    out = {}
    for spec in specs:
        tiles, _ = parse_tiles(spec)
        name = tiles_name(tiles)
        try:
            f = jax.jit(lambda *a, t=tiles: dense_mod.dense_topk(*a, cfg, tiles=t))
            i, sc = f(*args)
            if base is None:
                base = (i, sc)
            same_idx = float(jnp.mean(jnp.sort(i, axis=1) == jnp.sort(base[0], axis=1)))
            diff = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(sc), sc, 0)
                                         - jnp.where(jnp.isfinite(base[1]), base[1], 0))))
            t, _ = timeit(f, *args, iters=iters)
            out[name] = dict(ms=t * 1e3, tflops=flops / t / 1e12, index_agreement=same_idx,
                             max_score_diff=diff)
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=repr(e)[:400])
        log("sweep", name, out[name])
    res["sweep"] = dict(shape=shape.name, data=data, configs=out)


def dosa_sweep_section(res, shape, data, iters, specs):
    """DoSA configurations (scoring tiles, screening kernel, seed count): time, survival, and
    bitwise equality with the dense kernel of the same scoring tiles."""
    from pallas_kernels import pipeline
    inp = make_inputs(shape, data)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    dense_out = {}
    out = {}
    for spec in specs:
        tiles, seeds = parse_tiles(spec)
        name = tiles_name(tiles, seeds)
        cfg = seeds.config(shape.K)
        try:
            score_tiles = tiles._replace(screen_layout="hk", screen_bq=0, screen_warps=4,
                                         screen_lane_sums=True, screen_bk=0)
            if score_tiles not in dense_out:
                dense_out[score_tiles] = jax.jit(
                    lambda *a, t=tiles: pipeline.dense_topk(*a, cfg, tiles=t))(*args)
            ei, es = dense_out[score_tiles]
            f = jax.jit(lambda *a, t=tiles, c=cfg: pipeline.dosa_topk(*a, c, tiles=t))
            i, sc, st = f(*args)
            same = bool(jnp.all(i == ei) & jnp.all((sc == es) | (jnp.isnan(sc) & jnp.isnan(es))))
            t, _ = timeit(f, *args, iters=iters)
            surv = float(np.sum(np.asarray(st.survivors, np.float64))
                         / max(np.sum(np.asarray(st.visible, np.float64)), 1))
            out[name] = dict(ms=t * 1e3, survival=surv, dosa_eq_dense=same,
                             recoveries=int(np.asarray(st.recoveries).sum()))
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=repr(e)[:400])
        log("dosa_sweep", name, out[name])
    res["dosa_sweep"] = dict(shape=shape.name, data=data, configs=out)


# ------------------------------------------------------------------ report

def write_report(res, path):
    lines = [f"# DoSA Pallas benchmark ({res['date']})", "",
             f"device: {res['device']}; jax {res['jax']}; commit {res['commit']}; "
             f"DoSA config: Config(top_k=2048) with each row's seeds[/anchor stride] after the "
             f"tiles (default {BENCH_SEEDS} seeds), budgets r with r + A a power of two", ""]
    if "peak" in res:
        p = res["peak"]
        lines += [f"XLA matmul 8192^3: fp8 {p['matmul_fp8_tflops']:.0f} TFLOP/s, "
                  f"bf16 {p['matmul_bf16_tflops']:.0f} TFLOP/s; copy {p['copy_TBps']:.2f} TB/s", ""]
    if "select" in res:
        s = res["select"]
        lines += [f"timing clock: {s.get('clock')} (device: CUPTI activity spans of each call)"]
        lines += [f"exact_topk {s['shape']} k={s['k']}: pallas {s['pallas_ms']:.2f} ms, "
                  f"lax.top_k {s['lax_top_k_ms']:.2f} ms ({s['speedup_vs_lax']:.1f}x), "
                  f"equal={s['equal']}, equal(ties/NaN)={s['equal_ties_nan']}", ""]
        for v, o in s.get("variants", {}).items():
            lines += [f"- block:splits {v}: {o['ms']:.2f} ms ({o['speedup_vs_lax']:.1f}x), "
                      f"equal={o['equal']}"]
    if "shapes" in res:
        lines += ["| shape | data | XLA ms | dense ms (seeded) | dense ms (from −inf) | "
                  "dense fp8-MMA ms (plain / fast acc.) | DoSA ms | DoSA/XLA | "
                  "DoSA/dense | dense TFLOP/s | survival | tau/tau* | recov | workspace GiB | "
                  "XLA temp GiB | dosa==dense |", "|" + "---|" * 16]
        for name, o in res["shapes"].items():
            t = o.get("times_ms", {})
            g = lambda k_: f"{t[k_]:.1f}" if k_ in t else "-"
            lines.append(
                f"| {name} | {o['data']} | {g('xla_baseline')} | {g('dense_pallas')} | "
                f"{g('dense_pallas_unseeded')} | {g('dense_pallas_fp8mma')} / "
                f"{g('dense_pallas_fp8mma_fastacc')} | {g('dosa_pallas')} | "
                f"{o.get('dosa_vs_xla', float('nan')):.1f} | {o.get('dosa_vs_dense', float('nan')):.2f} | "
                f"{o.get('tflops', {}).get('dense_pallas', float('nan')):.0f} | "
                f"{o['survival']:.3f} | {o['tau_over_tau_star']} | {o['recoveries']} | "
                f"{o['workspace']['total'] / 2 ** 30:.2f} | "
                f"{o.get('workspace_xla_temp_bytes', float('nan')) / 2 ** 30:.2f} | "
                f"{o['dosa_eq_dense_indices'] and o['dosa_eq_dense_scores']} |")
    if "shapes" in res:
        lines += ["", "DoSA stages (ms, cumulative: pipeline cut after the stage; median of the same runs):"]
        for name, o in res["shapes"].items():
            t = o.get("times_ms", {})
            st = ", ".join(f"until {s_} {t[f'dosa_until_{s_}']:.1f}" for s_ in ("seeds", "screen", "refine")
                           if f"dosa_until_{s_}" in t)
            lines.append(f"- {name}: {st}; full {t.get('dosa_pallas', float('nan')):.1f}; "
                         f"overflowed queries {o.get('overflow_queries')}; direct to dense "
                         f"{o.get('direct_queries')}; budgets {o.get('budget_hist')}; "
                         f"wave {o.get('wave')}; "
                         f"tau*>0 for {o.get('tau_star_positive_frac')}; "
                         f"median tau*-tau {o.get('tau_below_tau_star_median')}")
    if "sweep" in res:
        lines += ["", f"dense tile sweep on {res['sweep']['shape']}:"]
        for name, o in res["sweep"]["configs"].items():
            lines.append(f"- {name}: " + (f"{o['ms']:.2f} ms, {o['tflops']:.0f} TFLOP/s, "
                                          f"index agreement with the first {o['index_agreement']:.6f}, "
                                          f"max score diff {o['max_score_diff']:.3g}"
                                          if "ms" in o else o["error"]))
    if "dosa_sweep" in res:
        lines += ["", f"DoSA configuration sweep on {res['dosa_sweep']['shape']} "
                      f"({res['dosa_sweep']['data']}):"]
        for name, o in res["dosa_sweep"]["configs"].items():
            lines.append(f"- {name}: " + (f"{o['ms']:.2f} ms, survival {o['survival']:.4f}, "
                                          f"recoveries {o['recoveries']}, DoSA == dense bitwise "
                                          f"{o['dosa_eq_dense']}" if "ms" in o else o["error"]))
    if "mma_error" in res:
        lines += ["", "MMA dot error (max over pairs of |err| / sum|a_j b_j|):"]
        for dt, d in res["mma_error"].items():
            for kind, m in d.items():
                lines.append(f"- {dt} {kind}: max {m['max_rel']:.3e} (model γ {m['model_gamma']:.3e}, "
                             f"within: {m['within_model']}), pairs {m['pairs']}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(QUICK))
    ap.add_argument("--data", default="structured")
    ap.add_argument("--sections", default="peak,mma,select,shapes")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--sweep-shape", default="prefill_T16k_N128k_H32")
    ap.add_argument("--sweep-tiles", default="hk:64:4:2,hk:128:8:3,kh:64:4:2,kh:128:4:3,kh:128:8:3",
                    help="layout:BK:num_warps:num_stages,... for the dense tile sweep")
    ap.add_argument("--dosa-sweep", default="hk:64:4:2,kh:128:4:3,kh:128:4:3:kh:4:4,"
                    "kh:128:4:3:kh:8:4,kh:128:4:3:kh:8:4/8192,kh:128:4:3:kh:8:4/4096",
                    help="DoSA configurations (see parse_tiles) for the DoSA sweep")
    ap.add_argument("--select-variants", default="",
                    help="exact_topk block:splits variants to time beside the default")
    ap.add_argument("--tiles", default="",
                    help="tile configs for the shapes section (','-separated; '' = default)")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage DoSA timings")
    ap.add_argument("--stages-max-n", type=int, default=1 << 30,
                    help="per-stage DoSA timings only for shapes with N at most this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    try:
        commit = os.environ.get("DOSA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "uncommitted"
    except Exception:  # noqa: BLE001
        commit = "unknown"
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), jax=jax.__version__,
               device=str(jax.devices()[0].device_kind), commit=commit, errors={})
    secs = a.sections.split(",")
    jobs = []
    if "mma" in secs:
        jobs.append(("mma", lambda: mma_section(res)))
    if "sweep" in secs:
        jobs.append(("sweep", lambda: sweep_section(res, SHAPES[a.sweep_shape], a.data, a.iters,
                                                    a.sweep_tiles.split(","))))
    if "dosa_sweep" in secs:
        jobs.append(("dosa_sweep", lambda: dosa_sweep_section(
            res, SHAPES[a.sweep_shape], a.data, a.iters, a.dosa_sweep.split(","))))
    if "shapes" in secs:
        seen = set()
        for entry in a.shapes.split(","):
            if not entry:
                continue
            name, _, own = entry.partition("@")   # "shape@layout:BK:warps:stages" or "shape@best"
            for spec in ([own] if own else a.tiles.split(",")):
                # the XLA baseline once per shape (it does not depend on the tiles)
                jobs.append((f"{name}@{spec}", lambda n=name, sp=spec, x=(name not in seen): shape_section(
                    res, SHAPES[n], a.data, a.iters, x and not a.no_xla, sp,
                    not a.no_stages and SHAPES[n].N <= a.stages_max_n)))
                seen.add(name)
    if "select" in secs:   # after the long sections: the GPU's clocks are up (s4: timed first,
        # the same exact_topk configuration measured 2.01 ms and, a few seconds later, 1.63 ms)
        jobs.append(("select", lambda: select_section(
            res, variants=[v for v in a.select_variants.split(",") if v])))
    if "peak" in secs:
        jobs.append(("peak", lambda: peak_section(res)))
    for name, job in jobs:
        t0 = time.time()
        try:
            job()
        except Exception:  # noqa: BLE001
            res["errors"][name] = traceback.format_exc()[-3000:]
            log("ERROR in", name, res["errors"][name])
        log(f"[{name}] {time.time() - t0:.1f}s")
        with open(os.path.join(a.out, "bench.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        write_report(res, os.path.join(a.out, "bench.md"))
    log(open(os.path.join(a.out, "bench.md")).read())
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
