"""Query-side planning: from (q, w, seed sample) to a :class:`ScreeningPlan`.

For each query: activation frequencies p_h on the seed sample, the retained
heads R for a budget r (DESIGN §4), positive projection and folded weights
(Eq. 4–6), the residual allowance (Eq. 6/7/A.1), the negative aggregate with
its support (Eq. 8), the certificate form (Eq. 9 or 24–25) and the numerical
enclosure coefficients (App. C). With ``retained_heads="auto"`` the budget is
chosen per query by the dot-product cost model (Eq. 18–21) evaluated on the
seed sample (:mod:`dosa_jax.budget`), each candidate priced with its real-number
residual allowance (:mod:`dosa_jax.bounds.allowance_estimate`); only the chosen
budget's plan is built, with the certified allowance.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dosa_jax import budget as budget_mod
from dosa_jax import enclosure as enc
from dosa_jax import numerics as nm
from dosa_jax.bounds import allowance_estimate, heads, negative, positive
from dosa_jax.plan import ScreeningPlan


class PlanDetails(NamedTuple):
    """Per-head view of one query's plan, for diagnostics and notebooks ([H] arrays)."""

    retained: jax.Array
    omitted_pos: jax.Array
    omitted_neg: jax.Array
    support: jax.Array
    anchor: jax.Array
    beta: jax.Array
    w_fold: jax.Array
    support_weight: jax.Array
    residual: jax.Array      # E (upper bound)
    activation: jax.Array    # p_h


def plan_for_mask(q, w, p, retained, config, R: int, *, fp8_aggregate: bool = False,
                  row_dtype=None):
    """Plan of one query for a given retained mask.

    Args:
      q: [H, D] float32; w: [H] float32; p: [H] activation frequencies;
      retained: [H] bool; R: static number of plan rows (≥ |retained|).
      fp8_aggregate: represent a_A by two FP8 rows (App. C) instead of one float32 row.
      row_dtype: dtype a kernel casts the plan rows to (adds the cast error to C).
    Returns:
      (ScreeningPlan fields for one query, PlanDetails).
    """
    H, D = q.shape
    roles = _head_roles(q, w, p, retained, config)
    omitted_pos, anchor, beta = roles.omitted_pos, roles.anchor, roles.beta
    w_fold, fold_abs, support = roles.w_fold, roles.fold_abs, roles.support
    resid_err = positive.residual_error(q, beta, anchor, omitted_pos)
    E = positive.residual_allowance_upper(w, roles.residual, omitted_pos, resid_err,
                                          config.positive_residual, residual_groups(config, D))
    E = jnp.where(jnp.any(omitted_pos), E, 0.0)
    a, a_err = negative.negative_aggregate(q, w, support)
    if fp8_aggregate:
        agg_rows, _, _, split_err = negative.split_aggregate_fp8(a)
        a_err = a_err + split_err
    else:
        agg_rows = a[None, :]
    linear = (config.certificate_form == "absolute") & ~jnp.any(omitted_pos)

    idx = jnp.nonzero(retained, size=R, fill_value=H)[0]
    ok = idx < H
    idc = jnp.minimum(idx, H - 1)
    rows = jnp.where(ok[:, None], q[idc], 0.0)
    row_w = jnp.where(ok, w_fold[idc], 0.0)
    row_fold_abs = jnp.where(ok, fold_abs[idc], 0.0)

    q_norm_up = nm.norm_upper(q)
    row_norm_up = jnp.where(ok, q_norm_up[idc], 0.0)
    agg_norm_up = nm.norm_upper(agg_rows)
    C = (enc.scorer_error_coefficient(w, q_norm_up, D, config.scorer_unit_roundoff)
         + enc.screening_error_coefficient(row_w, row_norm_up, agg_norm_up, D,
                                           config.screen_unit_roundoff)
         + enc.fold_error_coefficient(row_fold_abs, row_norm_up, H)
         + a_err)
    if row_dtype is not None:
        C = C + jnp.sum(jnp.abs(row_w) * enc.row_cast_error(rows, row_dtype))
    C = nm.inflate(C, 6)
    eps = enc.underflow_allowance(w, row_w, agg_rows.shape[0], D, H, R)
    finite = (jnp.all(jnp.isfinite(q)) & jnp.all(jnp.isfinite(w)) & jnp.isfinite(E)
              & jnp.isfinite(C) & jnp.isfinite(eps) & jnp.all(jnp.isfinite(row_w))
              & jnp.all(jnp.isfinite(agg_rows)))
    plan = ScreeningPlan(rows=rows, row_weights=row_w, aggregate=agg_rows,
                         aggregate_linear=linear, residual=E, error=C, eps_raw=eps,
                         prune=finite, retained=jnp.sum(retained).astype(jnp.int32))
    return plan, _details(roles, retained, w, p, E)


class _HeadRoles(NamedTuple):
    """One query's heads under a retained mask: omitted positive P and negative N heads,
    anchors j*_h, β_h and residuals d_h (Eq. 4–5), folded weights w̃ with their magnitudes
    (Eq. 6) and the negative support A (Eq. 8)."""

    omitted_pos: jax.Array
    omitted_neg: jax.Array
    anchor: jax.Array
    beta: jax.Array
    residual: jax.Array
    w_fold: jax.Array
    fold_abs: jax.Array
    support: jax.Array


