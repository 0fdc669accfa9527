"""Slack-regularised fine-tuning of the committed indexers (KL + λ·slack, LM frozen).

    python -m benchmarks.slack_finetune --out $OUT [--lambdas 0,0.3,1,3] [--seconds-per-run 40]
    python -m benchmarks.slack_finetune --quick --out DIR     # tiny random model, CPU smoke run
    python -m benchmarks.slack_finetune --probe               # slack vs KL magnitudes (CPU)
    python -m benchmarks.slack_finetune --train-only --out DIR   # then: --evaluate DIR

For every λ, both indexers of every layer (H = 32 and H = 64, one optimizer step
trains all eight) continue from the committed weights with the long-crop recipe
(``dosa_jax.lm.train`` preset ``h200-long``: 32K-token crops, KL on the last two
query blocks) plus λ · ``dosa_jax.slack.slack_loss`` through
``optax.chain(dosa_jax.slack.regularizer(...), <optimizer>)``
(``train.make_indexer_optimizer``); λ is an argument of the jitted step, so one
compilation serves every λ and every λ runs the same steps on the same batches.
The step count is fixed once, from the first run's timed steps and
``--seconds-per-run``. Each λ's indexers are exported as int8 (the LM's arrays
unchanged) and measured as reloaded from that file:

* held-out KL: the distillation objective on held-out crops of the training length;
* Top-K attention coverage at each ``--lengths`` (``lm.long_context_coverage.run``,
  both domains, its last 512 positions);
* survival at N: survivors / visible keys in ``dosa_jax.topk(...).stats``
  (``backend="auto"``, the call-level dense switch off so every query is screened),
  code domain, the last T = 16K positions (``Plan.survival_queries`` < T: a strided
  subset of them);

* the mean retained-head budget r of the same calls and their work
  (``dosa_jax.slack.screening_work``: dot products per visible key relative to the
  dense scan, Eq. 21 measured). With ``retained_heads="auto"`` the planner spends a
  tighter certificate partly on a smaller r, so survival alone can rise while the
  work falls (DESIGN §16): the work, not the survival, decides;

then, for the chosen λ and λ = 0, DoSA (``Config(backend="auto")``, the dense
switch on) and the dense path timed side by side on the same inputs (the last
T = 16K positions at N = 1M), bitwise equality checked. The chosen λ: among λ > 0 whose Top-K coverage stays within
``--coverage-tolerance`` (0.5 points) of λ = 0 on every domain, length, layer and
head count, the one with the lowest worst-layer work; if none does, the λ > 0
whose worst coverage drop is least (and the table says so). Its weights go to
``$OUT/lm_weights_slack.npz`` (``dosa_jax.datasets.trained(weights="slack")`` reads
that file from ``dosa_jax/data/``). Without λ = 0 in ``--lambdas`` the rows are the result:
nothing is chosen nor timed. ``--layer-scale F0,F1,…`` multiplies λ per LM layer (the
committed slack file: ``--lambdas 3 --steps 85 --layer-scale 4,1,1,1``); ``--survivor-cost κ``
makes the survival and timing calls ``Config(survivor_cost=κ)`` (the committed slack file was
measured at κ = 8).

Everything is written to ``$OUT/slack_finetune.{md,json}`` after every row, with a
timestamped progress log; ``--budget-seconds`` bounds the whole run (stages that no
longer fit are skipped and listed as errors).

Budget of the defaults on one H200 (≈ 9 min with start-up, ``--budget-seconds 500``): setup ≈ 30 s
(held-out crops, the 1M-token hidden states); the step's compilation (KL and eight
slack terms) once, ≈ 60–100 s; 4 λ × 40 s of steps; per λ ≈ 25 s of measurements
(coverage at 128K and 1M, eight survival calls at T = 16K, N = 1M), plus ≈ 40 s of
compilations the first time; timing: 2 λ × 8 indexers × ≈ 6 s plus four compilations.
A λ is skipped when its steps, the last λ's measurement time and ``timing_reserve`` (not with
``--train-only``: no timing stage follows) no longer fit; a timing row when 15 s no longer do
(the chosen λ's rows come first).

The default λ grid comes from ``--probe`` (CPU, committed model, 8K crop, H = 32):
‖∇slack‖ / ‖∇KL‖ ≈ 5.8 at λ = 1 (slack loss 0.36 against KL 0.093;
``benchmarks/results/2026-12-02_cpu_slack_lambda_probe.txt``), so λ ∈ {0.05, 0.2, 1}
puts the slack term's gradient at ≈ 0.3, 1.2 and 5.8 times the KL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import shutil
import sys
import time
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import dosa_jax
from benchmarks.devtime import timeit
from benchmarks.presets import bitwise_equal, jitted_paths, stats_summary
from benchmarks.report import Table, log, run_meta
from dosa_jax.slack import screening_work

WEIGHTS_NAME = "lm_weights_slack.npz"


class Plan(NamedTuple):
    """What one run measures (``--quick``: tiny shapes)."""

    train_preset: str = "h200-long"
    heads: Tuple[int, ...] = ()                    # indexers trained (): all of the preset's
    layer_scale: Tuple[float, ...] = ()            # λ's factor per LM layer (): 1 everywhere
    lambdas: Tuple[float, ...] = (0.0, 0.05, 0.2, 1.0)
    seconds_per_run: float = 40.0
    steps: int = 0                                 # steps per λ (0: fitted to seconds_per_run)
    lengths: Tuple[int, ...] = (131072, 1048576)   # coverage
    coverage_queries: int = 512
    N: int = 1048576                               # survival and timing
    T: int = 16384
    survival_queries: int = 16384                  # strided over the T (T: all of them)
    K: int = 2048
    seeds: int = 8192
    kl_crops: int = 1                              # held-out crops per domain
    repeats: int = 3
    warmup: int = 1
    budget_seconds: float = 500.0
    timing_reserve: float = 60.0                   # seconds kept for the timing stage
    coverage_tolerance: float = 0.005
    survivor_cost: float = 0.0                     # Config.survivor_cost of survival and timing
                                                   # (0: the backend's default)
    evaluate: str = ""                             # read each λ's weights from here, no training
    train_only: bool = False                       # write every λ's weights, measure nothing


FULL = Plan()
QUICK = Plan(train_preset="tiny", heads=(4,), lambdas=(0.0, 3.0), steps=20, lengths=(256, 512),
             coverage_queries=32, N=512, T=64, survival_queries=16, K=16, seeds=64,
             repeats=1, warmup=0, budget_seconds=600.0)


class Clock:
    """Elapsed time since the start, and whether a stage of a given cost still fits."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, seconds: float) -> bool:
        return self.elapsed() + seconds <= self.budget

    def log(self, msg: str) -> None:
        log(f"[slack_finetune {time.strftime('%H:%M:%S', time.gmtime())} +{self.elapsed():6.1f}s] "
            f"{msg}")


