"""Certificate diagnostics: slack decomposition, margin relation, per-query analysis.

* :func:`slack_decomposition` — Prop. 6 / Eq. 14 (per-head residual form):
  ``U − s = δ_P + Σ_{h∈N\\A} c_h relu(x_h) + min(Z_A⁺, Z_A⁻)``, each term ≥ 0.
* :func:`margin_terms` — Eq. 17: with b = τ* − τ, δ_i = U_i − s_i,
  Δ_i = τ* − s_i: ``U_i < τ ⇔ Δ_i > δ_i + b``.
* :func:`screening_counts` — per query, survivors of the numeric certificate,
  the real-number certificate and the exact score at the seed threshold.

The cost model (Eq. 18–21) lives in :mod:`dosa_jax.budget`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax import seeds as seeds_mod
from dosa_jax.bounds.certificate import certificate
from dosa_jax.config import Config
from dosa_jax.inputs import check_inputs
from dosa_jax.pipeline import plan_tile, prepare_keys
from dosa_jax.scorer import score_ids, to_f32
from dosa_jax.screen import screening_bound
from dosa_jax.tiling import map_query_tiles


class SlackTerms(NamedTuple):
    """The three non-negative slack terms of Eq. 14 and their sum ([...] arrays)."""

    positive: jax.Array        # δ_P
    uncovered_negative: jax.Array  # Σ_{h∈N\A} c_h relu(x_h)
    cancellation: jax.Array    # min(Z_A⁺, Z_A⁻)
    total: jax.Array


def positive_slack(head_dots, key_norm, w, omitted_pos, anchor, beta, residual_norms):
    """δ_P = Σ_{h∈P} w_h (β_h relu(x_{j*}) + ‖d_h‖‖k‖ − relu(x_h)) (per-head residual form)."""
    H = w.shape[-1]
    xa = jnp.take(head_dots, jnp.clip(anchor, 0, H - 1), axis=-1)
    xa = jnp.where(anchor >= 0, xa, 0.0)
    per = beta * jnp.maximum(xa, 0.0) + residual_norms * key_norm[..., None] - jnp.maximum(head_dots, 0.0)
    return jnp.sum(jnp.where(omitted_pos, w * per, 0.0), axis=-1)


def slack_decomposition(head_dots, key_norm, w, omitted_pos, omitted_neg, support, anchor, beta,
                        residual_norms) -> SlackTerms:
    """Eq. 14 terms for keys with head dots ``head_dots`` [..., H] (triangle residual form).

    Equals ``certificate(...) − original_score(...)`` exactly in real arithmetic
    when E = Σ_P w_h ‖d_h‖ (the proofs check this equality).
    """
    c = jnp.abs(w)
    dp = positive_slack(head_dots, key_norm, w, omitted_pos, anchor, beta, residual_norms)
    relu = jnp.maximum(head_dots, 0.0)
    unc = jnp.sum(jnp.where(omitted_neg & ~support, c * relu, 0.0), axis=-1)
    zp = jnp.sum(jnp.where(support, c * relu, 0.0), axis=-1)
    zm = jnp.sum(jnp.where(support, c * jnp.maximum(-head_dots, 0.0), 0.0), axis=-1)
    canc = jnp.minimum(zp, zm)
    return SlackTerms(dp, unc, canc, dp + unc + canc)


class MarginTerms(NamedTuple):
    """Eq. 17 quantities for each key ([...] arrays) and the query's b."""

    gap: jax.Array        # Δ_i = τ* − s_i
    slack: jax.Array      # δ_i = U_i − s_i
    deficit: jax.Array    # b = τ* − τ
    rejected: jax.Array   # U_i < τ
    margin_rule: jax.Array  # Δ_i > δ_i + b


def margin_terms(scores, bounds, tau, tau_star) -> MarginTerms:
    """Eq. 17: ``U_i < τ ⇔ Δ_i > δ_i + b`` (both sides returned, to be compared)."""
    gap = tau_star - scores
    slack = bounds - scores
    b = tau_star - tau
    return MarginTerms(gap, slack, b, bounds < tau, gap > slack + b)


