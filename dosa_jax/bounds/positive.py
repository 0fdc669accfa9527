"""Omitted positive heads: projection, folded weights, residual allowances.

For an omitted positive head h ∈ P and a retained anchor j (paper Eq. 4–5),

    relu(q_h·k) ≤ β_h relu(q_j·k) + ‖d_h‖·‖k‖,   d_h = q_h − β_h q_j,  β_h ≥ 0,

by ReLU subadditivity, positive homogeneity and Cauchy–Schwarz. The anchor
maximises relu(q_h·q_j)/‖q_j‖ and β_h = relu(q_h·q_j*)/‖q_j*‖², which makes
‖d_h‖ the distance from q_h to the ray {β q_j*: β ≥ 0} — the smallest c of any
single-anchor bound (Prop. 5). The projection is folded into the anchor's
weight (Eq. 6) and the residuals are covered by one coefficient E times ‖k‖:

* triangle (Eq. 6):  E_P = Σ_{h∈P} w_h ‖d_h‖;
* joint (Eq. 7):     E_P^joint = ½(‖Σ u_h‖ + sqrt(Σ_{h,l} |u_h·u_l|)), u_h = w_h d_h;
* grouped (App. A.1): split the coordinates into groups g, B_g the joint
  allowance of the group-restricted u_h, E = sqrt(Σ_g B_g²).

The certificate holds for *any* β ≥ 0, so computed β are used as they are;
the ``*_upper`` variants bound the exact allowance for the computed β from
above, covering the rounding of the residual vectors (App. C).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax import numerics as nm

HIGHEST = lax.Precision.HIGHEST
RESIDUALS = ("triangle", "joint", "grouped", "best")


def anchor_projection(q, retained, omitted_pos, use_projection: bool = True, gram=None):
    """Anchors j*_h, coefficients β_h ≥ 0 and residuals d_h for omitted positive heads.

    Args:
      q: [H, D] float32 head vectors; retained: [H] bool; omitted_pos: [H] bool (P).
      use_projection: False gives β = 0, d_h = q_h (the "no positive projection" ablation).
      gram: q qᵀ [H, H] when the caller has it (``allowance_estimate.head_gram``), else
        computed here (float32, HIGHEST precision).
    Returns:
      anchor [H] int32 (−1 where h ∉ P or no anchor), beta [H] float32 (0 off P),
      residual [H, D] float32 (0 off P).
    """
    H = q.shape[0]
    qn2 = jnp.sum(q * q, axis=-1)
    qn = jnp.sqrt(qn2)
    if not use_projection:
        resid = jnp.where(omitted_pos[:, None], q, 0.0)
        return jnp.full((H,), -1, jnp.int32), jnp.zeros((H,), jnp.float32), resid
    if gram is None:
        gram = jnp.einsum("hd,jd->hj", q, q, precision=HIGHEST)
    match = jnp.where(qn[None, :] > 0, jnp.maximum(gram, 0.0) / jnp.where(qn > 0, qn, 1.0)[None, :], 0.0)
    match = jnp.where(retained[None, :], match, -1.0)
    anchor = jnp.argmax(match, axis=1).astype(jnp.int32)  # first maximum: lowest index
    best = jnp.take_along_axis(match, anchor[:, None], axis=1)[:, 0]
    has = omitted_pos & (best > 0) & jnp.any(retained)
    a_n2 = qn2[anchor]
    dot = jnp.take_along_axis(gram, anchor[:, None], axis=1)[:, 0]
    beta = jnp.where(has & (a_n2 > 0), jnp.maximum(dot, 0.0) / jnp.where(a_n2 > 0, a_n2, 1.0), 0.0)
    resid = q - beta[:, None] * q[anchor]
    resid = jnp.where(omitted_pos[:, None], resid, 0.0)
    anchor = jnp.where(has, anchor, -1)
    return anchor, beta, resid


def folded_weights(w, retained, omitted_pos, anchor, beta):
    """w̃_j = w_j + Σ_{h∈P, j*_h = j} w_h β_h on retained heads, 0 elsewhere (Eq. 6).

    Returns:
      (w_fold [H] float32, fold_abs [H] float32): fold_abs_j = |w_j| + Σ |w_h β_h|,
      the magnitude that bounds the rounding of w̃_j (App. C).
    """
    H = w.shape[0]
    contrib = jnp.where(omitted_pos & (anchor >= 0), w * beta, 0.0)
    tgt = jnp.where(anchor >= 0, anchor, 0)
    add = jnp.zeros((H,), contrib.dtype).at[tgt].add(contrib)
    add_abs = jnp.zeros((H,), contrib.dtype).at[tgt].add(jnp.abs(contrib))
    w_fold = jnp.where(retained, w + add, 0.0)
    fold_abs = jnp.where(retained, jnp.abs(w) + add_abs, 0.0)
    return w_fold, fold_abs


def triangle_allowance(w, residual, omitted_pos):
    """E_P = Σ_{h∈P} w_h ‖d_h‖ (Eq. 6), real-number value computed in float32."""
    n = jnp.sqrt(jnp.sum(residual * residual, axis=-1))
    return jnp.sum(jnp.where(omitted_pos, w * n, 0.0))


def joint_allowance(u):
    """E^joint = ½(‖Σ_h u_h‖ + sqrt(Σ_{h,l} |u_h·u_l|)) for u_h = w_h d_h (Eq. 7).

    Args:
      u: [H, D] weighted residuals (zero rows for heads outside P).
    """
    s = jnp.sum(u, axis=0)
    g = jnp.einsum("hd,ld->hl", u, u, precision=HIGHEST)
    return 0.5 * (jnp.sqrt(jnp.sum(s * s)) + jnp.sqrt(jnp.sum(jnp.abs(g))))


def grouped_allowance(u, groups: int):
    """sqrt(Σ_g B_g²) with B_g the joint allowance of the group-restricted u (App. A.1).

    Coordinates are split into ``groups`` contiguous groups (D % groups == 0).
    """
    H, D = u.shape
    ug = u.reshape(H, groups, D // groups).transpose(1, 0, 2)
    b = jax.vmap(joint_allowance)(ug)
    return jnp.sqrt(jnp.sum(b * b))


# ----- upper bounds for the computed β (App. C: every piece bounded upward) -----

def residual_error(q, beta, anchor, omitted_pos):
    """e_h ≥ ‖d_h^exact − d̂_h‖ for d̂_h = fl(q_h − fl(β_h q_j)): two roundings per coordinate."""
    qn = nm.norm_upper(q)
    a_n = jnp.where(anchor >= 0, qn[jnp.maximum(anchor, 0)], 0.0)
    e = jnp.float32(nm.gamma(3)) * (qn + beta * a_n) * 1.01
    e = e + jnp.float32(2 * q.shape[-1] ** 0.5 * nm.ETA32)  # flushed β·q_j, q − β·q_j per coordinate
    return jnp.where(omitted_pos, e, 0.0)


def triangle_allowance_upper(w, residual, omitted_pos, resid_err):
    """Upper bound on Σ_{h∈P} w_h ‖d_h^exact‖ (Eq. 6 bounded upward)."""
    H = w.shape[0]
    n = nm.norm_upper(residual) + resid_err
    terms = jnp.where(omitted_pos, nm.upper_product(w, n), 0.0)
    return nm.inflate(jnp.sum(terms), H)


def _joint_upper(uh, e):
    """Upper bound on Eq. 7's value for exact vectors within e_h of the computed u_h."""
    H, D = uh.shape
    un = nm.norm_upper(uh)
    sum_un = nm.inflate(jnp.sum(un), H)
    sum_e = nm.inflate(jnp.sum(e), H)
    s = jnp.sum(uh, axis=0)
    norm_s = nm.norm_upper(s) + jnp.float32(nm.gamma(H + 1)) * sum_un * 1.01
    g = jnp.einsum("hd,ld->hl", uh, uh, precision=HIGHEST)
    gsum = nm.inflate(jnp.sum(jnp.abs(g)), H * H)
    gsum = gsum + jnp.float32(nm.gamma(D + 2)) * sum_un * sum_un * 1.01
    delta = 2.0 * sum_e * sum_un + sum_e * sum_e
    root = nm.sqrt_upper(nm.inflate(gsum + delta, 3))
    return nm.inflate(0.5 * (norm_s + sum_e + root), 4)


