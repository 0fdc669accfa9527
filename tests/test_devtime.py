"""The benchmark's device clock (``benchmarks.devtime``) on synthetic profiler traces, and its
fallback on a machine without GPU activity records."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks import devtime

ProfileData = pytest.importorskip("jax._src.profiler").ProfileData


def _trace(host_calls, streams, xla_ops=()):
    """XSpace text proto: host annotations [(start_ns, dur_ns)], GPU stream events
    {line name: [(start_ns, dur_ns)]} and an "XLA Ops" line (derived, must be ignored)."""
    ps = lambda ns: int(ns * 1000)
    host = "".join(f"events {{ metadata_id: {i + 1} offset_ps: {ps(s)} duration_ps: {ps(d)} }} "
                   for i, (s, d) in enumerate(host_calls))
    meta = "".join(f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} '
                   f'name: "{devtime._TAG}{i}" }} }} ' for i in range(len(host_calls)))
    lines = "".join(
        f'lines {{ id: {j + 1} name: "{name}" timestamp_ns: 0 '
        + "".join(f"events {{ metadata_id: 1 offset_ps: {ps(s)} duration_ps: {ps(d)} }} "
                  for s, d in evs) + "} "
        for j, (name, evs) in enumerate(list(streams.items()) + [("XLA Ops", list(xla_ops))]))
    return ProfileData.from_text_proto(
        f'planes {{ id: 1 name: "/host:CPU" lines {{ id: 1 name: "python" timestamp_ns: 0 '
        f"{host}}} {meta}}} "
        f'planes {{ id: 2 name: "/device:GPU:0" {lines}'
        f'event_metadata {{ key: 1 value {{ id: 1 name: "fusion" }} }} }}')


def test_call_spans_first_start_to_last_end_per_call_across_streams():
    pd = _trace([(1000, 5000), (7000, 5000)],
                {"Stream #13(compute)": [(2000, 2000), (8000, 1000)],
                 "Stream #14(memcpy)": [(3500, 1500), (8500, 2500)]},
                xla_ops=[(0, 20000)])
    spans = devtime.call_spans(pd, 2)
    assert spans == pytest.approx([3000e-9, 3000e-9])   # [2000, 5000), [8000, 11000)


def test_call_spans_none_without_gpu_records_or_with_a_call_missing():
    assert devtime.call_spans(_trace([(0, 10)], {}), 1) is None
    pd = _trace([(1000, 1000), (3000, 1000)], {"Stream #1": [(1500, 100)]})
    assert devtime.call_spans(pd, 2) is None        # the second call has no GPU activity
    assert devtime.call_spans(pd, 3) is None        # fewer annotations than calls


def test_device_times_without_gpu_records_fall_back_to_the_wall_clock():
    """On the CPU there are no GPU activity records: ``None`` and the wall times (on a GPU:
    one device time per call, each within its wall time)."""
    f = jax.jit(lambda x: x * 2)
    dev, wall = devtime.device_times(f, jnp.ones(8), warmup=1, iters=3)
    assert len(wall) == 3 and all(t > 0 for t in wall)
    if jax.default_backend() == "gpu":
        assert len(dev) == 3 and all(0 < d <= w for d, w in zip(dev, wall))
    else:
        assert dev is None


def test_breakdown_sums_kernels_per_call_and_counts_idle_gaps():
    """Per-call kernel time (all events share the metadata name "fusion" here), busy time as
    the union of overlapping stream activities, idle time as span − busy."""
    pd = _trace([(1000, 5000), (7000, 5000)],
                {"Stream #13(compute)": [(2000, 2000), (8000, 1000)],
                 "Stream #14(memcpy)": [(3500, 1500), (10000, 1000)]},
                xla_ops=[(0, 20000)])
    b = devtime.breakdown(pd, 2)
    # call 0: [2000, 4000) and [3500, 5000) overlap: busy 3000 ns, span 3000, idle 0
    # call 1: [8000, 9000) and [10000, 11000): busy 2000 ns, span 3000, idle 1000
    assert b["span_ms"] == pytest.approx(3000e-6)
    assert b["busy_ms"] == pytest.approx(2500e-6)
    assert b["idle_ms"] == pytest.approx(500e-6)
    assert b["launches"] == 2
    # where the idle falls: one gap of 1000 ns in call 1, after a "fusion", before a "fusion"
    assert b["gaps"] == [["fusion -> fusion", pytest.approx(1000e-6 / 2), 0.5]]
    (name, ms, count, _), = b["kernels"]
    assert name == "fusion" and count == 2
    assert ms == pytest.approx((3500 + 2000) * 1e-6 / 2)
    rows = devtime.breakdown_rows(b)    # the table rows of that breakdown
    assert [r["kernel"] for r in rows] == ["(span)", "(busy)", "(idle)", "fusion",
                                           "(other kernels)"]
    assert rows[0]["launches"] == 2 and rows[3]["ms"] == pytest.approx(ms)
    assert rows[-1]["ms"] == 0
    assert devtime.breakdown(_trace([(0, 10)], {}), 1) is None


def test_command_buffer_report_places_each_conditional():
    """A loop body with one conditional between two command buffers (a host round trip) and
    one inside the second, whose branch holds a third: 2 of 3 captured, the loop not."""
    hlo = """HloModule jit_step, is_scheduled=true

