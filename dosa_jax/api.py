"""Public API (DESIGN §12): ``topk``, ``dense_topk``, ``score``, ``exact_topk``.

Every call is answered by an implementation from one table,
:data:`IMPLEMENTATIONS`: ``"reference"`` is the pure-jnp pipeline,
``"pallas"`` the Pallas kernels (``pallas_kernels``, imported on first use;
interpret mode without a GPU). ``Config.backend`` names one, or ``"auto"``
(:mod:`dosa_jax.backend`): pallas on a GPU, falling back to the reference when
pallas cannot answer (``NotImplementedError``), the reference elsewhere. Both
implementations take the same arguments and return the same indices.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax import autodiff, context_parallel, decode, manual_axes, selection
from dosa_jax.backend import BACKENDS, candidates, resolve_backend
from dosa_jax.config import Config
from dosa_jax.dense import dense_topk_reference
from dosa_jax.inputs import check_hint, check_inputs
from dosa_jax.pipeline import dosa_topk_reference
from dosa_jax.results import Stats, TopKResult
from dosa_jax.scorer import score_matrix

__all__ = ["IMPLEMENTATIONS", "Implementation", "Stats", "TopKResult", "decode_topk",
           "dense_topk", "exact_topk", "implementation", "resolve_backend", "score",
           "sharded_decode_topk", "sharded_topk", "topk"]


class Implementation(NamedTuple):
    """One backend's functions, all on validated inputs.

    topk(q, k, w, k_scale, lo, hi, config, *, hint=None) -> (indices, scores, Stats);
    dense_topk(q, k, w, k_scale, lo, hi, config) -> (indices, scores);
    exact_topk(scores, k, valid=None) -> (indices, scores);
    scorer_error(q, w, k_dtype, unit_roundoff) -> [T] relative error coefficient C of the
    backend's scorer (DESIGN §9, Eq. 26), for the cross-backend contract (``agreement``).
    decode_topk(q, k, w, ids, k_scale, lengths, page_table, config) -> (indices, scores,
    DecodeStats, next witnesses [B, M, W / M]), one decode step on validated inputs
    (:mod:`dosa_jax.decode`).
    """

    topk: Callable
    dense_topk: Callable
    exact_topk: Callable
    scorer_error: Callable
    decode_topk: Callable


def _reference_scorer_error(q, w, k_dtype, unit_roundoff):
    from dosa_jax import enclosure, numerics
    q_norm = numerics.norm_upper(jnp.asarray(q).astype(jnp.float32))
    return enclosure.scorer_error_coefficient(jnp.asarray(w, jnp.float32), q_norm, q.shape[-1],
                                              unit_roundoff)


def _reference() -> Implementation:
    return Implementation(dosa_topk_reference, dense_topk_reference, selection.exact_topk,
                          _reference_scorer_error, decode.decode_topk_reference)


def _pallas() -> Implementation:
    try:
        import pallas_kernels.pipeline as pipeline  # the one lazy edge to the kernels
        import pallas_kernels.select as select
        import pallas_kernels.numerics as numerics
        import pallas_kernels.decode as decode_kernels
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise NotImplementedError(f"backend='pallas' needs pallas_kernels: {e}") from e
    return Implementation(pipeline.dosa_topk, pipeline.dense_topk, select.exact_topk,
                          lambda q, w, k_dtype, _u: numerics.scorer_error_coefficient(q, w, k_dtype),
                          decode_kernels.decode_topk)


#: Backend name -> loader of its :class:`Implementation` (loaded on first use).
IMPLEMENTATIONS = {"reference": _reference, "pallas": _pallas}


def implementation(name: str) -> Implementation:
    """The :class:`Implementation` registered as ``name`` (``"reference"`` or ``"pallas"``)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return IMPLEMENTATIONS[name]()


def _dispatch(backend: str, op: str, *args, **kwargs):
    """Call ``op`` of the first implementation for ``backend`` that can answer; raise
    NotImplementedError with every implementation's reason when none can."""
    reasons = []
    for name in candidates(backend):
        try:
            if name == "pallas" and manual_axes.checking_varying_axes():
                # inside a user's shard_map: kernels carry no varying-axes type (DESIGN §12)
                with manual_axes.outside_varying_checks():
                    out = getattr(implementation(name), op)(*args, **kwargs)
                return manual_axes.as_varying(out, manual_axes.varying_axes(args, kwargs))
            return getattr(implementation(name), op)(*args, **kwargs)
        except NotImplementedError as e:
            reasons.append(f"{name}: {e}")
    raise NotImplementedError(f"no implementation of {op} for backend={backend!r}: "
                              + "; ".join(reasons))


