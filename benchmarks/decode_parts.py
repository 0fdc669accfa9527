"""Where a decode step's time goes: each part of ``pallas_kernels.decode.decode_topk`` timed
alone on the state a generation loop has (``python -m benchmarks.decode_parts``).

One trained-indexer case (default code 2, H = 32) at B sequences and N keys, contiguous FP8
keys, along consecutive positions (``benchmarks.decode``'s streams): the state is two steps
from ``decode_init``. Then, each jitted on its own and timed on the device clock (median
of ``--repeats`` calls after warm-up):

* ``step``: the whole step through ``dosa_jax.decode_topk``;
* ``witness``: operands + the witness scores and τ_w (``witness_threshold``);
* ``screen``: the one-slot screen kernel from those τ_w (``screen_records``);
* ``screened``: the screened step after τ_w (``screened_step``: the screen, the candidates
  rescored by the canonical tile, their selection and the next witnesses; not the second
  round, which only a step with more candidates than the buffer runs);
* ``scan``: the canonical scan kernel from those τ_w (``scan_records``, what a step that the
  screen cannot certify runs);
* ``gather``: the splits' records of each sequence's real query slot into the selection
  buffer and its Top-K (``gather_records``, its overflow fallback included when a query
  overflows);
* ``update``: the next witnesses from the buffer and the witnesses (``distinct_pool`` +
  ``best_witnesses``);
* ``screened select``: the screened step's Top-K and next witnesses from its rescored
  candidates (``select_and_witness``: one ``top_k``, a binary search); ``screened select,
  sorted pool``: the same by the candidates' ``top_k`` and ``distinct_pool`` +
  ``best_witnesses`` (a sort of the pool);
* ``screen splits=S``: the screen with S key splits per sequence (the default:
  ``default_splits``);
* ``screen fp8 x fp8 MMA, not certified``: the screen with the query rounded to FP8 and an
  fp8 × fp8 MMA instead of widening each key to bf16 in registers — a timing study of that
  widening and MMA (``screen_records(fp8_mma=True)``: its margin does not cover the rounding,
  so no step uses it), with its records per query beside the certified screen's;
* ``screen, scales read in each tile``: the screen reading each tile's key scales in that
  tile and the head weights per tile (``screen_records(ahead=False)``) instead of a tile
  ahead (a plain load the compiler does not pipeline) and once, with whether its records are
  the default's, bitwise (every recorded id and key, each count); also the default read-ahead
  with 4 pipeline stages for the key tiles (3 by default);
* ``screen bf16 MMA, canonical pieces``: the screen multiplying the canonical bf16 query
  pieces (``screen_records(mma="bf16")``) instead of the float16 scaled rows;
* ``screen BK=… warps=… stages=…``: the screen at other tiles, Triton warps and pipeline
  stages (the default: ``screen_key_tile`` and ``SCREEN_WARPS``, ``SCREEN_STAGES``); the
  ``warps`` study's grid, or the settings ``--screen-configs`` names (timed also with
  ``--parts``, with their records per query); in interpret mode (no GPU) one program serves
  every warps and stages setting of a tile, as the interpreter has neither;
* ``overflow update``: the same from all records (``record_witnesses``, the overflow path);
* ``records select``: the exact selection over all records of the real slots (the overflow
  fallback alone);
* ``witness rows read in place`` / ``witness rows from a gathered table``: the witnesses'
  seed-kernel scores alone, the kernel gathering each row from the key cache
  (``witness_keys(direct=True)``, the default where ``direct_rows`` allows) against a table
  of the rows gathered first (checked bitwise equal);
* ``step, sequence 0 stale``: the whole step with sequence 0's witnesses gone (its ids −1:
  ``dosa_jax.decode_topk`` gives its empty slots the sequence's seeds,
  ``decode.seeded_witnesses``), checked equal to the step's answer; ``step, sequence 0
  stale, unseeded``: the same ids given to the kernels as they are (``pallas_kernels.decode.
  decode_topk``: no τ_w for sequence 0, so the canonical scan answers it, and only it:
  ``exact_rows``), checked equal too; ``step, every sequence by the canonical scan``: the
  step with the screen off (``decode_topk(screen=False)``), what such a step cost when one
  stale sequence sent the whole batch to the canonical scan; the stale step's fallback by
  part: the screened step with its second round (no canonical scan), and each part of the
  second round alone on that step's screen records (``compact_records``,
  ``bound_threshold``, ``records_at_least``, ``rescored_selection``); with ``--kernels``
  the stale step's kernels too;
* with ``--kernels``: the whole step's kernels, each one's device time per step
  (:func:`benchmarks.devtime.device_breakdown`: the span, the busy time of the streams, the
  idle time between launches, and the costliest kernels with their XLA op), a second table;
* ``loop`` (a second table, ``decode_loop_<tag>``): the step inside a ``lax.scan`` of 16
  (``--loop-steps``) consecutive steps, as a generation loop runs it, at each of
  :data:`LOOP_COMPILES` (``--loop-compiles``: XLA's default, conditionals on the host or in
  command buffers, no CUB sorts, no command buffers), beside the certified path with a
  conditional that does nothing and the certified path alone (the step without its
  ``lax.cond``, the fallback left out: what the step's one conditional costs a loop), each
  with its trace's busy and idle time per step and where the idle time falls. With
  ``--parts P --studies loop`` the loop study runs beside those parts only (an A/B of two
  trees in little device time: ``gpu.sh decode_loop_ab``);
* ``top_k rows``: ``lax.top_k`` of the witness order keys over all 4 slots per sequence and
  over the M real ones (what the padded slots cost); ``kth_largest rows all slots``: the same
  K-th value by ``pallas_kernels.kth_largest``, as the step takes τ_w (checked bitwise equal).

Also per query: candidates, and whether its records overflowed the buffer.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dosa_jax
from benchmarks.decode import batch_streams, caches, copy_bandwidth
from benchmarks.devtime import (breakdown_rows, command_buffer_report, custom_call_targets,
                               device_breakdown, timeit)
from benchmarks.report import Table, log, run_meta


class Shape(NamedTuple):
    domain: str
    layer: int
    H: int
    N: int
    B: int
    K: int
    capacity: object


#: The screen variants timed beside the default (``--studies``).
STUDIES = ("mma", "ahead", "tiles", "warps", "splits", "fp8", "rows", "stale", "loop")
#: Consecutive steps of the ``loop`` study's ``lax.scan`` (``--loop-steps``).
LOOP_STEPS = 16
#: The ``loop`` study's compiles of the same loop: XLA's command buffers (CUDA graphs) as
#: XLA sets them, without conditionals (each ``lax.cond`` a host round trip between graphs),
#: with conditionals but not while loops, without CUB radix sorts (XLA:GPU's rewrite of long
#: one-row sorts, which may keep a conditional out of a command buffer), and none (every
#: kernel launched by the host).
#: Keyed by the names ``--loop-compiles`` takes.
LOOP_COMPILES = {"default": ("default compile", None),
                 "host_conditionals": ("no conditionals in command buffers",
                                       {"xla_gpu_enable_command_buffer":
                                        "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"}),
                 "conditionals": ("conditionals in command buffers, while loops not",
                                  {"xla_gpu_enable_command_buffer":
                                   "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL"}),
                 "no_cub": ("CUB radix sorts off", {"xla_gpu_enable_cub_radix_sort": False}),
                 "none": ("no command buffers", {"xla_gpu_enable_command_buffer": ""})}


#: The parts timed in every run (``--parts`` picks among them; the studies follow them).
PARTS = ("step", "witness", "screen", "screened", "scan", "gather", "update", "screened select",
         "screened select, sorted pool", "overflow update", "records select",
         "top_k rows all slots", "top_k rows real slots", "kth_largest rows all slots")


def chosen(parts, only=()):
    """The (name, function, args) of ``parts`` to time: those named in ``only`` (empty: all,
    studies included; else only those parts, no study)."""
    if not only:
        return list(parts)
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        raise ValueError(f"decode_parts: parts {unknown} unknown; the parts: {list(PARTS)}")
    return [p for p in parts if p[0] in only]


def step_kernels(step, args, meta, out: str, title: str, tag: str, repeats: int) -> Table:
    """The step's kernels per call (:func:`benchmarks.devtime.device_breakdown`)."""
    tab = Table("decode_kernels" + (f"_{tag}" if tag else ""), f"Kernels of one step: {title}",
                [("kernel", "kernel"), ("ms", "ms per step"), ("launches", "launches per step"),
                 ("op", "XLA op")], out, meta,
                notes=[f"{repeats} traced steps after 2 warm-up; span: first activity start to "
                       "last end; busy: union of stream activities; idle = span − busy"])
    b = device_breakdown(step, *args, warmup=2, iters=repeats, top=40)
    if b is None:
        tab.notes.append("no GPU activity records (not on a GPU): nothing to list")
        return tab
    for row in breakdown_rows(b):
        tab.add(row)
    log(f"[decode_parts] step kernels: span {b['span_ms']:.3f} ms, busy {b['busy_ms']:.3f}, "
        f"{b['launches']:.0f} launches")
    return tab


