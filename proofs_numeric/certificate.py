"""Eq. 9 and Eq. 24–25: the certificate is an upper bound, U ≥ s, on every key.

For every instance, every retained budget r and every ablation variant
(negative ranking uncertainty/strength × positive projection on/off ×
negative support majority/all/none), in float64:

* ``U ≥ s`` for the certificate (Eq. 9) built from the library's pieces
  (``retained_heads``, ``omitted_heads``, ``anchor_projection``,
  ``negative_support``, ``triangle/joint/grouped_allowance``, ``certificate``)
  with each residual allowance: triangle E_P (Eq. 6), joint (Eq. 7), grouped
  (App. A.1) and their minimum (``best``);
* when P = ∅: ``U_abs ≥ s`` and ``U_abs == U + relu(−a_A·k)`` (Eq. 24–25,
  ``absolute_value_certificate``);
* ``positive.folded_weights`` (float32 by design) agrees with the float64 fold
  within float32 rounding (the certificate itself uses the float64 fold, Eq. 6).

A violation is ``s − U > 2^-40·M`` with M = 4‖k‖Σ_h|w_h|‖q_h‖ (float64 rounding is
≈ 2^-46·M at D = 128; a float32 rounding anywhere shows up as ≈ 2^-24·M).
The planner's float32 plans are checked by :mod:`proofs_numeric.enclosure`.
"""

from __future__ import annotations

from typing import NamedTuple

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax.bounds import certificate as cert
from dosa_jax.bounds import heads, negative, positive
from proofs_numeric import _common as cm

NAME = "certificate"
CLAIM = "U >= s on every key (Eq. 9, every variant); U_abs >= s and U_abs == U + relu(-a.k) (Eq. 24-25)"
TOL = 2.0 ** -40
RANKINGS = ("uncertainty", "strength")
PROJECTIONS = (True, False)
SUPPORTS = ("majority", "all", "none")
LABELS = ("triangle", "joint", "grouped", "best", "abs_bound", "abs_identity")


def groups_for(D: int) -> int:
    """Coordinate groups for the grouped allowance (the planner's rule: D % g == 0)."""
    for g in (4, 2):
        if D % g == 0 and D >= g:
            return g
    return 1


def variants():
    """(negative ranking, positive projection, negative support) ablation variants."""
    return tuple(itertools.product(RANKINGS, PROJECTIONS, SUPPORTS))


def _select(i, options):
    """options[i] for a traced index i (every option is computed; one is kept)."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs)[i], *options)


class VariantPlan(NamedTuple):
    """One (instance, budget, variant)'s plan in float64, as the library builds it."""

    x: jax.Array            # [n, H] head dots q_h·k
    kn: jax.Array           # [n] ‖k‖
    qn: jax.Array           # [H] ‖q_h‖
    retained: jax.Array
    omitted_pos: jax.Array
    omitted_neg: jax.Array
    anchor: jax.Array
    beta: jax.Array
    resid: jax.Array
    support: jax.Array
    w_fold: jax.Array
    fold_abs: jax.Array


def variant_plan(q, w, p, keys, r, vid) -> VariantPlan:
    """The plan of variant ``vid`` (traced) among :func:`variants`: every library call is
    made for each option (ranking, projection, support) and the one for ``vid`` kept, so
    one compiled program serves all variants."""
    n_sup, n_proj = len(SUPPORTS), len(PROJECTIONS)
    i_rank, i_proj, i_sup = vid // (n_sup * n_proj), (vid // n_sup) % n_proj, vid % n_sup
    x = jnp.einsum("nd,hd->nh", keys, q, precision=jax.lax.Precision.HIGHEST)
    kn = jnp.sqrt(jnp.sum(keys * keys, axis=-1))
    qn = jnp.sqrt(jnp.sum(q * q, axis=-1))
    retained = _select(i_rank, [heads.retained_heads(w, qn, p, r, rk) for rk in RANKINGS])
    omitted_pos, omitted_neg = heads.omitted_heads(w, retained)
    anchor, beta, resid = _select(i_proj, [positive.anchor_projection(q, retained, omitted_pos, pj)
                                           for pj in PROJECTIONS])
    support = _select(i_sup, [negative.negative_support(p, omitted_neg, sp) for sp in SUPPORTS])
    w_fold, fold_abs = fold_float64(w, retained, omitted_pos, anchor, beta)
    return VariantPlan(x, kn, qn, retained, omitted_pos, omitted_neg, anchor, beta, resid,
                       support, w_fold, fold_abs)


