"""Agreement of the two backends' selections, bounded by their scorers' rounding (DESIGN §12).

Within one backend ``topk`` and ``dense_topk`` return the same indices bitwise. Across
backends they need not: the reference scorer (:mod:`dosa_jax.scorer`: float32 head dots
and a left-to-right head sum) and the Pallas scorer (``pallas_kernels.scoring``: bf16
operand pieces, float32 tensor-core accumulation, a tree head sum) round differently, so
keys whose scores lie close to the K-th score may swap. This module states and checks
how close.

**The bound.** Let s* be the real score of Eq. 1 and s_b the score a backend computes.
:func:`score_rounding_bound` gives, per query, β_b with ``|s_b − s*| ≤ β_b`` for every
key, from the error coefficients of the numerical enclosure (DESIGN §9, App. C,
Eq. 26): :func:`dosa_jax.enclosure.scorer_error_coefficient` for the reference,
``pallas_kernels.numerics.scorer_error_coefficient`` for Pallas.

**The contract.** Let A and B be the two selections of one query (K keys each, or all
visible keys when fewer), kth* the real K-th largest score. The K-th order statistic is
1-Lipschitz in the sup norm, so each backend's computed K-th score is within β of kth*.
A key i in A but not in B has ``s_a(i) ≥ kth_a`` and ``s_b(i) ≤ kth_b``, hence

    kth* − 2β_a  ≤  s*(i)  ≤  kth* + 2β_b ,

and symmetrically for B \\ A. Every differing id therefore satisfies
``|s*(i) − kth*| ≤ 2·max(β_a, β_b)`` (:func:`agreement_radius`). This is the sum
β_a + β_b of the two bounds when they are equal, and no less than it otherwise; the
plain sum is not enough when the bounds differ: with β_b = 0, keys x (s* = kth*) and
i (s* = kth* − 2β_a, lower index) may both be computed as kth* − β_a by backend a,
which then keeps i on the index tie, while the exact backend b keeps x.

**Exact scores.** The real scores are not computable; :func:`exact_scores` evaluates
Eq. 1 in float64 from the inputs' exact float32 values, and :func:`exact_score_error`
bounds that evaluation's error β₆₄ (products of two float32 values are exact in float64;
the D- and H-term sums and the scaling round with u = 2^-53). The radius compared
against float64 scores and the float64 K-th score is ``2·max(β_a, β_b) + 2β₆₄``: a
rigorous check, not a tolerance. (Scoring with the float32 reference scorer plus its
bound instead would need a radius grown by that bound twice over.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from dosa_jax import api
from dosa_jax import enclosure as enc
from dosa_jax import numerics as nm

BACKENDS = ("reference", "pallas")
#: Unit roundoff of float64 round-to-nearest.
U64 = 2.0 ** -53


def _scale_terms(k, k_scale):
    """(max_i α_i n_i, max_i α_i) upward, over all keys; (max n_i, 1) without scales."""
    n = enc.key_norm_upper(k)
    if k_scale is None:
        return jnp.max(n), jnp.float32(1.0)
    a = jnp.abs(jnp.asarray(k_scale, jnp.float32))
    return jnp.max(nm.upper_product(a, n)), jnp.max(a)


def score_rounding_bound(q, k, w, k_scale=None, backend: str = "reference", *,
                         unit_roundoff: float = nm.U32):
    """β_t ≥ |s_computed(t, i) − s*(t, i)| for every key i of query t (DESIGN §9).

    The backend's scorer computes a payload sum ŝ with ``|ŝ − s*_pay| ≤ n_i·C + ε``
    (Eq. 26: n_i ≥ ‖k̄_i‖, C the scorer's error coefficient, ε the flushed-underflow
    allowance :func:`dosa_jax.enclosure.underflow_allowance`), then multiplies by α_i
    (one rounding, relative u and absolute 2^-126). With ``|ŝ| ≤ n_i(M + C) + ε``,
    ``M = Σ_h |w_h|‖q_h‖`` (Cauchy–Schwarz; relu(x) ≤ |x|):

        |fl(α_i ŝ) − α_i s*_pay| ≤ α_i n_i (C + u(M + C)) + α_i ε (1 + u) + 2^-126 .

    The bound is made uniform over keys with max_i α_i n_i and max_i α_i; every
    operation is evaluated upward (:mod:`dosa_jax.numerics`).

    Args:
      q: [T, H, D] queries (float32/bfloat16/float16/float8_e4m3fn).
      k: [N, D] keys or FP8 payloads.
      w: [T, H] head weights.
      k_scale: None or [N] float32 per-key scales α_i.
      backend: ``"reference"`` (C = :func:`dosa_jax.enclosure.scorer_error_coefficient`)
        or ``"pallas"`` (C = ``pallas_kernels.numerics.scorer_error_coefficient``: bf16
        operand pieces and the tensor cores' float32 accumulation).
      unit_roundoff: the reference scorer's accumulation roundoff (float32: 2^-24).
    Returns:
      [T] float32 upper bounds; non-finite for non-finite inputs (no bound).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.ndim != 3 or k.ndim != 2 or w.shape != q.shape[:2] or k.shape[1] != q.shape[2]:
        raise ValueError(f"q [T, H, D], k [N, D], w [T, H] expected, got q {q.shape}, "
                         f"k {k.shape}, w {w.shape}")
    T, H, D = q.shape
    q32 = jnp.asarray(q).astype(jnp.float32)
    w32 = jnp.asarray(w, jnp.float32)
    q_norm = nm.norm_upper(q32)
    M = nm.inflate(jnp.sum(jnp.abs(w32) * q_norm, axis=-1), H)
    # the backend's own coefficient C, through the dispatch table
    C = api.implementation(backend).scorer_error(jnp.asarray(q), w32, jnp.dtype(k.dtype),
                                                 unit_roundoff)
    u = nm.U32      # the scaling α_i·ŝ is one float32 multiply on both backends
    eps = enc.underflow_allowance(w32, jnp.zeros((T, 0), jnp.float32), 0, D, H, 0)
    an, a = _scale_terms(k, k_scale)
    rel = nm.upper_sum(C, nm.upper_product(jnp.float32(u), nm.upper_sum(M, C)))
    absolute = nm.upper_product(a, nm.upper_product(eps, jnp.float32(1.0 + 2 * u)))
    return nm.upper_sum(nm.upper_product(an, rel), absolute, jnp.float32(nm.ETA32))


def agreement_radius(bound_a, bound_b, exact_error=0.0):
    """Per-query radius r with ``|s64(i) − kth64| ≤ r`` for every id selected by exactly
    one of two scorers with bounds β_a, β_b (module docstring; DESIGN §12):
    ``2·max(β_a, β_b) + 2β₆₄``, in float64, rounded up."""
    r = (2.0 * np.maximum(np.asarray(bound_a, np.float64), np.asarray(bound_b, np.float64))
         + 2.0 * np.asarray(exact_error, np.float64))
    return np.nextafter(r * (1.0 + 4 * U64), np.inf)


def exact_scores(q, k, w, k_scale=None, lo=None, hi=None, *, query_chunk: int = 8):
    """[T, N] float64 scores α_i Σ_h w_h relu(q_h·k̄_i) (Eq. 1); −inf outside [lo_t, hi_t).

    Inputs are widened exactly (every accepted dtype is exact in float32); NumPy, so the
    evaluation shares no code with either backend. Computed ``query_chunk`` queries at a
    time ([chunk·H, N] float64 head dots).
    """
    q64 = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    k64 = np.asarray(jnp.asarray(k).astype(jnp.float32), np.float64)
    w64 = np.asarray(w, np.float64)
    T, H, D = q64.shape
    N = k64.shape[0]
    out = np.empty((T, N), np.float64)
    kt = np.ascontiguousarray(k64.T)
    for t0 in range(0, T, query_chunk):
        qc = q64[t0:t0 + query_chunk]
        c = qc.shape[0]
        x = np.maximum(qc.reshape(c * H, D) @ kt, 0.0).reshape(c, H, N)
        out[t0:t0 + c] = np.matmul(w64[t0:t0 + c, None, :], x)[:, 0]
    if k_scale is not None:
        out *= np.asarray(k_scale, np.float64)[None, :]
    if lo is not None or hi is not None:
        ids = np.arange(N)[None, :]
        lo_ = np.zeros((T,), np.int64) if lo is None else np.clip(np.asarray(lo), 0, N)
        hi_ = np.full((T,), N, np.int64) if hi is None else np.clip(np.asarray(hi), 0, N)
        out = np.where((ids >= lo_[:, None]) & (ids < hi_[:, None]), out, -np.inf)
    return out


def exact_score_error(q, k, w, k_scale=None):
    """[T] float64 β₆₄ ≥ |exact_scores − s*| for every key (the float64 evaluation's error).

    Products of two values exact in float32 are exact in float64 (48 ≤ 53 bits); the D-term
    dot, the H weighted terms and their sum, and the scaling add at most
    γ_{D+H+2}(2^-53)·α_i Σ_h |w_h| ‖q_h‖‖k̄_i‖; doubled to cover this bound's own rounding.
    """
    q64 = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    k64 = np.asarray(jnp.asarray(k).astype(jnp.float32), np.float64)
    T, H, D = q64.shape
    mag = np.sum(np.abs(np.asarray(w, np.float64)) * np.linalg.norm(q64, axis=-1), axis=-1)
    kn = np.linalg.norm(k64, axis=-1)
    if k_scale is not None:
        kn = kn * np.abs(np.asarray(k_scale, np.float64))
    g = (D + H + 2) * U64 / (1.0 - (D + H + 2) * U64)
    return 2.0 * g * mag * (np.max(kn) if kn.size else 0.0) + 2.0 ** -1000


def kth_score(scores, top_k: int):
    """[T] the K-th largest finite-or-infinite entry of each row (NaN and −inf pads skipped
    as the selection skips them: rows with fewer than K visible keys give −inf)."""
    s = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float64))
    if top_k > s.shape[1]:
        return np.full((s.shape[0],), -np.inf)
    return -np.partition(-s, top_k - 1, axis=1)[:, top_k - 1]