def weighted_residuals(w, residual, omitted_pos, resid_err):
    """û_h = fl(w_h d̂_h) and e_h ≥ ‖u_h^exact − û_h‖ (u_h = w_h d_h^exact)."""
    uh = jnp.where(omitted_pos[:, None], w[:, None] * residual, 0.0)
    e = jnp.abs(w) * resid_err + jnp.float32(2 * nm.U32) * nm.norm_upper(uh)
    return uh, jnp.where(omitted_pos, nm.inflate(e, 2), 0.0)


def joint_allowance_upper(w, residual, omitted_pos, resid_err):
    """Upper bound on E_P^joint (Eq. 7) for the exact residuals of the computed β."""
    uh, e = weighted_residuals(w, residual, omitted_pos, resid_err)
    return _joint_upper(uh, e)


def grouped_allowance_upper(w, residual, omitted_pos, resid_err, groups: int):
    """Upper bound on the grouped allowance (App. A.1); group errors reuse e_h (a bound
    on each group's share since ‖x_g‖ ≤ ‖x‖)."""
    uh, e = weighted_residuals(w, residual, omitted_pos, resid_err)
    H, D = uh.shape
    ug = uh.reshape(H, groups, D // groups).transpose(1, 0, 2)
    b = jax.vmap(_joint_upper, in_axes=(0, None))(ug, e)
    return nm.sqrt_upper(nm.inflate(jnp.sum(nm.upper_product(b, b)), groups))


def residual_allowance_upper(w, residual, omitted_pos, resid_err, mode: str, groups: int):
    """The configured residual allowance, bounded upward. ``best`` takes the minimum of
    the valid bounds (each is an upper bound, so is their minimum)."""
    if mode not in RESIDUALS:
        raise ValueError(f"positive_residual must be one of {RESIDUALS}, got {mode!r}")
    tri = triangle_allowance_upper(w, residual, omitted_pos, resid_err)
    if mode == "triangle":
        return tri
    # the Gram-based bounds can overflow where the triangle bound is still finite:
    # a non-finite alternative is skipped (never used to prune), not propagated
    smaller = lambda a, b: jnp.where(jnp.isfinite(b), jnp.minimum(a, b), a)
    joint = smaller(tri, joint_allowance_upper(w, residual, omitted_pos, resid_err))
    if mode == "joint":
        return joint
    grp = grouped_allowance_upper(w, residual, omitted_pos, resid_err, groups)
    if mode == "grouped":
        return smaller(tri, grp)
    return smaller(joint, grp)
