"""Prop. 6 / Eq. 14: with the triangle allowance, the certificate's slack splits exactly as

    U − s = δ_P + Σ_{h∈N\\A} c_h relu(x_h) + min(Z_A⁺, Z_A⁻),   every term ≥ 0.

For every instance, budget and variant (negative ranking × positive projection
× negative support), in float64, on every key: ``diagnostics.slack_decomposition``
(with the library's anchors, β and ‖d_h‖) against ``certificate − original_score``
(U with E = Σ_P w_h‖d_h‖ and the Eq. 6 fold). Equality must hold to float64
rounding (|total − (U − s)| ≤ 2^-40·M, M = 4‖k‖Σ|w_h|‖q_h‖); the uncovered-negative
and cancellation terms must be ≥ 0 exactly and δ_P ≥ −2^-40·M.
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
from proofs_numeric.certificate import variant_plan, variants

NAME = "slack_decomposition"
CLAIM = "Eq. 14: U - s == delta_P + sum_{N\\A} c relu(x) + min(Z+, Z-) exactly; all terms >= 0"
TOL = 2.0 ** -40
LABELS = ("equality", "delta_P>=0", "uncovered>=0", "cancellation>=0")


def _one(q, w, p, keys, r, vid):
    vp = variant_plan(q, w, p, keys, r, vid)
    x, kn, omitted_pos, resid = vp.x, vp.kn, vp.omitted_pos, vp.resid
    tol = TOL * 4.0 * kn * jnp.sum(jnp.abs(w) * vp.qn)
    rn = jnp.sqrt(jnp.sum(resid * resid, axis=-1))
    e_tri = positive.triangle_allowance(w, resid, omitted_pos)
    U = cert.certificate(x, kn, vp.w_fold, e_tri, jnp.where(vp.support, jnp.abs(w), 0.0))
    s = cert.original_score(x, w)
    t = diagnostics.slack_decomposition(x, kn, w, omitted_pos, vp.omitted_neg, vp.support, vp.anchor,
                                         vp.beta, rn)
    gap = jnp.abs(t.total - (U - s))
    bad = jnp.stack([~(gap <= tol), ~(t.positive >= -tol), ~(t.uncovered_negative >= 0),
                     ~(t.cancellation >= 0)])
    scale = jnp.where(tol > 0, tol / TOL, 1.0)
    nonzero = jnp.stack([jnp.sum(t.positive > tol), jnp.sum(t.uncovered_negative > 0),
                         jnp.sum(t.cancellation > 0)])
    return jnp.sum(bad, axis=-1), jnp.max(gap / scale), jnp.sum(jnp.ones_like(s, jnp.int32)), nonzero


@functools.lru_cache(maxsize=None)
def _compiled(H: int, D: int, n_keys: int):
    f = jax.vmap(_one, in_axes=(None,) * 5 + (0,))
    f = jax.vmap(f, in_axes=(None,) * 4 + (0, None))
    return jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None, None)))


def expected_keys(n_instances: int, shapes, n_keys: int) -> int:
    return sum(n_instances * len(cm.budgets(H)) * len(variants()) * n_keys for H, _ in shapes)


def check(n_instances: int = 60, seed: int = 0, shapes=cm.SHAPES_ALL, n_keys: int = 128,
          families=cm.FAMILIES) -> dict:
    """Counts: instances; keys = (instance, budget, variant, key) tuples; violations per
    claim; how often each slack term is non-zero (so the check exercises all three)."""
    rng = np.random.default_rng(seed)
    viol = np.zeros(len(LABELS), np.int64)
    nonzero = np.zeros(3, np.int64)
    worst = 0.0
    keys = n_total = 0
    by_family = {}
    with cm.float64():
        for (H, D) in shapes:
            batch = cm.make_batch(rng, n_instances, H, D, n_keys, families)
            rs = np.asarray(cm.budgets(H), np.int32)
            bad, gap, nk, nz = jax.device_get(_compiled(H, D, n_keys)(
                jnp.asarray(batch["q"]), jnp.asarray(batch["w"]), jnp.asarray(batch["p"]),
                jnp.asarray(batch["keys"]), jnp.asarray(rs),
                jnp.arange(len(variants()), dtype=jnp.int32)))
            viol += bad.reshape(-1, len(LABELS)).sum(0)
            nonzero += nz.reshape(-1, 3).sum(0)
            worst = max(worst, float(gap.max()))
            keys += int(nk.sum())
            cm.add_by_family(by_family, batch["family"], bad.sum(axis=(1, 2, 3)))
            n_total += n_instances
    return cm.result(NAME, CLAIM, instances=n_total, shapes=[list(x) for x in shapes],
                     keys=keys, violations=int(viol.sum()),
                     violations_by_claim=dict(zip(LABELS, viol.tolist())),
                     violations_by_family=by_family, max_violation=worst,
                     keys_with_nonzero_term=dict(zip(("delta_P", "uncovered", "cancellation"),
                                                     nonzero.tolist())))


def main(argv=None) -> int:
    return cm.cli(check, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
