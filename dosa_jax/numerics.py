"""Floating-point error model used by the numerical enclosure (paper App. C).

Model for float32 round-to-nearest *with flush-to-zero*: XLA on CPU and GPU
flushes results below the smallest normal 2^-126 to zero (and reads subnormal
inputs as zero), so ``fl(a op b) = (a op b)(1 + δ) + η`` with ``|δ| ≤ u = 2^-24``
and ``|η| ≤ 2^-126`` for *every* operation. Every absolute allowance here is
therefore a normal number (``TINY`` = 2^-125): a subnormal margin would itself
be flushed away (the proofs caught exactly that).
A sum or dot product of n terms evaluated in *any* order obeys
``|fl(Σ x_j) − Σ x_j| ≤ γ_{n} Σ |x_j|`` with ``γ_n = n u / (1 − n u)``.

All helpers return *upper* bounds: they widen results computed with
round-to-nearest so that the true real value is below them (Eq. 26–28's
``Eval_up``), using an explicit error bound plus one ``nextafter`` toward +∞.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

#: Unit roundoff of float32 round-to-nearest.
U32 = 2.0 ** -24
#: Bound on the absolute error of one float32 operation whose result underflows
#: (flush-to-zero: anything below 2^-126 may become 0).
ETA32 = 2.0 ** -126
#: The absolute allowance added by the upward helpers: normal, so never flushed.
TINY = 2.0 ** -125


def gamma(n: int, u: float = U32) -> float:
    """γ_n = n u / (1 − n u): relative error bound of an n-term sum/dot (Higham Thm 3.1)."""
    if n * u >= 0.5:
        raise ValueError(f"gamma: n*u = {n * u} too large for a meaningful bound")
    return n * u / (1.0 - n * u)


def rounded_to(x, dtype):
    """The float32 value of ``x`` rounded to ``dtype`` (bf16, fp8, …), *kept* under jit.

    ``x.astype(dtype).astype(float32)`` alone is not safe: with XLA's default
    ``xla_allow_excess_precision`` the GPU compiler may drop the round trip (its
    float-conversion simplification), so under ``jax.jit`` the "rounded" value is ``x`` itself
    and every error term computed from it is zero while the kernels multiply the rounded
    operands (a screening bound would then lose its aggregate-split remainder under jit and
    fall below computed scores). The optimization barrier hides the pair from that
    simplification; the value is the correctly rounded cast.
    """
    return lax.optimization_barrier(jnp.asarray(x).astype(dtype)).astype(jnp.float32)


def round_up(x):
    """One ulp toward +inf (``nextafter``): turns a round-to-nearest result into an upper bound
    when the exact value was within half an ulp below it."""
    return jnp.nextafter(x, jnp.asarray(jnp.inf, x.dtype))


def inflate(x, n_ops: int):
    """Upper bound on the exact value of a *non-negative* quantity computed with n_ops
    round-to-nearest float32 operations on non-negative terms (relative error ≤ γ_n).

    Returns ``x·(1 + γ_{n+2}) + (n+2)·2^-125`` rounded up; the extra two γ steps cover
    the multiplication's own rounding, the constant the flushed (underflowed) results.
    """
    g = jnp.float32(gamma(n_ops + 2))
    return round_up(x * (1.0 + g) + jnp.float32((n_ops + 2) * TINY))


def upper_sum(*terms):
    """Upper bound on the exact sum of float32 terms of any sign.

    s = Σ terms (round-to-nearest, left to right); the error is at most
    γ_{n-1} Σ|terms| (Higham), itself computed and inflated; result rounded up.
    """
    n = len(terms)
    s = terms[0]
    a = jnp.abs(terms[0])
    for t in terms[1:]:
        s = s + t
        a = a + jnp.abs(t)
    g = jnp.float32(gamma(2 * n + 2))
    return round_up(s + a * g + jnp.float32((2 * n + 2) * TINY))


def upper_product(a, b):
    """Upper bound on the exact product a·b (any signs) from one round-to-nearest multiply."""
    p = a * b
    return round_up(p + jnp.abs(p) * jnp.float32(2 * U32) + jnp.float32(2 * TINY))


def norm_upper(x, axis=-1):
    """Upper bound on the Euclidean norm ‖x‖₂ along ``axis`` (float32 input).

    Scaled like LAPACK's nrm2: x is multiplied by the power of two 2^-e that brings
    max|x| to [1, 2) (exact), so squares neither overflow nor flush to zero except
    for entries below 2^-63·max|x|; Σ x_d² then carries relative error ≤ γ_{D+1} plus
    D flushed squares of at most 2^-126 each; sqrt adds one rounding; the result is
    scaled back by 2^e and widened by a normal allowance. Non-finite inputs give a
    non-finite bound (callers treat that as a fault).
    """
    x = x.astype(jnp.float32)
    d = x.shape[axis]
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    e = jnp.where((m > 0) & jnp.isfinite(m), jnp.frexp(jnp.where(m > 0, m, 1.0))[1] - 1, 0)
    xs = jnp.ldexp(x, -e)
    ss = jnp.sum(xs * xs, axis=axis)
    ss_up = ss * (1.0 + jnp.float32(gamma(d + 3))) + jnp.float32(d * ETA32 * 2)
    r = round_up(jnp.sqrt(round_up(ss_up)) * (1.0 + jnp.float32(2 * U32)))
    r = jnp.ldexp(r, jnp.squeeze(e, axis)) * (1.0 + jnp.float32(2 * U32))
    r = jnp.where(jnp.isfinite(jnp.squeeze(m, axis)), r, jnp.squeeze(m, axis) * jnp.inf)
    return round_up(r + jnp.float32(2 * TINY))


def sqrt_upper(x):
    """Upper bound on sqrt of a non-negative upper-bounded value."""
    return round_up(jnp.sqrt(round_up(jnp.maximum(x, 0.0))) * (1.0 + jnp.float32(2 * U32)))