# ------------------------------------------------------------------------------- the model

def base_weights(plan: Plan, out: str):
    """(lm_cfg, lm, {H: (cfg, layers)}, meta, digest) to start from, and the training config.

    Full runs: the committed weights (their configs must be the preset's). ``--quick``: a
    tiny randomly initialised model written to ``out`` and read back like committed weights.
    """
    from dosa_jax.lm import checkpoint, dump, indexer as idx, train
    from dosa_jax.lm.model import init_lm
    tc = train.PRESETS[plan.train_preset]
    if plan.heads:
        tc = dataclasses.replace(tc, indexers=tuple(c for c in tc.indexers if c.n_heads in plan.heads))
    if plan.layer_scale:
        tc = dataclasses.replace(tc, slack_layer_scale=plan.layer_scale)
    if plan.train_preset == "tiny":
        lm = init_lm(jax.random.PRNGKey(0), tc.lm)
        ks = jax.random.split(jax.random.PRNGKey(1), len(tc.indexers))
        inds = {c.n_heads: (c, idx.init_indexers(k, tc.lm, c)) for k, c in zip(ks, tc.indexers)}
        path = os.path.join(out, "quick_base_weights.npz")
        checkpoint.export_weights(path, tc.lm, lm, inds, {"kind": "random tiny model"})
        weights = dump.load_default_weights(path)
    else:
        weights = dump.load_default_weights()
    lm_cfg, lm, inds, wmeta, digest = weights
    inds = {c.n_heads: inds.get(c.n_heads) for c in tc.indexers}
    weights = (lm_cfg, lm, inds, wmeta, digest)
    if lm_cfg != tc.lm:
        raise ValueError(f"the weights' LM config {lm_cfg} differs from preset {plan.train_preset}")
    for c in tc.indexers:
        if inds[c.n_heads] is None or inds[c.n_heads][0] != c:
            raise ValueError(f"the weights have no indexer {c}")
    return weights, tc


def export_and_reload(path: str, weights, indexers, meta: dict):
    """Write the int8 weights file (the LM's arrays copied from the base weights) and read it
    back: what is measured is what the file holds."""
    from dosa_jax.lm import checkpoint, dump
    lm_cfg, lm, _, _, _ = weights
    checkpoint.export_weights(path, lm_cfg, lm, indexers, meta)
    dump.load_default_weights.cache_clear()
    return dump.load_default_weights(path)


