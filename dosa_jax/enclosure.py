"""Numerical enclosure of the certificate (paper App. C, Eq. 22–28; DESIGN §9).

The real-number inequality s_i ≤ U_i is not enough: the scorer and the
screening both round. What exactness needs is ``s_i^ref ≤ U_i^num`` where
``s_i^ref`` is what the scorer *computes* and ``U_i^num`` what screening computes:

    U_i^num = up[ α_i ( Û_i + n_i·(E + C) + ε_raw ) ] ,       n_i ≥ ‖k̄_i‖₂   (Eq. 26)

(the paper writes ρ_i C with ρ_i ≥ ‖k̄_i‖/√D; we keep the norm and fold √D into C).
C is a sum of per-query coefficients, each a pure function below:

* :func:`scorer_error_coefficient` — the original scorer's own rounding
  (head dots with unit roundoff u_s, the left-to-right head sum);
* :func:`screening_error_coefficient` — the screening dots and sum;
* :func:`fold_error_coefficient` — rounding of the folded weights w̃_j;
* the aggregate's representation error (``negative_aggregate``'s err plus the
  FP8 split residual ‖e_A‖) and any row cast (:func:`row_cast_error`);

``ε_raw`` covers underflow (absolute errors) before scaling and ``up[α·v]``
(:func:`scaled_upper`) the scaling and ``ε_out``. Everything is evaluated
upward: explicit γ_n bounds plus ``nextafter`` toward +∞ (:mod:`dosa_jax.numerics`).
"""

from __future__ import annotations

import jax.numpy as jnp

from dosa_jax import numerics as nm


def key_norm_upper(keys):
    """n_i ≥ ‖k̄_i‖₂ for payload rows (any float dtype, widened exactly to float32)."""
    return nm.norm_upper(keys.astype(jnp.float32), axis=-1)


def scorer_error_coefficient(w, q_norm_up, D: int, u_scorer: float = nm.U32):
    """C_s with |s_ref − s| ≤ C_s·‖k̄‖ (+ underflow) for the payload score.

    Head dot x̂_h: |x̂_h − x_h| ≤ γ_D(u_s)‖q_h‖‖k̄‖; the head sum of H rounded
    products: ≤ γ_{H+1} Σ|w_h| relu(x̂_h) ≤ γ_{H+1}(1+γ_D)Σ|w_h|‖q_h‖‖k̄‖.
    """
    H = w.shape[-1]
    gd = nm.gamma(D, u_scorer)
    coef = gd + nm.gamma(H + 1) * (1.0 + gd)
    mag = nm.inflate(jnp.sum(jnp.abs(w) * q_norm_up, axis=-1), H)
    return nm.inflate(mag * jnp.float32(coef * 1.01), 1)


def screening_error_coefficient(row_weights, row_norm_up, agg_norm_up, D: int,
                                u_screen: float = nm.U32):
    """C_u with |Û − U(rows)| ≤ C_u·‖k̄‖: screening dots (γ_D each, aggregate rows
    summed before the ReLU) and the R+1-term sum of the bound."""
    R = row_weights.shape[-1]
    A = agg_norm_up.shape[-1]
    gd = nm.gamma(D + A, u_screen)
    mag = nm.inflate(jnp.sum(jnp.abs(row_weights) * row_norm_up, axis=-1)
                     + jnp.sum(agg_norm_up, axis=-1), R + A)
    coef = gd + nm.gamma(R + 3) * (1.0 + gd)
    return nm.inflate(mag * jnp.float32(coef * 1.01), 1)


def fold_error_coefficient(fold_abs, row_norm_up, H: int):
    """C_w ≥ Σ_j |w̃_j − ŵ_j|·‖q_j‖ for folded weights summed from ≤ H+1 terms (Eq. 6)."""
    R = fold_abs.shape[-1]
    mag = nm.inflate(jnp.sum(fold_abs * row_norm_up, axis=-1), R)
    return nm.inflate(mag * jnp.float32(nm.gamma(H + 2) * 1.01), 1)


def row_cast_error(rows, dtype):
    """e_j ≥ ‖q_j − cast(q_j)‖ when a kernel feeds rows to the MMA in ``dtype``."""
    cast = nm.rounded_to(rows, dtype)   # (a bare astype round trip is dropped under jit)
    return nm.norm_upper(rows - cast)  # the difference is exact in float32 (same exponent range)


def underflow_allowance(w, row_weights, n_agg_rows: int, D: int, H: int, R: int):
    """ε_raw: absolute errors of flushed (underflowed) results, scorer and screening.

    With flush-to-zero every float32 operation may lose up to 2^-126 absolutely.
    The scorer's D products and D−1 sums per head are weighted by |w_h|, then H
    products and sums; the screening likewise with |w̃_j| and the aggregate rows.
    """
    mag = (jnp.sum(jnp.abs(w), axis=-1) + jnp.sum(jnp.abs(row_weights), axis=-1)
           + n_agg_rows + 1.0) * (2 * D) + 2 * (H + R) + 16
    return nm.inflate(mag * jnp.float32(2 * nm.ETA32), H + R)


def payload_upper(u_hat, key_norm_up, coef, eps_raw):
    """Upper bound on Û + n·coef + ε_raw (coef = E + C), evaluated upward."""
    return nm.upper_sum(u_hat, nm.upper_product(key_norm_up, coef), eps_raw)


def scaled_upper(v, scale=None):
    """up[α·v] (+ ε_out): bounds fl(α·ŝ) for any ŝ ≤ v when α > 0 (Eq. 26)."""
    if scale is None:
        return v
    return nm.upper_product(scale, v)


def scale_is_valid(scale):
    """Per-key α_i valid for the enclosure: finite and > 0 (App. C guards)."""
    return jnp.isfinite(scale) & (scale > 0)
