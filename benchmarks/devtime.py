"""Device-side timing of jitted calls from the profiler's GPU activity records.

DESIGN §14 asks for CUDA-event based timing. JAX exposes no CUDA events, but its
profiler records every kernel and copy on the GPU with CUPTI activity
timestamps (the mechanism behind Nsight Systems), which time the device work
the same way. :func:`device_times` runs ``fn`` ``iters`` times inside one
profiler trace, each call wrapped in a host annotation and followed by
``block_until_ready``; a call's device time is the span from the first GPU
activity that starts inside its annotation to the last one that ends by the
next call's start (host gaps inside a call, e.g. a ``lax.cond`` predicate read
back by XLA, count: they are part of the call). Without a GPU plane in the
trace (CPU) it returns ``None``.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
import time
from typing import NamedTuple, Optional

import jax

_TAG = "dosa_timed_call_"


def _stream_events(pd):
    """Every activity event on the stream lines of a trace's GPU planes."""
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # "XLA Ops"/"XLA Modules"/"Steps" lines derive from the stream lines; keep streams
            if not line.name.startswith("Stream"):
                continue
            yield from line.events


def _device_events(pd):
    """[(start_ns, end_ns)] of all activities on the GPU planes of a trace."""
    return sorted((e.start_ns, e.start_ns + e.duration_ns) for e in _stream_events(pd))


def _call_windows(pd):
    """[(start_ns, end_ns)] of the host annotations, in call order."""
    wins = {}
    for plane in pd.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith(_TAG):
                    wins[int(e.name[len(_TAG):])] = (e.start_ns, e.start_ns + e.duration_ns)
    return [wins[i] for i in sorted(wins)]


def call_spans(pd, iters: int):
    """Device time (s) of each annotated call in a trace, or ``None`` when the trace has no GPU
    activity records for every call: the span from the first stream activity starting in the
    call's window (its annotation's start to the next call's start) to the last one's end."""
    ev = _device_events(pd)
    wins = _call_windows(pd)
    if not ev or len(wins) != iters:
        return None
    times = []
    for i, (s, _) in enumerate(wins):
        nxt = wins[i + 1][0] if i + 1 < iters else float("inf")
        mine = [x for x in ev if s <= x[0] < nxt]
        if not mine:
            return None
        times.append((max(x[1] for x in mine) - min(x[0] for x in mine)) * 1e-9)
    return times


def _stat_text(e, keys=("tf_op", "hlo_op", "name_stack", "long_name")):
    """``key=value`` of those of ``keys`` among an event's stats, else ''."""
    try:
        stats = dict(e.stats)
    except Exception:  # noqa: BLE001
        return ""
    return " ".join(f"{k}={stats[k]}" for k in keys if stats.get(k))