def reload_weights(directory: str, lam: float):
    """(path, weights) of λ's file ``weights_lambda_<λ>.npz`` written by an earlier run into
    ``directory`` (``--evaluate``: measure without training again)."""
    from dosa_jax.lm import dump
    path = os.path.join(directory, f"weights_lambda_{lam:g}.npz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--evaluate: {path} is missing (written by a training run "
                                "of python -m benchmarks.slack_finetune --out DIR)")
    dump.load_default_weights.cache_clear()
    return path, dump.load_default_weights(path)


def lm_unchanged(a, b) -> bool:
    """The two weights' LM arrays are equal bit for bit (the LM stays frozen)."""
    la, lb = jax.tree_util.tree_leaves(a[1]), jax.tree_util.tree_leaves(b[1])
    return len(la) == len(lb) and all(bool(jnp.all(x == y)) for x, y in zip(la, lb))


# ------------------------------------------------------------------------------- training

class Trainer:
    """The jitted indexer step with λ as an argument; the step count fixed by the first run."""

    def __init__(self, tc, weights, plan: Plan, clock: Clock):
        from dosa_jax.lm import train
        self.train, self.tc, self.plan, self.clock = train, tc, plan, clock
        self.lm = weights[1]
        self.init = {str(h): layers for h, (_, layers) in weights[2].items()}
        self.streams = train.device_streams("train")
        self.total: Optional[int] = None
        self.step_seconds: Optional[float] = None

    def run(self, lam: float):
        tr, tc = self.train, self.tc
        p = jax.tree_util.tree_map(jnp.array, self.init)
        lam_arr = jnp.float32(lam)
        o = tr.make_indexer_optimizer(p, tc, lam_arr).init(p)
        t0 = time.perf_counter()
        step, timing = 0, 5
        while self.total is None or step < self.total:
            total = self.total if self.total is not None else 10 ** 6
            ts = time.perf_counter()
            p, o, parts = tr.indexer_train_step(p, o, self.lm, jnp.int32(step), jnp.int32(total),
                                                self.streams, tc, lam_arr)
            if step == 0:
                jax.block_until_ready(parts)
                self.clock.log(f"λ={lam}: first step {time.perf_counter() - ts:.1f}s")
                t_timing = time.perf_counter()
            step += 1
            if self.total is None and step == 1 + timing:
                # fewer timing steps than the warm-up: the schedule so far did not depend on total
                jax.block_until_ready(parts)
                self.step_seconds = (time.perf_counter() - t_timing) / timing
                self.total = self.plan.steps or max(
                    step, int(self.plan.seconds_per_run / self.step_seconds))
                self.clock.log(f"{self.step_seconds * 1e3:.1f} ms/step -> {self.total} steps per λ")
            if step % 50 == 0:
                self.clock.log(f"λ={lam}: step {step}/{self.total} "
                               + " ".join(f"kl_H{h}={float(v):.4f}" for h, v in parts.items()))
        jax.block_until_ready(p)
        kl = {h: float(v) for h, v in parts.items()}
        return p, dict(steps=step, train_seconds=time.perf_counter() - t0, last_train_kl=kl)


# ------------------------------------------------------------------------------- measurements

@functools.lru_cache(maxsize=None)
def _jitted(fn, static: Tuple[str, ...]):
    return jax.jit(fn, static_argnames=static)


class HeldOut:
    """Held-out crops of the training length and the frozen LM's layers on them."""

    def __init__(self, tc, weights, crops: int):
        from dosa_jax.lm import corpora, train
        L = tc.idx_seq_len or tc.seq_len
        self.tc = tc
        self.layers = []
        for d in corpora.DOMAINS:
            c = train.eval_crops(corpora.heldout_stream(d), crops, L)
            self.layers.append(_jitted(train.frozen_layers, ("tc",))(weights[1], jnp.asarray(c), tc))

    def kl(self, p, cfg, layer: int) -> float:
        from dosa_jax.lm import indexer as idx
        f = _jitted(idx.distillation_loss, ("cfg", "lm_cfg", "tail_blocks"))
        vals = [float(f(p, pl[layer][0], pl[layer][1], cfg, self.tc.lm, self.tc.idx_tail_blocks))
                for pl in self.layers]
        return float(np.mean(vals))


