"""The key-side summary both backends compute once per call: norm bounds and scale faults.

n_i ≥ ‖k̄_i‖₂ multiplies the residual and error coefficients of the certificate
(Eq. 26); a key scale α_i that is not finite and positive voids the enclosure
(App. C guards), so a query whose visible range holds one does not prune.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dosa_jax import enclosure as enc


class KeySummary(NamedTuple):
    """Per-key summaries of the keys ``k`` [N, D] (and scales ``k_scale`` [N])."""

    norm: jax.Array               # [N] n_i ≥ ‖k̄_i‖₂ (payload rows)
    bad_prefix: Optional[jax.Array]  # [N + 1] int32 prefix count of invalid scales; None: no scales


def invalid_scale_prefix(k_scale):
    """[N + 1] int32 prefix counts of invalid scales (not finite or ≤ 0), or None."""
    if k_scale is None:
        return None
    bad = (~enc.scale_is_valid(k_scale)).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad, dtype=jnp.int32)])


def key_summary(k, k_scale) -> KeySummary:
    """:class:`KeySummary` of the keys."""
    return KeySummary(enc.key_norm_upper(k), invalid_scale_prefix(k_scale))


def scale_fault(bad_prefix, lo, hi):
    """[T] bool: the visible range [lo, hi) holds an invalid key scale (False without scales)."""
    if bad_prefix is None:
        return jnp.zeros(lo.shape, bool)
    return (bad_prefix[hi] - bad_prefix[lo]) > 0
