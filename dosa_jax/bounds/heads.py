"""Activation frequencies and retained heads (paper Sec. 2.2; DESIGN §4)."""

from __future__ import annotations

import jax.numpy as jnp

RANKINGS = ("uncertainty", "strength")


def activation_frequencies(head_dots, valid):
    """p_h: fraction of sampled keys with q_h · k > 0.

    Args:
      head_dots: [S, H] dot products of the sample keys with each head.
      valid: [S] bool, which sample rows are real keys.
    Returns:
      [H] float32 in [0, 1] (0.5 when the sample is empty: maximal uncertainty).
    """
    pos = jnp.sum(jnp.where(valid[:, None], head_dots > 0, False), axis=0)
    n = jnp.sum(valid)
    return jnp.where(n > 0, pos / jnp.maximum(n, 1), 0.5).astype(jnp.float32)


def negative_priority(w, q_norm, p, ranking: str = "uncertainty"):
    """Priority of a negative head for direct computation.

    ``uncertainty`` (default): |w_h|·‖q_h‖·min(p_h, 1−p_h) — the proxy slack the
    head would otherwise leave (App. B.2, Eq. 15–16). ``strength``: |w_h|·‖q_h‖
    (the Fig. 9 ablation "strength-only ranking").
    """
    strength = jnp.abs(w) * q_norm
    if ranking == "uncertainty":
        return strength * jnp.minimum(p, 1.0 - p)
    if ranking == "strength":
        return strength
    raise ValueError(f"negative_ranking must be one of {RANKINGS}, got {ranking!r}")


def retained_heads(w, q_norm, p, r, ranking: str = "uncertainty"):
    """Retained set R of (at most) r heads (DESIGN §4).

    If |H+| ≤ r keep every positive head and fill the rest with negative heads in
    descending :func:`negative_priority`; else keep the r positive heads with the
    largest w_h‖q_h‖. Zero-weight heads are never retained (they drop out).
    Ties break toward the lower head index.

    Args:
      w: [H] weights; q_norm: [H] head norms; p: [H] activation frequencies;
      r: retained budget (int or traced int32 scalar, 0 ≤ r ≤ H).
    Returns:
      [H] bool mask.
    """
    H = w.shape[0]
    pos = w > 0
    neg = w < 0
    n_pos = jnp.sum(pos)
    group = jnp.where(pos, 2, jnp.where(neg, 1, 0))
    prio = jnp.where(pos, w * q_norm, negative_priority(w, q_norm, p, ranking))
    prio = jnp.where(jnp.isnan(prio), -jnp.inf, prio)
    # lexicographic: group desc, priority desc, index asc
    order = jnp.lexsort((jnp.arange(H), -prio, -group))
    rank = jnp.zeros((H,), jnp.int32).at[order].set(jnp.arange(H, dtype=jnp.int32))
    take = (rank < r) & (group > 0)
    # when |H+| > r only positive heads are kept: rank < r already covers them
    return jnp.where(n_pos > r, take & pos, take)


def omitted_heads(w, retained):
    """(P, N): omitted positive and omitted negative heads (zero weights drop out)."""
    return (w > 0) & ~retained, (w < 0) & ~retained
