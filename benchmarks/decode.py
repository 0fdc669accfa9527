"""The ``decode`` preset: per-step latency of ``decode_topk`` against the dense paths, on a trained
indexer along real text (``python -m benchmarks decode``).

Data: the trained indexer's q/k/w on the first N held-out tokens
(``dosa_jax.datasets.trained``). Sequence b of a batch decodes the consecutive positions
``N − T + 8b + t`` (t = 0 … steps−1): its own copy of the N keys (FP8 payloads + scales), its
own query stream, its own length, so the witnesses are what a generation loop has: the state
of the previous position's step (the step before the first starts from ``decode_init``, every
key a candidate, and is not timed).
Keys are contiguous [B, N, D] or shuffled pages of 64 keys with a page table.

Per row, in one process: correctness first (every step's indices and scores bitwise equal
to the pallas ``dense_topk`` of each sequence), then the median time of a jitted
``lax.scan`` over the steps for each path, divided by the steps:

* ``decode``: ``dosa_jax.decode_topk`` (witness threshold, fused scan, bounded selection);
* ``dense``: ``dosa_jax.dense_topk`` (the fused dense scan + exact selection) over all the
  batch's keys as one table, each query seeing its sequence's rows;
* ``score+exact``: jnp scoring (bf16 operands, f32 accumulation) + ``dosa_jax.exact_topk``;
* ``xla``: the same jnp scoring + ``lax.top_k``.

The scan kernel alone (from the last step's τ_w) gives the achieved bandwidth: payload +
scale bytes of the visible keys over its time, against a device copy measured in the same
run. τ_w/τ* is the median over steps and sequences with τ* > 0 (a mean is dominated by the
steps whose τ* is close to 0); candidates per query and the overflow share are means. The
first step (from ``decode_init``: every witness slot empty, filled with the sequences' seeds)
is not timed; its candidates per query and overflow share are columns of their own.

The ``exactness`` rows: ≥ 1000 consecutive steps (B = 8) compared with ``dense_topk`` step by
step, the queries switching to another text's stream halfway (the witnesses become useless)
and a buffer of K slots (overflow and its exact fallback happen).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dosa_jax
from benchmarks.devtime import timeit
from benchmarks.report import Table, log
from benchmarks.shapes import Case, Preset

#: Positions between the query streams of consecutive sequences of a batch.
GAP = 8
#: Keys per page of the paged layout.
PAGE = 64
#: The indexer whose query stream replaces the case's halfway through the exactness run.
OTHER = Case("prose", 3)
#: XLA compile options of the ``--graphs`` study: the loop, its steps and each step's
#: ``lax.cond`` captured in command buffers (CUDA graphs; conditionals evaluated on the device
#: instead of read back by the host). The same program and answer; only the compile differs.
GRAPH_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer":
                          "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"}


def copy_bandwidth(nbytes: int = 1 << 31, repeats: int = 10) -> float:
    """Measured device copy bandwidth (GB/s: bytes read + written per second)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    t = timeit(f, x, warmup=2, repeats=repeats)
    del x
    return 2 * nbytes / t.seconds / 1e9


def batch_streams(inp, B: int, steps: int, offset: int = 0):
    """Queries [steps + 1, B, H, D], weights and lengths [steps + 1, B] of B sequences
    decoding consecutive positions (row 0: the step before the first)."""
    T = inp.q.shape[0]
    N = inp.k.shape[0]
    t = offset + np.arange(steps + 1)[:, None] + GAP * np.arange(B)[None, :]
    if t.max() >= T:
        raise ValueError(f"{T} queries cannot feed B={B} sequences for {steps} steps")
    pos = N - T + t
    return inp.q[t], inp.w[t], jnp.asarray(pos + 1, jnp.int32)


