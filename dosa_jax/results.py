"""What ``topk`` and ``dense_topk`` return: :class:`TopKResult` and its :class:`Stats`."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Stats(NamedTuple):
    """Per-query statistics ([T] arrays) returned in ``TopKResult.stats``.

    visible: |Ω|. seeds: seed keys scored. screened: non-seed visible keys
    (each screened once unless recovered). survivors: keys that passed
    screening and were fully scored. records: survivors with s ≥ τ. rounds:
    scan rounds (1 without overflow). overflows: rounds that ended with a full
    candidate buffer (resolved by exact merging). recoveries: full-domain
    recoveries after a fault. pruning: whether rejection was enabled at the
    end. budget: retained heads r. tau_seed: seed threshold τ (−inf when not
    pruning). tau_final: K-th selected score (τ* when ≥ K eligible keys).
    dense: the query was answered by the dense scan from θ₀ = τ because the plan
    predicted that screening could not pay (its group's sampled survival, or the
    whole call's predicted cost; ``Config.dense_switch``); exact either way.
    predicted_cost: the call's predicted ratio of DoSA's time to the dense scan's
    (the same on every query; NaN where no prediction was made).
    """

    visible: jax.Array
    seeds: jax.Array
    screened: jax.Array
    survivors: jax.Array
    records: jax.Array
    rounds: jax.Array
    overflows: jax.Array
    recoveries: jax.Array
    pruning: jax.Array
    budget: jax.Array
    tau_seed: jax.Array
    tau_final: jax.Array
    dense: jax.Array
    predicted_cost: jax.Array


class TopKResult(NamedTuple):
    """indices int32 [T, K] (score desc, index asc; −1 pads), scores float32 [T, K]
    (the original scorer's values; −inf pads), stats (per-query, see :class:`Stats`;
    ``dense_topk`` gives ``{"visible": [T]}``)."""

    indices: jax.Array
    scores: jax.Array
    stats: object
