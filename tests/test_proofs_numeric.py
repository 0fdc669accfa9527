"""The numeric checks of the paper's propositions (proofs_numeric/), at CPU sizes.

Each check must report zero violations *and* have checked exactly what was
asked (instance and key counts computed here independently), so a check that
silently checks nothing fails. The mutation tests at the end show that the
checks catch a bound that is slightly wrong.
"""

from __future__ import annotations

import jax
import pytest

from proofs_numeric import _common as cm
from proofs_numeric import (certificate, exact_selection, joint_allowance, margin_equivalence,
                            single_anchor_optimality, slack_decomposition)
from proofs_numeric.__main__ import QUICK


def _explain(r):
    keys = ("violations_by_claim", "violations_by_family", "max_violation")
    return {k: r[k] for k in keys if k in r}


def _no_x64_leak():
    assert not jax.config.jax_enable_x64, "a check left jax_enable_x64 on"


@pytest.mark.slow
def test_certificate_upper_bound_every_variant():
    kw = QUICK["certificate"]
    r = certificate.check(**kw)
    _no_x64_leak()
    n, shapes = kw["n_instances"], kw["shapes"]
    assert r["instances"] == n * len(shapes)
    assert r["keys"] == certificate.expected_keys(n, shapes, 128)
    # every claim was exercised: P = ∅ cases (Eq. 24–25), omitted positives, supports
    assert r["checks_by_claim"]["abs_bound"] > 0
    assert r["cases_with_omitted_positive"] > 0 and r["cases_with_negative_support"] > 0
    assert r["violations"] == 0, _explain(r)


@pytest.mark.slow
def test_joint_allowance_and_upper_versions():
    kw = QUICK["joint_allowance"]
    r = joint_allowance.check(**kw)
    _no_x64_leak()
    n, shapes = kw["n_instances"], kw["shapes"]
    assert r["instances"] == n * len(shapes)
    assert r["keys"] == joint_allowance.expected_keys(n, shapes, 128)
    assert r["cases_with_omitted_positive"] > 0
    assert r["violations"] == 0, _explain(r)


def test_single_anchor_optimality_prop5():
    kw = QUICK["single_anchor_optimality"]
    r = single_anchor_optimality.check(**kw)
    n, dims = kw["n_instances"], single_anchor_optimality.SHAPES_D
    assert r["instances"] == n * len(dims)
    assert r["keys"] == n * len(dims) * 64
    per = len(single_anchor_optimality.beta_grid(1.0)) + single_anchor_optimality.N_RANDOM_BETA
    assert r["betas"] == n * len(dims) * per
    # c = c*(1 − 10⁻⁶) is shown to fail for most (pair, β); the rest are parallel pairs
    # (c* = 0) or β so large that float64 cannot decide
    assert r["failures_shown_below_c_star"] > 0.5 * r["betas"]
    assert r["exact_rational_witnesses"] == n * 3  # D ≤ 32
    assert r["violations"] == 0, _explain(r)


def test_slack_decomposition_eq14():
    kw = QUICK["slack_decomposition"]
    r = slack_decomposition.check(**kw)
    _no_x64_leak()
    n, shapes = kw["n_instances"], kw["shapes"]
    assert r["instances"] == n * len(shapes)
    assert r["keys"] == slack_decomposition.expected_keys(n, shapes, 128)
    assert all(v > 0 for v in r["keys_with_nonzero_term"].values())  # all three terms occur
    assert r["violations"] == 0, _explain(r)


def test_margin_equivalence_eq17():
    kw = QUICK["margin_equivalence"]
    r = margin_equivalence.check(**kw)
    _no_x64_leak()
    n, shapes = kw["n_instances"], kw["shapes"]
    assert r["instances"] == n * len(shapes)
    assert r["keys"] == margin_equivalence.expected_keys(n, shapes, 128)
    assert r["rejected_keys"] > 0 and r["keys_in_exact_arithmetic"] > 0
    assert r["violations"] == 0, _explain(r)


@pytest.mark.slow
def test_exact_selection_theorem1():
    kw = QUICK["exact_selection"]
    r = exact_selection.check(**kw)
    n, names = kw["n_instances"], kw["variants"]
    assert r["instances"] == n * len(names)
    assert r["queries"] == sum(n * v.T for v in exact_selection.VARIANTS if v.name in names)
    assert r["keys"] > 0
    assert r["coverage"]["overflow_rounds"] > 0  # small capacities forced extra rounds
    assert r["violations"] == 0, _explain(r)


# ----------------------------------------------------------------------------- the checks can fail

@pytest.fixture
def fresh_compiles():
    """Mutations must be traced anew: drop the checks' compiled programs before and after."""
    caches = (certificate._compiled, slack_decomposition._compiled,
              cm.over_instances_variants_keys)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def test_certificate_check_catches_a_too_small_joint_allowance(monkeypatch, fresh_compiles):
    from dosa_jax.bounds import positive
    orig = positive.joint_allowance
    monkeypatch.setattr(positive, "joint_allowance", lambda u: orig(u) * (1 - 1e-9))
    r = certificate.check(n_instances=15, shapes=((8, 32),))
    assert r["violations_by_claim"]["joint"] > 0
    assert r["violations_by_claim"]["triangle"] == 0


def test_slack_check_catches_a_wrong_term(monkeypatch, fresh_compiles):
    from dosa_jax import diagnostics
    orig = diagnostics.slack_decomposition

    def off(*a):  # drop the cancellation term's contribution to the total
        t = orig(*a)
        return t._replace(total=t.total - 0.5 * t.cancellation)

    monkeypatch.setattr(diagnostics, "slack_decomposition", off)
    r = slack_decomposition.check(n_instances=15, shapes=((8, 32),))
    assert r["violations_by_claim"]["equality"] > 0


def test_prop5_check_catches_a_suboptimal_projection(monkeypatch):
    from dosa_jax.bounds import positive
    orig = positive.anchor_projection

    def off(q, retained, omitted, use=True):
        a, b, d = orig(q, retained, omitted, use)
        return a, b * 1.001, d

    monkeypatch.setattr(positive, "anchor_projection", off)
    single_anchor_optimality._library.cache_clear()
    try:
        r = single_anchor_optimality.check(n_instances=40, dims=(8,))
    finally:
        single_anchor_optimality._library.cache_clear()
    assert r["violations_by_claim"]["library_beta"] > 0


def test_float64_scope_does_not_leak():
    with cm.float64():
        assert jax.config.jax_enable_x64
    _no_x64_leak()
    with pytest.raises(RuntimeError):
        with cm.float64():
            raise RuntimeError("inside")
    _no_x64_leak()
