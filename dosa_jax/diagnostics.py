"""Certificate diagnostics: slack decomposition, margin relation, per-query analysis.

* :func:`slack_decomposition` — Prop. 6 / Eq. 14 (per-head residual form):
  ``U − s = δ_P + Σ_{h∈N\\A} c_h relu(x_h) + min(Z_A⁺, Z_A⁻)``, each term ≥ 0.
* :func:`margin_terms` — Eq. 17: with b = τ* − τ, δ_i = U_i − s_i,
  Δ_i = τ* − s_i: ``U_i < τ ⇔ Δ_i > δ_i + b``.
* :func:`analyze_query` — everything for one query in a notebook: plan
  details, U and s on every visible key, survivals (real-number and numeric).

The cost model (Eq. 18–21) lives in :mod:`dosa_jax.budget`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dosa_jax.bounds.certificate import certificate


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