def breakdown(pd, iters: int, top: int = 30):
    """Per-kernel device time of the annotated calls of a trace, averaged over the calls.

    Returns a dict: ``span_ms`` (median call span), ``busy_ms`` (mean union of the call's
    stream activities: the time some stream works), ``idle_ms`` (span − busy: launch gaps and
    host round trips such as a ``lax.cond`` predicate or a while loop's condition),
    ``launches`` (mean activities per call) and ``kernels``: the ``top`` names by mean time
    per call, each ``[name, ms, count, op]`` (op: the event's ``tf_op``/``hlo_op`` stat, the
    jax name stack where XLA records it); ``gaps``: where the idle time falls, the ``top``
    pairs (the activity that ended last → the next to start) by mean idle time per call,
    each ``["before -> after", ms, count]``. ``None`` without GPU activity records.
    """
    wins = _call_windows(pd)
    evs = [(e.start_ns, e.start_ns + e.duration_ns, e.name, e) for e in _stream_events(pd)]
    if not evs or len(wins) != iters:
        return None
    evs.sort(key=lambda x: x[0])
    per, spans, busy, launches, ops, gaps = {}, [], [], [], {}, {}
    for i, (s, _) in enumerate(wins):
        nxt = wins[i + 1][0] if i + 1 < iters else float("inf")
        mine = [x for x in evs if s <= x[0] < nxt]
        if not mine:
            return None
        spans.append((max(x[1] for x in mine) - mine[0][0]) * 1e-6)
        b, cur_s, cur_e, last = 0, None, None, None
        for a, z, name, e in mine:
            per.setdefault(name, [0.0, 0])
            per[name][0] += (z - a) * 1e-6
            per[name][1] += 1
            if name not in ops:
                ops[name] = _stat_text(e)
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    b += cur_e - cur_s
                    g = gaps.setdefault((last, name), [0.0, 0])   # idle: ended → next start
                    g[0] += (a - cur_e) * 1e-6
                    g[1] += 1
                cur_s, cur_e = a, z
            else:
                cur_e = max(cur_e, z)
            if z >= cur_e:
                last = name      # the activity that ends last so far
        b += cur_e - cur_s
        busy.append(b * 1e-6)
        launches.append(len(mine))
    rows = sorted(([n, v[0] / iters, v[1] / iters, ops[n][:240]] for n, v in per.items()),
                  key=lambda r: -r[1])
    spans.sort()
    mean = lambda x: sum(x) / len(x)
    idle = sorted(([f"{a} -> {z}", v[0] / iters, v[1] / iters] for (a, z), v in gaps.items()),
                  key=lambda r: -r[1])
    return dict(span_ms=spans[len(spans) // 2], busy_ms=mean(busy),
                idle_ms=mean(spans) - mean(busy), launches=mean(launches),
                kernels=rows[:top], other_ms=sum(r[1] for r in rows[top:]),
                gaps=idle[:top])


def breakdown_rows(b):
    """Table rows of a :func:`breakdown`: (span), (busy), (idle), each listed kernel, (other
    kernels) — dicts of kernel, ms, launches, op."""
    rows = [dict(kernel=f"({label})", ms=b[f"{label}_ms"],
                 launches=b["launches"] if label == "span" else None)
            for label in ("span", "busy", "idle")]
    rows += [dict(kernel=name[:80], ms=ms, launches=count, op=op[:80])
             for name, ms, count, op in b["kernels"]]
    return rows + [dict(kernel="(other kernels)", ms=b["other_ms"])]


def device_breakdown(fn, *args, warmup: int = 2, iters: int = 3, top: int = 30):
    """:func:`breakdown` of ``iters`` calls of ``fn`` (after ``warmup``), or ``None`` without a
    GPU."""
    from jax._src.profiler import ProfileData
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="dosa_breakdown_")
    try:
        with jax.profiler.trace(d):
            for i in range(iters):
                with jax.profiler.TraceAnnotation(f"{_TAG}{i}"):
                    jax.block_until_ready(fn(*args))
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None
        return breakdown(ProfileData.from_file(files[0]), iters, top)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def command_buffer_report(hlo_text: str) -> dict:
    """Where a compiled program's control flow sits relative to XLA:GPU's command buffers (CUDA
    graphs), from its optimized HLO (``jit(f).lower(...).compile().as_text()``): an XLA that
    schedules command buffers on the HLO outlines the ops it captures into computations named
    ``command_buffer…`` and calls them; a ``conditional`` or ``while`` outside them runs on
    the host between graphs (its predicate read back). The XLA of jax 0.11 forms command
    buffers later, from the thunk sequence: its HLO shows none (``command_buffers`` 0), and
    the kernel trace tells instead (:func:`breakdown`: ``set_case_condition`` is a conditional
    evaluated in a graph, ``MemcpyD2H`` before a gap a predicate read back). Returns the
    number of command-buffer computations, and per op kind (``conditional``, ``while``) how
    many there are and how many sit inside a command buffer (directly in one, or in a
    computation only a command buffer reaches)."""
    comps, current = {}, None
    for line in hlo_text.splitlines():
        head = line.strip()
        if head.endswith("{") and "->" in head and " = " not in head:    # a computation
            words = head.split()
            current = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            comps[current] = []
        elif head == "}":
            current = None
        elif current is not None and " = " in head:
            comps[current].append(head)
    callers = {}                     # computation -> the computations that call it
    for name, ops in comps.items():
        for op in ops:
            for key in ("calls=", "to_apply=", "body=", "condition=", "branch_computations={",
                        "true_computation=", "false_computation="):
                i = op.find(key)
                while i >= 0:
                    rest = op[i + len(key):]
                    for callee in rest.split("}")[0].split(",") if key.endswith("{") \
                            else [rest.split(",")[0].split(")")[0]]:
                        callers.setdefault(callee.strip().lstrip("%"), set()).add(name)
                    i = op.find(key, i + 1)
    buffers = {n for n in comps if n.startswith("command_buffer")}

    def captured(name, seen=()):      # every path from the entry passes a command buffer
        if name in buffers:
            return True
        up = callers.get(name, set()) - set(seen)
        return bool(up) and all(captured(c, seen + (name,)) for c in up)
    out = dict(command_buffers=len(buffers))
    for kind in ("conditional", "while"):
        where = [n for n, ops in comps.items() for op in ops if f" {kind}(" in op]
        out[kind] = len(where)
        out[f"{kind}_in_command_buffers"] = sum(captured(n) for n in where)
    return out


