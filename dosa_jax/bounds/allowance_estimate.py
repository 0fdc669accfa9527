"""Real-number residual allowances of the automatic budget's candidates (steering only).

The automatic budget (Eq. 18–21) prices every candidate budget by its real-number
certificate (Eq. 9) on the planner's sample, which needs the residual allowance E
(triangle Eq. 6, joint Eq. 7, grouped App. A.1) of every candidate's retained set.
The certified allowances (:mod:`dosa_jax.bounds.positive`'s ``*_upper``: scaled norms,
inflated sums, each Gram's rounding) of every candidate would dominate the planner's
cost, and only the chosen budget needs a bound. Here the candidates get the real-number
values: the weighted residuals u_h = w_h (q_h − β_h q_{j_h}) are built group-major, one
batched product forms the group Grams (their sum is the full Gram, Eq. 7), and triangle,
joint and grouped values follow from the Grams' sums; the query's head Gram q qᵀ (the
anchors' matches) is computed once for every candidate.

These are estimates that steer the plan (which budget), never bounds: no rounding is
covered. The chosen budget's plan carries the certified allowance
(:func:`dosa_jax.bounds.positive.residual_allowance_upper`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dosa_jax.bounds.positive import RESIDUALS

HIGHEST = lax.Precision.HIGHEST


def head_gram(q):
    """q qᵀ [H, H] (float32, HIGHEST precision): the anchors' matches (Eq. 4–5), computed once
    per query for every candidate (``positive.anchor_projection(..., gram=)``)."""
    q = q.astype(jnp.float32)
    return jnp.einsum("hd,ld->hl", q, q, precision=HIGHEST)


def residual_group_grams(q, w, omitted_pos, anchor, beta, groups: int):
    """[groups, H, H] Grams of the group-restricted weighted residuals (App. A.1),
    u_h = w_h (q_h − β_h q_{j_h}) on P (zero rows elsewhere); their sum over groups is the
    full residual Gram (Eq. 7). The residuals are built group-major ([groups, H, D/groups]),
    so one batched product forms every Gram. ``anchor`` −1 must come with β_h = 0."""
    H, D = q.shape
    qg = q.astype(jnp.float32).reshape(H, groups, D // groups).transpose(1, 0, 2)
    c = jnp.where(omitted_pos, w, 0.0)
    b = jnp.where(omitted_pos & (anchor >= 0), w * beta, 0.0)
    u = c[None, :, None] * qg - b[None, :, None] * jnp.take(qg, jnp.maximum(anchor, 0), axis=1,
                                                             mode="clip")
    return jnp.einsum("ghd,gld->ghl", u, u, precision=HIGHEST)


def _joint(g):
    """½(‖Σ_h u_h‖ + sqrt(Σ_{h,l} |u_h·u_l|)) (Eq. 7) from the Gram of the u_h ([..., H, H])."""
    s2 = jnp.sum(g, axis=(-2, -1))
    return 0.5 * (jnp.sqrt(jnp.maximum(s2, 0.0)) + jnp.sqrt(jnp.sum(jnp.abs(g), axis=(-2, -1))))


def allowance_estimate(q, w, omitted_pos, anchor, beta, mode: str, groups: int):
    """The configured residual allowance E (``positive_residual``) as a real-number estimate:
    triangle Σ_P ‖u_h‖ (Eq. 6), joint (Eq. 7), grouped sqrt(Σ_g B_g²) over ``groups``
    coordinate groups (App. A.1), or ``best`` (the least of the three), as
    :func:`dosa_jax.bounds.positive.residual_allowance_upper` takes them; 0 when P is empty.
    """
    if mode not in RESIDUALS:
        raise ValueError(f"positive_residual must be one of {RESIDUALS}, got {mode!r}")
    gg = residual_group_grams(q, w, omitted_pos, anchor, beta, groups)
    full = jnp.sum(gg, axis=0)
    tri = jnp.sum(jnp.sqrt(jnp.maximum(jnp.diagonal(full), 0.0)))
    est = tri
    if mode in ("joint", "best"):
        est = jnp.minimum(est, _joint(full))
    if mode in ("grouped", "best"):
        b = _joint(gg)
        est = jnp.minimum(est, jnp.sqrt(jnp.sum(b * b)))
    return jnp.where(jnp.any(omitted_pos), est, 0.0)
