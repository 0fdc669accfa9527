"""The automatic budget's real-number allowances (bounds.allowance_estimate) against the
explicit residual formulas of bounds.positive, and never above the certified bounds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import synthetic
from dosa_jax.bounds import allowance_estimate as ae
from dosa_jax.bounds import heads, positive
from dosa_jax.bounds.positive import RESIDUALS


@functools.partial(jax.jit, static_argnames=("mode", "groups", "use_projection"))
def _explicit(q, w, retained, mode, groups, use_projection=True):
    """(estimate, explicit real value, certified upper bound, anchors, anchors from the shared
    Gram) for one query's retained mask (jitted: one compilation per configuration, also on
    a GPU, where op-by-op dispatch made this file take minutes)."""
    op, _ = heads.omitted_heads(w, retained)
    a, b, d = positive.anchor_projection(q, retained, op, use_projection)
    a2, _, _ = positive.anchor_projection(q, retained, op, use_projection, gram=ae.head_gram(q))
    est = ae.allowance_estimate(q, w, op, a, b, mode, groups)
    u = w[:, None] * d
    tri = positive.triangle_allowance(w, d, op)
    ref = {"triangle": tri, "joint": jnp.minimum(tri, positive.joint_allowance(u)),
           "grouped": jnp.minimum(tri, positive.grouped_allowance(u, groups))}
    ref["best"] = jnp.minimum(ref["joint"], ref["grouped"])
    up = positive.residual_allowance_upper(w, d, op, positive.residual_error(q, b, a, op), mode,
                                           groups)
    real = jnp.where(jnp.any(op), ref[mode], 0.0)
    return est, real, up, a, a2


def _check(q, w, retained, mode, groups, use_projection=True):
    est, real, up, a, a2 = _explicit(q, w, retained, mode, groups, use_projection)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))   # the shared Gram: same anchors
    return float(est), float(real), float(up)


def _queries(seed=1):
    inp = synthetic.structured(T=12, N=64, H=16, D=32, seed=seed)
    q = np.array(inp.q, np.float32)
    w = np.array(inp.w, np.float32)
    q[3, 5] = 0.0                                      # a zero head
    q[4, 2] = 3.0 * q[4, 1]                            # a head on its anchor's ray: d_h = 0
    q[5, 7] = q[5, 6] + 1e-3 * q[5, 0]                 # a head nearly on it
    w[6] = np.abs(w[6])                                # all weights positive
    w[7] = -np.abs(w[7])                               # all negative: P is empty
    q[8] *= 1e15                                       # large magnitudes (no overflow in f32 sums)
    return jnp.asarray(q), jnp.asarray(w)


@pytest.mark.parametrize("mode", RESIDUALS)
@pytest.mark.parametrize("groups,use_projection", [(4, True), (1, True), (2, False)])
def test_estimate_is_the_real_allowance_and_below_the_certified_bound(mode, groups,
                                                                      use_projection):
    q, w = _queries()
    rng = np.random.default_rng(groups)
    n = 0
    for t in range(q.shape[0]):
        for frac in (0.1, 0.4, 0.8):
            retained = jnp.asarray(rng.random(q.shape[1]) < frac)
            est, real, up = _check(q[t], w[t], retained, mode, groups, use_projection)
            assert est == pytest.approx(real, rel=2e-5, abs=1e-30), (t, frac)
            assert est <= up, (t, frac, est, up)
            n += real > 0
    assert n > 10                                      # most masks omit positive heads


def test_estimate_under_vmap_matches_one_query_at_a_time():
    """Batched over queries and candidates as the planner does (vmap of vmap)."""
    q, w = _queries(seed=2)
    masks = jnp.asarray(np.random.default_rng(0).random((q.shape[0], 3, q.shape[1])) < 0.5)

    def one(qt, wt, m):
        op, _ = heads.omitted_heads(wt, m)
        a, b, _ = positive.anchor_projection(qt, m, op, gram=ae.head_gram(qt))
        return ae.allowance_estimate(qt, wt, op, a, b, "best", 4)

    got = np.asarray(jax.jit(jax.vmap(jax.vmap(one, (None, None, 0))))(q, w, masks))
    for t in range(q.shape[0]):
        for c in range(3):
            est, real, _ = _check(q[t], w[t], masks[t, c], "best", 4)
            assert got[t, c] == pytest.approx(real, rel=2e-5, abs=1e-30)


def test_unknown_mode_is_refused():
    q, w = _queries()
    op = jnp.zeros(q.shape[1], bool)
    with pytest.raises(ValueError, match="positive_residual"):
        ae.allowance_estimate(q[0], w[0], op, jnp.full(q.shape[1], -1), jnp.zeros(q.shape[1]),
                              "exact", 4)