def loop_study(inp, k, s, st, cfg, B: int, out: str, meta, title: str, tag: str,
               repeats: int, steps: int = LOOP_STEPS, compiles=tuple(LOOP_COMPILES)) -> Table:
    """``decode_topk`` inside a ``lax.scan`` of ``steps`` consecutive steps (what a
    generation loop runs), at each of :data:`LOOP_COMPILES`, beside the certified path alone:
    the same step without its ``lax.cond`` (witnesses, screen, rescoring, selection — the
    answer only where no sequence needs the fallback, checked on these steps), and the
    certified path with a ``lax.cond`` on its predicate whose branches do next to nothing
    (what the conditional alone costs a loop). Each loop
    timed twice, alternating; per step: ms, and from a device trace span, busy, idle
    (span − busy: the host's share), where that idle time falls (between which activities)
    and launches; and for each compile, where XLA put the
    loop's conditionals and while loops relative to its command buffers
    (:func:`benchmarks.devtime.command_buffer_report`)."""
    from dosa_jax.decode import fit_witnesses, seeded_witnesses, witness_budget
    from pallas_kernels import decode as kd
    K, cap = cfg.top_k, kd.candidate_capacity(cfg)
    loops, warm = max(1, repeats // 4), 2 if repeats >= 4 else 1    # 5 and 2 at the default
    tab = Table("decode_loop" + (f"_{tag}" if tag else ""),
                f"{steps} steps in one lax.scan: {title}",
                [("variant", "variant"), ("ms", "ms/step"), ("ms_again", "ms/step (again)"),
                 ("span", "trace: span ms/step"), ("busy", "busy"), ("idle", "idle"),
                 ("launches", "launches/step")], out, meta,
                notes=[f"median of {loops} loops after {warm} warm-up, device clock, "
                       "each loop timed twice (the variants alternating); trace: 3 loops"])
    qs, ws, ls = batch_streams(inp, B, steps - 1, offset=3)   # the steps after ``st``

    kernels = cfg.replace(backend="pallas")     # auto's choice on a GPU; CPU: interpreted

    def full(state, q, w, n, k, s):
        res, state = dosa_jax.decode_topk(q, k, w, state, k_scale=s, lengths=n, config=kernels)
        return state, (res.indices, res.scores, jnp.zeros((), jnp.int32))

    def certified(state, q, w, n, k, s):   # the screened step's own answer, no fallback
        q1, w1 = q[:, None], w[:, None]
        p = kd.prepare(q1, w1, k, s, None)
        theta, _, wk, wids = kd.witness_threshold(p, seeded_witnesses(state.ids, n, cfg), n, 1, K)
        out_, need, _ = kd.screened_step(p, q1, w1, theta, wk, wids, n, B, K, cap,
                                         witness_budget(state.ids.shape[1], 1), None, None)
        nxt = dosa_jax.DecodeState(fit_witnesses(out_[4][0], state.ids.shape[1]))
        return nxt, (out_[0], out_[1], jnp.sum(need, dtype=jnp.int32))

    def round_trip(state, q, w, n, k, s):   # the same with one lax.cond on its predicate
        nxt, (idx, sc, needed) = certified(state, q, w, n, k, s)
        idx = lax.cond(needed > 0, lambda i: jnp.full_like(i, -1), lambda i: i, idx)
        return nxt, (idx, sc, needed)

    def loop(step, options=None):
        f = lambda qs, ws, ls, st, k, s: lax.scan(lambda c, x: step(c, *x, k, s), st,
                                                  (qs, ws, ls))   # the caches: arguments
        return jax.jit(f, compiler_options=options) if options else jax.jit(f)

    short = lambda g: " -> ".join(x[:48] for x in g.split(" -> "))
    on_gpu = dosa_jax.backend.on_gpu()
    variants = [(f"decode_topk, {name}", loop(full, o))
                for name, o in (LOOP_COMPILES[c] for c in compiles) if on_gpu or o is None]
    variants.append(("the certified path and a lax.cond on its predicate whose branches "
                     "do nothing but a fill (the conditional's own cost)", loop(round_trip)))
    variants.append(("the certified path alone: no lax.cond (not exact where a sequence "
                     "needs the fallback)", loop(certified)))
    args = (qs, ws, ls, st, k, s)
    compiled = []
    for name, f in variants:          # compiled once; a compile XLA refuses is noted
        try:
            compiled.append((name, f.lower(*args).compile()))
        except Exception as e:  # noqa: BLE001 - an option this XLA does not know
            tab.notes.append(f"{name}: not compiled ({type(e).__name__}: {str(e)[:160]})")
    variants = compiled
    for name, f in variants:      # where XLA put the loop's control flow
        text = f.as_text()
        r = command_buffer_report(text)
        where = (f"{r['command_buffers']} command-buffer computations, "
                 f"{r['conditional_in_command_buffers']} conditionals and "
                 f"{r['while_in_command_buffers']} while loops inside one"
                 if r["command_buffers"] else
                 "no command-buffer computation (this XLA forms its command buffers after the "
                 "HLO, from the thunk sequence, so the HLO cannot say which ops they hold)")
        calls = ", ".join(f"{t} {n}" for t, n in custom_call_targets(text).items())
        tab.notes.append(f"{name}: optimized HLO: conditionals {r['conditional']}, while loops "
                         f"{r['while']}; {where}; custom calls: {calls or 'none'}")
    want = variants[0][1](*args)[1]
    for name, f in variants[1:]:
        got = f(*args)[1]
        same = bool(jnp.array_equal(got[0], want[0])) and bool(jnp.array_equal(
            lax.bitcast_convert_type(got[1], jnp.int32), lax.bitcast_convert_type(want[1], jnp.int32)))
        needed = int(jnp.sum(got[2]))
        tab.notes.append(f"{name}: answers {'bitwise the same' if same else 'DIFFER'}"
                         + (f"; sequence-steps needing the fallback: {needed}"
                            if name.startswith("the certified path") else ""))
        if not same and not needed:
            raise AssertionError(f"the loop '{name}' answers differently")
    rows = {name: dict(variant=name) for name, _ in variants}
    for key in ("ms", "ms_again"):
        for name, f in variants:
            rows[name][key] = timeit(f, *args, warmup=warm, repeats=loops).seconds \
                * 1e3 / steps
            log(f"[decode_parts] loop, {name}: {rows[name][key]:.3f} ms/step")
    for name, f in variants:
        b = device_breakdown(f, *args, warmup=1, iters=3, top=4)
        if b is not None:
            rows[name].update(span=b["span_ms"] / steps, busy=b["busy_ms"] / steps,
                              idle=b["idle_ms"] / steps, launches=b["launches"] / steps)
            tab.notes.append(f"{name}: idle by place (ms/step; the activity before → after): "
                             + "; ".join(f"{short(g)} {ms / steps:.4f} ({n / steps:.2f}×)"
                                         for g, ms, n in b["gaps"][:4]))
        tab.add(rows[name])
    return tab


def run(domain: str, layer: int, H: int, N: int, B: int, K: int, repeats: int, out: str,
        capacity=None, studies=STUDIES, tag: str = "", only=(), kernels: bool = False,
        loop_steps: int = LOOP_STEPS, loop_compiles=tuple(LOOP_COMPILES),
        loop_with_parts: bool = False, screen_configs=()):
    from dosa_jax import datasets
    from dosa_jax.decode import (best_witnesses, distinct_pool, seeded_witnesses,
                                 select_and_witness, witness_budget)
    from pallas_kernels import decode as kd
    from pallas_kernels import records as rec
    from pallas_kernels.kth_largest import kth_largest
    from dosa_jax.seeds import distinct_visible
    from dosa_jax.selection import INT32_MIN
    from pallas_kernels.common import interpret_default, pad_axis

    inp = datasets.trained(domain, layer, length=N, heads=H,
                           num_queries=8 * B + 4 + (loop_steps if "loop" in studies else 0))
    qs, ws, ls = batch_streams(inp, B, 3)
    k, s, _ = caches(inp, B, False)
    cfg = dosa_jax.Config(top_k=K, backend="auto", capacity=capacity)
    cap = kd.candidate_capacity(cfg)
    step = jax.jit(lambda q, w, n, k, s, st: dosa_jax.decode_topk(q, k, w, st, k_scale=s,
                                                                  lengths=n, config=cfg))
    st = dosa_jax.decode_init(B, cfg)
    for t in range(3):
        res, st = step(qs[t], ws[t], ls[t], k, s, st)
    q, w, n = qs[3][:, None], ws[3][:, None], ls[3]
    ids = st.ids
    M = 1

    def prep(q, w, k, s):
        return kd.prepare(q, w, k, s, None)

    f_wit = jax.jit(lambda q, w, k, s, ids, n: kd.witness_threshold(prep(q, w, k, s), ids, n, M,
                                                                    K))
    theta, n_wit, wk, wids = f_wit(q, w, k, s, ids, n)
    f_scan = jax.jit(lambda q, w, k, s, theta, n: kd.scan_records(prep(q, w, k, s), theta, n, M,
                                                                  K))
    rk, ri, cnt, app = f_scan(q, w, k, s, theta, n)

    programs = {}
    interpreted = interpret_default()

    def screen_variant(**options):   # the screen kernel from those τ_w, at these options
        if interpreted:   # the Pallas interpreter has no warps or stages: one program for all
            options = {o: v for o, v in options.items() if o not in ("warps", "stages")}
        return programs.setdefault(tuple(sorted(options.items())), jax.jit(
            lambda q, w, k, s, theta, n: kd.screen_records(
                prep(q, w, k, s), q, w, theta[::kd.SLOTS], n, K, **options)))

    f_screen = screen_variant()
    f_screened = jax.jit(lambda q, w, k, s, theta, wk, wids, n: kd.screened_step(
        prep(q, w, k, s), q, w, theta, wk, wids, n, B, K, cap, witness_budget(ids.shape[1], M),
        None, None)[:2])    # the first round: what a step the screen certifies runs
    need_exact = f_screened(q, w, k, s, theta, wk, wids, n)[1]
    real = jnp.arange(B) * kd.SLOTS      # the real query slot of each sequence (M = 1)
    f_gather = jax.jit(lambda rk, ri, cnt: kd.gather_records(rk[real], ri[real], cnt[real], K,
                                                             cap))
    idx, sc, total, over, (bk, bi) = f_gather(rk, ri, cnt)
    carry = witness_budget(ids.shape[1], M)
    f_update = jax.jit(lambda bk, bi, wk, wids: best_witnesses(
        *distinct_pool(bk, bi, wk[real], wids[real]), carry))
    f_recwit = jax.jit(lambda rk, ri, cnt, wk, wids: kd.record_witnesses(
        rk[real], ri[real], cnt[real], K, carry, wk[real], wids[real]))
    f_selrec = jax.jit(lambda rk, ri, cnt: rec.select_from_records(rk[real], ri[real],
                                                                   cnt[real], K))
    # the screened step's selection: one top_k over the candidates and the witnesses outside
    # them (a binary search), against the candidates' top_k and a sort of the pool
    def candidates(q, w, k, s, cri, ccnt):          # rescored as screened_step rescores them
        p = prep(q, w, k, s)
        cid, valid, _ = kd.gather_candidates(cri, ccnt, cap)
        ck = kd.witness_keys(p.ops, p.kp, p.scale, kd.key_rows(p, cid), valid, 1, p.tiles,
                             interpret_default())[::kd.SLOTS]
        return ck, pad_axis(cid, 1, ck.shape[1], -1)

    def select_sorted(ck, ci, wk, wids):
        top, pos = lax.top_k(ck, K)
        idx = jnp.where(top == INT32_MIN, -1, jnp.take_along_axis(ci, pos, axis=1))
        return idx, top, best_witnesses(*distinct_pool(ck, ci, wk[real], wids[real]), carry)

    ck, cids = jax.jit(candidates)(q, w, k, s, *f_screen(q, w, k, s, theta, n)[1:3])
    f_select = jax.jit(lambda ck, ci, wk, wids: select_and_witness(
        ck, ci, wk[real], wids[real], K, carry))
    f_select_sorted = jax.jit(select_sorted)
    f_top_all = jax.jit(lambda wk: lax.top_k(wk, K)[0][:, K - 1])
    f_top_real = jax.jit(lambda wk: lax.top_k(wk[real], K)[0][:, K - 1])
    f_kth = jax.jit(lambda wk: kth_largest(wk, K))   # τ_w as the step takes it
    if not bool(jnp.array_equal(f_kth(wk), f_top_all(wk))):
        raise AssertionError("kth_largest differs from lax.top_k's K-th value")

    screen_args = (q, w, k, s, theta, n)
    variants = []
    if k.dtype == jnp.float8_e4m3fn and "mma" in studies:   # the default float16 MMA's gain
        f = screen_variant(mma="bf16")
        recorded = float(jnp.mean(jnp.sum(f(*screen_args)[2], axis=1)))
        variants.append((f"screen bf16 MMA, canonical pieces ({recorded:.0f} recorded/query)",
                         f, screen_args))
    reference = f_screen(*screen_args)
    for what, options in (("scales read in each tile", dict(ahead=False)),
                          ("scales a tile ahead, 4 stages", dict(stages=4))):
        if "ahead" in studies:   # the same records as the default screen, other loads
            f = screen_variant(**options)
            same = kd.same_records(f(*screen_args), reference)
            variants.append((f"screen, {what} (records "
                             f"{'bitwise the same' if same else 'DIFFER'})", f, screen_args))
    for tile in (64, 128, 256) if "tiles" in studies else ():
        for norm in ("auto", None):
            f = screen_variant(key_tile=tile, norm=norm)
            recorded = float(jnp.mean(jnp.sum(f(*screen_args)[2], axis=1)))
            variants.append((f"screen BK={tile} norm={'each key' if norm is None else 'dtype'}"
                             f" ({recorded:.0f} recorded/query)", f, screen_args))
    for tile in (64, 128) if "warps" in studies else ():   # Triton warps and stages
        for warps in (2, 4, 8):
            for stages in (2, 4):
                variants.append((f"screen BK={tile} warps={warps} stages={stages}",
                                 screen_variant(key_tile=tile, warps=warps, stages=stages),
                                 screen_args))
    configured = []   # --screen-configs: timed with --parts too
    for tile, warps, stages in screen_configs:
        f = screen_variant(key_tile=tile, warps=warps, stages=stages)
        recorded = float(jnp.mean(jnp.sum(f(*screen_args)[2], axis=1)))
        configured.append((f"screen BK={tile} warps={warps} stages={stages} ({recorded:.0f} "
                           "recorded/query)", f, screen_args))
    screen_tile = kd.scan_tile(N, kd.screen_key_tile(H))
    same_select = all(bool(jnp.array_equal(x, y)) for x, y in zip(
        jax.tree.leaves(f_select(ck, cids, wk, wids)),
        jax.tree.leaves(f_select_sorted(ck, cids, wk, wids))))
    for S in (x for x in (16, 32, 64, 128, 256, 512)
              if x <= N // screen_tile and "splits" in studies):
        variants.append((f"screen splits={S}", screen_variant(splits=S), screen_args))
    study_notes = []
    fits = kd.reads_rows_in_place(q, w, k, s, None)
    if "rows" in studies and not fits:
        study_notes.append("witness rows read in place: not timed (row ids or offsets beyond "
                           "direct_rows' limits at this shape)")
    if "rows" in studies and fits:
        def rows_variant(direct):
            def f(q, w, k, s, ids, n):
                p = prep(q, w, k, s)
                first = distinct_visible(ids, jnp.zeros((B,), jnp.int32), n)
                return kd.witness_keys(p.ops, p.kp, p.scale, kd.key_rows(p, ids), first, M,
                                       p.tiles, interpret_default(), direct=direct)
            return jax.jit(f)
        f_in, f_table = rows_variant(True), rows_variant(False)
        rows_args = (q, w, k, s, ids, n)
        if not bool(jnp.array_equal(f_in(*rows_args), f_table(*rows_args))):
            raise AssertionError("witness rows read in place score differently")
        variants += [("witness rows read in place", f_in, rows_args),
                     ("witness rows from a gathered table", f_table, rows_args)]
    if "stale" in studies:
        stale = st._replace(ids=st.ids.at[0].set(-1))
        got = step(qs[3], ws[3], ls[3], k, s, stale)[0]
        want = step(qs[3], ws[3], ls[3], k, s, st)[0]
        if not (bool(jnp.array_equal(got.indices, want.indices))
                and bool(jnp.array_equal(got.scores, want.scores))):
            raise AssertionError("the step with a stale sequence answers differently")
        f_canon = jax.jit(lambda q, w, k, s, ids, n: kd.decode_topk(
            q, k, w, ids, s, n, None, cfg, screen=False)[:2])
        f_kernels = jax.jit(lambda q, w, k, s, ids, n: kd.decode_topk(
            q, k, w, ids, s, n, None, cfg)[:2])    # the ids as given: no seeds
        bare, fresh = f_kernels(q, w, k, s, stale.ids, n), f_kernels(q, w, k, s, ids, n)
        if not (bool(jnp.array_equal(bare[0], fresh[0]))
                and bool(jnp.array_equal(bare[1], fresh[1]))):
            raise AssertionError("the unseeded step with a stale sequence answers differently")
        # what the stale step's fallback does with sequence 0: the screen's records, whether
        # the second round certifies it, else the canonical scan of its keys alone
        seeded = seeded_witnesses(stale.ids, n, cfg)    # the ids decode_topk gives the kernels

        def fallback_need(q, w, k, s, ids, n):
            p = prep(q, w, k, s)
            th, _, wk_, wids_ = kd.witness_threshold(p, ids, n, M, K)
            out, need, retry = kd.screened_step(p, q, w, th, wk_, wids_, n, B, K, cap, carry,
                                                None, None)
            _, ri_, cnt_, _ = kd.screen_records(p, q, w, th[::kd.SLOTS], n, K)
            return need, retry(out, need)[1], kd.gather_candidates(ri_, cnt_, cap)[2], th, wk_, \
                wids_
        need0, left0, total0, th0, wk0, wids0 = jax.jit(fallback_need)(q, w, k, s, seeded, n)
        study_notes.append(
            f"sequence 0 stale: {int(total0[0])} screen records (buffer {cap}); the screen "
            f"certifies it: {'no' if bool(need0[0]) else 'yes'}; the second round certifies "
            f"it: {'no' if bool(left0[0]) else 'yes' if bool(need0[0]) else '-'}; sequences "
            f"left to the canonical scan: {int(jnp.sum(left0))} of {B}")
        f_rows = jax.jit(lambda q, w, k, s, th, wk, wids, n, left: kd.exact_step(
            prep(q, w, k, s), th, wk, wids, jnp.where(left, n, 0), B, M, K, cap, carry, None,
            None))
        # the second round's parts, each alone on the stale step's screen records
        f_recs = jax.jit(lambda q, w, k, s, th, n: kd.screen_records(
            prep(q, w, k, s), q, w, th[::kd.SLOTS], n, K))
        srk, sri, scnt, _ = f_recs(q, w, k, s, th0, n)
        slots = min(sri.shape[1] * sri.shape[2], kd.SECOND_ROUND_SLOTS * cap)
        f_compact = jax.jit(lambda rk, ri, cnt: kd.compact_records(rk, ri, cnt, slots))
        rk2, ri2, cnt2, _ = f_compact(srk, sri, scnt)
        f_theta2 = jax.jit(lambda rk, cnt: kd.bound_threshold(rk, cnt, cap))
        theta2, _ = f_theta2(rk2, cnt2)
        f_least = jax.jit(lambda ri, rk, cnt, t: kd.records_at_least(ri, rk, cnt, t, cap))
        ids2, valid2 = f_least(ri2, rk2, cnt2, theta2)
        f_resel = jax.jit(lambda q, w, k, s, ids, valid, wk, wids: kd.rescored_selection(
            prep(q, w, k, s), ids, valid, wk, wids, K, carry, None))

        def whole_second(q, w, k, s, th, wk, wids, n):
            out, need, retry = kd.screened_step(prep(q, w, k, s), q, w, th, wk, wids, n, B, K,
                                                cap, carry, None, None)
            return retry(out, need)
        variants += [("step, sequence 0 stale", step, (qs[3], ws[3], ls[3], k, s, stale)),
                     ("stale: screened step and second round, no canonical scan",
                      jax.jit(whole_second), (q, w, k, s, th0, wk0, wids0, n)),
                     (f"second round: records laid end to end ({slots} slots)", f_compact,
                      (srk, sri, scnt)),
                     ("second round: θ₂", f_theta2, (rk2, cnt2)),
                     ("second round: ids at or above θ₂", f_least, (ri2, rk2, cnt2, theta2)),
                     ("second round: rescoring and selection", f_resel,
                      (q, w, k, s, ids2, valid2, wk0, wids0)),
                     ("canonical scan of the sequences left (their keys only), with selection",
                      f_rows, (q, w, k, s, th0, wk0, wids0, n, left0)),
                     ("step, sequence 0 stale, unseeded", f_kernels, (q, w, k, s, stale.ids, n)),
                     ("step, every sequence by the canonical scan", f_canon,
                      (q, w, k, s, ids, n))]
    if k.dtype == jnp.float8_e4m3fn and "fp8" in studies:   # not certified: a study
        try:   # a study: if this MMA does not compile here, the other parts are still timed
            f = screen_variant(fp8_mma=True)
            recorded = float(jnp.mean(jnp.sum(f(*screen_args)[2], axis=1)))
            variants.append((f"screen fp8 x fp8 MMA, not certified ({recorded:.0f} "
                             "recorded/query)", f, screen_args))
        except Exception as e:  # noqa: BLE001 - recorded in the table's notes
            study_notes.append(f"screen fp8 x fp8 MMA: not timed ({e!r})"[:300])
            log(f"[decode_parts] screen fp8 x fp8 MMA: ERROR {e!r}")
    parts = [(name, f, a) for name, (f, a) in zip(PARTS, (   # in the order of PARTS
        (step, (qs[3], ws[3], ls[3], k, s, st)),
        (f_wit, (q, w, k, s, ids, n)),
        (f_screen, (q, w, k, s, theta, n)),
        (f_screened, (q, w, k, s, theta, wk, wids, n)),
        (f_scan, (q, w, k, s, theta, n)),
        (f_gather, (rk, ri, cnt)),
        (f_update, (bk, bi, wk, wids)),
        (f_select, (ck, cids, wk, wids)),
        (f_select_sorted, (ck, cids, wk, wids)),
        (f_recwit, (rk, ri, cnt, wk, wids)),
        (f_selrec, (rk, ri, cnt)),
        (f_top_all, (wk,)),
        (f_top_real, (wk,)),
        (f_kth, (wk,))), strict=True)] + variants
    meta = run_meta(Shape(domain, layer, H, N, B, K, cap))
    meta["command"] = "python -m benchmarks.decode_parts " + " ".join(sys.argv[1:])
    tab = Table("decode_parts" + (f"_{tag}" if tag else ""), f"Decode step by part: {domain} {layer} H={H}, N={N}, B={B}, "
                f"K={K}, capacity {cap}", [("part", "part"), ("ms", "ms"),
                                            ("share", "of the step"),
                                            ("copy", "screen/copy bandwidth"),
                                            ("clock", "clock")],
                out, meta, notes=[
                    f"median of {repeats} calls after 2 warm-up, each part jitted alone",
                    "candidates/query: "
                    + ", ".join(f"{x:.0f}" for x in np.asarray(total)),
                    f"steps the screen cannot certify: {int(jnp.any(need_exact))}; "
                    f"queries over the buffer: {int(jnp.sum(over))} of {B}; splits "
                    f"compacted mid-scan: {int(jnp.sum(app > rk.shape[2] - 64))}; "
                    f"splits {rk.shape[1]}, records per split {rk.shape[2]}; the screen's "
                    f"default splits {kd.screen_layout(B, N // screen_tile, K, screen_tile)[0]}",
                    "screened select == screened select, sorted pool (indices, scores, next "
                    f"witnesses): {'bitwise' if same_select else 'MISMATCH'}"] + study_notes)
    if not same_select:
        raise AssertionError("select_and_witness differs from the sorted pool's selection")
    if kernels:
        step_kernels(step, (qs[3], ws[3], ls[3], k, s, st), meta, out, tab.title, tag,
                     repeats).write()
        if "stale" in studies:
            step_kernels(step, (qs[3], ws[3], ls[3], k, s, stale), meta, out,
                         tab.title + ", sequence 0 stale", (tag + "_" if tag else "") + "stale",
                         repeats).write()
    if "loop" in studies and (loop_with_parts or not only):
        loop_study(inp, k, s, st, cfg, B, out, meta, tab.title, tag, repeats,
                   loop_steps, loop_compiles).write()
    t_step = None
    copy_gbs = copy_bandwidth(1 << 31 if jax.default_backend() == "gpu" else 1 << 24)
    tab.notes.append(f"copy bandwidth of the run {copy_gbs:.0f} GB/s; screen/copy bandwidth: "
                     "the screen's key payload and scale bytes, B·N·(D + 4), per second over it")
    screen_bytes = B * N * (k.shape[-1] * k.dtype.itemsize + 4)
    for name, f, a in chosen(parts, only) + configured:
        t = timeit(f, *a, warmup=2, repeats=repeats)
        t_step = t.seconds if name == "step" else t_step
        is_screen = name == "screen" or name.startswith("screen ")
        tab.add(dict(part=name, ms=t.seconds * 1e3,
                     share=None if t_step is None else t.seconds / t_step,
                     copy=screen_bytes / t.seconds / 1e9 / copy_gbs if is_screen else None,
                     clock=t.clock))
        log(f"[decode_parts] {name}: {t.seconds * 1e3:.3f} ms")
    return tab


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_parts", description=__doc__)
    ap.add_argument("--domain", default="code")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--N", type=int, default=1 << 20)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--studies", default=None,
                    help=f"screen variants timed beside the default, of {','.join(STUDIES)} "
                         "(empty: none; default: all, or none with --parts; named with --parts, "
                         "the loop study runs beside those parts)")
    ap.add_argument("--tag", default="", help="suffix of the output files' name")
    ap.add_argument("--parts", default="",
                    help="time only these parts, comma-separated (e.g. 'screen' under a "
                         "profiler; default: every part)")
    ap.add_argument("--kernels", action="store_true",
                    help="also list the whole step's kernels by device time (a second table, "
                         "decode_kernels_<tag>)")
    ap.add_argument("--loop-steps", type=int, default=LOOP_STEPS,
                    help="consecutive steps of the loop study's lax.scan")
    ap.add_argument("--loop-compiles", default=",".join(LOOP_COMPILES),
                    help=f"the loop study's compiles of decode_topk, of "
                         f"{','.join(LOOP_COMPILES)}")
    ap.add_argument("--screen-configs", default="",
                    help="screen settings timed beside the default (also with --parts), "
                         "comma-separated BK:warps:stages, e.g. 128:2:2,64:2:3")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    a = ap.parse_args(argv)
    if a.loop_steps < 1:
        ap.error(f"--loop-steps: a count >= 1, got {a.loop_steps}")
    studies = STUDIES if a.studies is None else tuple(x for x in a.studies.split(",") if x)
    unknown = sorted(set(studies) - set(STUDIES))
    if unknown:
        ap.error(f"--studies: unknown {unknown}; choose from {','.join(STUDIES)}")
    compiles = tuple(x for x in a.loop_compiles.split(",") if x)
    unknown = sorted(set(compiles) - set(LOOP_COMPILES))
    if unknown or not compiles:
        ap.error(f"--loop-compiles: unknown {unknown or 'none named'}; choose from "
                 f"{','.join(LOOP_COMPILES)}")
    try:
        configs = tuple(tuple(int(v) for v in c.split(":")) for c in a.screen_configs.split(",")
                        if c)
        if any(len(c) != 3 or min(c) < 1 for c in configs):
            raise ValueError
    except ValueError:
        ap.error(f"--screen-configs: BK:warps:stages triples of positive integers, got "
                 f"{a.screen_configs!r}")
    only = tuple(x for x in a.parts.split(",") if x)
    try:
        chosen((), only)
    except ValueError as e:
        ap.error(f"--parts: {e}")
    tab = run(a.domain, a.layer, a.heads, a.N, a.B, a.K, a.repeats, a.out, a.capacity,
              studies, a.tag, only, a.kernels, a.loop_steps, compiles,
              loop_with_parts=a.studies is not None, screen_configs=configs)
    tab.write()
    print(tab.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