def real_certificate_on_keys(head_dots, key_norm, details):
    """Real-number U (Eq. 9) of a plan (``PlanDetails`` of one query) on keys' head dots."""
    return certificate(head_dots, key_norm, details.w_fold, details.residual,
                       details.support_weight)


class ScreeningCounts(NamedTuple):
    """Per-query counts over the screened (visible, non-seed) keys at the seed threshold."""

    screened: jax.Array
    survive_numeric: jax.Array   # U^num ≥ τ (what the pipeline does, App. C enclosure)
    survive_real: jax.Array      # real-number bound Û + ‖k‖E ≥ τ in plain float32 (Eq. 9)
    survive_exact: jax.Array     # s ≥ τ: the floor no certificate can go below
    tau: jax.Array


def screening_counts(q, k, w, k_scale=None, lo=None, hi=None, config=None) -> ScreeningCounts:
    """How much pruning the numerical enclosure costs (App. C's allowance against the
    real-number certificate).

    For every query, at its seed threshold τ (no raising), counts the screened keys
    that survive the numeric certificate U^num, the real-number certificate
    (same plan, E but no C, ε or upward rounding — *not* safe, for comparison
    only) and the exact score. Runs the reference planner exactly as the pipeline.
    """
    config = config or Config()
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    keys = prepare_keys(k, k_scale, config.key_block)
    B = config.key_block
    nb = keys.k.shape[0] // B

    def tile(qt, wt, lot, hit):
        tp = plan_tile(qt, wt, lot, hit, keys, config)
        Tq = qt.shape[0]
        real_plan = tp.plan._replace(error=jnp.zeros_like(tp.plan.error),
                                     eps_raw=jnp.zeros_like(tp.plan.eps_raw))

        def body(b, acc):
            ids = b * B + jnp.arange(B, dtype=jnp.int32)
            kb = lax.dynamic_slice_in_dim(keys.k, b * B, B)
            nbk = lax.dynamic_slice_in_dim(keys.norm_up, b * B, B)
            ab = None if keys.scale is None else lax.dynamic_slice_in_dim(keys.scale, b * B, B)
            u_num = screening_bound(tp.plan, kb, nbk, ab)
            kf = to_f32(kb)
            y = jnp.einsum("trd,bd->tbr", real_plan.rows, kf, precision=lax.Precision.HIGHEST)
            z = jnp.einsum("tad,bd->tb", real_plan.aggregate, kf, precision=lax.Precision.HIGHEST)
            u_real = (jnp.sum(real_plan.row_weights[:, None, :] * jnp.maximum(y, 0.0), -1)
                      - jnp.where(real_plan.aggregate_linear[:, None], z, jnp.maximum(z, 0.0))
                      + jnp.sqrt(jnp.sum(kf * kf, -1))[None, :] * real_plan.residual[:, None])
            if ab is not None:
                u_real = u_real * ab[None, :]
            idb = jnp.broadcast_to(ids[None, :], (Tq, B))
            s = score_ids(qt, wt, keys.k, keys.scale, idb)
            vis = (idb >= lot[:, None]) & (idb < hit[:, None]) & ~seeds_mod.is_seed(idb, tp.layout)
            t = tp.tau[:, None]
            cnt = lambda m: jnp.sum(vis & m, axis=1).astype(jnp.int32)
            return (acc[0] + cnt(jnp.ones_like(vis)), acc[1] + cnt(~(u_num < t)),
                    acc[2] + cnt(~(u_real < t)), acc[3] + cnt(~(s < t)))

        z0 = jnp.zeros_like(lot)
        out = lax.fori_loop(0, nb, body, (z0, z0, z0, z0))
        return ScreeningCounts(*out, tau=tp.tau)

    return map_query_tiles(tile, q, w, lo, hi, config.query_tile)
