"""The measurements behind ``python -m benchmarks <preset>`` (shapes in :mod:`benchmarks.shapes`).

Every path is called through the public API (``dosa_jax.topk``, ``dosa_jax.dense_topk``,
``dosa_jax.exact_topk`` with ``Config(backend="auto")``: the Pallas kernels on a GPU, the
jnp reference elsewhere), jitted once per configuration so that each (H, N) shape compiles
once and is reused across layers and domains. Correctness comes first in every row (DoSA's
indices and scores bitwise equal to the dense scan's), then the median of the timed calls
(:func:`benchmarks.devtime.timeit`: the device clock on a GPU). Inputs are the trained
indexer's, never zeros.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dosa_jax
from benchmarks.devtime import breakdown_rows, device_breakdown, timeit
from benchmarks.report import Table, geometric_mean, log
from benchmarks.shapes import Case, Preset


def weights_of(meta) -> str:
    """The run's trained indexers (``--weights``; ``datasets.trained``'s ``weights``)."""
    return meta.get("weights") or "committed"


def weights_note(meta) -> str:
    """The table note naming the trained indexers the run loaded."""
    w = weights_of(meta)
    if w == "committed":
        return "indexer weights: committed (dosa_jax/data/lm_weights.npz)"
    name = os.path.basename(meta.get("weights_file") or w)
    return f"indexer weights: {w} (datasets.trained(..., weights={w!r}): {name})"


def trained_inputs(case: Case, T: int, N: int, weights: str = "committed"):
    """The case's indexer inputs (FP8 keys, bf16 queries, the last T of N positions causal)
    from the ``weights`` indexers (``datasets.trained``)."""
    from dosa_jax import datasets
    t0 = time.perf_counter()
    inp = datasets.trained(case.domain, case.layer, length=N, num_queries=T, heads=case.H,
                           key_dtype="float8_e4m3fn", query_dtype="bfloat16", weights=weights)
    jax.block_until_ready((inp.q, inp.k, inp.w))
    for name in ("q", "k", "w"):
        if not bool(jnp.any(getattr(inp, name).astype(jnp.float32) != 0)):
            raise ValueError(f"{case.name} N={N}: input {name} is all zeros; refusing to time it")
    return inp, time.perf_counter() - t0


def args_of(inp):
    return (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)


def config_of(p: Preset) -> dosa_jax.Config:
    return dosa_jax.Config(top_k=p.K, seed_size=p.seeds, backend="auto")


@functools.lru_cache(maxsize=8)
def jitted_paths(cfg: dosa_jax.Config):
    """(DoSA, dense) as jitted functions of (q, k, w, k_scale, lo, hi), one pair per config (its
    compilations are reused by every preset that runs the same config and shapes)."""
    dosa = jax.jit(lambda q, k, w, s, lo, hi: tuple(dosa_jax.topk(
        q, k, w, k_scale=s, lo=lo, hi=hi, config=cfg)))
    dense = jax.jit(lambda q, k, w, s, lo, hi: dosa_jax.dense_topk(
        q, k, w, k_scale=s, lo=lo, hi=hi, config=cfg)[:2])
    return dosa, dense


def xla_baseline(q, k, w, k_scale, lo, hi, K: int, chunk: int):
    """jnp scoring (bf16 operands, f32 accumulation) + ``lax.top_k``, ``chunk`` queries at a time."""
    T = q.shape[0]
    N = k.shape[0]
    kb = k.astype(jnp.bfloat16)
    ids = jnp.arange(N, dtype=jnp.int32)[None, :]

    def one(a):
        qc, wc, loc, hic = a
        x = jnp.einsum("thd,nd->thn", qc.astype(jnp.bfloat16), kb,
                       preferred_element_type=jnp.float32)
        s = jnp.einsum("thn,th->tn", jnp.maximum(x, 0.0), wc,
                       precision=lax.Precision.HIGHEST) * k_scale[None, :]
        s = jnp.where((ids >= loc[:, None]) & (ids < hic[:, None]), s, -jnp.inf)
        return lax.top_k(s, K)

    n = T // chunk
    sp = lambda a: a.reshape((n, chunk) + a.shape[1:])
    v, i = lax.map(one, (sp(q), sp(w), sp(lo), sp(hi)))
    return i.reshape(T, -1), v.reshape(T, -1)


def bitwise_equal(a_idx, a_sc, b_idx, b_sc) -> bool:
    """Indices equal and scores equal bit for bit (NaN pads equal)."""
    return bool(jnp.all(a_idx == b_idx) & jnp.all((a_sc == b_sc) | (jnp.isnan(a_sc) & jnp.isnan(b_sc))))


def stats_summary(stats) -> Dict[str, float]:
    """Survival (survivors / visible, all queries), the median τ/τ* over queries with τ* > 0, the
    mean retained-head budget r, and the shares of queries whose candidate lists overflowed,
    that were rescanned after a fault, and that were answered by the dense pass (the cost
    model's missing terms)."""
    surv = np.asarray(stats.survivors, np.float64)
    vis = np.asarray(stats.visible, np.float64)
    tau = np.asarray(stats.tau_seed, np.float64)
    tstar = np.asarray(stats.tau_final, np.float64)
    ok = np.isfinite(tau) & np.isfinite(tstar) & (tstar > 0)
    return dict(survival=float(surv.sum() / max(vis.sum(), 1.0)),
                overflow_share=float(np.mean(np.asarray(stats.overflows) > 0)),
                recovery_share=float(np.mean(np.asarray(stats.recoveries) > 0)),
                dense_share_screened=float(np.mean(np.asarray(stats.dense))),
                tau_over_tau_star=float(np.median(tau[ok] / tstar[ok])) if ok.any() else None,
                tau_star_positive=float(np.mean(tstar > 0)),
                budget=float(np.mean(np.asarray(stats.budget, np.float64))))


def bound_floor(inp, scores_dense, tau_seed, cfg, K: int, queries: int) -> Dict[str, float]:
    """The certificate evaluated on every key of ``queries`` queries strided over the T.

    The reference planner plans those queries as one tile (with the kernels' survivor cost κ
    when ``cfg`` runs the kernels); over their screened (visible,
    non-seed) keys: survival at the run's seed threshold τ (``tau_seed``: U^num ≥ τ), at
    the exact τ* (U^num ≥ τ*: the bound's floor with a perfect seed), and
    the means of the Eq. 14 slack terms U^num − s = δ_P + uncovered negatives + cancellation
    + numeric enclosure (``benchmarks.slack_analysis.analyse``). Over all T queries: the
    exact floor Σ min(K, |Ω|) / Σ |Ω| (a bound with U = s at τ*).
    """
    from benchmarks.slack_analysis import analyse_jit
    T = inp.q.shape[0]
    vis = np.asarray(inp.hi, np.float64) - np.asarray(inp.lo, np.float64)
    out = dict(floor_exact=float(np.minimum(vis, K).sum() / max(vis.sum(), 1.0)))
    if queries <= 0:
        return out
    sub = np.arange(0, T, max(1, T // queries))[:queries]
    q, w, lo, hi = inp.q[sub], inp.w[sub], inp.lo[sub], inp.hi[sub]
    s = dosa_jax.score(q, inp.k, w, k_scale=inp.k_scale, lo=lo, hi=hi)
    ref = cfg.replace(backend="reference")
    if dosa_jax.backend.resolve_backend(cfg.backend) == "pallas":   # the kernels' κ
        from pallas_kernels.pipeline import survivor_cost
        ref = ref.replace(survivor_cost=survivor_cost(cfg))
    a = analyse_jit(q, inp.k, w, inp.k_scale, lo, hi, s, ref)
    a = {k_: np.asarray(v) for k_, v in a.items()}
    scr = a["screened"]
    n = max(int(scr.sum()), 1)
    tau_star = np.asarray(scores_dense, np.float64)[sub, K - 1]
    u = a["u_num"]
    tau = np.asarray(tau_seed, np.float64)[sub]
    out.update(bound_queries=len(sub),
               survival_sub_tau=float((scr & ~(u < tau[:, None])).sum() / n),
               survival_sub_tau_star=float((scr & ~(u < tau_star[:, None])).sum() / n),
               **{f"slack_{t}": float(a[t][scr].mean()) for t in ("pos", "unc", "canc", "num")})
    return out


# ------------------------------------------------------------------------------------ presets

def headline(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    """XLA baseline, dense fused Pallas scan and DoSA at each N, one case."""
    cols = [("case", "case"), ("N", "N"), ("xla_ms", "XLA ms"), ("dense_ms", "dense ms"),
            ("dosa_ms", "DoSA ms"), ("xla_over_dosa", "XLA/DoSA"),
            ("dense_over_dosa", "dense/DoSA"), ("survival", "survival"),
            ("tau_over_tau_star", "τ/τ*"), ("dosa_eq_dense", "DoSA == dense bitwise"),
            ("xla_index_agreement", "XLA index agreement"), ("clock", "clock")]
    tab = Table("headline", f"Headline: T={p.T} causal, K={p.K}, FP8 keys, seeds {p.seeds}",
                cols, out, meta, notes=[
                    f"median of {repeats} timed calls after {warmup} warm-up (XLA baseline: "
                    f"median of {min(repeats, 3)} after 1)",
                    "XLA: jnp scoring (bf16 operands, f32 accumulation) + lax.top_k",
                    weights_note(meta)])
    cfg = config_of(p)
    f_dosa, f_dense = jitted_paths(cfg)
    for case in cases:
        for N in Ns:
            inp, gen_s = trained_inputs(case, p.T, N, weights_of(meta))
            log(f"[headline] {case.name} N={N}: data {gen_s:.1f}s")
            args = args_of(inp)
            chunk = max(1, min(p.T, (1 << 29) // (case.H * N)))
            while p.T % chunk:
                chunk -= 1
            f_xla = jax.jit(lambda *a: xla_baseline(*a, p.K, chunk))
            di, ds, st = f_dosa(*args)
            ei, es = f_dense(*args)
            xi, _ = f_xla(*args)
            row = dict(case=case.name, N=N, dosa_eq_dense=bitwise_equal(di, ds, ei, es),
                       xla_index_agreement=float(jnp.mean(jnp.sort(xi, 1) == jnp.sort(ei, 1))),
                       **stats_summary(st))
            del di, ds, ei, es, xi
            log(f"[headline] {case.name} N={N}: checked, DoSA == dense {row['dosa_eq_dense']}")
            t_dense = timeit(f_dense, *args, warmup=warmup, repeats=repeats)
            t_dosa = timeit(f_dosa, *args, warmup=warmup, repeats=repeats)
            t_xla = timeit(f_xla, *args, warmup=1, repeats=min(repeats, 3))
            row.update(xla_ms=t_xla.seconds * 1e3, dense_ms=t_dense.seconds * 1e3,
                       dosa_ms=t_dosa.seconds * 1e3, xla_over_dosa=t_xla.seconds / t_dosa.seconds,
                       dense_over_dosa=t_dense.seconds / t_dosa.seconds, clock=t_dosa.clock)
            tab.add(row)
            log(f"[headline] {case.name} N={N}: {row}")
    return tab


def cost_terms_fn(cfg: dosa_jax.Config):
    """Jitted (q, k, w, k_scale, lo, hi) -> the pallas dense switch's cost terms
    (``pallas_kernels.pipeline.call_cost_terms``): screen rows, refined keys and densely
    scanned keys per key of the call's ranges, and H over the mean range (the per-query
    term), for calibrating its constants. None where
    the config does not resolve to the kernels (the reference backend has no switch)."""
    if dosa_jax.backend.resolve_backend(cfg.backend) != "pallas":
        return None
    from pallas_kernels import pipeline
    return jax.jit(lambda q, k, w, s, lo, hi: pipeline.call_cost_terms(q, k, w, s, lo, hi, cfg))


def gate_fn(cfg: dosa_jax.Config):
    """Jitted (q, k, w, k_scale, lo, hi) -> what the pallas gate of ``block_witnesses=None``
    weighs (``pallas_kernels.pipeline.call_block_witness_gate``): the call's τ gap, its
    mean key range and whether the gate adds block witnesses. None where the config does not
    resolve to the kernels or names its block witnesses (no gate runs)."""
    if dosa_jax.backend.resolve_backend(cfg.backend) != "pallas" or cfg.block_witnesses is not None:
        return None
    from pallas_kernels import pipeline
    return jax.jit(lambda q, k, w, s, lo, hi: pipeline.call_block_witness_gate(q, k, w, s, lo, hi,
                                                                               cfg))


def matrix_summary(rows):
    out = {}
    timed = dict.fromkeys(c for r in rows for c in r           # the variants, in row order
                          if c.startswith("dense_over_") and c != "dense_over_dosa")
    for N in sorted({r["N"] for r in rows}, reverse=True):
        sel = [r["dense_over_dosa"] for r in rows if r["N"] == N]
        out[f"geometric mean dense/DoSA, N={N} ({len(sel)} cases)"] = geometric_mean(sel)
        for col in timed:
            sel = [r[col] for r in rows if r["N"] == N and r.get(col) is not None]
            if sel:
                out[f"geometric mean dense/{col[len('dense_over_'):]}, N={N} "
                    f"({len(sel)} cases)"] = geometric_mean(sel)
    out["all DoSA == dense bitwise"] = all(r["dosa_eq_dense"] for r in rows) if rows else None
    return out


def matrix(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    """DoSA and dense side by side over the cases, with the survival floors and slack split."""
    cols = [("case", "case"), ("N", "N"), ("dosa_ms", "DoSA ms"), ("dense_ms", "dense ms"),
            ("dense_over_dosa", "dense/DoSA"), ("dosa_eq_dense", "bitwise"),
            ("screened_ms", "DoSA, always screened, ms"),
            ("dense_over_screened", "dense/screened"), ("predicted_cost", "predicted DoSA/dense"),
            ("dense_share", "queries answered densely"),
            ("cost_terms", "cost terms (screen, refine, dense, per query)"),
            ("tau_gap", "τ gap (gate)"), ("block_witnesses_used", "block witnesses (gate)"),
            ("overflow_share", "screened: queries overflowed"),
            ("recovery_share", "screened: queries rescanned"),
            ("dense_share_screened", "screened: queries in the dense pass"),

            ("survival", "survival (τ)"), ("budget", "mean r"), ("tau_over_tau_star", "τ/τ*"),
            ("survival_sub_tau", "sub: survival (τ)"),
            ("survival_sub_tau_star", "sub: survival (τ*)"), ("floor_exact", "floor K/|Ω|"),
            ("slack_pos", "δ_P"), ("slack_unc", "uncov. neg."), ("slack_canc", "cancel."),
            ("slack_num", "numeric"), ("clock", "clock")]
    # the variants' columns (anchors, block witnesses, survivor cost), beside the screened one's
    # (block witnesses: any explicit W, 0 included, is a variant beside the default's gate)
    variants = [(name, label, over) for name, label, over, on in (
        ("anchored", f"anchors every {p.anchor_stride}", dict(anchor_stride=p.anchor_stride),
         bool(p.anchor_stride)),
        ("blockwit", f"{p.block_witnesses} block witnesses",
         dict(block_witnesses=p.block_witnesses), p.block_witnesses is not None),
        ("kappa", f"survivor cost {p.survivor_cost:g}",
         dict(survivor_cost=p.survivor_cost or None), bool(p.survivor_cost))) if on]
    at = [c for c, _ in cols].index("cost_terms") + 1
    for name, label, _ in reversed(variants):
        cols[at:at] = [(f"{name}_ms", f"DoSA, {label}, ms"), (f"dense_over_{name}", f"dense/{name}"),
                       (f"{name}_survival", f"{name} survival"), (f"{name}_budget", f"{name} mean r"),
                       (f"{name}_tau_over_tau_star", f"{name} τ/τ*")]
    tab = Table("matrix", f"Matrix: T={p.T} causal, K={p.K}, FP8 keys, Config(backend='auto')",
                cols, out, meta, summary=matrix_summary, notes=[
                    f"median of {repeats} timed calls after {warmup} warm-up, each case's "
                    "DoSA and dense in the same process",
                    "survival (τ), mean r, τ/τ*: all T queries, from the always-screened DoSA's stats (τ/τ* median where τ* > 0; mean r: the retained-head budget, each variant's from its own call); predicted DoSA/dense: the call-level switch's prediction (Config.dense_switch)",
                    f"sub: columns and the slack means (Eq. 14, score units, mean over screened "
                    f"keys) on {p.bound_queries} queries strided over the T (the certificate "
                    "evaluated per key by the reference planner)",
                    "floor K/|Ω|: Σ min(K, |Ω|) / Σ |Ω| over all queries (a bound with U = s)",
                    weights_note(meta)])
    cfg = config_of(p)
    f_dosa, f_dense = jitted_paths(cfg)
    # the same DoSA with the call-level dense switch off: what the switch's prediction decides on
    f_screened, _ = jitted_paths(cfg.replace(dense_switch=float("inf")))
    f_terms = cost_terms_fn(cfg)
    f_gate = gate_fn(cfg)
    f_variants = [(name, jitted_paths(cfg.replace(**over))[0]) for name, _, over in variants]
    for N in Ns:
        for case in sorted(cases, key=lambda c: c.H):     # one compile per (H, N)
            t0 = time.perf_counter()
            try:
                inp, gen_s = trained_inputs(case, p.T, N, weights_of(meta))
                log(f"[matrix] {case.name} N={N}: data {gen_s:.1f}s")
                args = args_of(inp)
                di, ds, st = f_dosa(*args)
                ei, es = f_dense(*args)
                si, ss, sst = f_screened(*args)
                row = dict(case=case.name, N=N, dosa_eq_dense=bitwise_equal(di, ds, ei, es)
                           and bitwise_equal(si, ss, ei, es), **stats_summary(sst),
                           predicted_cost=float(np.asarray(st.predicted_cost)[0]),
                           dense_share=float(np.mean(np.asarray(st.dense))),
                           cost_terms=None if f_terms is None else
                           [round(float(t), 5) for t in np.asarray(f_terms(*args))])
                row.update(tau_gap=None, block_witnesses_used=None)   # no gate ran
                if f_gate is not None:
                    gap, _, used = (float(g) for g in np.asarray(f_gate(*args)))
                    from pallas_kernels.pipeline import AUTO_BLOCK_WITNESSES
                    row.update(tau_gap=gap,
                               block_witnesses_used=AUTO_BLOCK_WITNESSES if used else 0)
                del di, ds, si, ss
                log(f"[matrix] {case.name} N={N}: checked (compiled) at "
                    f"{time.perf_counter() - t0:.1f}s, DoSA == dense {row['dosa_eq_dense']}")
                t_dosa = timeit(f_dosa, *args, warmup=warmup, repeats=repeats)
                t_dense = timeit(f_dense, *args, warmup=warmup, repeats=repeats)
                t_scr = timeit(f_screened, *args, warmup=warmup, repeats=repeats)
                row.update(dosa_ms=t_dosa.seconds * 1e3, dense_ms=t_dense.seconds * 1e3,
                           dense_over_dosa=t_dense.seconds / t_dosa.seconds, clock=t_dosa.clock,
                           screened_ms=t_scr.seconds * 1e3,
                           dense_over_screened=t_dense.seconds / t_scr.seconds)
                for name, f_var in f_variants:
                    vi, vsc, vst = f_var(*args)
                    row["dosa_eq_dense"] &= bitwise_equal(vi, vsc, ei, es)
                    t_var = timeit(f_var, *args, warmup=warmup, repeats=repeats)
                    vsum = stats_summary(vst)
                    row.update({f"{name}_ms": t_var.seconds * 1e3,
                                f"dense_over_{name}": t_dense.seconds / t_var.seconds,
                                f"{name}_survival": vsum["survival"],
                                f"{name}_budget": vsum["budget"],
                                f"{name}_tau_over_tau_star": vsum["tau_over_tau_star"]})
                    del vi, vsc
                log(f"[matrix] {case.name} N={N}: timed DoSA {row['dosa_ms']:.1f} ms, dense "
                    f"{row['dense_ms']:.1f} ms")
                row.update(bound_floor(inp, es, sst.tau_seed, cfg, p.K, p.bound_queries))
                del ei, es
                tab.add(row)
                log(f"[matrix] {case.name} N={N}: done in {time.perf_counter() - t0:.1f}s {row}")
            except Exception as e:  # noqa: BLE001 - one failed case must not lose the others
                tab.error(f"{case.name} N={N}: {e!r}"[:500])
                log(f"[matrix] {case.name} N={N}: ERROR {e!r}")
    return tab


def kernels(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    """Each path's costliest kernels per call (:func:`benchmarks.devtime.device_breakdown`)."""
    cols = [("path", "path"), ("case", "case"), ("N", "N"), ("kernel", "kernel"),
            ("ms", "ms per call"), ("launches", "launches per call"), ("op", "XLA op")]
    tab = Table("kernels", f"Kernels: T={p.T} causal, K={p.K}, seeds {p.seeds}", cols, out, meta,
                notes=[f"{repeats} traced calls after {warmup} warm-up; span: first activity "
                       "start to last end; busy: union of stream activities; idle = span − busy",
                       weights_note(meta)])
    cfg = config_of(p)
    paths = dict(zip(("dosa", "dense"), jitted_paths(cfg)))
    for case in cases:
        for N in Ns:
            inp, gen_s = trained_inputs(case, p.T, N, weights_of(meta))
            log(f"[kernels] {case.name} N={N}: data {gen_s:.1f}s")
            args = args_of(inp)
            for name, f in paths.items():
                b = device_breakdown(f, *args, warmup=warmup, iters=repeats, top=20)
                base = dict(path=name, case=case.name, N=N)
                if b is None:
                    t = timeit(f, *args, warmup=0, repeats=repeats)
                    tab.add(dict(base, kernel=f"(no GPU activity records: {t.clock} median)",
                                 ms=t.seconds * 1e3))
                    continue
                for row in breakdown_rows(b):
                    tab.add(dict(base, **row))
                log(f"[kernels] {name} {case.name} N={N}: span {b['span_ms']:.1f} ms")
    return tab


def select(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    """``exact_topk`` (Pallas threshold select vs the reference) against ``lax.top_k``."""
    R, M, k = p.select_rows, p.select_cols, p.K
    cols = [("path", "path"), ("ms", "ms"), ("vs_lax", "lax.top_k / path"),
            ("equal", "== reference"), ("equal_ties_nan", "== reference (ties, NaN)"),
            ("clock", "clock")]
    tab = Table("select", f"Selection: [{R}, {M}] float32 rows, k={k}", cols, out, meta,
                notes=[f"median of {repeats} timed calls after {warmup} warm-up",
                       "ties/NaN rows: scores rounded to quarters, every 97th column NaN"])
    x = jax.random.normal(jax.random.PRNGKey(3), (R, M), jnp.float32)
    y = (jnp.round(x * 4) / 4).at[:, ::97].set(jnp.nan)
    fns = {"pallas": jax.jit(lambda x: dosa_jax.exact_topk(x, k, backend="pallas")),
           "reference": jax.jit(lambda x: dosa_jax.exact_topk(x, k, backend="reference")),
           "lax.top_k": jax.jit(lambda x: lax.top_k(x, k)[::-1])}
    ref_x, ref_y = fns["reference"](x), fns["reference"](y)
    t_lax = timeit(fns["lax.top_k"], x, warmup=warmup, repeats=repeats)
    for name, f in fns.items():
        t = t_lax if name == "lax.top_k" else timeit(f, x, warmup=warmup, repeats=repeats)
        row = dict(path=name, ms=t.seconds * 1e3, vs_lax=t_lax.seconds / t.seconds, clock=t.clock)
        if name != "lax.top_k":
            i, s = f(x)
            j, u = f(y)
            row.update(equal=bitwise_equal(i, s, *ref_x), equal_ties_nan=bitwise_equal(j, u, *ref_y))
        tab.add(row)
        log(f"[select] {row}")
    return tab


def decode(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    """Per-step decode latency against the dense paths (:mod:`benchmarks.decode`)."""
    from benchmarks import decode as measure
    return measure.decode(p, Ns, cases, out, meta, repeats, warmup)


#: Preset name -> measurement.
RUNNERS: Dict[str, Callable[..., Table]] = dict(headline=headline, matrix=matrix,
                                               kernels=kernels, select=select, decode=decode)
