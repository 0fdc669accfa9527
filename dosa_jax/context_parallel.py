"""Context parallel: exact Top-K over keys sharded along a mesh axis (DESIGN §17).

Inside ``jax.shard_map`` over mesh axis ``a`` (``Config.context_axis``) with P devices,
device d holds the contiguous key slice ``[d·n, (d+1)·n)`` (n = keys per device) and the
queries' ranges ``[lo, hi)`` are global positions. The answer is the global Top-K, global
ids, the contract's tie order (score desc, global index asc), on every device, bitwise
the unsharded call's. Bitwise equality holds because a key's score is the canonical
scorer's value on a ``[Tq, key_block]`` block gathered by id (``dosa_jax.scorer``), which
depends on the key and the query only, not on where the key sits in an array or a block;
the tests check it against the unsharded call.

Three phases, one idea each:

1. **shared threshold** — the seed layout is defined on global positions (sinks,
   local window, strided; DESIGN §3). Each device scores the seeds it holds; one
   all-reduce (max of int32 order keys, ``S_pad`` per query, −∞ for seeds held
   elsewhere) gives every device every seed's score, and τ is their K-th (Eq. 2): the
   unsharded seed threshold, ≤ τ* since it has K witnesses whichever device holds them.
2. **local pass** — the backend's pipeline (reference or Pallas kernels, through the
   api's dispatch table) on the local slice with local ranges ``clip([lo, hi) − d·n, 0,
   n)``, its threshold starting at max(τ, its own local seeds' τ) (``tau_floor=τ``);
   its answer is the exact Top-K of the local keys scoring ≥ τ (fewer than K, padded,
   on a device whose keys mostly score below τ). Every key of the global Top-K scores
   ≥ τ* ≥ τ, survives screening and refinement, and has fewer than K local keys ranked
   above it, so it is among the device's K records.
3. **exact merge** — the union of the P lists holds every global Top-K key with its
   exact score, so one exact selection (``select_records``: score desc, id asc) over
   it is the global Top-K. ``gather``: one all-gather of K records per device;
   ``tree``: log2 P butterfly rounds, each a pairwise exchange (``ppermute``) and an
   exact merge of two lists. A last all-reduce (max; every device holds the same
   values) types the result as replicated along the axis, so ``out_specs`` may
   leave the axis out.

On a 1-device axis the local seeds are the global seeds and the local answer is the
global one: phases 1 and 3 are skipped (the replicating all-reduce remains).

Collective payloads per query (int32 words of 4 bytes, :func:`collective_bytes_per_query`):
seeds 4·S_pad (all-reduce); merge 8K (all-gather, result 8K·P) or log2 P exchanges of
8K; replication 4·(2K + 6) (all-reduce max, with the max-combined statistics); 4·7
(all-reduce sum of the summed statistics). ``dense_topk`` moves the merge and 8K only.

Statistics (``Stats``): ``visible``, ``seeds``, ``screened``, ``survivors``,
``records``, ``overflows``, ``recoveries`` are summed over devices; ``rounds``,
``budget``, ``dense`` are the maximum over devices; ``pruning`` holds when every
device prunes; ``tau_seed`` is the shared threshold τ of phase 1 (each device starts
at or above it; on one device the pipeline's seed τ); ``tau_final`` is the K-th selected
score.

Gradients: ``scores`` carry the derivative of the selected keys' scores (as the
unsharded call's, ``dosa_jax.autodiff``): each device differentiates the ids it holds
and an all-reduce sums the tangents, so gradients reach the local key slice. Use
``shard_map``'s default ``check_vma=True`` when differentiating.

Backends: the local pass (and the local dense scan of :func:`dense_topk`) is the one
backend-specific step; it runs through ``dispatch``, the api's dispatcher
(``dosa_jax.api._dispatch``: ``"pallas"`` / ``"auto"`` on a GPU run the kernels, traced
inside the ``shard_map`` with the varying-axes checks off, :mod:`dosa_jax.manual_axes`).
The public entries (``dosa_jax.topk`` with ``context_axis``, ``dosa_jax.sharded_topk``)
pass it; called here without one, the entries answer with the reference pipeline
(:func:`reference_dispatch`). Both backends' local passes return the same records
(the exact Top-K of the local keys scoring ≥ τ), so the merged answer is the same.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec

from dosa_jax import autodiff
from dosa_jax import seeds as seeds_mod
from dosa_jax.backend import candidates
from dosa_jax.config import Config
from dosa_jax.decode import (DecodeState, DecodeStats, check_decode_inputs, decode_config,
                             decode_topk_reference, key_table, selected_rows, witness_budget)
from dosa_jax.dense import dense_topk_reference
from dosa_jax.inputs import check_hint, check_inputs, same_varying_axes
from dosa_jax.pipeline import dosa_topk_reference
from dosa_jax.results import Stats, TopKResult
from dosa_jax.scorer import score_ids_blocked
from dosa_jax.selection import INT32_MIN, key_to_score, order_key, select_records
from dosa_jax.tiling import map_query_tiles, round_up_to

__all__ = ["at_or_above", "collective_bytes", "collective_bytes_per_query", "decode_topk",
           "dense_topk", "local_pass", "merge_witnesses", "per_device_stats",
           "reference_decode_dispatch", "reference_dispatch", "shared_seed_threshold",
           "sharded_decode_topk", "sharded_topk", "topk"]

#: Statistics summed over devices, and combined by maximum (``pruning`` as its negation).
SUMMED = ("visible", "seeds", "screened", "survivors", "records", "overflows", "recoveries")
MAXED = ("rounds", "budget", "dense", "pruning", "tau_seed", "predicted_cost")


# ---- geometry -----------------------------------------------------------------------------

def axis_geometry(axis: str, n_local: int):
    """(P, d, offset) of this device on mesh axis ``axis``: P devices, index d, first global
    key id d·n. Raises ValueError naming ``Config.context_axis`` outside a ``shard_map``
    over that axis."""
    try:
        P = lax.axis_size(axis)
        d = lax.axis_index(axis)
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(f"Config.context_axis={axis!r}: not a mesh axis of the enclosing "
                         f"jax.shard_map (call topk / decode_topk inside shard_map over "
                         f"{axis!r}, or use dosa_jax.sharded_topk / sharded_decode_topk): "
                         f"{e}") from e
    return int(P), d, (d * n_local).astype(jnp.int32)


def local_ranges(lo, hi, offset, n_local: int):
    """This device's visible ranges: ``clip([lo, hi) − offset, 0, n)`` (empty if disjoint)."""
    lo_l = jnp.clip(lo - offset, 0, n_local).astype(jnp.int32)
    hi_l = jnp.clip(hi - offset, 0, n_local).astype(jnp.int32)
    return lo_l, jnp.maximum(hi_l, lo_l)


