"""Dot-product cost model and the automatic retained-head budget (Eq. 18–21).

Seeds N0 are scored with all H heads, Ns keys are screened with r retained
heads plus d_a auxiliary rows, and M survivors are rescored with H heads:

    D_base = H (N0 + Ns),    D_DoSA = H N0 + (r + d_a) Ns + H M            (Eq. 18–19)
    D_DoSA / D_base ≈ f + (1 − f)((r + d_a)/H + m),  f = N0/(N0+Ns), m = M/Ns   (Eq. 20–21)

Screening saves dot products iff m < 1 − (r + d_a)/H; one more retained head
pays only if it lowers m by more than 1/H. The automatic budget evaluates
the real-number certificate of each candidate budget on the seed sample and
picks the smallest (r + d_a)/H + m̂ (f does not depend on r).
"""

from __future__ import annotations

import jax.numpy as jnp

from dosa_jax.bounds.certificate import certificate


def dot_product_counts(n_seeds, n_screened, n_survivors, H: int, r, d_a: int):
    """(D_base, D_DoSA) of Eq. 18–19 (works on arrays)."""
    base = H * (n_seeds + n_screened)
    dosa = H * n_seeds + (r + d_a) * n_screened + H * n_survivors
    return base, dosa


def cost_ratio(f, m, r, d_a: int, H: int):
    """D_DoSA / D_base ≈ f + (1 − f)((r + d_a)/H + m) (Eq. 20–21)."""
    return f + (1.0 - f) * ((r + d_a) / H + m)


def break_even_survival(r, d_a: int, H: int):
    """Largest survival fraction m at which screening still saves dot products."""
    return 1.0 - (r + d_a) / H


def sample_survivors(head_dots, key_norm, valid, tau, details):
    """[P] bool: the sample keys whose real-number certificate (Eq. 9) is ≥ τ (valid ones)."""
    U = certificate(head_dots, key_norm, details.w_fold, details.residual, details.support_weight)
    return valid & ~(U < tau)


def estimated_survival(head_dots, key_norm, valid, tau, details):
    """m̂: fraction of sample keys whose real-number certificate (Eq. 9) is ≥ τ."""
    n = jnp.maximum(jnp.sum(valid), 1)
    return jnp.sum(sample_survivors(head_dots, key_norm, valid, tau, details)) / n


def estimated_cost(head_dots, key_norm, valid, tau, details, r: int, d_a: int, H: int,
                   survivor_weight: float = 1.0):
    """(r + d_a)/H + κ·m̂ for one candidate budget (the r-dependent part of Eq. 21).

    κ = ``survivor_weight`` prices a survivor's rescoring against the screen's dot
    products: 1 counts dot products (Eq. 21); a backend whose rescoring costs more per
    dot product than its screen (gathers, a group's union of survivors) measures its own.
    """
    return (r + d_a) / H + survivor_weight * estimated_survival(head_dots, key_norm, valid, tau,
                                                                details)