def _head_roles(q, w, p, retained, config, gram=None) -> _HeadRoles:
    """:class:`_HeadRoles` of a retained mask (``gram``: q qᵀ when the caller has it)."""
    omitted_pos, omitted_neg = heads.omitted_heads(w, retained)
    anchor, beta, resid = positive.anchor_projection(q, retained, omitted_pos,
                                                     config.positive_projection, gram=gram)
    w_fold, fold_abs = positive.folded_weights(w, retained, omitted_pos, anchor, beta)
    support = negative.negative_support(p, omitted_neg, config.negative_support)
    return _HeadRoles(omitted_pos, omitted_neg, anchor, beta, resid, w_fold, fold_abs, support)


def _details(roles: _HeadRoles, retained, w, p, E) -> PlanDetails:
    """:class:`PlanDetails` of a retained mask's head roles with the residual allowance E."""
    return PlanDetails(retained=retained, omitted_pos=roles.omitted_pos,
                       omitted_neg=roles.omitted_neg, support=roles.support, anchor=roles.anchor,
                       beta=roles.beta, w_fold=roles.w_fold,
                       support_weight=jnp.where(roles.support, jnp.abs(w), 0.0), residual=E,
                       activation=p)


def residual_groups(config, D: int) -> int:
    """Coordinate groups of the grouped allowance (App. A.1): ``config.residual_groups``
    when it divides D, else 1."""
    return config.residual_groups if D % config.residual_groups == 0 else 1


def estimated_details(q, w, p, retained, config, gram):
    """:class:`PlanDetails` of one query's retained mask with the residual allowance as the
    real-number estimate of :func:`dosa_jax.bounds.allowance_estimate.allowance_estimate`,
    not the certified bound: what the automatic budget needs to price a candidate (Eq. 9 on
    the sample). ``gram``: the query's ``head_gram``. Never a plan.
    """
    roles = _head_roles(q, w, p, retained, config, gram=gram)
    E = allowance_estimate.allowance_estimate(q, w, roles.omitted_pos, roles.anchor, roles.beta,
                                              config.positive_residual,
                                              residual_groups(config, q.shape[1]))
    return _details(roles, retained, w, p, E)


def retained_mask(q, w, p, r, config):
    """R for budget r (DESIGN §4) from head norms and activation frequencies."""
    qn = jnp.sqrt(jnp.sum(q * q, axis=-1))
    return heads.retained_heads(w, qn, p, r, config.negative_ranking)


def build_plan(q, w, p, config, *, sample_dots=None, sample_norms=None, sample_valid=None,
               tau=None, fp8_aggregate: bool = False, row_dtype=None, program_queries: int = 1,
               survivor_weight: float = 1.0):
    """Plans for a batch of queries ([T, H, D] etc.), choosing the budget per query.

    With a single budget (``Config.retained_heads`` an int) the sample arguments
    are unused. With ``"auto"``, each candidate budget's real-number certificate
    (Eq. 9) is evaluated on the sample keys' head dots, the surviving fraction m
    estimated against τ, and the budget minimising (r + d_a)/H + κ·m chosen
    (Eq. 21 with κ = ``survivor_weight``; 1 counts dot products as the paper does).
    The candidates' allowances E are real-number estimates from the query's head Grams
    (:func:`estimated_details`; certifying every candidate's allowance would dominate the
    planner's cost); only the chosen budget's plan is built, certified.

    ``program_queries`` > 1: one budget for each block of that many consecutive queries
    (a screening program, which pays for the largest budget among its queries anyway),
    the one minimising the block's summed cost over its queries with visible sample keys;
    every query of the block then retains that many heads.

    Returns:
      (ScreeningPlan [T, ...], PlanDetails [T, ...], chosen budget [T] int32).
    """
    H = q.shape[1]
    budgets = config.budgets(H)
    R = max(budgets)
    d_a = 2 if fp8_aggregate else 1

    def for_r(qt, wt, pt, r):
        m = retained_mask(qt, wt, pt, r, config)
        return plan_for_mask(qt, wt, pt, m, config, R, fp8_aggregate=fp8_aggregate,
                             row_dtype=row_dtype)

    if len(budgets) == 1:
        plan, det = jax.vmap(lambda qt, wt, pt: for_r(qt, wt, pt, budgets[0]))(q, w, p)
        return plan, det, jnp.full((q.shape[0],), budgets[0], jnp.int32)
    rs = jnp.asarray(budgets, jnp.int32)

    def costs(qt, wt, pt, x, kn, ok, tt):   # [len(budgets)] for one query
        gram = allowance_estimate.head_gram(qt)               # once per query, every budget
        dets = jax.vmap(lambda r: estimated_details(
            qt, wt, pt, retained_mask(qt, wt, pt, r, config), config, gram))(rs)
        return jax.vmap(lambda det, r: budget_mod.estimated_cost(
            x, kn, ok, tt, det, r, d_a, H, survivor_weight))(dets, rs)

    c = jax.vmap(costs)(q, w, p, sample_dots, sample_norms, sample_valid, tau)   # [T, nb]
    if program_queries > 1:
        T = q.shape[0]
        B = int(program_queries)
        Tb = -(-T // B) * B
        has = jnp.any(sample_valid, axis=-1)
        cb = jnp.pad(jnp.where(has[:, None], c, 0.0), ((0, Tb - T), (0, 0)))
        best = jnp.argmin(jnp.sum(cb.reshape(Tb // B, B, -1), axis=1), axis=1)
        best = jnp.repeat(best, B)[:T]    # ties: the smaller budget (candidates ascending)
    else:
        best = jnp.argmin(c, axis=1)
    budget = rs[best]
    # the plans of the chosen budgets only (one more plan per query instead of holding
    # [T, budgets, R, D] rows to pick from)
    plan, det = jax.vmap(for_r)(q, w, p, budget)
    return plan, det, budget