def _one(q, w, p, keys, r, vid, *, groups):
    """Violation counts of one (instance, budget, variant) over all keys (:func:`variant_plan`)."""
    H, D = q.shape
    vp = variant_plan(q, w, p, keys, r, vid)
    x, kn, retained, omitted_pos = vp.x, vp.kn, vp.retained, vp.omitted_pos
    anchor, beta, resid, w_fold, fold_abs = vp.anchor, vp.beta, vp.resid, vp.w_fold, vp.fold_abs
    s = cert.original_score(x, w)
    mag = 4.0 * kn * jnp.sum(jnp.abs(w) * vp.qn)
    tol = TOL * mag

    u = jnp.where(omitted_pos[:, None], w[:, None] * resid, 0.0)
    e_tri = positive.triangle_allowance(w, resid, omitted_pos)
    e_joint = positive.joint_allowance(u)
    e_grp = positive.grouped_allowance(u, groups)
    support = vp.support
    sw = jnp.where(support, jnp.abs(w), 0.0)

    excess = []  # (s - U) per claim, [claims, n]
    viol = []
    for E in (e_tri, e_joint, e_grp, jnp.minimum(jnp.minimum(e_tri, e_joint), e_grp)):
        U = cert.certificate(x, kn, w_fold, E, sw)
        excess.append(s - U)
        viol.append(~(s - U <= tol))  # NaN counts as a violation

    # absolute-value form, valid when every positive head is retained
    p_empty = ~jnp.any(omitted_pos)
    u_abs = cert.absolute_value_certificate(x, w, retained, sw)
    u_tri = cert.certificate(x, kn, w_fold, e_tri, sw)
    a_dot_k = jnp.sum(sw * x, axis=-1)
    identity_gap = jnp.abs(u_abs - (u_tri + jnp.maximum(-a_dot_k, 0.0)))
    excess.append(jnp.where(p_empty, s - u_abs, -jnp.inf))
    viol.append(p_empty & ~(s - u_abs <= tol))
    excess.append(jnp.where(p_empty, identity_gap, -jnp.inf))
    viol.append(p_empty & ~(identity_gap <= tol))

    viol = jnp.stack(viol)
    rel = jnp.stack(excess) / jnp.where(mag > 0, mag, 1.0)
    checked = jnp.stack([jnp.ones_like(s, bool)] * 4 + [jnp.broadcast_to(p_empty, s.shape)] * 2)
    # the library's folded_weights (float32 by design) against the float64 fold
    f32 = jnp.float32
    lib_fold, _ = positive.folded_weights(w.astype(f32), retained, omitted_pos, anchor,
                                          beta.astype(f32))
    fold_err = jnp.abs(lib_fold.astype(w.dtype) - w_fold)
    fold_bad = jnp.sum(~(fold_err <= (H + 2) * 2.0 ** -23 * fold_abs + 2.0 ** -140))
    return (jnp.sum(viol, axis=-1), jnp.max(rel, axis=-1), jnp.sum(checked, axis=-1),
            p_empty, jnp.sum(omitted_pos), jnp.sum(support), fold_bad)


def fold_float64(w, retained, omitted_pos, anchor, beta):
    """w̃_j = w_j + Σ_{h∈P, j*_h=j} w_h β_h in the input precision (Eq. 6), and
    Σ|terms| per anchor. ``positive.folded_weights`` accumulates in float32 by design
    (the planner covers that rounding in C), which is not a real-number fold."""
    contrib = jnp.where(omitted_pos & (anchor >= 0), w * beta, 0.0)
    tgt = jnp.where(anchor >= 0, anchor, 0)
    add = jnp.zeros_like(w).at[tgt].add(contrib)
    add_abs = jnp.zeros_like(w).at[tgt].add(jnp.abs(contrib))
    return jnp.where(retained, w + add, 0.0), jnp.where(retained, jnp.abs(w) + add_abs, 0.0)