def to_local_ids(ids, offset, n_local: int):
    """Global key ids → this device's local ids (−1 for ids held elsewhere or < 0)."""
    loc = ids - offset
    return jnp.where((ids >= 0) & (loc >= 0) & (loc < n_local), loc, -1).astype(jnp.int32)


def to_global_ids(idx, offset):
    """Local selected ids → global ids (−1 pads stay −1)."""
    return jnp.where(idx >= 0, idx + offset, -1).astype(jnp.int32)


def _check_global_ranges(lo, hi, T: int, N: int):
    """Validated global ranges clipped to [0, N] (N = P·n, the keys over all devices)."""
    if (lo is None) != (hi is None):
        raise ValueError("lo and hi must be given together (or neither)")
    if lo is None:
        return jnp.zeros((T,), jnp.int32), jnp.full((T,), N, jnp.int32)
    for name, x in (("lo", lo), ("hi", hi)):
        if not hasattr(x, "shape") or tuple(x.shape) != (T,):
            raise ValueError(f"{name} must have shape [T] = ({T},), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    lo = jnp.clip(jnp.asarray(lo).astype(jnp.int32), 0, N)
    hi = jnp.clip(jnp.asarray(hi).astype(jnp.int32), 0, N)
    return lo, jnp.maximum(hi, lo)


_REFERENCE = {"topk": dosa_topk_reference, "dense_topk": dense_topk_reference}


def reference_dispatch(backend: str, op: str, *args, **kwargs):
    """``dispatch`` without the api: the reference pipeline's ``op`` ("topk" or
    "dense_topk"), for a backend that may answer with it. ``dosa_jax.topk`` and
    ``dosa_jax.sharded_topk`` pass the api's dispatcher, which also reaches the kernels."""
    if "reference" not in candidates(backend):
        raise NotImplementedError(
            f"context-parallel {op} for backend={backend!r}: the kernels are reached through "
            "the api's dispatch table; call dosa_jax.topk / dosa_jax.sharded_topk (or pass "
            "dispatch=dosa_jax.api._dispatch)")
    return _REFERENCE[op](*args, **kwargs)


def at_or_above(idx, sc, tau):
    """(idx, sc) [T, K] with the records scoring below τ [T] made pads (−1, −inf): the exact
    Top-K of the keys scoring ≥ τ, from a Top-K of a set holding all of them (the records are
    in contract order, so the pads stay last)."""
    keep = ~(sc < tau[:, None])
    return jnp.where(keep, idx, -1), jnp.where(keep, sc, -jnp.inf)


# ---- phase 1: the shared threshold --------------------------------------------------------

def shared_seed_threshold(q, w, k, k_scale, lo, hi, offset, config: Config, axis: str):
    """[T] τ: the K-th score of the *global* seed layout on [lo, hi) (Eq. 2), each seed
    scored by the device holding it; one all-reduce of S_pad int32 order keys per query.
    Equal to the unsharded pipeline's seed threshold (same layout, same scorer)."""
    B = config.key_block
    S_pad = round_up_to(config.seeds(), B)
    n_local = k.shape[0]

    def tile(qt, wt, lot, hit):
        layout = seeds_mod.seed_layout(lot, hit, config.seed_strategy, config.seeds(),
                                       config.sink_size, config.local_fraction)
        sid, svalid = seeds_mod.seed_ids(layout, S_pad)
        lid = to_local_ids(sid, offset, n_local)
        own = svalid & (lid >= 0)
        sc = score_ids_blocked(qt, wt, k, k_scale, jnp.maximum(lid, 0), B)
        return jnp.where(own, order_key(sc), INT32_MIN), svalid

    keys, valid = map_query_tiles(tile, q, w, lo, hi, config.query_tile)
    keys = lax.pmax(keys, axis)        # every seed is held by exactly one device
    ok = valid & (keys != INT32_MIN)   # NaN seeds are not eligible
    return seeds_mod.seed_threshold(key_to_score(keys), ok, config.top_k)


# ---- phase 2: the local pass --------------------------------------------------------------

def local_pass(q, k, w, k_scale, lo, hi, config: Config, *, hint=None,
               share_threshold: bool = True, dispatch=None):
    """This device's exact candidates on validated inputs (k the local slice, lo/hi global).

    Returns (global ids [T, K], scores [T, K], per-device Stats, τ [T], offset): the exact
    Top-K of this device's keys scoring ≥ τ (−1/−inf pads after them), the same records on
    every backend. ``share_threshold=False`` starts from the local seeds' τ alone (τ then
    −inf: the local Top-K; for measuring what sharing buys). On a 1-device axis the local
    seeds are the global seeds: no collective, τ is the pipeline's. ``dispatch``: the api's
    dispatcher (``backend``, ``op``, arguments), :func:`reference_dispatch` when None.
    """
    axis = config.context_axis
    n_local = k.shape[0]
    P, _, offset = axis_geometry(axis, n_local)
    lo_l, hi_l = local_ranges(lo, hi, offset, n_local)
    local_cfg = config.replace(context_axis=None)
    hint_l = None if hint is None else to_local_ids(hint.astype(jnp.int32), offset, n_local)
    # one device: its own seeds are the global seeds, the pipeline's τ is the shared one
    share = share_threshold and P > 1
    tau = (shared_seed_threshold(q, w, k, k_scale, lo, hi, offset, config, axis) if share
           else jnp.full(lo.shape, -jnp.inf, jnp.float32))
    q, k, w, k_scale, lo_l, hi_l, tau = same_varying_axes(q, k, w, k_scale, lo_l, hi_l, tau)
    if hint_l is not None:
        hint_l = same_varying_axes(hint_l, q)[0]
    idx, sc, stats = (dispatch or reference_dispatch)(
        config.backend, "topk", q, k, w, k_scale, lo_l, hi_l, local_cfg, hint=hint_l,
        tau_floor=tau if share else None)
    if share:   # the reference keeps its seeds below the floor: the same records on every backend
        idx, sc = at_or_above(idx, sc, tau)
    if share_threshold and not share:
        tau = stats.tau_seed
    return to_global_ids(idx, offset), sc, stats, tau, offset


# ---- phase 3: the exact merge -------------------------------------------------------------

def merge_gather(idx, sc, K: int, axis: str):
    """Exact global Top-K from one all-gather of every device's K records (one collective of
    [T, 2K] int32 per device) and one exact selection over the P·K records."""
    rec = jnp.concatenate([order_key(sc), idx], axis=1)       # [T, 2K] int32
    allr = lax.all_gather(rec, axis)                          # [P, T, 2K]
    P, T = allr.shape[0], allr.shape[1]
    keys = jnp.moveaxis(allr[:, :, :K], 0, 1).reshape(T, P * K)
    ids = jnp.moveaxis(allr[:, :, K:], 0, 1).reshape(T, P * K)
    return select_records(key_to_score(keys), ids, K, valid=keys != INT32_MIN)


def merge_tree(idx, sc, K: int, axis: str, P: int):
    """Exact global Top-K by log2 P butterfly rounds: in round r device d exchanges its
    current list with device d XOR 2^r (``ppermute``) and keeps the exact Top-K of the two.
    Merging is associative and commutative, so after the last round every device holds the
    Top-K of all P lists. P must be a power of two."""
    for r in range(int(math.log2(P))):
        perm = [(i, i ^ (1 << r)) for i in range(P)]
        other = lax.ppermute(jnp.concatenate([order_key(sc), idx], axis=1), axis, perm)
        okeys, oids = other[:, :K], other[:, K:]
        idx, sc = select_records(jnp.concatenate([sc, key_to_score(okeys)], axis=1),
                                 jnp.concatenate([idx, oids], axis=1), K,
                                 valid=jnp.concatenate([idx >= 0, okeys != INT32_MIN], axis=1))
    return idx, sc


def merge_candidates(idx, sc, config: Config, P: int):
    """Exact global Top-K of the per-device lists by ``config.context_merge``."""
    if P == 1:
        return idx, sc
    if config.context_merge == "tree" and (P & (P - 1)) == 0:
        return merge_tree(idx, sc, config.top_k, config.context_axis, P)
    return merge_gather(idx, sc, config.top_k, config.context_axis)


def replicated(idx, sc, axis: str, extra_max=None):
    """(idx, sc, extra) typed as replicated along ``axis``: every device holds the same
    values, so an all-reduce max of their int32 words returns them unchanged; ``extra_max``
    [T, m] int32 are further words combined by maximum in the same collective."""
    K = idx.shape[1]
    words = [order_key(sc), idx] + ([] if extra_max is None else [extra_max])
    out = lax.pmax(jnp.concatenate(words, axis=1), axis)
    return out[:, K:2 * K], key_to_score(out[:, :K]), out[:, 2 * K:]


def combine_stats(stats: Stats, tau, axis: str):
    """(summed [T, 7] int32 words, max-combined [T, 6] int32 words) of one device's Stats;
    :func:`finish_stats` turns the all-reduced words back into Stats."""
    sums = jnp.stack([getattr(stats, f).astype(jnp.int32) for f in SUMMED], axis=1)
    maxes = jnp.stack([stats.rounds.astype(jnp.int32), stats.budget.astype(jnp.int32),
                       stats.dense.astype(jnp.int32), (~stats.pruning).astype(jnp.int32),
                       order_key(tau), order_key(stats.predicted_cost)], axis=1)
    return lax.psum(sums, axis), maxes


def finish_stats(sums, maxes, like: Stats) -> Stats:
    """Stats from the all-reduced words of :func:`combine_stats`."""
    s = {f: sums[:, i].astype(getattr(like, f).dtype) for i, f in enumerate(SUMMED)}
    cost = maxes[:, 5]
    return Stats(**s, rounds=maxes[:, 0], budget=maxes[:, 1].astype(like.budget.dtype),
                 dense=maxes[:, 2] > 0, pruning=maxes[:, 3] == 0,
                 tau_seed=key_to_score(maxes[:, 4]),
                 tau_final=like.tau_final,
                 predicted_cost=jnp.where(cost == INT32_MIN, jnp.nan, key_to_score(cost)))


# ---- gradients ----------------------------------------------------------------------------

def selected_scores_sharded(q, k, w, k_scale, local_idx, scores, axis: str):
    """``scores`` unchanged, differentiable as ``autodiff.selected_scores`` at the selected
    global ids: each device's tangent covers the ids it holds (``local_idx`` ≥ 0; −1
    elsewhere) and an all-reduce sums them, so exactly one device contributes per slot."""

    @jax.custom_jvp
    def value(q, k, w, k_scale, scores):
        return scores

    def jvp(primals, tangents):
        q, k, w, k_scale, scores = primals
        if all(t is None or isinstance(t, SymbolicZero) for t in tangents[:4]):
            return scores, jnp.zeros(scores.shape, scores.dtype)
        zeros = jnp.zeros(scores.shape, scores.dtype)
        _, t = autodiff._selected_scores_jvp((q, k, w, k_scale, local_idx, zeros),
                                             tuple(tangents[:4]) + (None, None))
        return scores, lax.psum(t, axis)

    value.defjvp(jvp, symbolic_zeros=True)
    return value(q, k, w, k_scale, scores)


def _differentiable(q, k, w, k_scale, idx, sc, offset, axis):
    local = to_local_ids(lax.stop_gradient(idx), offset, k.shape[0])
    local = same_varying_axes(local, k)[0]
    return lax.stop_gradient(idx), selected_scores_sharded(q, k, w, k_scale, local, sc, axis)


# ---- the public entries (validated config with top_k) --------------------------------------

def _varying_over(x, axis: str) -> bool:
    """Whether ``x``'s type varies over mesh axis ``axis`` (False without such types)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else None
    mat = getattr(aval, "mat", None)
    axes = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return axis in (axes or ())


def _validate(q, k, w, k_scale, lo, hi, config: Config):
    """Checked arrays with global ranges, and P."""
    k_given = k
    q, k, w, k_scale, _, _ = check_inputs(q, k, w, k_scale)
    axis = config.context_axis
    P, d, _ = axis_geometry(axis, k.shape[0])
    # with varying-axes types (check_vma), a k replicated over the axis is not a slice
    if P > 1 and _varying_over(d, axis) and not _varying_over(k_given, axis):
        raise ValueError(f"k must be this device's slice of keys sharded along "
                         f"Config.context_axis={axis!r} (in_specs P({axis!r}) for k); it is "
                         f"replicated over {axis!r}")
    lo, hi = _check_global_ranges(lo, hi, q.shape[0], P * k.shape[0])
    return q, k, w, k_scale, lo, hi, P


def topk(q, k, w, k_scale, lo, hi, config: Config, hint=None, *, dispatch=None) -> TopKResult:
    """Context-parallel DoSA Top-K inside ``shard_map`` over ``config.context_axis``
    (``dosa_jax.topk`` routes here, passing its ``dispatch``): ``k`` [n, D] this device's
    slice, ``lo``/``hi`` global. Returns the global Top-K (global ids), the same on every
    device of the axis."""
    q, k, w, k_scale, lo, hi, P = _validate(q, k, w, k_scale, lo, hi, config)
    config.budgets(q.shape[1])
    hint = check_hint(hint, q.shape[0])
    axis = config.context_axis
    cq, ck, cw, cs = (None if x is None else lax.stop_gradient(x) for x in (q, k, w, k_scale))
    idx, sc, stats, tau, offset = local_pass(cq, ck, cw, cs, lo, hi, config, hint=hint,
                                             dispatch=dispatch)
    idx, sc = merge_candidates(idx, sc, config, P)
    sums, maxes = combine_stats(stats, tau, axis)
    idx, sc, maxes = replicated(idx, sc, axis, maxes)
    idx, sc = _differentiable(q, k, w, k_scale, idx, sc, offset, axis)
    stats = finish_stats(sums, maxes, stats)
    stats = stats._replace(tau_final=jnp.where(idx[:, -1] >= 0, sc[:, -1], -jnp.inf))
    return TopKResult(idx, sc, stats)


def dense_topk(q, k, w, k_scale, lo, hi, config: Config, *, dispatch=None) -> TopKResult:
    """Context-parallel dense Top-K (every visible local key scored, exact merge); same
    arguments as :func:`topk`. ``stats`` holds ``visible`` (global)."""
    q, k, w, k_scale, lo, hi, P = _validate(q, k, w, k_scale, lo, hi, config)
    axis = config.context_axis
    n_local = k.shape[0]
    _, _, offset = axis_geometry(axis, n_local)
    lo_l, hi_l = local_ranges(lo, hi, offset, n_local)
    cq, ck, cw, cs, lo_l, hi_l = same_varying_axes(
        *(None if x is None else lax.stop_gradient(x) for x in (q, k, w, k_scale)), lo_l, hi_l)
    idx, sc = (dispatch or reference_dispatch)(config.backend, "dense_topk", cq, ck, cw, cs,
                                               lo_l, hi_l, config.replace(context_axis=None))
    idx, sc = merge_candidates(to_global_ids(idx, offset), sc, config, P)
    idx, sc, _ = replicated(idx, sc, axis)
    idx, sc = _differentiable(q, k, w, k_scale, idx, sc, offset, axis)
    return TopKResult(idx, sc, {"visible": hi - lo})


# ---- decode ---------------------------------------------------------------------------------

def _local_capacity(k, page_table) -> int:
    """Sequence positions per device: N of contiguous keys [B, N, D], or max_pages · page."""
    return k.shape[1] if page_table is None else page_table.shape[1] * k.shape[1]


def merge_witnesses(ids, keys, n: int, axis: str, P: int):
    """The ``n`` best (global ids, order keys) [T, n] of every device's next witnesses: one
    all-gather of [T, 2n] int32 per device and a Top-n. No id is on two devices' lists (each
    device keeps the keys it holds), so the result is the best ``n`` of what all looked at."""
    if P == 1:
        return ids
    allr = lax.all_gather(jnp.concatenate([keys, ids], axis=1), axis)    # [P, T, 2n]
    T = allr.shape[1]
    gk = jnp.moveaxis(allr[:, :, :n], 0, 1).reshape(T, P * n)
    gi = jnp.moveaxis(allr[:, :, n:], 0, 1).reshape(T, P * n)
    top_key, pos = lax.top_k(gk, n)
    return jnp.where(top_key == INT32_MIN, -1, jnp.take_along_axis(gi, pos, axis=1))


def decode_topk(q, k, w, ids, k_scale, lengths, page_table, config: Config, *, dispatch=None):
    """Context-parallel decode step inside ``shard_map`` over ``config.context_axis``, on
    validated inputs (``dosa_jax.decode_topk`` routes here): q [B, M, H, D] and w, ``ids``
    (the witnesses, global positions) and ``lengths`` (global) the same on every device;
    k this device's keys — contiguous [B, n, D], positions [d·n, (d+1)·n) of each
    sequence, or paged: this device's pool [P, page, D] and ``page_table`` [B, max_pages]
    its pages of positions [d·n, (d+1)·n), n = max_pages · page.

    Three steps, as :func:`topk`'s: (1) each device scores the witnesses it holds and one
    all-reduce (max, W int32 per query) gives every device every witness's key, so τ_w is
    the unsharded step's; (2) the backend's decode step on the local keys with that τ_w;
    (3) the exact merge of the per-device Top-K lists, and the next witnesses: the best
    W / M of the devices' own (one all-gather of 2·W / M int32 per query).

    Returns (indices [B, M, K] global positions, scores, DecodeStats summed over devices,
    except ``tau_witness`` (the shared τ_w) and ``overflow`` (any device), next witnesses
    [B, M, W / M]), the same on every device of the axis; indices and scores bitwise the
    unsharded ``decode_topk``'s.
    """
    axis = config.context_axis
    B, M = q.shape[:2]
    K = config.top_k
    n_local = _local_capacity(k, page_table)
    P, _, offset = axis_geometry(axis, n_local)
    lengths_l = jnp.clip(lengths - offset, 0, n_local).astype(jnp.int32)
    ids_l = to_local_ids(ids, offset, n_local)
    combine = (lambda x: lax.pmax(x, axis)) if P > 1 else (lambda x: x)
    cq, ck, cw, cs = (None if x is None else lax.stop_gradient(x) for x in (q, k, w, k_scale))
    cq, ck, cw, cs, lengths_l, ids_l = same_varying_axes(cq, ck, cw, cs, lengths_l, ids_l)
    pt = None if page_table is None else same_varying_axes(page_table, cq)[0]
    idx, sc, st, (nid, nkey) = (dispatch or reference_decode_dispatch)(
        config.backend, "decode_topk", cq, ck, cw, ids_l, cs, lengths_l, pt,
        config.replace(context_axis=None), combine=combine)
    T = B * M
    carry = witness_budget(ids.shape[1], M)
    idx = to_global_ids(idx.reshape(T, K), offset)
    idx, sc = merge_candidates(idx, sc.reshape(T, K), config, P)
    nxt = merge_witnesses(to_global_ids(nid.reshape(T, carry), offset),
                          jnp.where(nid >= 0, nkey, INT32_MIN).reshape(T, carry), carry,
                          axis, P)
    words = lambda x: x.reshape(T, 1).astype(jnp.int32)
    sums = lax.psum(jnp.concatenate([words(st.witnesses), words(st.candidates)], axis=1), axis)
    extra = jnp.concatenate([nxt, sums, words(st.overflow),
                             order_key(st.tau_witness.reshape(T, 1))], axis=1)
    idx, sc, extra = replicated(idx, sc, axis, extra)
    nxt = extra[:, :carry]
    stats = DecodeStats(visible=jnp.broadcast_to(lengths[:, None], (B, M)).astype(jnp.int32),
                        witnesses=extra[:, carry].reshape(B, M),
                        tau_witness=key_to_score(extra[:, carry + 3]).reshape(B, M),
                        candidates=extra[:, carry + 1].reshape(B, M),
                        overflow=extra[:, carry + 2].reshape(B, M))
    # gradients: each device differentiates the rows it holds, an all-reduce sums them
    local = to_local_ids(lax.stop_gradient(idx), offset, n_local).reshape(B, M, K)
    rows = selected_rows(k, page_table, local).reshape(T, K)
    flat_k, flat_s = key_table(k, k_scale)
    rows = same_varying_axes(rows, flat_k)[0]
    H, D = q.shape[2], q.shape[3]
    sc = selected_scores_sharded(q.reshape(T, H, D), flat_k, w.reshape(T, H), flat_s, rows, sc,
                                 axis)
    r = lambda x: x.reshape(B, M, *x.shape[1:])
    return r(lax.stop_gradient(idx)), r(sc), stats, r(nxt)


def reference_decode_dispatch(backend: str, op: str, *args, **kwargs):
    """``dispatch`` for :func:`decode_topk` without the api: the reference decode step."""
    if "reference" not in candidates(backend):
        raise NotImplementedError(
            f"context-parallel {op} for backend={backend!r}: the kernels are reached through "
            "the api's dispatch table; call dosa_jax.decode_topk / dosa_jax.sharded_decode_topk")
    return decode_topk_reference(*args, **kwargs)


# ---- the shard_map wrapper ----------------------------------------------------------------

def _shard_map():
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # pragma: no cover - jax without jax.shard_map
        from jax.experimental.shard_map import shard_map as sm
    return sm


def sharded_topk(q, k, w, *, mesh, axis: str = "cp", query_axis: Optional[str] = None,
                 k_scale=None, lo=None, hi=None, config: Optional[Config] = None,
                 hint=None, dense: bool = False, dispatch=None) -> TopKResult:
    """Exact Top-K with the keys sharded along mesh axis ``axis`` (the ``shard_map`` done).

    Args:
      q [T, H, D], k [N, D], w [T, H], k_scale [N], lo/hi [T], hint [T, M]: global arrays
        (any placement, e.g. ``k`` under ``NamedSharding(mesh, P(axis))``); arguments as
        ``dosa_jax.topk``.
      mesh: a ``jax.sharding.Mesh`` with axis ``axis`` (and ``query_axis`` if given).
      query_axis: optional mesh axis over which the queries are sharded at the same time
        (data parallel); T need not divide its size.
      config: :class:`Config` (static, with ``top_k``; ``dosa_jax.sharded_topk`` also takes
        ``top_k=``); its ``context_axis`` is set to ``axis``.
      dense: answer with ``dense_topk`` (full scoring) instead of DoSA.
      dispatch: the api's dispatcher for the local pass (``dosa_jax.sharded_topk`` passes
        it; None: :func:`reference_dispatch`).
    Returns:
      TopKResult equal bitwise to the unsharded ``topk`` (``dense_topk``) of the same keys.
      N need not divide the axis size: keys are padded to a multiple of it with invisible
      keys (ranges are clipped to [0, N] first).
    """
    config = (config or Config()).replace(context_axis=axis)
    for name in (axis,) + (() if query_axis is None else (query_axis,)):
        if name not in mesh.shape:
            raise ValueError(f"mesh has no axis {name!r} (axes: {tuple(mesh.shape)})")
    if query_axis == axis:
        raise ValueError(f"query_axis must differ from axis, both are {axis!r}")
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    hint = check_hint(hint, q.shape[0])
    T, N = q.shape[0], k.shape[0]
    Pk = mesh.shape[axis]
    Pq = 1 if query_axis is None else mesh.shape[query_axis]
    npad = round_up_to(max(N, 1), Pk)
    tpad = round_up_to(max(T, 1), Pq)
    if npad != N:   # padded keys are invisible: ranges were clipped to [0, N]
        k = jnp.pad(k, ((0, npad - N), (0, 0)))
        k_scale = None if k_scale is None else jnp.pad(k_scale, (0, npad - N),
                                                       constant_values=1.0)
    if tpad != T:   # padded queries see nothing
        padt = lambda x, v=0: jnp.pad(x, ((0, tpad - T),) + ((0, 0),) * (x.ndim - 1),
                                      constant_values=v)
        q, w, lo, hi = padt(q), padt(w), padt(lo), padt(hi)
        hint = None if hint is None else padt(hint, -1)
    qs, ks = PartitionSpec(query_axis), PartitionSpec(axis)
    args = [q, k, w, lo, hi] + ([] if k_scale is None else [k_scale]) + (
        [] if hint is None else [hint])
    specs = [qs, ks, qs, qs, qs] + ([] if k_scale is None else [ks]) + (
        [] if hint is None else [qs])
    has_scale, has_hint = k_scale is not None, hint is not None

    def body(q, k, w, lo, hi, *rest):
        rest = list(rest)
        sc = rest.pop(0) if has_scale else None
        hn = rest.pop(0) if has_hint else None
        if dense:
            return tuple(dense_topk(q, k, w, sc, lo, hi, config, dispatch=dispatch))
        return tuple(topk(q, k, w, sc, lo, hi, config, hn, dispatch=dispatch))

    out = _shard_map()(body, mesh=mesh, in_specs=tuple(specs), out_specs=qs)(*args)
    res = TopKResult(*out)
    if tpad != T:
        res = jax.tree_util.tree_map(lambda x: x[:T], res)
    return res


def per_device_stats(q, k, w, *, mesh, axis: str = "cp", k_scale=None, lo=None, hi=None,
                     config: Config, share_threshold: bool = True, dispatch=None) -> Stats:
    """Each device's own local-pass Stats ([P, T] arrays, row d = device d) for keys sharded
    along ``axis`` (N a multiple of its size): what the shared τ (or, with
    ``share_threshold=False``, the local seeds alone) leaves each device to score."""
    config = config.replace(context_axis=axis)
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    if k.shape[0] % mesh.shape[axis]:
        raise ValueError(f"k has {k.shape[0]} keys, not a multiple of mesh axis {axis!r} "
                         f"of size {mesh.shape[axis]}")
    ks = PartitionSpec(axis)
    scale = () if k_scale is None else (k_scale,)

    def body(q, k, w, lo, hi, *s):
        st = local_pass(q, k, w, s[0] if s else None, lo, hi, config,
                        share_threshold=share_threshold, dispatch=dispatch)[2]
        return jax.tree_util.tree_map(lambda x: x[None], st)

    specs = (PartitionSpec(), ks, PartitionSpec(), PartitionSpec(), PartitionSpec()) + (
        (ks,) if scale else ())
    return _shard_map()(body, mesh=mesh, in_specs=specs, out_specs=ks)(q, k, w, lo, hi, *scale)


# ---- collective payloads ------------------------------------------------------------------

def collective_bytes_per_query(P: int, config: Config, *, dense: bool = False) -> dict:
    """Bytes each device contributes per query to each collective (operand sizes), by phase:
    ``seed_threshold`` (all-reduce, 4·S_pad), ``merge`` (all-gather of 8K, or log2 P
    ``ppermute`` of 8K for a tree), ``replicate`` (all-reduce of 4·(2K + 6); 8K for dense),
    ``stats`` (all-reduce of 4·7). An all-gather's result is P times its operand. With P = 1
    there is no seed all-reduce and no merge."""
    K = config.top_k
    S_pad = round_up_to(config.seeds(), config.key_block)
    tree = config.context_merge == "tree" and (P & (P - 1)) == 0
    merge = {"collective-permute": 8 * K * int(math.log2(P))} if tree else {"all-gather": 8 * K}
    if P == 1:   # the local answer is the global one; only the replication remains
        merge = {}
    if dense:
        return {"merge": merge, "replicate": {"all-reduce": 8 * K}}
    return {"seed_threshold": {"all-reduce": 4 * S_pad} if P > 1 else {}, "merge": merge,
            "replicate": {"all-reduce": 4 * (2 * K + len(MAXED))},
            "stats": {"all-reduce": 4 * len(SUMMED)}}


_HLO_COLLECTIVE = re.compile(
    r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\s(all-reduce|all-gather|collective-permute)"
    r"(?:-start)?\(")
_ITEMSIZE = {"s32": 4, "u32": 4, "f32": 4, "pred": 1, "s8": 1, "bf16": 2, "f16": 2,
             "s64": 8, "f64": 8}


def collective_bytes(hlo_text: str) -> dict:
    """Total result bytes of each collective kind in a compiled HLO module's text
    (``jax.jit(f).lower(...).compile().as_text()``): {kind: bytes}."""
    out = {}
    for dtype, dims, kind in _HLO_COLLECTIVE.findall(hlo_text):
        n = math.prod(int(x) for x in dims.split(",") if x) if dims else 1
        out[kind] = out.get(kind, 0) + n * _ITEMSIZE.get(dtype, 4)
    return out


def sharded_decode_topk(q, k, w, state, *, mesh, axis: str = "cp", k_scale=None, lengths=None,
                        config: Optional[Config] = None, step):
    """One decode step with each sequence's keys sharded along mesh axis ``axis`` (the
    ``shard_map`` done): k [B, N, D] contiguous (N a multiple of the axis size; e.g. placed
    under ``NamedSharding(mesh, P(None, axis))``), k_scale [B, N], q/w/lengths/state as
    ``dosa_jax.decode_topk``'s. Returns (TopKResult, DecodeState) bitwise equal, in indices
    and scores, to the unsharded ``decode_topk``; the state is the same on every device.

    Paged keys under context parallelism: call ``dosa_jax.decode_topk`` with
    ``Config(context_axis=axis)`` inside your ``shard_map``, each device passing its own page
    pool and the page table of its positions (:func:`decode_topk`).

    ``step``: the decode step run inside the ``shard_map`` (``dosa_jax.decode_topk``, which
    ``dosa_jax.sharded_decode_topk`` passes).
    """
    config = decode_config(config).replace(context_axis=axis)
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    if getattr(k, "ndim", 0) != 3:
        raise ValueError(f"k must have shape [B, N, D] (contiguous keys), got "
                         f"{getattr(k, 'shape', None)}")
    Pk = mesh.shape[axis]
    if k.shape[1] % Pk:
        raise ValueError(f"k has N={k.shape[1]} keys per sequence, not a multiple of mesh axis "
                         f"{axis!r} of size {Pk}")
    if lengths is None:
        lengths = jnp.full((k.shape[0],), k.shape[1], jnp.int32)
    q2, k, w2, ids, k_scale, lengths, _, squeeze = check_decode_inputs(
        q, k, w, state, k_scale, lengths, None)
    rep, ks = PartitionSpec(), PartitionSpec(None, axis)
    has_scale = k_scale is not None

    def body(q, k, w, ids, lengths, *s):
        return tuple(step(q, k, w, DecodeState(ids), k_scale=s[0] if s else None,
                          lengths=lengths, config=config))

    args = (q2, k, w2, ids, lengths) + ((k_scale,) if has_scale else ())
    specs = (rep, ks, rep, rep, rep) + ((ks,) if has_scale else ())
    res, new_state = _shard_map()(body, mesh=mesh, in_specs=specs, out_specs=rep)(*args)
    res = TopKResult(*res) if not isinstance(res, TopKResult) else res
    if squeeze:
        res = jax.tree_util.tree_map(lambda x: x[:, 0], res)
    return res, new_state
