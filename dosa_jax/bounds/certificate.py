"""The certificate (paper Eq. 9) and its absolute-value form (Eq. 24–25).

    U(k) = Σ_{j∈R} w̃_j relu(q_j·k) + E·‖k‖ − relu(a_A·k)  ≥  s(k)          (Eq. 9)

E is any valid positive-residual allowance (triangle, joint or grouped).
When every positive head is retained (P = ∅), with V = a_A − ½ Σ_{j∈R} w_j q_j,

    U_abs(k) = ½ Σ_{j∈R} w_j |q_j·k| − V·k = Σ_{j∈R} w_j relu(q_j·k) − a_A·k
             = U(k) + relu(−a_A·k)  ≥  s(k)                              (Eq. 24–25)

Both are written here on per-head dot products ``x_h = q_h·k`` (exact
linearity: a_A·k = Σ_A |w_h| x_h), which is how the analysis, the proofs and
the automatic budget evaluate them on sampled keys. The screening stage
evaluates the same expression from the plan rows (``dosa_jax.screen``).
"""

from __future__ import annotations

import jax.numpy as jnp


def certificate(head_dots, key_norm, w_fold, residual_coef, support_weight):
    """U of Eq. 9 from head dot products.

    Args:
      head_dots: [..., H] x_h = q_h·k.
      key_norm: [...] ‖k‖.
      w_fold: [H] folded weights (non-zero on R only).
      residual_coef: scalar E.
      support_weight: [H] |w_h| on the support A, 0 elsewhere.
    """
    retained = jnp.sum(w_fold * jnp.maximum(head_dots, 0.0), axis=-1)
    agg = jnp.maximum(jnp.sum(support_weight * head_dots, axis=-1), 0.0)
    return retained + residual_coef * key_norm - agg


def absolute_value_certificate(head_dots, w, retained, support_weight):
    """U_abs of Eq. 24–25 (valid when every positive head is retained).

    U_abs = ½ Σ_R w_j |x_j| − V·k with V·k = Σ_A |w_h| x_h − ½ Σ_R w_j x_j.
    """
    wr = jnp.where(retained, w, 0.0)
    half_abs = 0.5 * jnp.sum(wr * jnp.abs(head_dots), axis=-1)
    v_dot_k = jnp.sum(support_weight * head_dots, axis=-1) - 0.5 * jnp.sum(wr * head_dots, axis=-1)
    return half_abs - v_dot_k


def original_score(head_dots, w):
    """s = Σ_h w_h relu(x_h) (Eq. 1) from head dot products (analysis helper)."""
    return jnp.sum(w * jnp.maximum(head_dots, 0.0), axis=-1)