class SelectionComparison(NamedTuple):
    """Two selections of the same queries compared against exact scores (DESIGN §12).

    Attributes:
      differing: [T] int, ids in exactly one of the two selections (pads −1 ignored).
      within: [T] bool, every differing id has ``|exact_score − kth| ≤ bound`` and the
        two selections hold the same number of distinct ids, without duplicates.
      holds: the contract for every query (all of ``within``).
      fraction: Σ differing / Σ (|A| + |B|), the share of selected ids not shared.
      max_ratio: [T] float64, max over differing ids of ``|exact_score − kth| / bound``
        (0 with no differing id; inf where the bound is 0 and the distance is not).
    """

    differing: np.ndarray
    within: np.ndarray
    holds: bool
    fraction: float
    max_ratio: np.ndarray


def compare_selections(idx_a, idx_b, exact_scores, kth, bound) -> SelectionComparison:
    """Check that two selections differ only within ``bound`` of the K-th score.

    Args:
      idx_a, idx_b: [T, K] int selections (−1 pads), e.g. ``dense_topk(...).indices`` of
        two backends.
      exact_scores: [T, N] float64 scores (:func:`exact_scores`; −inf: not visible).
      kth: [T] float64 K-th largest exact score (:func:`kth_score`).
      bound: [T] or scalar radius (:func:`agreement_radius` for the contract).
    Returns:
      :class:`SelectionComparison`.
    """
    a_all, b_all = np.asarray(idx_a), np.asarray(idx_b)
    s = np.asarray(exact_scores, np.float64)
    if a_all.shape != b_all.shape or a_all.ndim != 2:
        raise ValueError(f"idx_a and idx_b must have the same shape [T, K], got {a_all.shape} "
                         f"and {b_all.shape}")
    T = a_all.shape[0]
    if s.ndim != 2 or s.shape[0] != T:
        raise ValueError(f"exact_scores must have shape [T={T}, N], got {s.shape}")
    kth = np.broadcast_to(np.asarray(kth, np.float64), (T,))
    bound = np.broadcast_to(np.asarray(bound, np.float64), (T,))
    N = s.shape[1]
    differing = np.zeros((T,), np.int64)
    within = np.ones((T,), bool)
    max_ratio = np.zeros((T,))
    selected = 0
    for t in range(T):
        ra, rb = a_all[t][a_all[t] >= 0], b_all[t][b_all[t] >= 0]
        ua, ub = np.unique(ra), np.unique(rb)
        selected += ua.size + ub.size
        ok = ua.size == ra.size and ub.size == rb.size and ua.size == ub.size
        d = np.setxor1d(ua, ub)
        differing[t] = d.size
        if d.size:
            inside = d < N
            dist = np.full(d.shape, np.inf)
            dist[inside] = np.abs(s[t, d[inside]] - kth[t])
            dist = np.where(np.isnan(dist), np.inf, dist)
            ok = ok and bool(np.all(dist <= bound[t]))
            worst = np.max(dist)
            max_ratio[t] = (worst / bound[t] if bound[t] > 0
                            else (0.0 if worst == 0 else np.inf))
        within[t] = ok
    fraction = float(differing.sum() / selected) if selected else 0.0
    return SelectionComparison(differing, within, bool(np.all(within)), fraction, max_ratio)