def caches(inp, B: int, paged: bool, seed: int = 0):
    """(k, k_scale, page_table): B copies of the keys, contiguous or as shuffled pages."""
    N, D = inp.k.shape
    copies = lambda k, s: (jnp.tile(k[None], (B, 1, 1)), jnp.tile(s[None], (B, 1)))
    if not paged:
        return jax.jit(copies)(inp.k, inp.k_scale) + (None,)
    per = N // PAGE
    perm = np.random.default_rng(seed).permutation(B * per)
    inv = jnp.asarray(np.argsort(perm), jnp.int32)

    def pages(k, s, inv):   # one program: no eager copy of the B·N keys besides the pages
        k, s = copies(k, s)
        return k.reshape(B * per, PAGE, D)[inv], s.reshape(B * per, PAGE)[inv]
    kp, sp = jax.jit(pages)(inp.k, inp.k_scale, inv)   # page perm[j] holds block j
    return kp, sp, jnp.asarray(perm.reshape(B, per), jnp.int32)


def flat_ranges(lengths, N: int):
    """lo/hi [B] of each sequence's rows in the batch's keys as one [B·N, D] table."""
    lo = jnp.arange(lengths.shape[-1], dtype=jnp.int32) * N
    return lo, lo + lengths


def dense_step(q, w, lengths, kf, sf, cfg, N: int):
    """dense_topk of the B queries over their sequences' rows; ids as sequence positions."""
    lo, hi = flat_ranges(lengths, N)
    r = dosa_jax.dense_topk(q, kf, w, k_scale=sf, lo=lo, hi=hi, config=cfg)
    return jnp.where(r.indices >= 0, r.indices - lo[:, None], -1), r.scores


