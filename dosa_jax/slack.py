"""Certificate slack per key, a differentiable survival surrogate, and an optax regulariser.

Pruning keeps key i unless its certificate falls below the threshold, ``U_i < τ``
(Eq. 9, Eq. 2); with δ_i = U_i − s_i, b = τ* − τ and Δ_i = τ* − s_i this is
``Δ_i > δ_i + b`` (Eq. 17): the smaller the slack, the more keys are rejected. A
trained indexer whose geometry keeps δ small is cheaper to run exactly (DESIGN §16).

Here U is the **real-number** certificate of the plan the reference pipeline builds
(no numerical enclosure, no directed rounding — it is a training signal, not a bound
the screen relies on):

    U_i = Σ_{j∈R} w̃_j relu(q_j·k_i) + E ‖k_i‖ − relu(a_A·k_i)                 (Eq. 9)

with the folded weights w̃_j = w_j + Σ_{h∈P, j*_h=j} w_h β_h and β_h =
relu(q_h·q_{j*})/‖q_{j*}‖² (Eq. 4–6), E the configured positive-residual allowance of
u_h = w_h (q_h − β_h q_{j*_h}) — triangle Σ_P ‖u_h‖ (Eq. 6), joint
½(‖Σ u_h‖ + sqrt(Σ_{h,l}|u_h·u_l|)) (Eq. 7), grouped sqrt(Σ_g B_g²) (App. A.1) or the
least of them (``best``) — and a_A = Σ_{h∈A} |w_h| q_h (Eq. 8). Plans in the
absolute-value form (Eq. 24–25, every positive head retained) subtract a_A·k instead
of relu(a_A·k). For FP8 keys every dot and norm is taken on k_i = α_i k̄_i.

The plan's **discrete** choices — retained heads R, anchors j*, negative support A,
the certificate form, the seed threshold τ and the Top-K set — are those of
:func:`dosa_jax.pipeline.plan_tile` on ``lax.stop_gradient`` inputs and are constants
of the derivative; the **continuous** parts (β, w̃, E, a_A, the head dots and key
norms) are differentiated with respect to q, k, w and ``k_scale``.

* :func:`plan_choices` — the discrete choices of the reference planner.
* :func:`certificate_coefficients` — β, w̃, E, |w| on A for given choices (differentiable).
* :func:`per_key_slack` — U, s, δ = U − s and its Eq. 14 split for every key.
* :func:`slack_loss` — the smooth survival rate (the training loss).
* :func:`regularizer` — ``optax.GradientTransformationExtraArgs`` adding
  ``weight · ∇ slack_loss`` to the updates.
* :func:`screening_work` — the dot products a ``topk`` call spent (Eq. 21 measured), the
  quantity a lower slack buys: with ``retained_heads="auto"`` the planner spends a
  tighter certificate on a smaller budget r as well as on fewer survivors, so the
  survival rate alone can rise while the work falls (DESIGN §16).

Cost: every key is scored with all H heads (T·N·H·D multiply-adds, like the dense
scorer); query tiles of ``config.query_tile`` run under ``lax.map`` with
``jax.checkpoint``, so memory holds one tile's [Tq, N, H] head dots.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax import diagnostics
from dosa_jax.bounds.positive import RESIDUALS
from dosa_jax.config import Config
from dosa_jax import witnesses
from dosa_jax.dense import dense_topk_reference
from dosa_jax.inputs import check_inputs
from dosa_jax.pipeline import plan_tile, prepare_keys
from dosa_jax.tiling import map_query_tiles
from dosa_jax.planner import residual_groups

HIGHEST = lax.Precision.HIGHEST
THRESHOLDS = ("seed", "exact")


# ----------------------------------------------------------------------------- the plan

class PlanChoices(NamedTuple):
    """Discrete choices of each query's plan (constants of every derivative here).

    Attributes:
      retained, omitted_pos, omitted_neg, support: [T, H] bool: R, P = H⁺∖R, N = H⁻∖R and
        the negative support A ⊆ N (DESIGN §4, Eq. 8).
      anchor: [T, H] int32 anchor j*_h of each h ∈ P (−1: none, β_h = 0; Eq. 4–5).
      linear: [T] bool, absolute-value form (Eq. 24–25): subtract a_A·k, not relu(a_A·k).
      tau_seed: [T] float32 seed threshold τ (Eq. 2, with the pipeline's witnesses).
      budget: [T] int32 retained-head budget r.
    """

    retained: jax.Array
    omitted_pos: jax.Array
    omitted_neg: jax.Array
    support: jax.Array
    anchor: jax.Array
    linear: jax.Array
    tau_seed: jax.Array
    budget: jax.Array


def plan_choices(q, k, w, k_scale=None, lo=None, hi=None, config: Optional[Config] = None
                 ) -> PlanChoices:
    """The reference pipeline's plan choices and seed threshold for every query.

    Runs the seeds and planner exactly as ``dosa_jax.topk`` with ``backend="reference"``
    (:func:`dosa_jax.pipeline.plan_tile`, with the anchor queries' witnesses when
    ``config.anchor_stride`` is set) on ``lax.stop_gradient`` inputs.
    """
    config = config or Config()
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    sg = lax.stop_gradient
    q, k, w = sg(q), sg(k), sg(w)
    k_scale = None if k_scale is None else sg(k_scale)
    keys = prepare_keys(k, k_scale, config.key_block)
    anchors = witnesses.anchor_topk(dense_topk_reference, q, k, w, k_scale, lo, hi, config)
    hint = witnesses.per_query_witnesses(anchors, config.anchors(q.shape[0]), q.shape[0])

    def tile(qt, wt, lot, hit, *h):
        tp = plan_tile(qt, wt, lot, hit, keys, config, h[0] if h else None)
        d = tp.details
        return PlanChoices(d.retained, d.omitted_pos, d.omitted_neg, d.support, d.anchor,
                           tp.plan.aggregate_linear, tp.tau, tp.budget)

    extra = () if hint is None else (hint,)
    return map_query_tiles(tile, q, w, lo, hi, config.query_tile, *extra)


# ----------------------------------------------------------------- continuous coefficients

class CertificateCoefficients(NamedTuple):
    """Continuous coefficients of each query's certificate (Eq. 4–9), differentiable.

    Attributes:
      w_fold: [T, H] folded weights w̃ (non-zero on R only; Eq. 6).
      residual: [T] positive-residual allowance E (the configured form; Eq. 6, 7, A.1).
      support_weight: [T, H] |w_h| on A, 0 elsewhere (a_A = Σ_h support_weight_h q_h; Eq. 8).
      beta: [T, H] β_h (0 off P or without an anchor; Eq. 4–5).
      residual_norm: [T, H] ‖d_h‖ = ‖q_h − β_h q_{j*_h}‖ on P (the Eq. 14 split).
    """

    w_fold: jax.Array
    residual: jax.Array
    support_weight: jax.Array
    beta: jax.Array
    residual_norm: jax.Array


def _compute_dtype(*dtypes):
    """At least float32; float64 when an operand is (the float64 checks)."""
    f64 = jnp.dtype(jnp.float64)
    return f64 if any(jnp.dtype(d) == f64 for d in dtypes) else jnp.dtype(jnp.float32)


def _safe_sqrt(x):
    """sqrt(max(x, 0)) with derivative 0 (not ∞) at 0: a zero residual has no direction."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def _joint_from_gram(g):
    """½(‖Σ_h u_h‖ + sqrt(Σ_{h,l} |u_h·u_l|)) (Eq. 7) from the Gram [..., H, H] of the u_h."""
    return 0.5 * (_safe_sqrt(jnp.sum(g, axis=(-2, -1)))
                  + _safe_sqrt(jnp.sum(jnp.abs(g), axis=(-2, -1))))


def residual_allowance(u, mode: str, groups: int):
    """Real-number allowance E of the weighted residuals u [H, D] (zero rows off P).

    ``triangle`` Σ_h ‖u_h‖ (Eq. 6), ``joint`` min(triangle, Eq. 7), ``grouped``
    min(triangle, sqrt(Σ_g B_g²)) over ``groups`` contiguous coordinate groups (App. A.1),
    ``best`` the least of the three — the forms
    :func:`dosa_jax.bounds.allowance_estimate.allowance_estimate` takes, with a square
    root whose derivative at 0 is 0.
    """
    if mode not in RESIDUALS:
        raise ValueError(f"positive_residual must be one of {RESIDUALS}, got {mode!r}")
    H, D = u.shape
    ug = u.reshape(H, groups, D // groups).transpose(1, 0, 2)
    gg = jnp.einsum("ghd,gld->ghl", ug, ug, precision=HIGHEST)          # group Grams
    full = jnp.sum(gg, axis=0)
    est = jnp.sum(_safe_sqrt(jnp.diagonal(full)))
    if mode in ("joint", "best"):
        est = jnp.minimum(est, _joint_from_gram(full))
    if mode in ("grouped", "best"):
        b = _joint_from_gram(gg)
        est = jnp.minimum(est, _safe_sqrt(jnp.sum(b * b)))
    return est


def _coefficients_one(q, w, retained, omitted_pos, support, anchor, mode, groups):
    H = q.shape[0]
    has = (anchor >= 0) & omitted_pos
    qa = q[jnp.clip(anchor, 0, H - 1)]                                     # anchor rows
    a_n2 = jnp.sum(qa * qa, axis=-1)
    dot = jnp.sum(q * qa, axis=-1)
    ok = has & (a_n2 > 0)
    beta = jnp.where(ok, jnp.maximum(dot, 0.0) / jnp.where(ok, a_n2, 1.0), 0.0)   # Eq. 5
    resid = jnp.where(omitted_pos[:, None], q - beta[:, None] * qa, 0.0)
    contrib = jnp.where(ok, w * beta, 0.0)
    add = jnp.zeros((H,), q.dtype).at[jnp.where(ok, anchor, 0)].add(contrib)
    w_fold = jnp.where(retained, w + add, 0.0)                             # Eq. 6
    u = jnp.where(omitted_pos[:, None], w[:, None] * resid, 0.0)
    E = jnp.where(jnp.any(omitted_pos), residual_allowance(u, mode, groups), 0.0)
    sw = jnp.where(support, jnp.abs(w), 0.0)
    rn = _safe_sqrt(jnp.sum(resid * resid, axis=-1))
    return CertificateCoefficients(w_fold, E, sw, beta, rn)


def certificate_coefficients(q, w, choices: PlanChoices, config: Optional[Config] = None
                             ) -> CertificateCoefficients:
    """β, w̃, E and |w| on A (Eq. 4–8) of every query for the given plan ``choices``.

    Differentiable in q and w (the choices are constants). Computed in float32, or
    float64 when q or w is float64.

    Args:
      q: [T, H, D]; w: [T, H]; choices: :class:`PlanChoices` ([T, ...]).
      config: ``positive_residual`` and ``residual_groups`` select E's form.
    """
    config = config or Config()
    dt = _compute_dtype(q.dtype, w.dtype)
    groups = residual_groups(config, q.shape[-1])
    fn = lambda qt, wt, r, p, a, j: _coefficients_one(qt, wt, r, p, a, j,
                                                      config.positive_residual, groups)
    return jax.vmap(fn)(q.astype(dt), w.astype(dt), choices.retained, choices.omitted_pos,
                        choices.support, choices.anchor)


# ------------------------------------------------------------------- the keys of a tile

def _head_dots(qt, k, k_scale, dt):
    """x [Tq, N, H] = q_h·k_i and ‖k_i‖ [N] on the keys k_i = α_i k̄_i."""
    kf = k.astype(dt)
    x = jnp.einsum("thd,nd->tnh", qt.astype(dt), kf, precision=HIGHEST)
    kn = _safe_sqrt(jnp.sum(kf * kf, axis=-1))
    if k_scale is not None:
        a = k_scale.astype(dt)
        x = x * a[None, :, None]
        kn = kn * a
    return x, kn


def _bound_and_score(x, kn, w, w_fold, E, sw, linear):
    """U (Eq. 9, or Eq. 24–25 where ``linear``) and s (Eq. 1) from head dots [Tq, N, H]."""
    relu = jnp.maximum(x, 0.0)
    z = jnp.sum(sw[:, None, :] * x, axis=-1)                               # a_A·k
    agg = jnp.where(linear[:, None], z, jnp.maximum(z, 0.0))
    U = jnp.sum(w_fold[:, None, :] * relu, axis=-1) + E[:, None] * kn[None, :] - agg
    s = jnp.sum(w[:, None, :] * relu, axis=-1)
    return U, s


def _visible(lo, hi, N):
    ids = jnp.arange(N, dtype=jnp.int32)[None, :]
    return (ids >= lo[:, None]) & (ids < hi[:, None])


class KeySlack(NamedTuple):
    """Per (query, key) values ([T, N] arrays; keys outside [lo, hi) are masked by ``visible``).

    bound: U (real-number certificate of the plan, Eq. 9 / 24–25). score: s (Eq. 1).
    slack: δ = U − s ≥ 0. terms: :class:`dosa_jax.diagnostics.SlackTerms`, the Eq. 14
    split of δ with the plan's allowance E. visible: the query's range.
    """

    bound: jax.Array
    score: jax.Array
    slack: jax.Array
    terms: diagnostics.SlackTerms
    visible: jax.Array


def per_key_slack(q, k, w, *, k_scale=None, lo=None, hi=None, config: Optional[Config] = None,
                  choices: Optional[PlanChoices] = None) -> KeySlack:
    """δ_i = U_i − s_i for every query and key, with its Eq. 14 split.

    U is the real-number certificate (Eq. 9) of the reference plan (:func:`plan_choices`,
    or ``choices`` when given), s the original score (Eq. 1), both from the same head dots
    (float32, or float64 for float64 inputs). The split, Prop. 6 / Eq. 14 with the plan's
    allowance E in place of the triangle one, reuses
    :func:`dosa_jax.diagnostics.slack_decomposition` (per-head residual form):

        U − s = δ_P + Σ_{h∈N∖A} |w_h| relu(x_h) + min(Z_A⁺, Z_A⁻),
        δ_P = Σ_{h∈P} w_h (β_h relu(x_{j*_h}) − relu(x_h)) + E‖k‖,

    Z_A^± = Σ_{h∈A} |w_h| relu(±x_h); in the absolute-value form (Eq. 24–25) the last
    term is Z_A⁻ = min(Z_A⁺, Z_A⁻) + relu(−a_A·k). Every term is ≥ 0 in real arithmetic
    (E bounds the residuals, Eq. 6/7/A.1). Differentiable like :func:`slack_loss`.
    Memory: [T, N] per output and one tile's [Tq, N, H] head dots.

    ``q`` and ``k`` may be float64 when ``choices`` is given (float64 checks).
    """
    config = config or Config()
    if choices is None:
        choices = plan_choices(q, k, w, k_scale, lo, hi, config)
    q, k, w, k_scale, lo, hi = _check_any_float(q, k, w, k_scale, lo, hi)
    coef = certificate_coefficients(q, w, choices, config)
    dt = _compute_dtype(q.dtype, k.dtype, w.dtype)
    N = k.shape[0]

    def tile(qt, wt, lot, hit, w_fold, E, sw, beta, rn, lin, pos, neg, sup, anc):
        x, kn = _head_dots(qt, k, k_scale, dt)
        wt = wt.astype(dt)
        linear = lin > 0
        U, s = _bound_and_score(x, kn, wt, w_fold, E, sw, linear)
        t = jax.vmap(diagnostics.slack_decomposition,
                     in_axes=(0, None, 0, 0, 0, 0, 0, 0, 0))(
            x, kn, wt, pos > 0, neg > 0, sup > 0, anc, beta, rn)
        e_tri = jnp.sum(jnp.where(pos > 0, wt * rn, 0.0), axis=-1)
        positive = t.positive - (e_tri - E)[:, None] * kn[None, :]
        agg = jnp.sum(sw[:, None, :] * x, axis=-1)
        canc = t.cancellation + jnp.where(linear[:, None], jnp.maximum(-agg, 0.0), 0.0)
        total = positive + t.uncovered_negative + canc
        terms = diagnostics.SlackTerms(positive, t.uncovered_negative, canc, total)
        return KeySlack(U, s, U - s, terms, _visible(lot, hit, N))

    i32 = lambda m: m.astype(jnp.int32)
    return map_query_tiles(tile, q, w, lo, hi, config.query_tile, coef.w_fold, coef.residual,
                           coef.support_weight, coef.beta, coef.residual_norm,
                           i32(choices.linear), i32(choices.omitted_pos),
                           i32(choices.omitted_neg), i32(choices.support), choices.anchor)


def _check_any_float(q, k, w, k_scale, lo, hi):
    """check_inputs, also accepting float64 operands (float64 checks of the bound)."""
    f64 = jnp.dtype(jnp.float64)
    if any(jnp.dtype(x.dtype) == f64 for x in (q, k)):
        T, N = q.shape[0], k.shape[0]
        if lo is None:
            lo, hi = jnp.zeros((T,), jnp.int32), jnp.full((T,), N, jnp.int32)
        lo = jnp.clip(jnp.asarray(lo).astype(jnp.int32), 0, N)
        hi = jnp.maximum(jnp.clip(jnp.asarray(hi).astype(jnp.int32), 0, N), lo)
        return q, k, w, k_scale, lo, hi
    q, k, w32, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    return q, k, (w if jnp.dtype(w.dtype) == f64 else w32), k_scale, lo, hi


# ------------------------------------------------------------------------------ the loss

def slack_loss(q, k, w, *, k_scale=None, lo=None, hi=None, config: Optional[Config] = None,
               margin: float = 0.0, temperature: float = 0.1, threshold: str = "seed",
               reduce: bool = True):
    """Smooth survival rate of the real-number certificate (the slack regulariser's loss).

    For query t with threshold τ_t and every visible key i outside the query's exact
    Top-K set 𝒦_t (keys in 𝒦_t survive any valid certificate, U ≥ s ≥ τ* ≥ τ):

        σ_ti = sigmoid( ((U_ti − τ_t) / c_t + margin) / temperature ),
        loss_t = Σ_i σ_ti / |Ω_t ∖ 𝒦_t|,     loss = Σ_t Σ_i σ_ti / Σ_t |Ω_t ∖ 𝒦_t|,

    with U the real-number certificate (Eq. 9, see the module docstring) and
    c_t = sqrt(mean_{i∈Ω_t} s_ti²) the query's score scale (root mean square of its
    visible scores; 1 if zero), so ``margin`` and ``temperature`` are in units of the
    query's scores and the loss is invariant to a common scale of q (or of w). As
    temperature → 0, σ_ti → 1[U_ti > τ_t − margin·c_t]: the loss counts the keys that
    survive screening with this certificate (Eq. 17: U_i < τ ⇔ Δ_i > δ_i + b). A positive
    ``margin`` also counts keys rejected by less than margin·c_t. The sigmoid, not a
    softplus hinge, because the quantity is a count: keys far below τ (rejected) and
    far above it (no change of the plan would reject them) contribute nearly no gradient,
    the gradient concentrates on keys near the threshold.

    ``threshold``: ``"seed"`` — the pipeline's seed threshold τ (Eq. 2, with its
    witnesses; the τ screening starts from), or ``"exact"`` — τ* the K-th largest score.
    τ, c, 𝒦 and the plan choices (:func:`plan_choices`) are stop-gradient; U's continuous
    parts are differentiated with respect to q, k, w and ``k_scale``. Pure: jit, vmap
    (leading batch axes) and grad work.

    Args:
      q, k, w, k_scale, lo, hi, config: as ``dosa_jax.topk`` (K = ``config.top_k``; the
        reference planner's choices are used whatever ``config.backend``).
      margin: shift of the threshold, in units of c_t.
      temperature: > 0, in units of c_t.
      threshold: ``"seed"`` or ``"exact"``.
      reduce: True: the pooled rate (a scalar); False: [T] per-query rates (0 where a query
        has no key outside its Top-K).
    """
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a dosa_jax.Config, got {type(config).__name__}")
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (
            0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not (
            abs(margin) < float("inf")):
        raise ValueError(f"margin must be a finite number, got {margin!r}")
    q, k, w, k_scale, lo, hi = check_inputs(q, k, w, k_scale, lo, hi)
    sg = lax.stop_gradient
    choices = plan_choices(q, k, w, k_scale, lo, hi, config)
    K = config.top_k
    top_idx, top_sc = dense_topk_reference(sg(q), sg(k), sg(w),
                                           None if k_scale is None else sg(k_scale), lo, hi,
                                           config)
    if threshold == "seed":
        tau = choices.tau_seed
    else:
        tau = jnp.where(top_idx[:, K - 1] >= 0, top_sc[:, K - 1], -jnp.inf)
    coef = certificate_coefficients(q, w, choices, config)
    dt = _compute_dtype(q.dtype, k.dtype, w.dtype)
    N = k.shape[0]

    @jax.checkpoint
    def tile(qt, wt, lot, hit, w_fold, E, sw, lin, tau_t, idx):
        x, kn = _head_dots(qt, k, k_scale, dt)
        U, s = _bound_and_score(x, kn, wt.astype(dt), w_fold, E, sw, lin > 0)
        vis = _visible(lot, hit, N)
        rows = jnp.arange(idx.shape[0])[:, None]
        top = jnp.zeros(vis.shape, bool).at[rows, jnp.where(idx >= 0, idx, N)].set(
            True, mode="drop")
        cand = vis & ~top
        s_sg = sg(s)
        nv = jnp.sum(vis, axis=1)
        rms = jnp.sqrt(jnp.sum(jnp.where(vis, s_sg * s_sg, 0.0), axis=1) / jnp.maximum(nv, 1))
        c = jnp.where((rms > 0) & jnp.isfinite(rms), rms, 1.0)
        finite = jnp.isfinite(tau_t)
        t_safe = jnp.where(finite, tau_t, 0.0).astype(dt)
        z = ((U - t_safe[:, None]) / c[:, None] + margin) / temperature
        z = jnp.where(finite[:, None], z, jnp.inf)         # τ = −∞: every key survives
        p = jax.nn.sigmoid(z)
        return (jnp.sum(jnp.where(cand, p, 0.0), axis=1),
                jnp.sum(cand, axis=1).astype(dt))

    count, n = map_query_tiles(tile, q, w, lo, hi, config.query_tile, coef.w_fold,
                               coef.residual, coef.support_weight,
                               choices.linear.astype(jnp.int32), sg(tau), top_idx)
    if reduce:
        return jnp.sum(count) / jnp.maximum(jnp.sum(n), 1.0)
    return count / jnp.maximum(n, 1.0)


# ------------------------------------------------------------------------ the regulariser

class RegularizerState(NamedTuple):
    """State of :func:`regularizer`: ``count`` (int32 scalar), the steps taken (the
    schedule's argument)."""

    count: jax.Array


def regularizer(indexer_fn: Callable, weight: Union[float, Callable]):
    """Adds ``weight · ∇_params slack_loss(**indexer_fn(params, batch))`` to the updates.

    An ``optax.GradientTransformationExtraArgs``: ``update(updates, state, params, *,
    batch, **extra)`` needs ``params`` and the keyword ``batch`` (``optax.chain`` passes
    its extra keyword arguments to every transformation that takes them), so

        opt = optax.chain(dosa_jax.slack.regularizer(indexer_fn, 1e-2), optax.adamw(1e-3))
        updates, state = opt.update(grads, state, params, batch=batch)

    adds the slack term to the task gradient before Adam. ``indexer_fn(params, batch)``
    returns a dict of :func:`slack_loss` keyword arguments (``q``, ``k``, ``w`` and
    optionally ``k_scale``, ``lo``, ``hi``, ``config``, ``margin``, ``temperature``,
    ``threshold``). ``weight``: a float or an optax schedule (a callable of the step count
    kept in :class:`RegularizerState`). A weight of 0 leaves the updates unchanged bitwise
    (a static 0 skips the loss entirely).
    """
    import optax

    if not callable(indexer_fn):
        raise TypeError(f"indexer_fn must be callable, got {type(indexer_fn).__name__}")
    static_zero = (not callable(weight) and isinstance(weight, (int, float))
                   and not isinstance(weight, bool) and weight == 0)
    if not callable(weight) and not hasattr(weight, "dtype") and (
            isinstance(weight, bool) or not isinstance(weight, (int, float))):
        raise TypeError(f"weight must be a number or an optax schedule, got {weight!r}")

    def init_fn(params):
        del params
        return RegularizerState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, batch=None, **extra_args):
        del extra_args
        new_state = RegularizerState(count=optax.safe_increment(state.count))
        if static_zero:
            return updates, new_state
        if params is None:
            raise ValueError("dosa_jax.slack.regularizer: update needs params")
        if batch is None:
            raise ValueError("dosa_jax.slack.regularizer: update needs the keyword batch=")
        wt = weight(state.count) if callable(weight) else weight
        grads = jax.grad(lambda p: slack_loss(**indexer_fn(p, batch)))(params)

        def add(u, g):
            term = (wt * g).astype(u.dtype)
            return jnp.where(wt == 0, u, u + term)

        return jax.tree_util.tree_map(add, updates, grads), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------------------- the measured work

def screening_work(stats, heads: int, aggregate_dots: int = 1) -> float:
    """Dot products of a ``topk`` call per visible key, relative to the dense scan's H.

        work = Σ_t [H·seeds_t + (r_t + d_a)·screened_t + H·survivors_t] / Σ_t H·|Ω_t|

    from ``TopKResult.stats`` (NumPy or jax arrays): every seed and survivor is scored
    with all H heads, every screened key costs the certificate's r_t retained-head dots
    plus ``aggregate_dots`` = d_a for a_A·k (the cost model of Eq. 18–21 that the
    ``"auto"`` budget minimises, measured instead of estimated; the planner uses d_a = 1,
    2 with an FP8 aggregate row). 1.0 is the dense scan's work; queries answered densely
    (``stats.dense``) count H per visible key. Lowering the slack lowers this at every
    budget; the survival rate survivors / visible is only its last term.
    """
    import numpy as np
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"heads must be an int >= 1, got {heads!r}")
    g = lambda name: np.asarray(getattr(stats, name), np.float64)
    vis, seeds, screened, surv, r = (g(n) for n in ("visible", "seeds", "screened",
                                                    "survivors", "budget"))
    dense = g("dense") > 0 if getattr(stats, "dense", None) is not None else np.zeros_like(vis, bool)
    per = np.where(dense, heads * vis,
                   heads * seeds + (r + aggregate_dots) * screened + heads * surv)
    return float(per.sum() / max(heads * vis.sum(), 1.0))