def _constants(*xs):
    """The pipeline's inputs under ``lax.stop_gradient``: its enclosure (``nextafter``) and
    integer selection are never differentiated; :func:`_differentiable` gives the scores
    their derivative (DESIGN §12)."""
    return tuple(None if x is None else lax.stop_gradient(x) for x in xs)


def _differentiable(q, k, w, k_scale, idx, sc):
    """(indices, scores) with the scores carrying the scorer's derivative at the selected ids
    with respect to q, k, w and k_scale (indices are integer constants, as ``lax.top_k``'s)."""
    idx = lax.stop_gradient(idx)
    return idx, autodiff.selected_scores(q, k, w, k_scale, idx, sc)


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
      config: :class:`Config` (static). An explicit budget (``retained_heads``,
        ``budget_candidates``) outside [1, H−1] raises ValueError.
      hint: optional [T, M] int32 key ids used as extra witnesses for τ after
        rescoring for the current query (e.g. the previous decode step's or a
        neighbouring query's selection; DESIGN §3, §11). Any ids are safe: invisible
        ids and duplicates are ignored; hints never change the answer, only pruning.
    Returns:
      TopKResult. ``indices`` equal ``dense_topk(...).indices`` bitwise.
    """
    config = _config_with_top_k(config, top_k)
    if config.context_axis is not None:   # keys sharded along a mesh axis, lo/hi global
        return context_parallel.topk(q, k, w, k_scale, lo, hi, config, hint,
                                     dispatch=_dispatch)
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    config.budgets(q.shape[1])   # explicit budgets must fit H (raises, naming the field)
    hint = check_hint(hint, q.shape[0])
    idx, sc, stats = _dispatch(config.backend, "topk", *_constants(q, k, w, k_scale), lo, hi,
                               config, hint=hint)
    idx, sc = _differentiable(q, k, w, k_scale, idx, sc)
    # the K-th selected score is differentiable as the scores are; tau_seed is a constant
    stats = stats._replace(tau_final=jnp.where(idx[:, -1] >= 0, sc[:, -1], -jnp.inf))
    return TopKResult(idx, sc, stats)


def dense_topk(q, k, w, top_k=None, k_scale=None, lo=None, hi=None,
               config: Optional[Config] = None) -> TopKResult:
    """Exact Top-K by scoring every visible key (the baseline). Same arguments as :func:`topk`.

    ``stats`` holds ``visible`` only.
    """
    config = _config_with_top_k(config, top_k)
    if config.context_axis is not None:   # keys sharded along a mesh axis, lo/hi global
        return context_parallel.dense_topk(q, k, w, k_scale, lo, hi, config,
                                           dispatch=_dispatch)
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    idx, sc = _dispatch(config.backend, "dense_topk", *_constants(q, k, w, k_scale), lo, hi,
                        config)
    idx, sc = _differentiable(q, k, w, k_scale, idx, sc)
    return TopKResult(idx, sc, {"visible": hi - lo})


def sharded_topk(q, k, w, *, mesh, axis: str = "cp", query_axis: Optional[str] = None,
                 k_scale=None, lo=None, hi=None, config: Optional[Config] = None, top_k=None,
                 hint=None, dense: bool = False) -> TopKResult:
    """Exact Top-K with the keys sharded along mesh ``axis`` (context parallel), the
    ``jax.shard_map`` done here: :func:`dosa_jax.context_parallel.sharded_topk`. Bitwise the
    unsharded :func:`topk` (``dense=True``: :func:`dense_topk`) on the same global arrays."""
    return context_parallel.sharded_topk(
        q, k, w, mesh=mesh, axis=axis, query_axis=query_axis, k_scale=k_scale, lo=lo, hi=hi,
        config=_config_with_top_k(config, top_k), hint=hint, dense=dense, dispatch=_dispatch)


def decode_topk(q, k, w, state: "decode.DecodeState", *, k_scale=None, lengths=None, page_table=None,
                config: Optional[Config] = None):
    """One decode step: the exact Top-K of every sequence's query(ies), and the next state.

    Args:
      q: [B, H, D] (one query per sequence) or [B, M, H, D] (M ≤ 4 queries per sequence, all
        seeing the same keys).
      k: contiguous [B, N, D], or paged [P, page, D] with ``page_table``.
      w: [B, H] (or [B, M, H]) float32 head weights.
      state: :class:`~dosa_jax.decode.DecodeState` (``decode_init``, then each step's returned state).
      k_scale: [B, N] (or [P, page]) float32 per-key scales; required for FP8 keys.
      lengths: [B] visible keys per sequence (default: all N; required when paged);
        clipped to [0, capacity]. Length 0 gives all pads.
      page_table: [B, max_pages] page ids of each sequence (paged keys). Entries past a
        sequence's length are never read (any value, e.g. −1, pads them); an id outside
        [0, P) that holds visible keys raises ``ValueError`` where its value is known (an
        eager call) and is clipped into [0, P) where it is traced (under ``jit``: no read
        outside k).
      config: :class:`Config` (static): ``top_k``, ``capacity`` (compaction buffer per query,
        default 4·K), ``key_block``, ``backend``; ``seed_strategy``, ``sink_size`` and
        ``local_fraction`` lay out the seeds that the state's empty witness slots take
        (:func:`~dosa_jax.decode.seeded_witnesses`).
    Returns:
      (TopKResult with indices [B, K] (or [B, M, K]) int32 sequence positions (score desc,
      id asc; −1 pads), scores float32 (−inf pads), stats :class:`~dosa_jax.decode.DecodeStats`; the next
      :class:`~dosa_jax.decode.DecodeState`: each query's best W / M keys of this step, selection first).
      Indices and scores equal, bitwise, ``dense_topk`` of each
      sequence's queries over its first ``lengths[b]`` keys on the same backend.
    """
    config = decode.decode_config(config)
    devices = 1 if config.context_axis is None else context_parallel.axis_geometry(
        config.context_axis, 1)[0]
    q, k, w, ids, k_scale, lengths, page_table, squeeze = decode.check_decode_inputs(
        q, k, w, state, k_scale, lengths, page_table, devices=devices)
    ids = decode.seeded_witnesses(ids, lengths, config)   # empty slots: the sequence's seeds
    if config.context_axis is not None:   # keys sharded along a mesh axis, positions global
        idx, sc, stats, nxt = context_parallel.decode_topk(
            q, k, w, ids, k_scale, lengths, page_table, config, dispatch=_dispatch)
    else:
        sg = lax.stop_gradient
        args = (sg(q), sg(k), sg(w), ids, None if k_scale is None else sg(k_scale), lengths,
                page_table, config)
        idx, sc, stats, nxt = _dispatch(config.backend, "decode_topk", *args)
        sc = decode.differentiable_scores(q, k, w, k_scale, page_table, idx, sc)
    new_state = decode.DecodeState(decode.fit_witnesses(nxt, ids.shape[1]))
    if squeeze:
        idx, sc = idx[:, 0], sc[:, 0]
        stats = jax.tree_util.tree_map(lambda x: x[:, 0], stats)
    return TopKResult(idx, sc, stats), new_state


def sharded_decode_topk(q, k, w, state: "decode.DecodeState", *, mesh, axis: str = "cp",
                        k_scale=None, lengths=None, config: Optional[Config] = None):
    """One decode step with the sequences' keys sharded along mesh ``axis`` (context
    parallel), the ``jax.shard_map`` done here: :func:`dosa_jax.context_parallel.
    sharded_decode_topk` (contiguous keys [B, N, D]). Indices and scores bitwise the
    unsharded :func:`decode_topk`'s."""
    return context_parallel.sharded_decode_topk(q, k, w, state, mesh=mesh, axis=axis,
                                                k_scale=k_scale, lengths=lengths, config=config,
                                                step=decode_topk)


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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'reference', 'pallas' or 'auto', got {backend!r}")
    # the values carry the derivative of the selected entries of ``scores`` (as lax.top_k's)
    select = lambda rows, kk, valid=None: _dispatch(backend, "exact_topk", rows, kk, valid=valid)
    return autodiff.exact_topk_with_grad(scores, k, valid=valid, select=select)