def jnp_scores(q, w, lengths, k, s):
    """[B, N] scores by jnp (bf16 operands, f32 accumulation), −inf beyond each length."""
    def one(a):
        qb, wb, kb, sb, n = a
        x = jnp.einsum("hd,nd->hn", qb.astype(jnp.bfloat16), kb.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        sc = jnp.einsum("hn,h->n", jnp.maximum(x, 0.0), wb) * sb
        return jnp.where(jnp.arange(kb.shape[0]) < n, sc, -jnp.inf)
    return lax.map(one, (q, w, k, s, lengths))


def scanned(step, graphs: bool = False):
    """jit of a lax.scan of ``step(state, q, w, lengths) -> (state, out)`` over steps;
    ``graphs``: compiled with :data:`GRAPH_COMPILER_OPTIONS`."""
    def run(qs, ws, ls, state, *rest):
        return lax.scan(lambda st, x: step(st, *x, *rest), state, (qs, ws, ls))
    if graphs:
        return jax.jit(run, compiler_options=GRAPH_COMPILER_OPTIONS)
    return jax.jit(run)


def decode_fn(cfg, paged: bool, graphs: bool = False):
    def step(state, q, w, n, k, s, pt):
        res, state = dosa_jax.decode_topk(q, k, w, state, k_scale=s, lengths=n,
                                          page_table=pt if paged else None, config=cfg)
        return state, (res.indices, res.scores, res.stats)
    return scanned(step, graphs)


def dense_fn(cfg, N: int, graphs: bool = False):
    """dense_topk steps over the contiguous caches k [B, N, D], s [B, N] (seen as one table
    inside the program: no second copy of the keys)."""
    def step(state, q, w, n, k, s):
        return state, dense_step(q, w, n, k.reshape(-1, k.shape[-1]), s.reshape(-1), cfg, N)
    return scanned(step, graphs)


def jnp_fn(K: int, exact: bool, graphs: bool = False):
    def step(state, q, w, n, k, s):
        sc = jnp_scores(q, w, n, k, s)
        if exact:
            return state, dosa_jax.exact_topk(sc, K)
        v, i = lax.top_k(sc, K)
        return state, (i, v)
    return scanned(step, graphs)


def scan_only_fn(cfg, paged: bool, screen: bool = False):
    """The scan kernel alone from given thresholds (the bandwidth figure): the canonical
    4-slot scan, or (``screen``) the one-slot screen a certified step runs."""
    from pallas_kernels import decode as kd

    def run(q, w, k, s, pt, n, theta):
        prep = kd.prepare(q[:, None], w[:, None], k, s, pt if paged else None)
        if screen:
            return kd.screen_records(prep, q[:, None], w[:, None], theta[::kd.SLOTS], n,
                                     cfg.top_k)[2]
        return kd.scan_records(prep, theta, n, 1, cfg.top_k)[2]
    return jax.jit(run)


def _bits_equal(a, b):
    return bool(jnp.all(lax.bitcast_convert_type(a, jnp.int32) == lax.bitcast_convert_type(b, jnp.int32)))


def _summary(rows):
    out = {}
    for r in rows:
        if r.get("layout") == "exactness":
            out[f"exactness: mismatches over {r['steps']} steps × B={r['B']}"] = r["mismatches"]
    ok = [r for r in rows if r.get("layout") != "exactness"]
    if ok:
        out["all rows decode == dense bitwise"] = all(r["decode_eq_dense"] for r in ok)
        for key, name in (("dense_over_decode", "dense/decode"),
                          ("score_exact_over_decode", "score+exact/decode"),
                          ("xla_over_decode", "XLA/decode")):
            vals = [r[key] for r in ok if r.get(key)]
            if vals:
                out[f"geometric mean of {name} over {len(vals)} rows"] = round(
                    float(np.exp(np.mean(np.log(vals)))), 3)
    return out


def exactness(tab: Table, inp, other, cfg, steps: int) -> None:
    """≥ 1000 consecutive steps, a switch of query stream halfway, a buffer of K slots."""
    B = 8
    N = inp.k.shape[0]
    t0 = time.perf_counter()
    qs, ws, ls = batch_streams(inp, B, steps)
    oq, ow, _ = batch_streams(other, B, steps)
    half = (np.arange(steps + 1) >= steps // 2)[:, None, None]
    qs = jnp.where(half[..., None], oq, qs)
    ws = jnp.where(half, ow, ws)
    k, s, _ = caches(inp, B, False)
    small = cfg.replace(capacity=cfg.top_k)

    def step(state, q, w, n, k, s):
        res, state = dosa_jax.decode_topk(q, k, w, state, k_scale=s, lengths=n, config=small)
        di, ds = dense_step(q, w, n, k.reshape(B * N, -1), s.reshape(-1), small, N)
        bad = jnp.sum(jnp.any((res.indices != di) | (lax.bitcast_convert_type(res.scores, jnp.int32)
                                                      != lax.bitcast_convert_type(ds, jnp.int32)),
                              axis=1))
        return state, (bad, res.stats.overflow, res.stats.candidates)

    run = scanned(step)       # the caches are arguments, not constants of the program
    _, (bad, over, cand) = run(qs[1:], ws[1:], ls[1:], dosa_jax.decode_init(B, small), k, s)
    row = dict(layout="exactness", B=B, N=N, H=inp.q.shape[1], steps=steps,
               mismatches=int(jnp.sum(bad)), overflow_steps=int(jnp.sum(jnp.any(over > 0, 1))),
               candidates=float(jnp.mean(cand)), seconds=time.perf_counter() - t0)
    row["decode_eq_dense"] = row["mismatches"] == 0
    tab.add(row)
    log(f"[decode] exactness: {row}")


def graph_times(row, f_dec, args, g_dec, expect, base, dense, xla, steps: int, warmup: int,
                repeats: int) -> None:
    """The row's decode, dense and XLA loops compiled with :data:`GRAPH_COMPILER_OPTIONS`
    (command buffers: the loop and each step's ``lax.cond`` run as CUDA graphs), timed beside
    the default compile: the same answer bitwise (checked), ms per step and their ratios."""
    _, (gi, gs, _) = g_dec(*args)
    row["graphs_eq"] = bool(jnp.all(gi == expect[0])) and _bits_equal(gs, expect[1])
    per_step = lambda f, a, r: timeit(f, *a, warmup=warmup, repeats=r).seconds * 1e3 / steps
    # the default compile again, in the same stretch of the run as the graphs
    row["decode_ms_again"] = per_step(f_dec, args, repeats)
    row["decode_graph_ms"] = per_step(g_dec, args, repeats)
    if "dense_graph_ms" not in base:
        base["dense_graph_ms"] = per_step(*dense, repeats)
        base["xla_graph_ms"] = per_step(*xla, max(1, repeats // 2))
    row.update(dense_graph_ms=base["dense_graph_ms"], xla_graph_ms=base["xla_graph_ms"])
    row["xla_over_decode_graphs"] = row["xla_graph_ms"] / row["decode_graph_ms"]
    row["dense_over_decode_graphs"] = row["dense_graph_ms"] / row["decode_graph_ms"]


def one_row(tab, p: Preset, case: Case, inp, B: int, paged: bool, copy_gbs: float, repeats: int,
            warmup: int, baselines: dict) -> None:
    from pallas_kernels import decode as kd
    N, D = inp.k.shape
    K = p.K
    cfg = dosa_jax.Config(top_k=K, backend="auto")
    steps = p.steps
    t0 = time.perf_counter()
    qs, ws, ls = batch_streams(inp, B, steps)
    k, s, pt = caches(inp, B, paged)
    kc, scc, _ = caches(inp, B, False) if paged else (k, s, None)
    # the state a generation loop has at the first timed step: one step from decode_init
    # (the witness slots all empty: the seeds give that step its τ_w)
    res0, state0 = jax.jit(lambda q, w, n, k, s, pt: dosa_jax.decode_topk(
        q, k, w, dosa_jax.decode_init(B, cfg), k_scale=s, lengths=n,
        page_table=pt if paged else None, config=cfg))(qs[0], ws[0], ls[0], k, s, pt)
    f_dec = decode_fn(cfg, paged)
    args = (qs[1:], ws[1:], ls[1:], state0, k, s, pt)
    _, (idx, sc, st) = f_dec(*args)
    f_dense = dense_fn(cfg, N)
    dargs = (qs[1:], ws[1:], ls[1:], state0, kc, scc)
    _, (ei, es) = f_dense(*dargs)
    eq = bool(jnp.all(idx == ei)) and _bits_equal(sc, es)
    tau_star = np.asarray(sc[..., -1], np.float64)
    tau_w = np.asarray(st.tau_witness, np.float64)
    ok = np.isfinite(tau_w) & (tau_star > 0)
    row = dict(case=case.name, H=case.H, N=N, B=B, layout="paged" if paged else "contiguous",
               decode_eq_dense=eq, tau_ratio=float(np.median(tau_w[ok] / tau_star[ok])) if ok.any()
               else None, candidates=float(np.mean(np.asarray(st.candidates))),
               overflow_share=float(np.mean(np.asarray(st.overflow))),
               first_candidates=float(np.mean(np.asarray(res0.stats.candidates))),
               first_overflow_share=float(np.mean(np.asarray(res0.stats.overflow))))
    log(f"[decode] {case.name} N={N} B={B} {row['layout']}: checked at "
        f"{time.perf_counter() - t0:.1f}s, decode == dense {eq}")
    t_dec = timeit(f_dec, *args, warmup=warmup, repeats=repeats)
    row.update(decode_ms=t_dec.seconds * 1e3 / steps, clock=t_dec.clock)
    key = (case.H, N, B)
    if key not in baselines:     # the same keys and queries for both layouts
        t_dense = timeit(f_dense, *dargs, warmup=warmup, repeats=repeats)
        jargs = (qs[1:], ws[1:], ls[1:], state0, kc, scc)
        t_ex = timeit(jnp_fn(K, True), *jargs, warmup=1, repeats=max(1, repeats // 2))
        t_xla = timeit(jnp_fn(K, False), *jargs, warmup=1, repeats=max(1, repeats // 2))
        baselines[key] = dict(dense_ms=t_dense.seconds * 1e3 / steps,
                              score_exact_ms=t_ex.seconds * 1e3 / steps,
                              xla_ms=t_xla.seconds * 1e3 / steps)
    row.update(baselines[key])
    row.update(dense_over_decode=row["dense_ms"] / row["decode_ms"],
               score_exact_over_decode=row["score_exact_ms"] / row["decode_ms"],
               xla_over_decode=row["xla_ms"] / row["decode_ms"])
    if p.graphs:
        graph_times(row, f_dec, args, decode_fn(cfg, paged, True), (idx, sc), baselines[key],
                    (dense_fn(cfg, N, True), dargs), (jnp_fn(K, False, True), dargs), steps,
                    warmup, repeats)
    # the scan kernel alone, from the last step's thresholds
    theta = jnp.where(jnp.isfinite(st.tau_witness[-1]), dosa_jax.selection.order_key(
        st.tau_witness[-1]), kd.THETA_NONE)
    theta = jnp.pad(theta[:, None], ((0, 0), (0, kd.SLOTS - 1)),
                    constant_values=kd.THETA_NONE).reshape(-1)
    sargs = (qs[-1], ws[-1], k, s, pt, ls[-1], theta)
    nbytes = float(jnp.sum(ls[-1])) * (D * k.dtype.itemsize + 4)
    t_scan = timeit(scan_only_fn(cfg, paged), *sargs, warmup=warmup, repeats=repeats)
    row.update(scan_ms=t_scan.seconds * 1e3, scan_gbs=nbytes / t_scan.seconds / 1e9,
               copy_gbs=copy_gbs)
    row["bandwidth_share"] = row["scan_gbs"] / copy_gbs
    if kd.screens(qs[-1][:, None], k):
        t_screen = timeit(scan_only_fn(cfg, paged, screen=True), *sargs, warmup=warmup,
                          repeats=repeats)
        row.update(screen_ms=t_screen.seconds * 1e3, screen_gbs=nbytes / t_screen.seconds / 1e9)
        row["bandwidth_share"] = row["screen_gbs"] / copy_gbs
    bk_screen = kd.scan_tile(N if not paged else PAGE, kd.screen_key_tile(case.H))
    s_splits, s_slots = kd.screen_layout(B, N // bk_screen, K, bk_screen)
    ws_b = kd.workspace_bytes(B, K, state0.ids.shape[1], D,
                              splits=kd.default_splits(B, N // kd.KEY_TILE),
                              screen_splits=s_splits, screen_slots=s_slots,
                              key_tile=kd.KEY_TILE if not paged else PAGE,
                              capacity=kd.candidate_capacity(cfg),
                              screen=kd.screens(qs[-1][:, None], k),
                              direct=kd.reads_rows_in_place(qs[-1][:, None],
                                                            ws[-1][:, None], k, s, pt))
    row["workspace_mib"] = ws_b["total"] / 2 ** 20
    row["seconds"] = time.perf_counter() - t0
    tab.add(row)
    log(f"[decode] {case.name} N={N} B={B} {row['layout']}: {row}")


def rows_in_order(p: Preset, Ns, cases):
    """(case, N, B, paged) with the headline shape first (B = 8, largest N, the first case)."""
    out = [(c, N, B, paged) for c in cases for N in sorted(Ns, reverse=True)
           for B in p.batches for paged in (False, True)
           if ("paged" if paged else "contiguous") in p.layouts]
    head = [r for r in out if r[2] == 8 and r[1] == max(Ns) and r[0] == cases[0]]
    return head + [r for r in out if r not in head]


def decode(p: Preset, Ns, cases, out, meta, repeats, warmup) -> Table:
    from benchmarks.presets import weights_note, weights_of     # --weights
    weights = weights_of(meta)
    cols = [("case", "case"), ("N", "N"), ("B", "B"), ("layout", "keys"),
            ("decode_ms", "decode ms/step"), ("dense_ms", "dense ms/step"),
            ("score_exact_ms", "score+exact_topk ms/step"), ("xla_ms", "XLA ms/step"),
            ("dense_over_decode", "dense/decode"), ("score_exact_over_decode", "score+exact/decode"),
            ("xla_over_decode", "XLA/decode"), ("screen_ms", "screen ms"),
            ("screen_gbs", "screen GB/s"), ("scan_ms", "canonical scan ms"),
            ("scan_gbs", "canonical scan GB/s"), ("copy_gbs", "copy GB/s"),
            ("bandwidth_share", "scan/copy"),
            ("tau_ratio", "τ_w/τ* (median)"), ("candidates", "candidates/query"),
            ("overflow_share", "overflow share"), ("overflow_steps", "overflow steps"),
            ("first_candidates", "first step candidates/query"),
            ("first_overflow_share", "first step overflow share"),
            ("workspace_mib", "workspace MiB"),
            ("decode_eq_dense", "decode == dense bitwise"), ("mismatches", "mismatches"),
            ("steps", "steps"), ("clock", "clock")]
    if p.graphs:
        cols += [("decode_ms_again", "decode ms/step (again)"),
                 ("decode_graph_ms", "decode ms/step, graphs"),
                 ("dense_graph_ms", "dense ms/step, graphs"),
                 ("xla_graph_ms", "XLA ms/step, graphs"),
                 ("dense_over_decode_graphs", "dense/decode, graphs"),
                 ("xla_over_decode_graphs", "XLA/decode, graphs"),
                 ("graphs_eq", "graphs == default bitwise")]
    tab = Table("decode", f"Decode: K={p.K}, FP8 keys, {p.steps} consecutive steps per row",
                cols, out, meta, summary=_summary, notes=[
                    f"per step: median of {repeats} timed scans over {p.steps} steps after "
                    f"{warmup} warm-up, divided by the steps (score+exact, XLA: half the repeats)",
                    "dense: dosa_jax.dense_topk (fused dense scan); score+exact: jnp scoring + "
                    "dosa_jax.exact_topk; XLA: jnp scoring + lax.top_k",
                    "screen: the one-slot screen kernel alone (what a certified step scans "
                    "with); canonical scan: the 4-slot scan kernel alone (what a step the screen "
                    "cannot certify runs); GB/s: (payload + scale) bytes of the visible keys / "
                    "kernel time, the screen's when it runs; copy GB/s: (read + written) bytes "
                    "of a 2 GiB device copy; scan/copy: the kernel the step scans with",
                    "workspace: records + witness table + selection buffer (independent of N)",
                    weights_note(meta)] + ([
                    "graphs: the same loops compiled with benchmarks.decode.GRAPH_COMPILER_OPTIONS "
                    "(command buffers for fusions, custom calls, conditionals and while loops); "
                    "decode (again): the default compile timed once more beside them"]
                    if p.graphs else []))
    if not meta.get("quick") and not dosa_jax.backend.on_gpu():
        raise SystemExit("the decode preset times N = 1M on a GPU; on a CPU run it with --quick")
    t_start = time.perf_counter()
    copy_gbs = copy_bandwidth(1 << 24 if meta.get("quick") else 1 << 31, repeats)
    log(f"[decode] copy bandwidth {copy_gbs:.0f} GB/s")
    T = p.steps + 1 + GAP * (max(p.batches) - 1)
    data = {}

    def inputs(case, N, T):
        if (case, N, T) not in data:
            from dosa_jax import datasets
            data.clear()
            data[(case, N, T)] = datasets.trained(case.domain, case.layer, length=N,
                                                  num_queries=T, heads=case.H, weights=weights)
        return data[(case, N, T)]

    if p.check_steps:
        try:
            N0 = min(Ns)
            Tc = p.check_steps + 1 + GAP * 7
            a = inputs(cases[0], N0, Tc)
            from dosa_jax import datasets
            b = datasets.trained(OTHER.domain, OTHER.layer, length=N0, num_queries=Tc,
                                 heads=cases[0].H, weights=weights)
            exactness(tab, a, b, dosa_jax.Config(top_k=p.K, backend="auto"), p.check_steps)
        except Exception as e:  # noqa: BLE001 - keep the timed rows
            tab.error(f"exactness: {e!r}"[:500])
            log(f"[decode] exactness: ERROR {e!r}")
    baselines = {}
    for case, N, B, paged in rows_in_order(p, Ns, cases):
        if time.perf_counter() - t_start > p.budget_s:
            tab.error(f"{case.name} N={N} B={B} {'paged' if paged else 'contiguous'}: skipped "
                      f"(time budget {p.budget_s}s)")
            continue
        try:
            inp = inputs(case, N, T)
            one_row(tab, p, case, inp, B, paged, copy_gbs, repeats, warmup, baselines)
        except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
            tab.error(f"{case.name} N={N} B={B} paged={paged}: {e!r}"[:500])
            log(f"[decode] {case.name} N={N} B={B}: ERROR {e!r}")
    return tab
