"""The planner's sample: a strided sample of each query's visible range.

The seeds are a biased sample (local and sink keys score high and share
activation patterns), so the activation frequencies p_h (head choice, the
majority support of Eq. 8) and the automatic budget's survival estimate
(Eq. 21) are taken on strided keys of the whole range, scored in full. Each
backend computes the head dots its own way; the ids, the frequencies and the
conversion to score units are defined here once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dosa_jax import enclosure as enc
from dosa_jax import seeds as seeds_mod
from dosa_jax.bounds.heads import activation_frequencies


class PlanSample(NamedTuple):
    """The planner's inputs from the sample ([T, P] keys per query)."""

    activation: jax.Array  # [T, H] p_h on the payload dots
    dots: jax.Array        # [T, P, H] head dots in score units (× α_i)
    norms: jax.Array       # [T, P] n_i in score units (× α_i)
    valid: jax.Array       # [T, P] visible sample keys with a valid scale


def strided_sample_ids(lo, hi, size: int, padded: int):
    """``size`` strided key ids of each range [lo, hi) in ``padded`` slots: (ids [T, padded]
    int32, −1 in empty slots; valid [T, padded])."""
    layout = seeds_mod.seed_layout(lo, hi, "strided", size, 0, 0.0)
    return seeds_mod.seed_ids(layout, padded)


def plan_sample(head_dots, ids, valid, key_norm, k_scale=None) -> PlanSample:
    """:class:`PlanSample` from the payload head dots [T, P, H] of sample keys ``ids``.

    The head dots are on payloads k̄_i: the certificate in score units is α_i·U(k̄_i), so
    dots and norms are multiplied by α_i, and keys with an invalid α_i leave the sample.
    """
    n = key_norm.shape[0]
    cid = jnp.clip(ids, 0, n - 1)
    p = jax.vmap(activation_frequencies)(head_dots, valid)
    norms = jnp.take(key_norm, cid)
    dots, s_valid = head_dots, valid
    if k_scale is not None:
        alpha = jnp.take(k_scale, cid)
        dots = dots * alpha[..., None]
        norms = norms * alpha
        s_valid = valid & enc.scale_is_valid(alpha)
    return PlanSample(p, dots, norms, s_valid)


def sample_tau_gap(dots, valid, w, tau, visible, k: int):
    """Per query, the share of its keys that score ≥ τ beyond its k, as the sample estimates it:
    max(0, #{sample keys with s ≥ τ} / #sample − min(k, |Ω|) / |Ω|), where a sample key's
    score s = Σ_h w_h ReLU(q_h·k_i) (Eq. 1) is formed from its head ``dots`` [T, P, H] in score
    units (the τ-independent part of the planner's sample), ``valid`` [T, P], the head weights
    ``w`` [T, H], the threshold ``tau`` [T] and the range sizes ``visible`` [T].

    A key scoring ≥ τ survives every upper bound; at τ = τ* only the k winners do. The
    estimate steers a cost decision (block witnesses), never a bound. 0 where a query sees
    no key or its sample is empty.
    """
    s = jnp.sum(w.astype(jnp.float32)[:, None, :] * jnp.maximum(dots, 0.0), axis=-1)   # [T, P]
    n = jnp.sum(valid, axis=1)
    above = jnp.sum(valid & (s >= tau[:, None]), axis=1) / jnp.maximum(n, 1)
    vis = visible.astype(jnp.float32)
    floor = jnp.minimum(vis, k) / jnp.maximum(vis, 1.0)
    return jnp.where((n > 0) & (vis > 0), jnp.maximum(above - floor, 0.0), 0.0)
