"""Public API (SPEC §12): ``topk``, ``dense_topk``, ``score``, ``exact_topk``.

Backends are chosen by name in one place (:func:`resolve_backend`):
``"reference"`` is the pure-jnp pipeline; ``"pallas"`` runs the Pallas kernels
(``pallas_kernels``; interpret mode without a GPU); ``"auto"`` picks pallas on
a GPU and the reference elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dosa_jax.config import Config
from dosa_jax.dense import anchor_hint, dense_topk_reference, score_matrix
from dosa_jax.inputs import check_inputs
from dosa_jax.pipeline import dosa_topk_reference
from dosa_jax import selection


class TopKResult(NamedTuple):
    """indices int32 [T, K] (score desc, index asc; −1 pads), scores float32 [T, K]
    (the original scorer's values; −inf pads), stats (per-query, see ``Stats``)."""

    indices: jax.Array
    scores: jax.Array
    stats: object


def _config_with_top_k(config: Optional[Config], top_k) -> Config:
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a dosa_jax.Config, got {type(config).__name__}")
    if top_k is not None:
        if isinstance(top_k, jax.core.Tracer):
            raise TypeError("top_k must be a static Python int; under jax.jit pass "
                            "config=dosa_jax.Config(top_k=...) instead")
        if isinstance(top_k, bool) or not hasattr(top_k, "__index__"):
            raise TypeError(f"top_k must be an int, got {top_k!r}")
        top_k = top_k.__index__()
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if top_k != config.top_k:
            config = config.replace(top_k=top_k)
    return config


def resolve_backend(config: Config) -> str:
    """``"reference"`` or ``"pallas"`` for this config on this machine."""
    if config.backend == "auto":
        # jax 0.10 names the CUDA backend "gpu", later versions may say "cuda"
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"
    return config.backend


def _pallas():
    try:
        import pallas_kernels.pipeline as pk  # noqa: WPS433
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise NotImplementedError(f"backend='pallas' needs pallas_kernels: {e}") from e
    return pk


def topk(q, k, w, top_k=None, k_scale=None, lo=None, hi=None, config: Optional[Config] = None,
         hint=None) -> TopKResult:
    """Exact indexer Top-K with DoSA screening.

    Args:
      q: [T, H, D] queries (float32/bfloat16/float16/float8_e4m3fn).
      k: [N, D] keys (same choices); FP8 keys need ``k_scale``.
      w: [T, H] float32 signed head weights.
      top_k: static K (overrides ``config.top_k``); under ``jax.jit`` put K in the config.
      k_scale: [N] float32 per-key scale α_i (scores are α_i · Σ_h w_h relu(q_h·k̄_i)).
      lo, hi: [T] int32 visible range [lo_t, hi_t) (default: all keys); clipped to [0, N].
      config: :class:`Config` (static).
      hint: optional [T, M] int32 key ids used as extra witnesses for τ after
        rescoring for the current query (e.g. the previous decode step's or a
        neighbouring query's selection; SPEC §3, §11). Any ids are safe: invisible
        ids and duplicates are ignored; hints never change the answer, only pruning.
    Returns:
      TopKResult. ``indices`` equal ``dense_topk(...).indices`` bitwise.
    """
    config = _config_with_top_k(config, top_k)
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    if hint is not None:
        if not hasattr(hint, "shape") or hint.ndim != 2 or hint.shape[0] != q.shape[0]:
            raise ValueError(f"hint must have shape [T, M] with T={q.shape[0]}, got "
                             f"{getattr(hint, 'shape', type(hint).__name__)}")
        if not jnp.issubdtype(hint.dtype, jnp.integer):
            raise TypeError(f"hint must be an integer array, got {hint.dtype}")
    if resolve_backend(config) == "pallas":
        idx, sc, stats = _pallas().dosa_topk(q, k, w, k_scale, lo, hi, config, hint=hint)
    else:
        anchors = anchor_hint(q, k, w, k_scale, lo, hi, config)
        if anchors is not None:
            hint = anchors if hint is None else jnp.concatenate(
                [anchors, hint.astype(jnp.int32)], axis=1)
        idx, sc, stats = dosa_topk_reference(q, k, w, k_scale, lo, hi, config, hint)
    return TopKResult(idx, sc, stats)


def dense_topk(q, k, w, top_k=None, k_scale=None, lo=None, hi=None,
               config: Optional[Config] = None) -> TopKResult:
    """Exact Top-K by scoring every visible key (the baseline). Same arguments as :func:`topk`.

    ``stats`` holds ``visible`` only.
    """
    config = _config_with_top_k(config, top_k)
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    if resolve_backend(config) == "pallas":
        idx, sc = _pallas().dense_topk(q, k, w, k_scale, lo, hi, config)
    else:
        idx, sc = dense_topk_reference(q, k, w, k_scale, lo, hi, config)
    return TopKResult(idx, sc, {"visible": hi - lo})


def score(q, k, w, k_scale=None, lo=None, hi=None, config: Optional[Config] = None):
    """[T, N] original scores s_i = α_i Σ_h w_h relu(q_h·k̄_i) (Eq. 1), canonical scorer.

    Keys outside ``[lo, hi)`` (when given) are −inf.
    """
    config = config or Config()
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    return score_matrix(q, k, w, k_scale, lo, hi, config.key_block, config.query_tile)


def exact_topk(scores, k: int, *, valid=None, backend: str = "auto"):
    """Exact Top-k of score rows (position = key index), the contract's tie order.

    Score desc, index asc; NaN never selected; ``-1``/``-inf`` pads. ``backend``:
    ``"reference"`` (``lax.top_k`` on int order keys), ``"pallas"`` (threshold
    select kernel, ``pallas_kernels.select``; interpret mode without a GPU) or
    ``"auto"`` (pallas on a GPU). Both return identical results.
    """
    if backend not in ("reference", "pallas", "auto"):
        raise ValueError(f"backend must be 'reference', 'pallas' or 'auto', got {backend!r}")
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    if backend == "pallas":
        from pallas_kernels import select as pallas_select
        return pallas_select.exact_topk(scores, k, valid=valid)
    return selection.exact_topk(scores, k, valid=valid)