class LongContext:
    """The frozen LM's hidden states of every layer over the code domain's first N held-out
    tokens (survival and timing inputs are built from them for each λ's indexers)."""

    def __init__(self, weights, N: int):
        from dosa_jax.lm import corpora
        from dosa_jax.lm.model import advance_layer, embed_sequence
        lm_cfg, lm = weights[0], weights[1]
        self.tokens = np.asarray(corpora.heldout_stream("code")[:N])
        if self.tokens.shape[0] < N:
            raise ValueError(f"the code held-out stream has {self.tokens.shape[0]} < {N} tokens")
        self.h = [embed_sequence(lm, self.tokens)]
        for layer in range(lm_cfg.n_layers - 1):
            self.h.append(advance_layer(lm, self.h[-1], layer, lm_cfg))
        self.lm = lm

    def inputs(self, weights, heads: int, layer: int, T: int):
        """What ``datasets.trained("code", layer, length=N, num_queries=T, heads=heads)``
        returns for these weights: FP8 keys, bf16 queries, the last T positions causal."""
        from dosa_jax.lm import dump
        cfg, layers = weights[2][heads]
        q, k, w = dump._indexer_rows(layers[layer], self.lm["layers"][layer]["attn_norm"],
                                     self.h[layer], cfg, T, True)
        return dump.finish(q, k.astype(jnp.bfloat16), w, key_dtype="float8_e4m3fn",
                           query_dtype="bfloat16", meta=dict(layer=layer, heads=heads))


def strided(inp, stride: int):
    """Every ``stride``-th query of ``inp`` (their own causal ranges kept)."""
    if stride == 1:
        return inp
    return dataclasses.replace(inp, q=inp.q[::stride], w=inp.w[::stride], lo=inp.lo[::stride],
                               hi=inp.hi[::stride])


