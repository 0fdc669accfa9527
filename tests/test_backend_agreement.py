"""The reference and Pallas backends agree up to their scorers' rounding (DESIGN §9, §12).

On random, trained and adversarial (near-tie) inputs with FP8 and bf16 keys:
every id selected by exactly one backend's ``dense_topk`` lies within
``2·max(β_ref, β_pallas) + 2β₆₄`` of the float64 K-th score; each backend's computed
scores lie within its bound β of the float64 scores; ``topk == dense_topk`` bitwise
within a backend. The near-tie inputs make the backends disagree, and the checker is
shown to flag a too-small bound and wrong selections (Pallas: interpret mode on CPU).
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import dosa_jax
from dosa_jax import agreement as ag
from dosa_jax import datasets

from conftest import reference_scores_f64

# one pytest-xdist worker runs this file: its Pallas calls share interpret-mode compilations
pytestmark = pytest.mark.xdist_group("pallas_kernels")

SMALL = dict(T=16, N=2048, H=8, D=64)
CASES = {
    "gaussian-fp8": (lambda: datasets.gaussian(**SMALL, seed=1, key_dtype="float8_e4m3fn"), 64),
    "structured-bf16": (lambda: datasets.structured(**SMALL, seed=2, key_dtype="bfloat16"), 64),
    # the committed fixture: N = 4096 keys, H = 32, D = 128, the last 16 positions as queries
    "trained-code0-fp8": (lambda: datasets.trained("code", 0, num_queries=16), 128),
    "trained-prose3-bf16": (lambda: datasets.trained("prose", 3, num_queries=16,
                                                     key_dtype="bfloat16"), 128),
    "near-tie-f32": (lambda: ag.near_tie_inputs(key_dtype="float32", seed=3), 64),
    "near-tie-bf16": (lambda: ag.near_tie_inputs(key_dtype="bfloat16", seed=4), 64),
    "near-tie-fp8": (lambda: ag.near_tie_inputs(key_dtype="float8_e4m3fn", seed=5), 64),
}
NEAR_TIE = [c for c in CASES if c.startswith("near-tie")]


@functools.lru_cache(maxsize=None)
def case(name):
    make, top_k = CASES[name]
    inp = make()
    return inp, top_k, ag.exact_scores(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)


@functools.lru_cache(maxsize=None)
def run(name, backend, fn="dense_topk"):
    """One call under jax.jit: one program (op by op, the Pallas pipeline in interpret mode
    compiles ~600 small programs: about three times the whole program's compile time)."""
    inp, top_k, _ = case(name)
    cfg = dosa_jax.Config(top_k=top_k, backend=backend)
    call = getattr(dosa_jax, fn)
    res = jax.jit(lambda kw: tuple(call(config=cfg, **kw)[:2]))(inp.as_kwargs())
    return np.asarray(res[0]), np.asarray(res[1])


@functools.lru_cache(maxsize=None)
def comparison(name):
    inp, top_k, s64 = case(name)
    return ag.compare_backends(inp.q, inp.k, inp.w, run(name, "reference")[0],
                               run(name, "pallas")[0], top_k, inp.k_scale, inp.lo, inp.hi,
                               scores=s64)


@pytest.mark.parametrize("name", list(CASES))
def test_backends_differ_only_within_the_radius_of_the_kth_score(name):
    cmp, radius = comparison(name)
    assert np.all(np.isfinite(radius)) and np.all(radius > 0)
    assert cmp.holds, (name, cmp.differing, cmp.max_ratio)
    assert np.all(cmp.max_ratio <= 1.0)
    if name in NEAR_TIE:       # the adversarial inputs do make the backends disagree
        assert cmp.differing.sum() > 0 and cmp.fraction > 0.01, (name, cmp.differing)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ag.BACKENDS)
