"""Real-number residual allowances of many retained sets from one query's head Grams.

The automatic budget (Eq. 18–21) prices every candidate budget by its real-number
certificate (Eq. 9) on the planner's sample, which needs the residual allowance E
(triangle Eq. 6, joint Eq. 7, grouped App. A.1) of every candidate's retained set.
Each weighted residual is a combination of two head vectors,

    u_h = c_h q_h − b_h q_{j_h},   c_h = w_h on P (0 elsewhere),  b_h = w_h β_h,

with j_h the anchor of h (Eq. 4–5), so every inner product of residuals is a
combination of entries of the query's head Gram Q = q qᵀ:

    u_h·u_l = c_h c_l Q_hl − c_h b_l Q_{h j_l} − b_h c_l Q_{j_h l} + b_h b_l Q_{j_h j_l},

and the group-restricted ones (App. A.1) of the group Grams Q_g = q_g q_gᵀ (Σ_g Q_g = Q).
:func:`head_grams` computes Q and the Q_g once per query (H²·D products); each
candidate then costs O(H²) per Gram (:func:`residual_grams`, :func:`allowance_estimate`)
instead of the O(H²·D) of forming its residuals and their Grams again.

These are estimates that steer the plan (which budget), never bounds: the
combination cancels where a residual is small against its head (relative error about
2⁻²³‖q_h‖²/‖u_h‖²), and no rounding is covered. The chosen budget's plan carries the
certified allowance (:func:`dosa_jax.bounds.positive.residual_allowance_upper`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dosa_jax.bounds.positive import RESIDUALS

HIGHEST = lax.Precision.HIGHEST


def head_grams(q, groups: int):
    """[1 + groups, H, H]: the head Gram q qᵀ, then the Grams of the ``groups`` contiguous
    coordinate groups (float32, HIGHEST precision). ``groups`` must divide D."""
    H, D = q.shape
    q = q.astype(jnp.float32)
    full = jnp.einsum("hd,ld->hl", q, q, precision=HIGHEST)
    qg = q.reshape(H, groups, D // groups)
    grp = jnp.einsum("hgd,lgd->ghl", qg, qg, precision=HIGHEST)
    return jnp.concatenate([full[None], grp], axis=0)


def residual_grams(grams, w, omitted_pos, anchor, beta):
    """[G, H, H] Grams u_h·u_l of the weighted residuals u_h = w_h (q_h − β_h q_{j_h}) for
    h ∈ P (zero rows elsewhere), from :func:`head_grams` (any leading axis G of Grams).

    ``anchor`` −1 (no anchor) must come with β_h = 0 (as ``anchor_projection`` returns).
    """
    c = jnp.where(omitted_pos, w, 0.0)
    b = jnp.where(omitted_pos & (anchor >= 0), w * beta, 0.0)
    j = jnp.maximum(anchor, 0)
    q_hl = grams                                  # Q_hl
    q_hj = jnp.take(grams, j, axis=2)             # Q_{h j_l}
    q_jl = jnp.take(grams, j, axis=1)             # Q_{j_h l}
    q_jj = jnp.take(q_jl, j, axis=2)              # Q_{j_h j_l}
    cc = c[:, None] * c[None, :]
    cb = c[:, None] * b[None, :]
    bc = b[:, None] * c[None, :]
    bb = b[:, None] * b[None, :]
    return cc * q_hl - cb * q_hj - bc * q_jl + bb * q_jj


def _joint(g):
    """½(‖Σ_h u_h‖ + sqrt(Σ_{h,l} |u_h·u_l|)) (Eq. 7) from the Gram of the u_h ([..., H, H])."""
    s2 = jnp.sum(g, axis=(-2, -1))
    return 0.5 * (jnp.sqrt(jnp.maximum(s2, 0.0)) + jnp.sqrt(jnp.sum(jnp.abs(g), axis=(-2, -1))))


def allowance_estimate(grams, w, omitted_pos, anchor, beta, mode: str):
    """The configured residual allowance E (``positive_residual``) as a real-number estimate,
    from :func:`head_grams`: triangle Σ_P ‖u_h‖ (Eq. 6), joint (Eq. 7), grouped
    sqrt(Σ_g B_g²) (App. A.1), or ``best`` (the least of the three), as
    :func:`dosa_jax.bounds.positive.residual_allowance_upper` takes them; 0 when P is empty.
    """
    if mode not in RESIDUALS:
        raise ValueError(f"positive_residual must be one of {RESIDUALS}, got {mode!r}")
    g = residual_grams(grams, w, omitted_pos, anchor, beta)
    diag = jnp.diagonal(g[0])
    tri = jnp.sum(jnp.sqrt(jnp.maximum(diag, 0.0)))
    est = tri
    if mode in ("joint", "best"):
        est = jnp.minimum(est, _joint(g[0]))
    if mode in ("grouped", "best"):
        b = _joint(g[1:])
        est = jnp.minimum(est, jnp.sqrt(jnp.sum(b * b)))
    return jnp.where(jnp.any(omitted_pos), est, 0.0)