def length_label(n: int) -> str:
    """131072 -> 128K, 1048576 -> 1M, 512 -> 512."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def args_of(inp):
    return (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)


def choose(rows, lambdas, tolerance: float):
    """(λ, coverage target met) by the rule in the module docstring."""
    by = {}
    for r in rows:
        by.setdefault(r["lambda"], []).append(r)
    base = {(r["heads"], r["layer"]): r for r in by.get(0.0, [])}
    best = None
    for lam in lambdas:
        if lam == 0 or lam not in by or not base:
            continue
        drops, works = [], []
        for r in by[lam]:
            b = base.get((r["heads"], r["layer"]))
            if b is None:
                continue
            drops += [b[c] - r[c] for c in r if c.startswith("cov_") and c in b]
            works.append(r.get("work", r.get("survival", float("inf"))))
        if not drops:
            continue
        ok = max(drops) <= tolerance
        key = (not ok, max(works) if ok else max(drops))
        if best is None or key < best[0]:
            best = (key, lam, ok)
    if best is None:
        return 0.0, True
    return best[1], best[2]


def summarize(rows) -> dict:
    """Per λ: the worst layer's survival and work, the largest coverage drop against λ = 0 (points),
    the least dense/DoSA ratio of the timed rows."""
    out = {}
    rows = [r for r in rows if "survival" in r]     # a --train-only run has no measurements
    base = {(r["heads"], r["layer"]): r for r in rows if r["lambda"] == 0.0}
    for lam in sorted({r["lambda"] for r in rows}):
        rs = [r for r in rows if r["lambda"] == lam]
        out[f"λ={lam:g}: worst-layer survival"] = max(r["survival"] for r in rs)
        if all("work" in r for r in rs):
            out[f"λ={lam:g}: worst-layer work"] = max(r["work"] for r in rs)
        drops = [base[(r["heads"], r["layer"])][c] - r[c] for r in rs
                 if (r["heads"], r["layer"]) in base for c in r if c.startswith("cov_")]
        if lam != 0.0 and drops:
            out[f"λ={lam:g}: largest coverage drop vs λ=0 (points)"] = 100 * max(drops)
        sp = [r["dense_over_dosa"] for r in rs if "dense_over_dosa" in r]
        if sp:
            out[f"λ={lam:g}: least dense/DoSA ({len(sp)} timed)"] = min(sp)
    return out


# ------------------------------------------------------------------------------- the run

def next_lambda_seconds(plan: Plan, trainer, eval_est: float) -> float:
    """Seconds the next λ still needs: its steps (none with ``--evaluate``), the last λ's
    measurement time and, unless the run only trains (no timing stage follows),
    ``timing_reserve``."""
    steps = 0.0 if trainer is None else trainer.total * trainer.step_seconds
    return steps + eval_est + (0.0 if plan.train_only else plan.timing_reserve)


def run(plan: Plan, out: str, quick: bool) -> Table:
    from dosa_jax.lm import long_context_coverage
    clock = Clock(plan.budget_seconds)
    os.makedirs(out, exist_ok=True)
    meta = run_meta(plan)
    meta["command"] = "python -m benchmarks.slack_finetune " + " ".join(sys.argv[1:])
    Ks = [plan.K]
    weights, tc = base_weights(plan, out)
    cov_cols = [(f"cov_{d}_N{N}", f"cov {d} {length_label(N)}") for d in ("code", "prose")
                for N in plan.lengths]
    cols = ([("lambda", "λ"), ("heads", "H"), ("layer", "layer"), ("steps", "steps"),
             ("kl_heldout", "held-out KL")] + cov_cols
            + [("survival", f"survival N={length_label(plan.N)}"), ("budget", "mean r"),
               ("work", "work"), ("tau_over_tau_star", "τ/τ*"),
               ("dosa_ms", "DoSA ms"), ("dense_ms", "dense ms"), ("dense_over_dosa", "dense/DoSA"),
               ("dense_share", "queries answered densely"), ("bitwise", "DoSA == dense"),
               ("clock", "clock")])
    stride = max(1, plan.T // plan.survival_queries)
    tab = Table("slack_finetune", f"Slack-regularised indexer fine-tuning: KL + λ·slack, LM frozen "
                f"(Top-{plan.K})", cols, out, meta, summary=summarize, notes=[
                    f"fine-tune: preset {plan.train_preset} from the "
                    f"{'random tiny' if quick else 'committed'} indexers, the same steps and "
                    f"batches for every λ, H={'/'.join(str(c.n_heads) for c in tc.indexers)} "
                    "trained together",
                    "held-out KL: distillation objective on held-out crops of the training "
                    "length (both domains)",
                    f"cov: Top-{plan.K} attention-mass coverage (lm.long_context_coverage, last "
                    f"{plan.coverage_queries} positions)",
                    f"survival: survivors / visible in dosa_jax.topk(...).stats (backend auto, "
                    f"dense switch off), code, N={plan.N}, "
                    + (f"the last {plan.T} positions" if stride == 1 else
                       f"{-(-plan.T // stride)} queries strided by {stride} over the last "
                       f"{plan.T} positions"),
                    "mean r: retained-head budget of those calls; work: their dot products "
                    "per visible key relative to the dense scan (dosa_jax.slack.screening_work, "
                    "Eq. 21 with d_a = 1)",
                    f"timing: T={plan.T} (last positions), N={plan.N}, code, Config(top_k="
                    f"{plan.K}, seed_size={plan.seeds}, backend='auto'"
                    + (f", survivor_cost={plan.survivor_cost:g}" if plan.survivor_cost else "")
                    + f"), median of {plan.repeats} calls after {plan.warmup} warm-up"
                    + ("; survival, mean r and work at the same survivor cost"
                       if plan.survivor_cost else "")])

    tab.meta.update(survivor_cost=plan.survivor_cost or None)   # None: the backend's default
    clock.log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; plan {plan._asdict()}")
    heads = sorted(weights[2])
    lm_cfg = weights[0]
    if not plan.train_only:   # what the measurements need
        held = HeldOut(tc, weights, plan.kl_crops)
        clock.log("held-out crops collected")
        longc = LongContext(weights, plan.N)
        jax.block_until_ready(longc.h)
        clock.log(f"long-context hidden states (N={plan.N}) ready")
    trainer = None if plan.evaluate else Trainer(tc, weights, plan, clock)
    cfg = dosa_jax.Config(top_k=plan.K, seed_size=plan.seeds, backend="auto",
                          survivor_cost=plan.survivor_cost or None)
    f_screened, _ = jitted_paths(cfg.replace(dense_switch=float("inf")))
    f_dosa, f_dense = jitted_paths(cfg)
    files, cache = {}, {}
    eval_est = None     # seconds of the last λ's measurements (the first includes compiles)
    for lam in plan.lambdas:
        if eval_est is not None and not clock.fits(next_lambda_seconds(plan, trainer, eval_est)):
            tab.error(f"λ={lam}: skipped, {clock.elapsed():.0f}s of {plan.budget_seconds:.0f}s "
                      "used")
            continue
        try:
            if trainer is None:    # --evaluate: the weights files of an earlier run
                path, wl = reload_weights(plan.evaluate, lam)
                info = dict(steps=wl[3].get("slack_fine_tuning", {}).get("steps"))
                clock.log(f"λ={lam}: read {path} ({info['steps']} steps)")
            else:
                params, info = trainer.run(lam)
                clock.log(f"λ={lam}: trained {info['steps']} steps in "
                          f"{info['train_seconds']:.1f}s")
                tab.meta.update(steps_per_lambda=trainer.total,
                                step_ms=trainer.step_seconds * 1e3)
                p8 = trainer.train.roundtrip_int8(params)
                inds = {h: (weights[2][h][0], p8[str(h)]) for h in heads}
                path = os.path.join(out, f"weights_lambda_{lam:g}.npz")
                wl = export_and_reload(path, weights, inds, dict(
                    slack_fine_tuning=dict(lam=lam, train_preset=plan.train_preset,
                                           train_config=repr(dataclasses.replace(tc)), **info),
                    base_weights=weights[3]))
            files[lam] = path
            if not lm_unchanged(weights, wl):
                tab.error(f"λ={lam}: the exported LM differs from the base LM")
            if plan.train_only:   # measured by a later --evaluate run on these files
                tab.add({"lambda": lam, "steps": info["steps"]})
                eval_est = 0.0
                continue
            t_eval = clock.elapsed()
            cov = long_context_coverage.run(["code", "prose"], list(range(lm_cfg.n_layers)),
                                            list(plan.lengths), heads, plan.coverage_queries, Ks,
                                            weights=wl, log=lambda s: None)
            clock.log(f"λ={lam}: coverage measured")
            for h in heads:
                for layer in range(lm_cfg.n_layers):
                    row = dict(**{"lambda": lam}, heads=h, layer=layer, steps=info["steps"],
                               kl_heldout=held.kl(wl[2][h][1][layer], wl[2][h][0], layer))
                    for d in ("code", "prose"):
                        for N in plan.lengths:
                            row[f"cov_{d}_N{N}"] = cov[f"{d}/N{N}/layer{layer}/H{h}"][f"indexer@{plan.K}"]
                    inp = longc.inputs(wl, h, layer, plan.T)
                    cache[(lam, h, layer)] = inp        # the timing stage reuses it
                    _, _, st = f_screened(*args_of(strided(inp, stride)))
                    row.update(stats_summary(st), work=screening_work(st, h))
                    del st
                    tab.add(row)
                    clock.log(f"λ={lam} H={h} layer {layer}: KL {row['kl_heldout']:.4f} survival "
                              f"{row['survival']:.4f} r {row['budget']:.2f} work "
                              f"{row['work']:.4f} " + " ".join(
                                  f"{c}={row[c]:.4f}" for c, _ in cov_cols))
        except Exception as e:  # noqa: BLE001 - keep the rows so far and the other λ
            tab.error(f"λ={lam}: {e!r}"[:500])
            clock.log(f"λ={lam}: ERROR {e!r}")
            continue
        eval_est = clock.elapsed() - t_eval
    if plan.train_only:
        tab.notes.append("trained only: measure with --evaluate " + out)
        tab.write()
        clock.log(f"trained {sorted(files)}; weights in {out}")
        return tab
    if 0.0 not in plan.lambdas:   # nothing to choose against: the rows are the result
        tab.notes.append("λ = 0 not in --lambdas: no λ chosen, nothing timed (the committed "
                         "indexers' rows: --evaluate a folder holding their weights as "
                         "weights_lambda_0.npz)")
        tab.write()
        clock.log("λ = 0 not requested: no λ chosen")
        return tab
    chosen, met = choose(tab.rows, plan.lambdas, plan.coverage_tolerance)
    tab.meta.update(chosen_lambda=chosen, coverage_target_met=met)
    if chosen == 0.0:    # no regularised λ was measured against λ = 0: no "slack" weights
        tab.error("no λ > 0 was measured beside λ = 0: no regularised weights written")
        clock.log("chosen λ: none measured; no regularised weights written")
    else:
        tab.notes.append(f"chosen λ = {chosen:g} (coverage within "
                         f"{plan.coverage_tolerance * 100:g} points of λ=0 everywhere: "
                         f"{'yes' if met else 'NO'}); its weights: {WEIGHTS_NAME}")
        if chosen in files:
            shutil.copyfile(files[chosen], os.path.join(out, WEIGHTS_NAME))
        clock.log(f"chosen λ={chosen} (coverage target met: {met}); wrote {WEIGHTS_NAME}")
    tab.write()

    # DoSA vs dense at T, N for the chosen λ, then λ = 0
    order = [chosen] + ([0.0] if chosen != 0.0 and 0.0 in files else [])
    for key in [k for k in cache if k[0] not in order]:
        del cache[key]
    for lam in order:
        if lam not in files:
            continue
        for h in heads:
            for layer in range(lm_cfg.n_layers):
                if not clock.fits(15):
                    tab.error(f"timing λ={lam} H={h} layer {layer}: skipped (budget)")
                    continue
                try:
                    a = args_of(cache.pop((lam, h, layer)))
                    di, ds, st = f_dosa(*a)
                    ei, es = f_dense(*a)
                    eq = bitwise_equal(di, ds, ei, es)
                    dense_share = float(np.mean(np.asarray(st.dense)))
                    del di, ds, ei, es, st
                    td = timeit(f_dosa, *a, warmup=plan.warmup, repeats=plan.repeats)
                    te = timeit(f_dense, *a, warmup=plan.warmup, repeats=plan.repeats)
                    row = next(r for r in tab.rows if r["lambda"] == lam and r["heads"] == h
                               and r["layer"] == layer)
                    row.update(dosa_ms=td.seconds * 1e3, dense_ms=te.seconds * 1e3,
                               dense_over_dosa=te.seconds / td.seconds, bitwise=eq,
                               dense_share=dense_share, clock=td.clock)
                    tab.write()
                    clock.log(f"timing λ={lam} H={h} layer {layer}: DoSA {row['dosa_ms']:.1f} ms "
                              f"dense {row['dense_ms']:.1f} ms bitwise {eq}")
                    del a
                except Exception as e:  # noqa: BLE001 - one failed case must not lose the others
                    tab.error(f"timing λ={lam} H={h} layer {layer}: {e!r}"[:500])
                    clock.log(f"timing λ={lam} H={h} layer {layer}: ERROR {e!r}")
    clock.log("done")
    return tab


def probe(heads: int = 32, queries: int = 8) -> dict:
    """Magnitude of the slack term against the KL on the committed model (runs on a CPU).

    One training batch (two crops of the ``h200`` preset's 8K tokens, KL on the last query
    block, the slack loss on ``queries`` of its positions, K = 2048): the two objectives of
    the H=``heads`` indexers and the norms of their gradients, overall and per layer. The
    default λ grid puts λ·‖∇slack‖ / ‖∇KL‖ near 0.3, 1 and 5.
    """
    from dosa_jax.lm import dump, train
    lm_cfg, lm, inds, _, _ = dump.load_default_weights()
    tc = dataclasses.replace(train.PRESETS["h200"], indexers=(inds[heads][0],), idx_batch=2,
                             idx_tail_blocks=1, slack_queries=queries)
    params = {str(heads): inds[heads][1]}
    tokens = train.sample_batch(1, 0, train.device_streams("train"), 2, tc.seq_len)
    per_layer = jax.jit(train.frozen_layers, static_argnames=("tc",))(lm, tokens, tc)
    batch = train.slack_batch(per_layer, 0, 0, tc)
    norm = lambda g: float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g))))
    (kl, _), g_kl = jax.jit(jax.value_and_grad(
        lambda p, m, t, pl: train.indexer_objective(p, m, t, tc, pl), has_aux=True))(
            params, lm, tokens, per_layer)
    (sl, _), g_sl = jax.jit(jax.value_and_grad(
        lambda p, b: train.slack_objective(p, b, tc), has_aux=True))(params, batch)
    out = dict(heads=heads, crop=tc.seq_len, slack_queries=queries, K=tc.slack_top_k,
               kl=float(kl), slack=float(sl), grad_kl=norm(g_kl), grad_slack=norm(g_sl),
               per_layer=[dict(layer=i, grad_kl=norm(g_kl[str(heads)][i]),
                               grad_slack=norm(g_sl[str(heads)][i])) for i in range(lm_cfg.n_layers)])
    out["grad_ratio_slack_over_kl"] = out["grad_slack"] / out["grad_kl"]
    return out


def parse_lambdas(spec: str) -> Tuple[float, ...]:
    try:
        vals = tuple(float(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--lambdas: cannot read {spec!r} (comma-separated numbers)") from None
    if not vals or any(not (v >= 0 and np.isfinite(v)) for v in vals):
        raise ValueError(f"--lambdas must be finite numbers >= 0, got {spec!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.slack_finetune",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--quick", action="store_true", help="tiny random model (CPU smoke run)")
    ap.add_argument("--lambdas", default="", help="comma-separated λ (default 0,0.3,1,3)")
    ap.add_argument("--seconds-per-run", type=float, default=None)
    ap.add_argument("--heads", default="", help="comma-separated indexer widths to train or "
                    "measure (default: all of the preset's, 32,64)")
    ap.add_argument("--layer-scale", default="", metavar="F0,F1,...",
                    help="λ's factor per LM layer, e.g. 4,1,1,1 (default: 1 on every layer)")
    ap.add_argument("--steps", type=int, default=None, help="steps per λ (default: fitted to "
                    "--seconds-per-run from the first run's timed steps)")
    ap.add_argument("--budget-seconds", type=float, default=None)
    ap.add_argument("--survivor-cost", type=float, default=None, metavar="KAPPA",
                    help="Config.survivor_cost of the survival and timing calls (default: the "
                         "backend's, 3 on the kernels), e.g. 8 for the committed slack weights")
    ap.add_argument("--coverage-queries", type=int, default=None,
                    help="positions per coverage measurement (default 512)")
    ap.add_argument("--survival-queries", type=int, default=None,
                    help="queries (strided over T) per survival measurement (default: all T)")
    ap.add_argument("--evaluate", default="", metavar="DIR",
                    help="measure the weights_lambda_<λ>.npz files an earlier run wrote to DIR "
                         "instead of training")
    ap.add_argument("--train-only", action="store_true",
                    help="train every λ and write its weights_lambda_<λ>.npz, measure nothing "
                         "(then --evaluate that directory, e.g. in a second device call)")
    ap.add_argument("--probe", action="store_true",
                    help="only the slack-vs-KL magnitude probe on the committed model (CPU)")
    a = ap.parse_args(argv)
    if a.probe:
        import json
        res = probe()
        log(json.dumps(res, indent=1))
        log(f"λ·‖∇slack‖/‖∇KL‖ for λ in {FULL.lambdas}: "
            + ", ".join(f"{lam:g}: {lam * res['grad_ratio_slack_over_kl']:.2f}" for lam in FULL.lambdas))
        return 0
    plan = QUICK if a.quick else FULL
    try:
        if a.lambdas:
            plan = plan._replace(lambdas=parse_lambdas(a.lambdas))
    except ValueError as e:
        ap.error(str(e))
    from dosa_jax.lm import train
    preset = train.PRESETS[plan.train_preset]
    if a.heads:
        try:
            heads = tuple(sorted({int(h) for h in a.heads.split(",")}))
        except ValueError:
            ap.error(f"--heads must be comma-separated integers, got {a.heads!r}")
        known = {c.n_heads for c in preset.indexers}
        if not set(heads) <= known:
            ap.error(f"--heads {a.heads!r}: preset {plan.train_preset} has indexers of "
                     f"{sorted(known)} heads")
        plan = plan._replace(heads=heads)
    if a.layer_scale:
        try:
            tc = train.with_slack_layer_scale(preset, a.layer_scale)
        except ValueError as e:
            ap.error(f"--layer-scale: {e}")
        plan = plan._replace(layer_scale=tc.slack_layer_scale)
    if a.seconds_per_run is not None:
        if not a.seconds_per_run > 0:
            ap.error(f"--seconds-per-run must be > 0, got {a.seconds_per_run}")
        plan = plan._replace(seconds_per_run=a.seconds_per_run)
    if a.steps is not None:
        if a.steps < 6:
            ap.error(f"--steps must be >= 6 (the first six steps are timed), got {a.steps}")
        plan = plan._replace(steps=a.steps)
    if a.budget_seconds is not None:
        plan = plan._replace(budget_seconds=a.budget_seconds)
    if a.survivor_cost is not None:
        if not (math.isfinite(a.survivor_cost) and a.survivor_cost > 0):
            ap.error(f"--survivor-cost must be a finite number > 0, got {a.survivor_cost}")
        plan = plan._replace(survivor_cost=a.survivor_cost)
    for name in ("coverage_queries", "survival_queries"):
        v = getattr(a, name)
        if v is not None:
            if v < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
            plan = plan._replace(**{name: v})
    if not a.quick and plan.coverage_queries % 512:
        ap.error(f"--coverage-queries must be a multiple of 512 (the coverage's query block), "
                 f"got {plan.coverage_queries}")
    if a.evaluate:
        if not os.path.isdir(a.evaluate):
            ap.error(f"--evaluate: no directory {a.evaluate!r}")
        if a.train_only:
            ap.error("--train-only and --evaluate exclude each other")
        plan = plan._replace(evaluate=a.evaluate)
    if a.train_only:
        plan = plan._replace(train_only=True)
    tab = run(plan, a.out, a.quick)
    log(tab.markdown())
    return 1 if tab.errors else 0


if __name__ == "__main__":
    sys.exit(main())
