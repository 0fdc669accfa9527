"""Screening: the numerical certificate U^num of a block of keys (Eq. 9, 26).

One GEMM of the plan rows against the key block, a ReLU, the folded weights,
the negative aggregate (its rows summed before the ReLU), the residual and
error coefficients times the key-norm bound, all evaluated upward. A key is
rejected only on ``U^num < τ`` (strict); a NaN bound never rejects.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dosa_jax import enclosure as enc
from dosa_jax.plan import ScreeningPlan
from dosa_jax.scorer import to_f32, weighted_relu_sum

HIGHEST = lax.Precision.HIGHEST


def screening_bound(plan: ScreeningPlan, keys, key_norm_up, scale=None):
    """U^num for every (query, key) of a shared key block.

    Args:
      plan: ScreeningPlan with leading axis Tq.
      keys: [B, D] key payloads (any accepted dtype), shared by the queries;
        or [Tq, B, D] keys gathered per query.
      key_norm_up: [B] (or [Tq, B]) float32, n_i ≥ ‖k̄_i‖.
      scale: None or [B] (or [Tq, B]) float32 α_i.
    Returns:
      [Tq, B] float32 upper bounds on the scorer's computed scores.
    """
    kf = to_f32(keys)  # float32 GEMM (see scorer.to_f32)
    kspec = "bd" if kf.ndim == 2 else "tbd"
    y = jnp.einsum(f"trd,{kspec}->tbr", plan.rows, kf, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    z = jnp.einsum(f"tad,{kspec}->tb", plan.aggregate, kf, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    u_hat = weighted_relu_sum(y, plan.row_weights)
    u_hat = u_hat - jnp.where(plan.aggregate_linear[:, None], z, jnp.maximum(z, 0.0))
    coef = (plan.residual + plan.error)[:, None]
    per_key = (lambda x: x[None, :]) if kf.ndim == 2 else (lambda x: x)
    v = enc.payload_upper(u_hat, per_key(key_norm_up), coef, plan.eps_raw[:, None])
    return enc.scaled_upper(v, None if scale is None else per_key(scale))


def survives(bound, tau):
    """Keep unless ``bound < τ`` (strict; equality and NaN survive)."""
    return ~(bound < tau[:, None])
