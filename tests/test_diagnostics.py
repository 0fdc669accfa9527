"""Diagnostics and cost model (Eq. 14, 17–21) and the enclosure's pruning cost."""

import numpy as np
import pytest

import dosa_jax
from dosa_jax import budget, diagnostics, synthetic


def test_cost_model_matches_dot_product_counts():
    H, r, d_a = 32, 14, 2
    n0, ns, m = 4096.0, 100000.0, 2650.0
    base, dosa = budget.dot_product_counts(n0, ns, m, H, r, d_a)
    f = n0 / (n0 + ns)
    assert dosa / base == pytest.approx(budget.cost_ratio(f, m / ns, r, d_a, H), rel=1e-12)
    # the paper's teaching example (ignoring seeds): 16/32 + 0.0265 = 0.5265
    assert budget.cost_ratio(0.0, 0.0265, 14, 2, 32) == pytest.approx(0.5265)
    assert budget.break_even_survival(14, 2, 32) == pytest.approx(0.5)


@pytest.mark.parametrize("key_dtype", ["float32", "float8_e4m3fn"])
def test_enclosure_never_below_exact_and_costs_little(key_dtype):
    inp = synthetic.structured(T=16, N=2048, H=16, D=64, seed=9, key_dtype=key_dtype)
    cfg = dosa_jax.Config(top_k=128, key_block=128, query_tile=16)
    c = diagnostics.screening_counts(**inp.as_kwargs(), config=cfg)
    ex, num, real = (np.asarray(x) for x in (c.survive_exact, c.survive_numeric, c.survive_real))
    assert (ex <= num).all()          # every key with s >= tau survives the numeric bound
    assert (real <= num).all()        # the enclosure only adds
    assert num.sum() <= real.sum() * 1.01 + 16  # and costs little pruning on this data
    assert (np.asarray(c.screened) > 0).all()


def test_margin_relation_eq17():
    rng = np.random.default_rng(0)
    s = rng.standard_normal(1000)
    U = s + np.abs(rng.standard_normal(1000))
    tau_star, tau = 1.0, 0.7
    m = diagnostics.margin_terms(s, U, tau, tau_star)
    np.testing.assert_array_equal(np.asarray(m.rejected), np.asarray(m.margin_rule))
