"""The numerical enclosure s_ref ≤ U_num (paper App. C), on ≥ 10^7 pairs.

s_ref is the canonical scorer's float32 output and U_num the screening's
numeric bound from the planner's plan, on adversarial FP8 inputs
(proofs_numeric/enclosure.py). The enclosed bound must have no violation;
the real-number bound (C = 0, ε = 0, no upward rounding) must be caught on
cases built so that it is tight — which shows the check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from proofs_numeric import enclosure

PAIRS = 10_000_000


def _expected_batches(cases, pairs):
    per_case = -(-pairs // len(cases))
    out = []
    for c in cases:
        Tq, B = enclosure.default_block(c)
        out.append((-(-per_case // (Tq * B)), Tq, B))
    return out


@pytest.mark.slow
def test_enclosure_holds_on_ten_million_adversarial_pairs():
    cases = enclosure.CASES_CPU
    r = enclosure.check(pairs=PAIRS, cases=cases)
    plan = _expected_batches(cases, PAIRS)
    assert r["instances"] == sum(n * Tq for n, Tq, _ in plan)
    total = sum(n * Tq * B for n, Tq, B in plan)
    # every generated pair is either checked, or excluded for a documented reason
    assert r["pairs"] + r["unpruned_plan_pairs"] + r["nonfinite_bound_pairs"] == total
    assert r["pairs"] >= PAIRS
    # the inputs reach the regime where bounds are tight (real-number U = s_ref)
    assert r["other_bound_violations"] > 0
    assert r["violations"] == 0, (r["violations_by_query_family"],
                                  {k: v["violations"] for k, v in r["by_case"].items()})


def test_unenclosed_real_number_bound_is_caught():
    cases = enclosure.CASE_SETS["cpu-tight"]
    assert cases and all(c.tight for c in cases)
    r = enclosure.check(pairs=600_000, cases=cases, unenclosed=True)
    assert r["pairs"] >= 600_000
    assert r["violations"] > 0.01 * r["pairs"], r["violations"]  # the real-number bound fails
    for label, c in r["by_case"].items():
        assert c["violations"] > 0, label
    assert r["other_bound_violations"] == 0  # the enclosed bound holds on the same pairs


def test_enclosure_cli_counts_and_exit_status(capsys):
    rc = enclosure.main(["--pairs", "200000", "--cases", "cpu-tight", "--unenclosed"])
    out = capsys.readouterr().out
    assert rc == 0  # --unenclosed succeeds when violations are found
    line = [x for x in out.splitlines() if x.startswith("violations:")][-1]
    n_viol, n_pairs = int(line.split()[1]), int(line.split()[3])
    assert n_viol > 0 and n_pairs >= 200_000


def test_fp8_inputs_hit_the_extremes():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(64)
    payload, scale = enclosure.make_keys(rng, 4096, 64, v)
    vals = np.abs(np.asarray(payload, np.float32))
    assert vals.max() == enclosure.FP8_MAX
    assert np.min(vals[vals > 0]) == enclosure.FP8_MIN_SUBNORMAL
    assert scale.min() < 2.0 ** -18 and scale.max() > 2.0 ** 18


def test_rounding_round_trips_survive_jit():
    """The rounded values that error terms are computed from stay rounded under jax.jit.

    A bare ``x.astype(bf16).astype(float32)`` inside one jitted program may be simplified to
    ``x`` by XLA's GPU compiler (excess precision): error terms computed from it (an aggregate
    remainder, a row rounding) would be zero and bounds could fall below computed scores. The
    CPU compiler keeps the round trip, so this test guards the GPU runs.
    """
    import jax
    import jax.numpy as jnp
    from dosa_jax import numerics as nm
    from pallas_kernels import numerics as knum
    from pallas_kernels.screen import aggregate_columns
    from dosa_jax.bounds.negative import split_aggregate_fp8

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 64)), jnp.float32) * 3.3
    want = np.asarray(x).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(nm.rounded_to, static_argnums=1)(
        x, jnp.bfloat16)), want)
    cols, _, err = jax.jit(lambda a: aggregate_columns(a, jnp.zeros((3,), bool), split=True,
                                                      absolute=False))(x[:, :1])
    cols, err = np.asarray(cols), np.asarray(err)
    hi, lo = cols[:, 0], -cols[:, 1]
    np.testing.assert_array_equal(hi, want[:, 0])
    assert np.all(lo != 0) and np.all(err > 0)
    rep = np.asarray(jax.jit(lambda r: knum.representation_error(r, True))(x))
    assert np.all(rep >= np.linalg.norm(np.asarray(x) - want, axis=-1))
    _, _, _, e8 = jax.jit(split_aggregate_fp8)(x[0, 0] * 1000.0)
    assert float(e8) > 0