def test_computed_scores_lie_within_the_backends_bound(name, backend):
    """|s_backend − s64| ≤ β + β₆₄ for every selected key (the bound is a bound)."""
    inp, _, s64 = case(name)
    idx, sc = run(name, backend)
    beta = np.asarray(ag.score_rounding_bound(inp.q, inp.k, inp.w, inp.k_scale, backend),
                      np.float64)
    err = np.abs(sc.astype(np.float64) - np.take_along_axis(s64, idx, axis=1))
    assert np.all(idx >= 0)
    slack = beta + ag.exact_score_error(inp.q, inp.k, inp.w, inp.k_scale)
    assert np.all(err <= slack[:, None]), (name, backend, float(np.max(err / slack[:, None])))


@pytest.mark.parametrize("name", NEAR_TIE)
def test_the_check_fails_with_a_bound_too_small(name):
    """On near ties the differing ids lie at positive distances from the K-th score:
    a zero bound, or half the largest distance, is reported as a violation."""
    inp, top_k, s64 = case(name)
    a, b = run(name, "reference")[0], run(name, "pallas")[0]
    kth = ag.kth_score(s64, top_k)
    zero = ag.compare_selections(a, b, s64, kth, 0.0)
    assert not zero.holds and np.isinf(np.max(zero.max_ratio))
    cmp, radius = comparison(name)
    worst = np.max(cmp.max_ratio * radius)
    assert worst > 0
    assert not ag.compare_selections(a, b, s64, kth, 0.5 * worst).holds


def test_a_wrong_selection_is_flagged():
    """Mutations of a correct selection: a far-away key swapped in, a duplicate, a
    missing id, an id that is not visible."""
    name = "trained-code0-fp8"
    inp, top_k, s64 = case(name)
    ref = run(name, "reference")[0]
    _, radius = comparison(name)
    kth = ag.kth_score(s64, top_k)
    assert ag.compare_selections(ref, ref, s64, kth, radius).holds
    far = ref.copy()
    far[3, -1] = int(np.argmin(np.where(np.isfinite(s64[3]), s64[3], np.inf)))  # lowest score
    cmp = ag.compare_selections(ref, far, s64, kth, radius)
    assert not cmp.holds and list(np.flatnonzero(~cmp.within)) == [3]
    assert cmp.differing[3] == 2 and cmp.max_ratio[3] > 1
    dup = ref.copy()
    dup[5, -1] = dup[5, 0]
    assert list(np.flatnonzero(~ag.compare_selections(ref, dup, s64, kth, radius).within)) == [5]
    short = ref.copy()
    short[7, -1] = -1
    assert list(np.flatnonzero(~ag.compare_selections(ref, short, s64, kth, radius).within)) == [7]
    hidden = ref.copy()
    hidden[0, -1] = int(np.asarray(inp.hi)[0])       # just past query 0's visible range
    assert list(np.flatnonzero(~ag.compare_selections(ref, hidden, s64, kth,
                                                      radius).within)) == [0]


@pytest.mark.parametrize("name,backend", [
    ("gaussian-fp8", "reference"), ("trained-prose3-bf16", "reference"),
    # Pallas DoSA in interpret mode: one more pipeline compilation; random inputs are covered
    # bitwise by tests/test_pallas_kernels.py
    pytest.param("trained-code0-fp8", "pallas", marks=pytest.mark.slow)])
def test_topk_equals_dense_topk_bitwise_within_a_backend(name, backend):
    idx, sc = run(name, backend, "topk")
    didx, dsc = run(name, backend, "dense_topk")
    np.testing.assert_array_equal(idx, didx)
    np.testing.assert_array_equal(sc.view(np.int32), dsc.view(np.int32))


def _select(scores, top_k):
    """Top-k positions by (score desc, index asc) of float64 rows."""
    ids = np.arange(scores.shape[1])
    return np.stack([np.lexsort((ids, -row))[:top_k] for row in scores])


