"""The indexer's inputs: one record type, argument checking and visibility ranges.

DESIGN §2 and §12: queries ``q`` [T, H, D], keys ``k`` [N, D] (optionally FP8
payloads with a per-key float32 scale ``k_scale`` [N]), signed head weights
``w`` [T, H] and per-query visible ranges ``[lo_t, hi_t)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

#: Input dtypes accepted for queries and keys (DESIGN §12).
FLOAT_INPUT_DTYPES = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.float8_e4m3fn),
)
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class IndexerInputs:
    """One indexer problem: everything ``dosa_jax.topk`` takes besides the config.

    Attributes:
      q: [T, H, D] query head vectors.
      k: [N, D] keys (payloads when ``k_scale`` is given).
      k_scale: [N] float32 per-key scale, or None (scale one).
      w: [T, H] float32 signed head weights.
      lo, hi: [T] int32 visible range ``[lo_t, hi_t)`` of each query.
      meta: free-form description (generator name and parameters, layer, ...).
    """

    q: Array
    k: Array
    k_scale: Optional[Array]
    w: Array
    lo: Array
    hi: Array
    meta: dict = dataclasses.field(default_factory=dict)

    def as_kwargs(self) -> dict:
        """Arguments for ``topk``/``dense_topk``/``score`` (without ``meta``)."""
        return dict(q=self.q, k=self.k, w=self.w, k_scale=self.k_scale,
                    lo=self.lo, hi=self.hi)

    @property
    def shape(self) -> dict:
        T, H, D = self.q.shape
        return dict(T=T, H=H, D=D, N=self.k.shape[0])


def causal_ranges(num_queries: int, num_keys: int, *, window: Optional[int] = None,
                  sinks: int = 0):
    """Visible ranges for causal prefill of the last ``num_queries`` positions.

    Query t sits at position ``pos = num_keys - num_queries + t`` and sees keys
    ``[0, pos + 1)`` (DESIGN §2; DeepGEMM's ks/ke). With ``window`` the range is
    ``[max(0, pos + 1 - window), pos + 1)``; ``sinks`` is accepted for symmetry
    with sliding-window attention but a range is contiguous, so it only widens
    ``lo`` to 0 when ``sinks > 0``.

    Returns:
      (lo, hi): int32 arrays of shape [num_queries].
    """
    if num_queries < 0 or num_keys < 0:
        raise ValueError("causal_ranges: num_queries and num_keys must be >= 0, got "
                         f"{num_queries}, {num_keys}")
    if num_queries > num_keys:
        raise ValueError(f"causal_ranges: num_queries={num_queries} exceeds num_keys={num_keys}")
    pos = np.arange(num_keys - num_queries, num_keys, dtype=np.int64)
    hi = pos + 1
    if window is None or sinks > 0:
        lo = np.zeros_like(hi)
    else:
        if window < 1:
            raise ValueError(f"causal_ranges: window must be >= 1, got {window}")
        lo = np.maximum(0, hi - window)
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def check_inputs(q, k, w, k_scale=None, lo=None, hi=None):
    """Validate the public arguments (DESIGN §12) and return them normalised.

    Raises ValueError/TypeError naming the argument for a wrong rank, shape or
    dtype, and FP8 keys without scales (``top_k`` is checked with the Config).
    Missing ranges default to all keys visible; ranges are clipped to [0, N]
    (an empty range is allowed).

    Returns:
      (q, k, w, k_scale, lo, hi) as jax arrays with w float32, scale float32 or
      None, lo/hi int32 clipped.
    """
    for name, x in (("q", q), ("k", k), ("w", w)):
        if x is None:
            raise TypeError(f"{name} is required")
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must have rank 3 [T, H, D], got shape {tuple(q.shape)}"
                         " (use jax.vmap for leading batch axes)")
    if k.ndim != 2:
        raise ValueError(f"k must have rank 2 [N, D], got shape {tuple(k.shape)}"
                         " (use jax.vmap for leading batch axes)")
    if w.ndim != 2:
        raise ValueError(f"w must have rank 2 [T, H], got shape {tuple(w.shape)}")
    T, H, D = q.shape
    N = k.shape[0]
    if k.shape[1] != D:
        raise ValueError(f"k has head dimension {k.shape[1]} but q has D={D}")
    if tuple(w.shape) != (T, H):
        raise ValueError(f"w must have shape [T, H] = {(T, H)}, got {tuple(w.shape)}")
    if H < 1 or D < 1:
        raise ValueError(f"q must have H >= 1 and D >= 1, got shape {tuple(q.shape)}")
    for name, x in (("q", q), ("k", k)):
        if jnp.dtype(x.dtype) not in FLOAT_INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float8_e4m3fn, "
                            f"got {x.dtype}")
    if not jnp.issubdtype(w.dtype, jnp.floating) or jnp.dtype(w.dtype) == FP8_DTYPE:
        raise TypeError(f"w must be a float32 (or other float) array, got {w.dtype}")
    if jnp.dtype(w.dtype).itemsize > 4:
        raise TypeError(f"w must be float32, got {w.dtype}")
    if k_scale is None:
        if jnp.dtype(k.dtype) == FP8_DTYPE:
            raise ValueError("k_scale is required for float8_e4m3fn keys (k = k_scale[:, None] * payload)")
    else:
        if not hasattr(k_scale, "shape"):
            raise TypeError(f"k_scale must be an array, got {type(k_scale).__name__}")
        if tuple(k_scale.shape) != (N,):
            raise ValueError(f"k_scale must have shape [N] = ({N},), got {tuple(k_scale.shape)}")
        if jnp.dtype(k_scale.dtype) != jnp.dtype(jnp.float32):
            raise TypeError(f"k_scale must be float32, got {k_scale.dtype}")
    if (lo is None) != (hi is None):
        raise ValueError("lo and hi must be given together (or neither)")
    if lo is None:
        lo = jnp.zeros((T,), jnp.int32)
        hi = jnp.full((T,), N, jnp.int32)
    else:
        for name, x in (("lo", lo), ("hi", hi)):
            if not hasattr(x, "shape"):
                raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
            if tuple(x.shape) != (T,):
                raise ValueError(f"{name} must have shape [T] = ({T},), got {tuple(x.shape)}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must be an integer array, got {x.dtype}")
        lo = jnp.clip(jnp.asarray(lo).astype(jnp.int32), 0, N)
        hi = jnp.clip(jnp.asarray(hi).astype(jnp.int32), 0, N)
        hi = jnp.maximum(hi, lo)  # lo >= hi is an empty range
    w = jnp.asarray(w).astype(jnp.float32)
    return same_varying_axes(q, k, w, k_scale, lo, hi)


def same_varying_axes(*xs):
    """The arrays with one set of varying manual axes (inside ``jax.shard_map``).

    Under ``shard_map`` an array is typed by the mesh axes it varies over; loop carries
    must keep their type. Casting every input to the union of the inputs' axes (a no-op
    on values) lets the pipelines start their loop carries from the inputs (``full_like``)
    whatever a caller shards. Outside ``shard_map`` this returns the arrays unchanged.
    """
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # pragma: no cover - older jax: no varying-axes types
        return xs
    def vma(x):   # jax 0.10+: aval.mat.varying; earlier releases: aval.vma
        aval = typeof(x)
        mat = getattr(aval, "mat", None)
        return frozenset((getattr(mat, "varying", None) if mat is not None
                          else getattr(aval, "vma", None)) or ())

    union = frozenset().union(*(vma(x) for x in xs if x is not None))
    if not union:
        return xs

    def cast(x):
        missing = tuple(sorted(union - vma(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # pragma: no cover - jax without pcast

    return tuple(None if x is None else cast(x) for x in xs)


def check_hint(hint, T: int):
    """Validate ``hint`` (None or an integer [T, M] array of witness key ids) and return it."""
    if hint is None:
        return None
    if not hasattr(hint, "shape") or hint.ndim != 2 or hint.shape[0] != T:
        raise ValueError(f"hint must have shape [T, M] with T={T}, got "
                         f"{getattr(hint, 'shape', type(hint).__name__)}")
    if not jnp.issubdtype(hint.dtype, jnp.integer):
        raise TypeError(f"hint must be an integer array, got {hint.dtype}")
    return hint