def compare_backends(q, k, w, idx_a, idx_b, top_k: int, k_scale=None, lo=None, hi=None, *,
                     backends=("reference", "pallas"), scores=None):
    """The DESIGN §12 contract for two backends' selections of the same inputs.

    Computes both scorers' bounds, float64 exact scores (or takes ``scores`` from
    :func:`exact_scores`), the exact K-th score and the radius ``2·max(β_a, β_b) + 2β₆₄``.

    Returns:
      (:class:`SelectionComparison`, radius [T] float64).
    """
    ba = np.asarray(score_rounding_bound(q, k, w, k_scale, backends[0]), np.float64)
    bb = np.asarray(score_rounding_bound(q, k, w, k_scale, backends[1]), np.float64)
    s = exact_scores(q, k, w, k_scale, lo, hi) if scores is None else scores
    radius = agreement_radius(ba, bb, exact_score_error(q, k, w, k_scale))
    return compare_selections(idx_a, idx_b, s, kth_score(s, top_k), radius), radius


def near_tie_inputs(*, T: int = 16, N: int = 2048, H: int = 8, D: int = 64, top_k: int = 64,
                    n_tied: int = 64, n_above: Optional[int] = None, key_dtype: str = "float32",
                    spread: float = 2.0 ** -20, seed: int = 0):
    """Adversarial inputs: ``n_tied`` keys whose scores straddle the K-th score within
    ~spread/√D relative, below the scorers' rounding, so the backends' selections differ.

    Every key is a coordinate permutation of one positive vector k₀ (exact in every key
    dtype). Head h of query t is ``c_th (1 + spread·ξ_thd)`` with positive weights, so
    ``q_h·P k₀`` is nearly the same for every permutation P and the rounding of the D-term
    dot (its order follows P) decides the computed order. ``n_above`` keys (default
    ``top_k − n_tied // 4``) are 2·(P k₀) (score doubled), the rest ½·(P k₀): the K-th
    score falls inside the tied group. FP8 keys carry the factors 2, 1, ½ as scales.
    """
    from dosa_jax.inputs import IndexerInputs

    n_above = top_k - n_tied // 4 if n_above is None else n_above
    if not 0 <= n_above < top_k <= n_above + n_tied <= N:
        raise ValueError(f"need 0 <= n_above < top_k <= n_above + n_tied <= N, got "
                         f"n_above={n_above}, top_k={top_k}, n_tied={n_tied}, N={N}")
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
              "float8_e4m3fn": jnp.float8_e4m3fn}
    if key_dtype not in dtypes:
        raise ValueError(f"key_dtype must be one of {sorted(dtypes)}, got {key_dtype!r}")
    dt = dtypes[key_dtype]
    rng = np.random.default_rng(seed)
    c = rng.uniform(0.5, 1.0, (T, H, 1)) / np.sqrt(D)
    q = (c * (1.0 + spread * rng.standard_normal((T, H, D)))).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, H)).astype(np.float32)
    k0 = np.asarray(jnp.asarray(rng.uniform(0.5, 4.0, D), jnp.float32).astype(dt)
                    .astype(jnp.float32))
    payload = k0[np.argsort(rng.random((N, D)), axis=1)]
    order = rng.permutation(N)
    factor = np.full((N,), 0.5, np.float32)
    factor[order[:n_above]] = 2.0
    factor[order[n_above:n_above + n_tied]] = 1.0
    if key_dtype == "float8_e4m3fn":
        k, k_scale = jnp.asarray(payload, jnp.float32).astype(dt), jnp.asarray(factor)
    else:
        k, k_scale = jnp.asarray(payload * factor[:, None], jnp.float32).astype(dt), None
    return IndexerInputs(q=jnp.asarray(q), k=k, k_scale=k_scale, w=jnp.asarray(w),
                         lo=jnp.zeros((T,), jnp.int32), hi=jnp.full((T,), N, jnp.int32),
                         meta=dict(kind="near_tie", T=T, N=N, H=H, D=D, top_k=top_k,
                                   n_tied=n_tied, n_above=n_above, spread=spread,
                                   key_dtype=key_dtype, seed=seed))


__all__ = ["BACKENDS", "SelectionComparison", "agreement_radius", "compare_backends",
           "compare_selections", "exact_score_error", "exact_scores", "kth_score",
           "near_tie_inputs", "score_rounding_bound"]