@pytest.mark.parametrize("beta_a,beta_b", [(1.0, 1.0), (1.0, 0.25), (0.0, 2.0)])
def test_radius_covers_any_two_scorers_within_their_bounds(beta_a, beta_b):
    """The argument behind :func:`agreement_radius`, on simulated scorers: any two
    perturbations within β_a, β_b of the exact scores select sets that differ only
    within 2·max(β_a, β_b) of the exact K-th score; extreme perturbations reach it."""
    rng = np.random.default_rng(7)
    T, N, K = 64, 200, 20
    s = np.round(rng.normal(0.0, 3.0, (T, N)), 1)          # many exact ties near the K-th
    kth = ag.kth_score(s, K)
    radius = ag.agreement_radius(beta_a, beta_b)
    worst = 0.0
    for _ in range(20):
        pa = s + beta_a * rng.choice([-1.0, 1.0, rng.uniform(-1, 1)], (T, N))
        pb = s + beta_b * rng.choice([-1.0, 1.0, rng.uniform(-1, 1)], (T, N))
        cmp = ag.compare_selections(_select(pa, K), _select(pb, K), s, kth, radius)
        assert cmp.holds
        worst = max(worst, float(np.max(cmp.max_ratio)))
    assert worst > 0.5


def test_the_sum_of_the_bounds_is_not_a_radius():
    """β_b = 0 (exact), β_a = 1: keys x (score kth) and i (kth − 2, lower index) both
    computed as kth − 1 by scorer a, which keeps i; the exact scorer keeps x."""
    s = np.array([[10.0, 6.0, 8.0, 0.0]])        # K = 2, kth = 8: i = key 1, x = key 2
    a = s + np.array([[0.0, 1.0, -1.0, 0.0]])    # both 7: the tie keeps the lower index 1
    sel_a, sel_b = _select(a, 2), _select(s, 2)
    kth = ag.kth_score(s, 2)
    assert ag.compare_selections(sel_a, sel_b, s, kth, ag.agreement_radius(1.0, 0.0)).holds
    assert not ag.compare_selections(sel_a, sel_b, s, kth, 1.0 + 0.0).holds


def test_exact_scores_match_an_independent_float64_scorer():
    inp, top_k, s64 = case("gaussian-fp8")
    ref = reference_scores_f64(inp.q, inp.k, inp.w, inp.k_scale)
    vis = np.isfinite(s64)
    np.testing.assert_allclose(s64[vis], ref[vis], rtol=1e-12, atol=1e-12)
    assert not np.any(np.isfinite(s64[~vis]))
    kth = ag.kth_score(s64, top_k)
    np.testing.assert_array_equal(kth, -np.sort(-s64, axis=1)[:, top_k - 1])
    assert np.all(ag.kth_score(s64[:, :10], top_k) == -np.inf)   # fewer than K visible


def test_bad_arguments_are_rejected_by_name():
    inp, _, _ = case("gaussian-fp8")
    with pytest.raises(ValueError, match="backend"):
        ag.score_rounding_bound(inp.q, inp.k, inp.w, inp.k_scale, "auto")
    with pytest.raises(ValueError, match="w"):
        ag.score_rounding_bound(inp.q, inp.k, inp.w[:, :3], inp.k_scale)
    with pytest.raises(ValueError, match="idx_a and idx_b"):
        ag.compare_selections(np.zeros((2, 3), int), np.zeros((2, 4), int), np.zeros((2, 5)),
                              np.zeros(2), 1.0)
    with pytest.raises(ValueError, match="exact_scores"):
        ag.compare_selections(np.zeros((2, 3), int), np.zeros((2, 3), int), np.zeros((3, 5)),
                              np.zeros(3), 1.0)
    with pytest.raises(ValueError, match="key_dtype"):
        ag.near_tie_inputs(key_dtype="float16")
    with pytest.raises(ValueError, match="n_tied"):
        ag.near_tie_inputs(top_k=64, n_tied=8, n_above=8)


def test_the_module_does_not_import_the_kernels():
    code = ("import sys, dosa_jax.agreement; "
            "assert 'pallas_kernels' not in sys.modules, 'imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=pathlib.Path(__file__).resolve().parents[1])