%inner_true (p: (f32[8])) -> (f32[8]) {
  ROOT %p = (f32[8]{0}) parameter(0)
}

%branch_a (a: (f32[8])) -> (f32[8]) {
  %a = (f32[8]{0}) parameter(0)
  %c = pred[] constant(true)
  ROOT %conditional.9 = (f32[8]{0}) conditional(%c, %a, %a), branch_computations={%inner_true, %inner_true}
}

%command_buffer.1 (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
}

%command_buffer.2 (y: (f32[8]), q: pred[]) -> (f32[8]) {
  %y = (f32[8]{0}) parameter(0)
  %q = pred[] parameter(1)
  ROOT %conditional.2 = (f32[8]{0}) conditional(%q, %y, %y), branch_computations={%branch_a, %inner_true}
}

%body (b: (f32[8])) -> (f32[8]) {
  %b = (f32[8]{0}) parameter(0)
  %g = f32[8]{0} get-tuple-element(%b), index=0
  %call.1 = f32[8]{0} call(%g), to_apply=%command_buffer.1
  %t = (f32[8]{0}) tuple(%call.1)
  %pr = pred[] constant(false)
  %conditional.1 = (f32[8]{0}) conditional(%pr, %t, %t), branch_computations={%inner_true, %inner_true}
  ROOT %call.2 = (f32[8]{0}) call(%conditional.1, %pr), to_apply=%command_buffer.2
}

%cond (c: (f32[8])) -> pred[] {
  %c = (f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(false)
}

ENTRY %main.1 (arg: f32[8]) -> (f32[8]) {
  %arg = f32[8]{0} parameter(0)
  %tu = (f32[8]{0}) tuple(%arg)
  ROOT %while.1 = (f32[8]{0}) while(%tu), condition=%cond, body=%body
}
"""
    r = devtime.command_buffer_report(hlo)
    assert r == dict(command_buffers=2, conditional=3, conditional_in_command_buffers=2,
                     **{"while": 1, "while_in_command_buffers": 0})


def test_custom_call_targets_counts_each_target():
    hlo = """ENTRY %m (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %s = (f32[8]{0}, u8[64]{0}) custom-call(%a), custom_call_target="__cub$DeviceRadixSort"
  %t = (f32[8]{0}, u8[64]{0}) custom-call(%a), custom_call_target="__cub$DeviceRadixSort"
  %u = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", backend_config="x"
  ROOT %f = f32[8]{0} fusion(%a), kind=kLoop, calls=%c
}"""
    assert devtime.custom_call_targets(hlo) == {"__cub$DeviceRadixSort": 2,
                                                "__gpu$xla.gpu.triton": 1}
    assert devtime.custom_call_targets("ENTRY %m () -> f32[] {}") == {}
