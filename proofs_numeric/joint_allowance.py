"""Eq. 6–7 and App. A.1: the residual allowances are valid, and the joint one is smaller.

With P the omitted positive heads, d_h the residual of head h after its
anchor projection and u_h = w_h d_h, for every instance, budget and variant
(negative ranking × positive projection), in float64:

* ``E_P^joint ≤ E_P`` (Eq. 7) and ``E_grouped ≤ E_P`` (Minkowski);
* per key, ``Σ_{h∈P} w_h relu(d_h·k) ≤ E·‖k‖`` for E = triangle (Eq. 6), joint
  (Eq. 7) and grouped (App. A.1) — on the instance's keys plus the extremal keys
  of the joint proof: ±Σ_h u_h, ±u_h, ±d_h and Σ_h σ_h u_h for random signs σ;
* App. C's upward versions (``triangle/joint/grouped_allowance_upper`` on float32
  inputs, as the planner calls them) are ≥ the exact float64 allowance of the
  exact residuals q_h − β̂_h q_j of the β̂ the float32 projection computed.

A violation is an excess above 2^-40 × (Σ_{h∈P} w_h ‖d_h‖)(‖k‖), i.e. beyond
float64 rounding, or an upper value below the exact one (``max_violation``
reports the larger of the relative excess and the relative shortfall (exact −
upper)/exact).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax.bounds import heads, positive
from proofs_numeric import _common as cm
from proofs_numeric.certificate import groups_for, _select

NAME = "joint_allowance"
CLAIM = "E_joint <= E_P (Eq. 7); sum_P w relu(d.k) <= E ||k|| for triangle/joint/grouped; *_upper >= exact"
TOL = 2.0 ** -40
RANKINGS = ("uncertainty", "strength")
PROJECTIONS = (True, False)
N_SIGNS = 16
LABELS = ("joint<=triangle", "grouped<=triangle", "key:triangle", "key:joint", "key:grouped",
          "upper:triangle", "upper:joint", "upper:grouped")


def variants():
    return tuple((rk, pj) for rk in RANKINGS for pj in PROJECTIONS)


def _one(q, w, p, keys, signs, r, vid, *, groups):
    i_rank, i_proj = vid // len(PROJECTIONS), vid % len(PROJECTIONS)
    H, D = q.shape
    qn = jnp.sqrt(jnp.sum(q * q, axis=-1))
    retained = _select(i_rank, [heads.retained_heads(w, qn, p, r, rk) for rk in RANKINGS])
    omitted_pos, _ = heads.omitted_heads(w, retained)
    anchor, beta, resid = _select(i_proj, [positive.anchor_projection(q, retained, omitted_pos, pj)
                                           for pj in PROJECTIONS])
    u = jnp.where(omitted_pos[:, None], w[:, None] * resid, 0.0)
    e_tri = positive.triangle_allowance(w, resid, omitted_pos)
    e_joint = positive.joint_allowance(u)
    e_grp = positive.grouped_allowance(u, groups)
    scale = e_tri  # Σ_P w_h ‖d_h‖ ≥ every allowance
    agg = [~(e_joint - e_tri <= TOL * scale), ~(e_grp - e_tri <= TOL * scale)]  # NaN fails

    # keys: the instance's, plus the extremal keys of the joint bound's proof
    extremal = jnp.concatenate([u.sum(0)[None], -u.sum(0)[None], u, -u, resid, -resid,
                                signs @ u], axis=0)
    k = jnp.concatenate([keys, extremal], axis=0)
    kn = jnp.sqrt(jnp.sum(k * k, axis=-1))
    dots = jnp.einsum("nd,hd->nh", k, resid, precision=jax.lax.Precision.HIGHEST)
    lhs = jnp.sum(jnp.where(omitted_pos, w * jnp.maximum(dots, 0.0), 0.0), axis=-1)
    tol = TOL * scale * kn
    per_key = [~(lhs - E * kn <= tol) for E in (e_tri, e_joint, e_grp)]
    excess = jnp.stack([jnp.max((lhs - E * kn) / jnp.where(scale * kn > 0, scale * kn, 1.0))
                        for E in (e_tri, e_joint, e_grp)])

    # App. C upward versions, float32 as the planner computes them
    q32, w32 = q.astype(jnp.float32), w.astype(jnp.float32)
    qn32 = jnp.sqrt(jnp.sum(q32 * q32, axis=-1))
    ret32 = _select(i_rank, [heads.retained_heads(w32, qn32, p.astype(jnp.float32), r, rk)
                             for rk in RANKINGS])
    pos32, _ = heads.omitted_heads(w32, ret32)
    an32, be32, re32 = _select(i_proj, [positive.anchor_projection(q32, ret32, pos32, pj)
                                        for pj in PROJECTIONS])
    err32 = positive.residual_error(q32, be32, an32, pos32)
    up = [positive.triangle_allowance_upper(w32, re32, pos32, err32),
          positive.joint_allowance_upper(w32, re32, pos32, err32),
          positive.grouped_allowance_upper(w32, re32, pos32, err32, groups)]
    # exact residuals of the computed β̂ (float32 values are exact in float64)
    qx, wx = q32.astype(q.dtype), w32.astype(w.dtype)
    d_exact = qx - be32.astype(q.dtype)[:, None] * qx[jnp.maximum(an32, 0)]
    d_exact = jnp.where(pos32[:, None], d_exact, 0.0)
    u_exact = jnp.where(pos32[:, None], wx[:, None] * d_exact, 0.0)
    exact = [positive.triangle_allowance(wx, d_exact, pos32), positive.joint_allowance(u_exact),
             positive.grouped_allowance(u_exact, groups)]
    # a non-finite upper value is no violation: the planner then disables pruning
    upper_bad = [jnp.isfinite(u_) & ~(u_.astype(q.dtype) >= ex) for u_, ex in zip(up, exact)]
    nonfinite = jnp.sum(jnp.stack([~jnp.isfinite(u_) for u_ in up]))
    shortfall = jnp.max(jnp.stack([jnp.where(jnp.isfinite(u_) & (ex > 0),
                                             (ex - u_.astype(q.dtype)) / jnp.where(ex > 0, ex, 1.0),
                                             -jnp.inf) for u_, ex in zip(up, exact)]))

    flags = jnp.stack(agg + [jnp.sum(v) for v in per_key] + upper_bad).astype(jnp.int32)
    return (flags, excess, jnp.sum(jnp.ones_like(lhs, jnp.int32)), jnp.sum(omitted_pos), nonfinite,
            shortfall)


def keys_per_instance(H: int, n_keys: int) -> int:
    """Instance keys plus the 2 + 4H + N_SIGNS extremal keys."""
    return n_keys + 2 + 4 * H + N_SIGNS


def expected_keys(n_instances: int, shapes, n_keys: int) -> int:
    return sum(n_instances * len(cm.budgets(H)) * len(variants()) * keys_per_instance(H, n_keys)
               for H, _ in shapes)


def check(n_instances: int = 60, seed: int = 0, shapes=cm.SHAPES_ALL, n_keys: int = 128,
          families=cm.FAMILIES) -> dict:
    """Counts: instances; cases (instance × budget × variant); keys (per-key
    inequality checks, each for three allowances); violations per claim."""
    rng = np.random.default_rng(seed)
    viol = np.zeros(len(LABELS), np.int64)
    maxrel = np.full(3, -np.inf)
    keys = cases = with_p = n_total = nonfinite = 0
    worst_upper = -np.inf
    by_family = {}
    with cm.float64():
        for (H, D) in shapes:
            batch = cm.make_batch(rng, n_instances, H, D, n_keys, families)
            signs = rng.choice([-1.0, 1.0], (n_instances, N_SIGNS, H))
            rs = np.asarray(cm.budgets(H), np.int32)
            fn = cm.over_instances_variants_keys(_one, groups_for(D))
            flags, excess, nk, npos, nonf, short = jax.device_get(fn(
                jnp.asarray(batch["q"]), jnp.asarray(batch["w"]), jnp.asarray(batch["p"]),
                jnp.asarray(batch["keys"]), jnp.asarray(signs), jnp.asarray(rs),
                jnp.arange(len(variants()), dtype=jnp.int32)))
            viol += flags.reshape(-1, len(LABELS)).sum(0)
            cm.add_by_family(by_family, batch["family"], flags.sum(axis=(1, 2, 3)))
            nonfinite += int(nonf.sum())
            worst_upper = max(worst_upper, float(short.max()))
            maxrel = np.maximum(maxrel, excess.reshape(-1, 3).max(0))
            keys += int(nk.sum())
            cases += int(npos.size)
            with_p += int((npos > 0).sum())
            n_total += n_instances
    return cm.result(
        NAME, CLAIM, instances=n_total, shapes=[list(x) for x in shapes], cases=cases,
        cases_with_omitted_positive=with_p, keys=keys,
        violations=int(viol.sum()), violations_by_claim=dict(zip(LABELS, viol.tolist())),
        violations_by_family=by_family, nonfinite_upper_values=nonfinite,
        max_violation=float(max(maxrel.max(), worst_upper, 0.0)),
        max_rel_excess_by_allowance=dict(zip(("triangle", "joint", "grouped"), maxrel.tolist())),
        max_rel_shortfall_of_upper=worst_upper)


def main(argv=None) -> int:
    return cm.cli(check, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
