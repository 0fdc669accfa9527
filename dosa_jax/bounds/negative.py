"""Omitted negative heads: the negative aggregate (paper Eq. 8; DESIGN §6).

For any support A ⊆ N (omitted negative heads) and a_A = Σ_{h∈A} |w_h| q_h,

    relu(a_A·k) ≤ Σ_{h∈A} |w_h| relu(q_h·k) ≤ Σ_{h∈N} |w_h| relu(q_h·k),

so subtracting relu(a_A·k) keeps an upper bound. Aggregating every omitted
negative head lets inactive heads cancel active ones; the default support is
the majority rule A = {h ∈ N : p_h ≥ ½}, the minimiser of the separable proxy
J(A) = Σ_{A} a_h(1−p_h) + Σ_{N\\A} a_h p_h (App. B.2, Eq. 15–16).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dosa_jax import numerics as nm

SUPPORTS = ("majority", "all", "none")
FP8_MAX = 448.0


def negative_support(p, omitted_neg, rule: str = "majority"):
    """Support A ⊆ N: ``majority`` (p_h ≥ ½), ``all`` (A = N) or ``none`` (no aggregate)."""
    if rule == "majority":
        return omitted_neg & (p >= 0.5)
    if rule == "all":
        return omitted_neg
    if rule == "none":
        return jnp.zeros_like(omitted_neg)
    raise ValueError(f"negative_support must be one of {SUPPORTS}, got {rule!r}")


def negative_aggregate(q, w, support):
    """a_A = Σ_{h∈A} |w_h| q_h (Eq. 8), computed in float32.

    Returns:
      (a [D] float32, err float32): err ≥ ‖a_exact − a‖ (summation of |A| rounded
      products; App. C's direction-representation term).
    """
    H = q.shape[0]
    c = jnp.where(support, jnp.abs(w), 0.0)
    terms = c[:, None] * q
    # fixed order h = 0..H-1 (err below bounds any order of this H-term sum), unrolled: one
    # fused kernel, not H launches of a loop; the carry starts from the inputs (zeros_like:
    # the same varying axes under shard_map)
    a = lax.fori_loop(0, H, lambda h, acc: acc + terms[h], jnp.zeros_like(terms[0]),
                      unroll=True)
    mag = nm.inflate(jnp.sum(c * nm.norm_upper(q)), H)
    err = jnp.float32(nm.gamma(H + 1)) * mag * 1.01 + jnp.float32((H + 1) * q.shape[-1] ** 0.5 * nm.ETA32)
    return a, err


def split_aggregate_fp8(a):
    """Two FP8 rows and a residual: a = σ0 v̄0 + σ1 v̄1 + e_A (App. C, Eq. 22–23).

    v̄0 = fp8(a/σ0), v̄1 = fp8((a − σ0 v̄0)/σ1) with power-of-two scales σ mapping
    the largest magnitude to ≤ 448, so σ·v̄ is exact in float32. Screening adds the
    two FP8 dot products *before* the ReLU; ‖e_A‖ (bounded upward) joins C.

    Returns:
      (rows [2, D] float32 values σ_a v̄_a, payloads [2, D] float8_e4m3fn,
       scales [2] float32, resid_norm_upper float32).
    """
    def one(x):
        amax = jnp.max(jnp.abs(x))
        sc = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, 1.0) / FP8_MAX)))
        sc = jnp.where(amax > 0, sc, 1.0).astype(jnp.float32)
        v = (x / sc).astype(jnp.float8_e4m3fn)
        # the payload's value through a barrier: XLA may drop a bare f32 -> fp8 -> f32 round trip
        return v, sc, lax.optimization_barrier(v).astype(jnp.float32) * sc

    v0, s0, r0 = one(a)
    rem = a - r0  # exact: r0 is a's leading bits (Sterbenz-like; verified by the bound below anyway)
    v1, s1, r1 = one(rem)
    e = rem - r1
    e_up = nm.norm_upper(e) + jnp.float32(nm.gamma(2)) * (nm.norm_upper(a) + nm.norm_upper(r0)) * 1.01
    rows = jnp.stack([r0, r1])
    return rows, jnp.stack([v0, v1]), jnp.stack([s0, s1]), e_up