@functools.lru_cache(maxsize=None)
def _compiled(H: int, D: int, n_keys: int, groups: int):
    one = functools.partial(_one, groups=groups)
    over_v = jax.vmap(one, in_axes=(None, None, None, None, None, 0))
    over_r = jax.vmap(over_v, in_axes=(None, None, None, None, 0, None))
    return jax.jit(jax.vmap(over_r, in_axes=(0, 0, 0, 0, None, None)))


def expected_keys(n_instances: int, shapes, n_keys: int) -> int:
    """(instance, budget, variant, key) tuples a run must check: the test's yardstick."""
    return sum(n_instances * len(cm.budgets(H)) * len(variants()) * n_keys for H, _ in shapes)


def check(n_instances: int = 60, seed: int = 0, shapes=cm.SHAPES_ALL, n_keys: int = 128,
          families=cm.FAMILIES) -> dict:
    """The certificate check on ``n_instances`` instances per (H, D) shape.

    Returns counts: ``instances``; ``keys`` = (instance, budget, variant, key)
    tuples checked (each for the four Eq. 9 allowances; the two Eq. 24–25 claims
    wherever P = ∅); ``violations`` (total and per claim); ``max_violation``
    (largest (s − U)/M, 0 when none is positive).
    """
    rng = np.random.default_rng(seed)
    viol = np.zeros(len(LABELS), np.int64)
    maxrel = np.full(len(LABELS), -np.inf)
    per_claim = np.zeros(len(LABELS), np.int64)
    fold_bad = p_empty = with_p = with_support = cases = 0
    by_family = {}
    n_total = 0
    with cm.float64():
        for (H, D) in shapes:
            batch = cm.make_batch(rng, n_instances, H, D, n_keys, families)
            rs = np.asarray(cm.budgets(H), np.int32)
            fn = _compiled(H, D, n_keys, groups_for(D))
            v, m, c, pe, npos, nsup, fb = jax.device_get(fn(
                jnp.asarray(batch["q"]), jnp.asarray(batch["w"]), jnp.asarray(batch["p"]),
                jnp.asarray(batch["keys"]), jnp.asarray(rs),
                jnp.arange(len(variants()), dtype=jnp.int32)))  # [instances, budgets, variants, ...]
            viol += v.sum(axis=(0, 1, 2))
            cm.add_by_family(by_family, batch["family"], v.sum(axis=(1, 2, 3)) + fb.sum(axis=(1, 2)))
            maxrel = np.maximum(maxrel, m.max(axis=(0, 1, 2)))
            per_claim += c.sum(axis=(0, 1, 2))
            p_empty += int(pe.sum())
            with_p += int((npos > 0).sum())
            with_support += int((nsup > 0).sum())
            fold_bad += int(fb.sum())
            cases += int(pe.size)
            n_total += n_instances
    return cm.result(
        NAME, CLAIM, instances=n_total, shapes=[list(x) for x in shapes],
        keys_per_instance=n_keys, variants=len(variants()), cases=cases,
        keys=int(per_claim[0]), checks_by_claim=dict(zip(LABELS, per_claim.tolist())),
        violations=int(viol.sum() + fold_bad),
        violations_by_claim=dict(zip(LABELS + ("fold_agreement",), viol.tolist() + [fold_bad])),
        violations_by_family=by_family,
        max_violation=float(max(maxrel.max(), 0.0)),
        max_rel_excess_by_claim=dict(zip(LABELS, [float(x) for x in maxrel])),
        cases_with_P_empty=p_empty, cases_with_omitted_positive=with_p,
        cases_with_negative_support=with_support)


def main(argv=None) -> int:
    return cm.cli(check, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
