"""Eq. 17: with τ ≤ τ*, b = τ* − τ, δ_i = U_i − s_i and Δ_i = τ* − s_i,

    U_i < τ   ⇔   Δ_i > δ_i + b,

so a rejected key has s_i < τ* (it cannot be in the Top-K).

For every instance, budget, variant (as in :mod:`proofs_numeric.certificate`),
K ∈ {1, n/8, n/2, n} and two thresholds — τ from a random seed subset S of
≥ K keys (Eq. 2) and τ = τ* (b = 0) — in float64, on every key:

* ``b ≥ 0`` (the seed threshold is a lower bound on τ*, Eq. 2);
* ``diagnostics.margin_terms``' two sides agree (``rejected == margin_rule``);
* a rejected key has ``s < τ*``.

U is the certificate with the best residual allowance. The two sides are
the same relation only in exact arithmetic: where U is within float64
rounding of τ (|U − τ| ≤ 2^-40·M) a disagreement is rounding and is counted
separately (``rounding_band``), elsewhere it is a violation. On keys where
U, s, τ and τ* are all integers (the ``integer`` family with P = ∅, exact
arithmetic) there is no band: every disagreement is a violation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax import diagnostics
from dosa_jax.bounds import certificate as cert
from dosa_jax.bounds import positive
from proofs_numeric import _common as cm
from proofs_numeric.certificate import groups_for, variant_plan, variants

NAME = "margin_equivalence"
CLAIM = "Eq. 17: U < tau <=> Delta > delta + b for tau <= tau*; rejected keys have s < tau*"
TOL = 2.0 ** -40
LABELS = ("b>=0", "equivalence", "rejected=>s<tau*")


def k_values(n: int) -> tuple:
    return tuple(sorted({1, max(1, n // 8), max(1, n // 2), n}))


def _one(q, w, p, keys, seed_masks, r, vid, *, groups):
    """seed_masks [len(K values), n] bool: the seed subsets S (|S| ≥ K)."""
    vp = variant_plan(q, w, p, keys, r, vid)
    x, kn, omitted_pos, resid = vp.x, vp.kn, vp.omitted_pos, vp.resid
    n = keys.shape[0]  # static
    u = jnp.where(omitted_pos[:, None], w[:, None] * resid, 0.0)
    E = jnp.minimum(jnp.minimum(positive.triangle_allowance(w, resid, omitted_pos),
                                positive.joint_allowance(u)), positive.grouped_allowance(u, groups))
    U = cert.certificate(x, kn, vp.w_fold, E, jnp.where(vp.support, jnp.abs(w), 0.0))
    s = cert.original_score(x, w)
    mag = 4.0 * kn * jnp.sum(jnp.abs(w) * vp.qn)
    desc = -jnp.sort(-s)
    out = []
    for i, K in enumerate(k_values(n)):
        tau_star = desc[K - 1]
        seeded = jnp.where(seed_masks[i], s, -jnp.inf)
        tau_seed = -jnp.sort(-seeded)[K - 1]  # K-th score of the seed subset (Eq. 2)
        for tau in (tau_seed, tau_star):
            m = diagnostics.margin_terms(s, U, tau, tau_star)
            band = jnp.abs(U - tau) <= TOL * (mag + jnp.abs(U) + jnp.abs(tau) + jnp.abs(tau_star))
            vals = (U, s, tau, tau_star)  # integers below 2^50: float64 arithmetic is exact
            exact = ~omitted_pos.any() & functools.reduce(
                jnp.logical_and, [(v == jnp.round(v)) & (jnp.abs(v) < 2.0 ** 50) for v in vals])
            band = band & ~exact
            disagree = m.rejected != m.margin_rule
            unsafe = m.rejected & ~(s < tau_star)
            bad = jnp.stack([~(m.deficit >= 0), jnp.sum(disagree & ~band), jnp.sum(unsafe & ~band)])
            out.append((bad, jnp.sum((disagree | unsafe) & band), jnp.sum(m.rejected),
                        jnp.sum(exact), jnp.sum(jnp.ones_like(disagree, jnp.int32))))
    bad = jnp.stack([o[0] for o in out])
    return (jnp.sum(bad, axis=0), sum(o[1] for o in out), sum(o[2] for o in out),
            sum(o[3] for o in out), sum(o[4] for o in out))


def seed_masks(rng, n_instances: int, n: int) -> np.ndarray:
    """[instances, len(K values), n] random seed subsets with K ≤ |S| ≤ n."""
    ks = k_values(n)
    out = np.zeros((n_instances, len(ks), n), bool)
    for i in range(n_instances):
        for j, K in enumerate(ks):
            size = rng.integers(K, n + 1)
            out[i, j, rng.permutation(n)[:size]] = True
    return out


def expected_keys(n_instances: int, shapes, n_keys: int) -> int:
    per = 2 * len(k_values(n_keys)) * n_keys
    return sum(n_instances * len(cm.budgets(H)) * len(variants()) * per for H, _ in shapes)


def check(n_instances: int = 60, seed: int = 0, shapes=cm.SHAPES_ALL, n_keys: int = 128,
          families=cm.FAMILIES) -> dict:
    """Counts: instances; keys = (instance, budget, variant, K, τ, key) tuples checked;
    rejected keys; keys decided in exact (integer) arithmetic; disagreements inside
    the rounding band; violations per claim."""
    rng = np.random.default_rng(seed)
    viol = np.zeros(len(LABELS), np.int64)
    keys = n_total = in_band = rejected = exact = 0
    by_family = {}
    with cm.float64():
        for (H, D) in shapes:
            batch = cm.make_batch(rng, n_instances, H, D, n_keys, families)
            masks = seed_masks(rng, n_instances, n_keys)
            rs = np.asarray(cm.budgets(H), np.int32)
            bad, band, rej, ex, nk = jax.device_get(cm.over_instances_variants_keys(_one, groups_for(D))(
                jnp.asarray(batch["q"]), jnp.asarray(batch["w"]), jnp.asarray(batch["p"]),
                jnp.asarray(batch["keys"]), jnp.asarray(masks), jnp.asarray(rs),
                jnp.arange(len(variants()), dtype=jnp.int32)))
            viol += bad.reshape(-1, len(LABELS)).sum(0)
            in_band += int(band.sum())
            rejected += int(rej.sum())
            exact += int(ex.sum())
            keys += int(nk.sum())
            cm.add_by_family(by_family, batch["family"], bad.sum(axis=(1, 2, 3)))
            n_total += n_instances
    return cm.result(NAME, CLAIM, instances=n_total, shapes=[list(x) for x in shapes],
                     keys=keys, rejected_keys=rejected, keys_in_exact_arithmetic=exact,
                     disagreements_in_rounding_band=in_band, violations=int(viol.sum()),
                     violations_by_claim=dict(zip(LABELS, viol.tolist())),
                     violations_by_family=by_family)


def main(argv=None) -> int:
    return cm.cli(check, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
