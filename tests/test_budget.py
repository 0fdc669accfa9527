"""The automatic retained-head budget (Eq. 18–21): per query, or shared by a screening program."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import budget as budget_mod
from dosa_jax import synthetic
from dosa_jax.bounds import positive
from dosa_jax.bounds.heads import activation_frequencies
from dosa_jax import planner
from dosa_jax.config import Config

#: the planner under jax.jit: one program per (Config, program size) instead of some 500
#: small ones op by op; κ (``survivor_weight``) is traced, so κ = 1 and 3 share a program
build_plan = jax.jit(planner.build_plan, static_argnames=("config", "program_queries"))


def _sample(T=12, P=96, H=8, D=16, seed=4):
    """Queries, weights and a strided key sample's head dots (the planner's inputs)."""
    inp = synthetic.structured(T=T, N=P, H=H, D=D, seed=seed)
    q = inp.q.astype(jnp.float32)
    k = inp.k.astype(jnp.float32)
    x = jnp.einsum("thd,nd->tnh", q, k)                        # [T, P, H]
    kn = jnp.broadcast_to(jnp.linalg.norm(k, axis=-1)[None], (T, P)) * (1 + 2 ** -20)
    valid = jnp.ones((T, P), bool).at[5].set(False)            # query 5: no visible sample keys
    s = jnp.einsum("tnh,th->tn", jnp.maximum(x, 0.0), inp.w)
    tau = jnp.sort(s, axis=1)[:, -P // 8]                      # a τ that prunes some keys
    p = jax.vmap(activation_frequencies)(x, valid)
    return q, inp.w, p, x, kn, valid, tau


def _real_allowance(qt, wt, det, groups):
    """E of one query's plan details as the real number (Eq. 6, 7, App. A.1; ``best``), from
    its residual vectors: what the automatic budget prices a candidate with."""
    _, _, d = positive.anchor_projection(qt, det.retained, det.omitted_pos)
    u = wt[:, None] * d
    tri = positive.triangle_allowance(wt, d, det.omitted_pos)
    e = jnp.minimum(tri, jnp.minimum(positive.joint_allowance(u),
                                     positive.grouped_allowance(u, groups)))
    return jnp.where(jnp.any(det.omitted_pos), e, 0.0)


def _costs(q, w, p, x, kn, valid, tau, cfg, kappa):
    """[T, n_budgets] costs, each from the details of a plan built for that budget alone, with
    the real-number allowance of its residuals (never above the plan's certified one)."""
    out = []
    for r in cfg.budgets(q.shape[1]):
        _, det, _ = build_plan(q, w, p, cfg.replace(retained_heads=r))
        real = _real_allowances(q, w, det, cfg.residual_groups)
        assert np.all(np.asarray(real) <= np.asarray(det.residual))
        det = det._replace(residual=real)
        out.append(_estimated_costs(x, kn, valid, tau, det, r, q.shape[1], kappa))
    return np.stack([np.asarray(c) for c in out], axis=1)


@functools.partial(jax.jit, static_argnums=(3,))
def _real_allowances(q, w, det, groups):
    return jax.vmap(lambda qt, wt, d: _real_allowance(qt, wt, d, groups))(q, w, det)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _estimated_costs(x, kn, valid, tau, det, r, H, kappa):
    return jax.vmap(lambda *a: budget_mod.estimated_cost(*a, r, 1, H, kappa))(
        x, kn, valid, tau, det)


@pytest.mark.parametrize("program_queries,kappa", [(1, 1.0), (4, 1.0), (4, 3.0)])
def test_auto_budget_minimises_the_cost_per_query_or_per_program(program_queries, kappa):
    q, w, p, x, kn, valid, tau = _sample()
    cfg = Config(top_k=8, retained_heads="auto", budget_candidates=(1, 3, 5))
    plan, det, budget = build_plan(q, w, p, cfg, sample_dots=x, sample_norms=kn,
                                   sample_valid=valid, tau=tau, program_queries=program_queries,
                                   survivor_weight=kappa)
    c = _costs(q, w, p, x, kn, valid, tau, cfg, kappa)
    rs = np.asarray(cfg.budgets(8))
    b = np.asarray(budget)
    if program_queries == 1:
        np.testing.assert_array_equal(b, rs[np.argmin(c, axis=1)])
    else:
        c[5] = 0.0                                  # a query without sample keys has no say
        blocks = c.reshape(-1, program_queries, len(rs)).sum(axis=1)
        np.testing.assert_array_equal(b, np.repeat(rs[np.argmin(blocks, axis=1)], program_queries))
    # every query's plan is the plan of its budget
    for r in set(b.tolist()):
        ref, _, _ = build_plan(q, w, p, cfg.replace(retained_heads=int(r)))
        sel = b == r
        rows = np.asarray(plan.rows)[sel]          # R = 5 rows; the single-budget plan has r
        np.testing.assert_array_equal(rows[:, :r], np.asarray(ref.rows)[sel])
        assert not rows[:, r:].any()
        np.testing.assert_array_equal(np.asarray(plan.residual)[sel],
                                      np.asarray(ref.residual)[sel])
    assert np.all(np.asarray(plan.retained) == b)


def test_survivor_weight_moves_the_budget_up():
    """κ prices survivors: a larger κ never picks a smaller budget (with the cost
    f(r) + κ·m(r), f increasing, the two optimality inequalities added give
    (κ2 − κ1)(m(r2) − m(r1)) ≤ 0, and r2 < r1 would then contradict the first)."""
    q, w, p, x, kn, valid, tau = _sample()
    cfg = Config(top_k=8, retained_heads="auto", budget_candidates=(1, 3, 5))
    args = dict(sample_dots=x, sample_norms=kn, sample_valid=valid, tau=tau)
    lo = np.asarray(build_plan(q, w, p, cfg, survivor_weight=0.25, **args)[2])
    hi = np.asarray(build_plan(q, w, p, cfg, survivor_weight=8.0, **args)[2])
    assert np.all(hi >= lo) and np.any(hi > lo)
