"""Derivatives of selected scores: Top-K values that differentiate like ``lax.top_k``'s.

The pipeline (seeds, certificate, screening, selection) is a discrete search; its
numerics (``nextafter`` in the enclosure, integer order keys in the selection) have
no useful derivative and must never be differentiated. What does have one is the
*value* of each selected key's score (Eq. 1),

    s_{t,j} = α_i Σ_h w_{t,h} relu(q_{t,h} · k̄_i),      i = indices[t, j],

as a function of q, k, w and α with the selected ids held fixed — exactly what
``lax.top_k`` gives its values. :func:`selected_scores` attaches that derivative to
the scores the pipeline computed: its primal output is ``scores`` itself (bitwise),
its JVP (``jax.custom_jvp``, so forward and reverse mode both work) is the JVP of
the scorer at the selected ids. The caller runs the pipeline on
``lax.stop_gradient`` inputs and passes the ids as integer constants:

    idx, sc = pipeline(stop_gradient(q), stop_gradient(k), ...)
    sc = selected_scores(q, k, w, k_scale, idx, sc)

:func:`gathered_values` does the same for a selection over given score rows
(``exact_topk``): the selected values carry the derivative of the rows' entries.
:func:`raise_if_differentiated` marks outputs that have no derivative so that
reverse-mode differentiation stops with a clear error instead of a silent zero.

Conventions: ``relu'(0) = 0`` (as ``jax.nn.relu``); padding slots (``indices < 0``)
have a zero derivative whatever their score (``−inf`` pads included). Gradients with
respect to float8_e4m3fn payloads (q or k) raise a ``TypeError``: a cotangent in
float8 saturates at ±448 and rounds to 3 mantissa bits, which would be a silently
wrong gradient; train with bfloat16/float32 operands (the scores' derivative in
α is supported for any key dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from dosa_jax.inputs import FP8_DTYPE

HIGHEST = lax.Precision.HIGHEST


def _is_zero(t) -> bool:
    return t is None or isinstance(t, SymbolicZero)


def _compute_dtype(*dtypes):
    """At least float32 (the scorer's accumulation), float64 when an operand is."""
    f64 = jnp.dtype(jnp.float64)
    return f64 if any(jnp.dtype(d) == f64 for d in dtypes) else jnp.dtype(jnp.float32)


def _check_selected_args(q, k, w, k_scale, indices, scores):
    for name, x in (("q", q), ("k", k), ("w", w), ("indices", indices), ("scores", scores)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"selected_scores: {name} must be an array, got {type(x).__name__}")
    if q.ndim != 3 or k.ndim != 2 or w.ndim != 2:
        raise ValueError(f"selected_scores: q must be [T, H, D], k [N, D], w [T, H]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}")
    T, H, D = q.shape
    if k.shape[1] != D or tuple(w.shape) != (T, H):
        raise ValueError(f"selected_scores: shapes disagree: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, w {tuple(w.shape)}")
    if indices.ndim != 2 or indices.shape[0] != T or tuple(scores.shape) != tuple(indices.shape):
        raise ValueError(f"selected_scores: indices and scores must both be [T, K] with T={T}; "
                         f"got indices {tuple(indices.shape)}, scores {tuple(scores.shape)}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"selected_scores: indices must be integer, got {indices.dtype}")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"selected_scores: scores must be floating point, got {scores.dtype}")
    if k_scale is not None and (not hasattr(k_scale, "shape")
                                or tuple(k_scale.shape) != (k.shape[0],)):
        raise ValueError(f"selected_scores: k_scale must be None or [N] = ({k.shape[0]},), got "
                         f"{getattr(k_scale, 'shape', type(k_scale).__name__)}")


def _gather(table, ids):
    """table[ids] with ids clipped (padding ids are masked by the caller)."""
    return jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0)


def _selected_scores_jvp(primals, tangents):
    q, k, w, k_scale, indices, scores = primals
    tq, tk, tw = tangents[0], tangents[1], tangents[2]
    for name, x, t in (("q", q, tq), ("k", k, tk)):
        if not _is_zero(t) and jnp.dtype(x.dtype) == FP8_DTYPE:
            raise TypeError(
                f"dosa_jax: the gradient with respect to float8_e4m3fn {name} is not supported "
                f"(a float8 cotangent saturates at 448 and keeps 3 mantissa bits); differentiate "
                f"with respect to a bfloat16/float32 {name} (e.g. the value before quantisation) "
                f"or hold {name} fixed with lax.stop_gradient")
    dt = _compute_dtype(q.dtype, k.dtype, w.dtype)
    valid = indices >= 0
    kg = _gather(k, indices).astype(dt)                                   # [T, K, D]
    qf = q.astype(dt)
    wf = w.astype(dt)
    x = jnp.einsum("thd,tkd->tkh", qf, kg, precision=HIGHEST)           # head dots (primal)
    active = x > 0                                                      # relu'(0) = 0
    relu = jnp.where(active, x, 0.0)
    alpha = None if k_scale is None else _gather(k_scale, indices).astype(dt)
    terms = []
    dx = None
    if not _is_zero(tq):
        dx = jnp.einsum("thd,tkd->tkh", tq.astype(dt), kg, precision=HIGHEST)
    if not _is_zero(tk):
        dxk = jnp.einsum("thd,tkd->tkh", qf, _gather(tk, indices).astype(dt), precision=HIGHEST)
        dx = dxk if dx is None else dx + dxk
    if dx is not None:
        terms.append(jnp.sum(wf[:, None, :] * jnp.where(active, dx, 0.0), axis=-1))
    if not _is_zero(tw):
        terms.append(jnp.sum(tw.astype(dt)[:, None, :] * relu, axis=-1))
    if terms:
        inner = functools.reduce(jnp.add, terms)
        if alpha is not None:
            inner = inner * alpha
    else:
        inner = None
    ta = tangents[3] if k_scale is not None else None
    if k_scale is not None and not _is_zero(ta):
        da = _gather(ta, indices).astype(dt) * jnp.sum(wf[:, None, :] * relu, axis=-1)
        inner = da if inner is None else inner + da
    if inner is None:
        out = jnp.zeros(scores.shape, scores.dtype)
    else:
        # select, not multiply: a pad's cotangent (e.g. from a −inf score) never leaks as NaN
        out = jnp.where(valid, inner, 0.0).astype(scores.dtype)
    return scores, out


@jax.custom_jvp
def _selected_scores(q, k, w, k_scale, indices, scores):
    return scores


_selected_scores.defjvp(_selected_scores_jvp, symbolic_zeros=True)


def selected_scores(q, k, w, k_scale, indices, scores):
    """``scores`` unchanged, differentiable as the scorer (Eq. 1) at the selected ids.

    Forward: returns ``scores`` bitwise (the values the pipeline computed). Derivative:
    that of s_{t,j} = α_i Σ_h w_{t,h} relu(q_{t,h}·k̄_i) at i = ``indices[t, j]`` with
    respect to q, k, w and ``k_scale`` (the ids are integer constants), evaluated in
    float32 (float64 when an operand is float64) with relu'(0) = 0:

        ds = α_i Σ_h [dw_h relu(x_h) + w_h 1[x_h > 0] (dq_h·k̄_i + q_h·dk̄_i)]
             + dα_i Σ_h w_h relu(x_h),       x_h = q_h·k̄_i.

    Slots with ``indices < 0`` (padding) have a zero derivative. Cotangents have their
    primal's dtype (bfloat16 q gets a bfloat16 gradient). Differentiating with respect
    to float8_e4m3fn q or k raises ``TypeError`` (see the module docstring). Works under
    ``jit``, ``vmap``, ``grad``, ``jvp``.

    Args:
      q: [T, H, D]; k: [N, D]; w: [T, H]; k_scale: [N] or None.
      indices: [T, K] integer selected key ids (−1 pads).
      scores: [T, K] the selected keys' scores as computed (any float dtype).
    Returns:
      ``scores`` (same array values and dtype).
    """
    _check_selected_args(q, k, w, k_scale, indices, scores)
    return _selected_scores(q, k, w, k_scale, lax.stop_gradient(indices), scores)


def _gathered_values_jvp(primals, tangents):
    values, rows, indices = primals
    t_rows = tangents[1]
    if _is_zero(t_rows):
        return values, jnp.zeros(values.shape, values.dtype)
    t = jnp.take_along_axis(t_rows.astype(values.dtype),
                            jnp.clip(indices, 0, rows.shape[-1] - 1), axis=-1)
    return values, jnp.where(indices >= 0, t, 0.0).astype(values.dtype)


@jax.custom_jvp
def _gathered_values(values, rows, indices):
    return values


_gathered_values.defjvp(_gathered_values_jvp, symbolic_zeros=True)


def gathered_values(values, rows, indices):
    """``values`` unchanged, with the derivative of ``rows[..., indices]`` (gather by index).

    For a selection over score rows (``exact_topk``): ``values[..., j] = rows[..., indices[...,
    j]]`` up to the selection's canonicalisation (−0.0 → +0.0, padding); the forward output
    is ``values`` bitwise, the derivative that of the gathered entry; ``indices < 0``
    (padding) has a zero derivative.

    Args:
      values: [..., k] float selected values; rows: [..., M] the score rows selected from;
      indices: [..., k] integer positions in ``rows`` (−1 pads).
    """
    if values.shape != indices.shape or rows.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"gathered_values: values {tuple(values.shape)} and indices "
                         f"{tuple(indices.shape)} must match, and share leading axes with rows "
                         f"{tuple(rows.shape)}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"gathered_values: indices must be integer, got {indices.dtype}")
    return _gathered_values(values, rows, lax.stop_gradient(indices))


def exact_topk_with_grad(scores, k: int, *, valid=None, select=None):
    """Exact Top-k of score rows (``dosa_jax.selection.exact_topk`` or ``select``) whose values
    carry the derivative of the selected entries of ``scores`` (as ``lax.top_k``'s do).

    ``select(scores, k, valid=valid) -> (indices, values)`` runs on stop-gradient rows (its
    integer order keys are never differentiated).
    """
    if select is None:
        from dosa_jax.selection import exact_topk as select
    idx, vals = select(lax.stop_gradient(scores), k, valid=valid)
    return idx, gathered_values(vals, scores, idx)


def raise_if_differentiated(value, *depends_on, name: str, hint: str = ""):
    """``value`` unchanged; reverse-mode differentiation through it raises ``TypeError``.

    For outputs that have no derivative (e.g. a threshold computed on stop-gradient inputs):
    a cotangent reaching ``value`` — or flowing to ``depends_on``, the inputs the value
    really depends on — raises, naming ``name``, instead of returning a silent zero.
    Unused outputs (a symbolic zero cotangent, e.g. ``jax.grad`` of another output) pass.
    It is a ``jax.custom_vjp``: forward-mode (``jvp``) through it fails with JAX's own
    error, so use it only where forward mode is not needed.
    """
    msg = f"dosa_jax: {name} is not differentiable" + (f"; {hint}" if hint else "")

    @jax.custom_vjp
    def guard(v, deps):
        return v

    def fwd(v, deps):
        return v, None

    def bwd(_, ct):
        raise TypeError(msg)

    guard.defvjp(fwd, bwd)
    return guard(value, tuple(depends_on))