def custom_call_targets(hlo_text: str) -> dict:
    """How many custom calls of each target an optimized HLO holds (e.g. a CUB radix sort,
    ``xla.gpu.ext.cub_sort_pairs`` in jax 0.11's XLA:GPU, which a command buffer cannot
    capture)."""
    out = {}
    for line in hlo_text.splitlines():
        i = line.find('custom_call_target="')
        if i >= 0 and " custom-call(" in line:
            name = line[i + len('custom_call_target="'):].split('"')[0]
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def device_times(fn, *args, warmup: int = 2, iters: int = 10):
    """Per-call times in seconds: (device [iters] or ``None`` without GPU records, wall [iters]).

    The wall times (``perf_counter`` around each call and its ``block_until_ready``)
    come from the same calls.
    """
    from jax._src.profiler import ProfileData
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="dosa_devtime_")
    wall = []
    try:
        with jax.profiler.trace(d):
            for i in range(iters):
                with jax.profiler.TraceAnnotation(f"{_TAG}{i}"):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    wall.append(time.perf_counter() - t0)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None, wall
        spans = call_spans(ProfileData.from_file(files[0]), iters)
        return spans, wall
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Timing(NamedTuple):
    """Median seconds of the timed calls: ``seconds`` on ``clock`` ("device": the calls' GPU
    activity spans; "wall": ``perf_counter`` around each call and its ``block_until_ready``),
    the wall median of the same calls, and how many calls were timed."""

    seconds: float
    clock: str
    wall_seconds: float
    calls: int


def timeit(fn, *args, warmup: int = 2, repeats: int = 10, clock: Optional[str] = None) -> Timing:
    """Median time of ``repeats`` calls of ``fn(*args)`` after ``warmup`` untimed calls.

    On a GPU the calls run inside one profiler trace and each call's device span
    (:func:`device_times`) is the figure; elsewhere, or with ``clock="wall"`` (or
    ``DOSA_TIMING=wall``), the wall time of the same calls.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    clock = clock or os.environ.get("DOSA_TIMING", "device")
    if clock not in ("device", "wall"):
        raise ValueError(f"clock must be 'device' or 'wall', got {clock!r}")
    if clock == "wall" or jax.default_backend() not in ("gpu", "cuda"):
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        wall = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall.append(time.perf_counter() - t0)
        dev = None
    else:
        dev, wall = device_times(fn, *args, warmup=warmup, iters=repeats)
    w = statistics.median(wall)
    if dev:
        return Timing(statistics.median(dev), "device", w, repeats)
    return Timing(w, "wall", w, repeats)
