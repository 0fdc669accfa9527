"""Certificate slack, the survival surrogate and the optax regulariser (dosa_jax.slack).

The real-number certificate is checked against an independent NumPy float64 version
built from the plan's discrete choices (Eq. 4–9, 24–25); the loss at a tiny temperature
against an independent survivor count; the regulariser the way optax tests its own
transformations (jit, state, schedule, identity at weight 0, the added term).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import dosa_jax
from dosa_jax import slack, synthetic
from dosa_jax.bounds import allowance_estimate, positive
from dosa_jax.bounds.positive import RESIDUALS

CFG_AUTO = dosa_jax.Config(top_k=16, key_block=32, query_tile=8, seed_size=32, budget_sample=64,
                           positive_residual="best", residual_groups=4)
CFG_ABS = dosa_jax.Config(top_k=16, key_block=32, query_tile=8, seed_size=32, budget_sample=64,
                          retained_heads=6, positive_residual="triangle",
                          certificate_form="absolute", negative_support="all")


@functools.lru_cache(maxsize=None)
def _inputs(key_dtype="float32", T=8, N=256, seed=3):
    return synthetic.structured(T=T, N=N, H=8, D=32, seed=seed, key_dtype=key_dtype)


@functools.lru_cache(maxsize=None)
def _choices(key_dtype, cfg):
    inp = _inputs(key_dtype)
    return jax.device_get(jax.jit(slack.plan_choices)(**_args(inp), config=cfg))


def _args(inp):
    return dict(q=inp.q, k=inp.k, w=inp.w, k_scale=inp.k_scale, lo=inp.lo, hi=inp.hi)


# ------------------------------------------------------------ independent float64 reference

def _joint_np(u):
    return 0.5 * (np.linalg.norm(u.sum(0)) + np.sqrt(np.abs(u @ u.T).sum()))


def reference_allowance(u, mode, groups):
    """E of the weighted residuals u [H, D] (NumPy float64): Eq. 6, Eq. 7, App. A.1."""
    tri = np.linalg.norm(u, axis=1).sum()
    joint = min(tri, _joint_np(u))
    D = u.shape[1]
    b = np.array([_joint_np(u[:, g * (D // groups):(g + 1) * (D // groups)])
                  for g in range(groups)])
    grouped = min(tri, np.sqrt((b * b).sum()))
    return {"triangle": tri, "joint": joint, "grouped": grouped,
            "best": min(joint, grouped)}[mode]


def reference_bound(q, k, w, a, ch, t, cfg):
    """(U, s) [N] of query t in float64 from the plan choices, written from Eq. 4–9/24–25."""
    q = np.asarray(q[t], np.float32).astype(np.float64)
    w = np.asarray(w[t], np.float64)
    kk = np.asarray(k, np.float32).astype(np.float64)
    if a is not None:
        kk = kk * np.asarray(a, np.float64)[:, None]
    H, D = q.shape
    R, P, A = ch.retained[t], ch.omitted_pos[t], ch.support[t]
    fold = np.where(R, w, 0.0)
    u = np.zeros((H, D))
    for h in np.nonzero(P)[0]:
        j = ch.anchor[t, h]
        beta = 0.0
        if j >= 0 and q[j] @ q[j] > 0:
            beta = max(q[h] @ q[j], 0.0) / (q[j] @ q[j])
            fold[j] += w[h] * beta
        u[h] = w[h] * (q[h] - beta * (q[j] if j >= 0 else 0.0))
    E = reference_allowance(u, cfg.positive_residual,
                            cfg.residual_groups if D % cfg.residual_groups == 0 else 1) \
        if P.any() else 0.0
    x = kk @ q.T
    agg = x @ np.where(A, np.abs(w), 0.0)
    U = np.maximum(x, 0) @ fold + E * np.linalg.norm(kk, axis=1) - (
        agg if ch.linear[t] else np.maximum(agg, 0.0))
    return U, np.maximum(x, 0) @ w


# ------------------------------------------------------------------------------ pieces

@pytest.mark.parametrize("mode", RESIDUALS)
def test_residual_allowance_equals_the_planner_estimate_and_numpy(mode):
    rng = np.random.default_rng(0)
    H, D, groups = 8, 16, 4
    q = rng.standard_normal((H, D)).astype(np.float32)
    q[5] = 0.5 * q[1]                       # exactly parallel to a retained head: d_5 = 0
    w = np.array([1.0, 0.7, -0.4, 0.3, 0.9, 0.6, -0.2, 0.5], np.float32)
    retained = np.array([True, True, True, False, False, False, False, False])
    omitted_pos = (w > 0) & ~retained
    anchor, beta, resid = positive.anchor_projection(jnp.asarray(q), jnp.asarray(retained),
                                                     jnp.asarray(omitted_pos))
    u = jnp.where(jnp.asarray(omitted_pos)[:, None], jnp.asarray(w)[:, None] * resid, 0.0)
    ours = slack.residual_allowance(u, mode, groups)
    est = allowance_estimate.allowance_estimate(jnp.asarray(q), jnp.asarray(w), omitted_pos,
                                                anchor, beta, mode, groups)
    np.testing.assert_allclose(float(ours), float(est), rtol=2e-6)
    np.testing.assert_allclose(float(ours), reference_allowance(np.asarray(u, np.float64), mode,
                                                                groups), rtol=2e-6)
    g = jax.grad(lambda u: slack.residual_allowance(u, mode, groups))(u)
    assert np.isfinite(np.asarray(g)).all()        # sqrt at a zero residual: no inf/NaN
    with pytest.raises(ValueError, match="positive_residual"):
        slack.residual_allowance(u, "nope", groups)


def test_choices_are_the_pipelines_and_coefficients_the_planners():
    from dosa_jax.pipeline import plan_tile, prepare_keys
    inp = _inputs()
    ch = _choices("float32", CFG_AUTO)
    st = jax.device_get(jax.jit(dosa_jax.topk)(**_args(inp), config=CFG_AUTO).stats)
    np.testing.assert_array_equal(ch.budget, st.budget)
    np.testing.assert_array_equal(ch.tau_seed[st.pruning], st.tau_seed[st.pruning])
    assert st.pruning.all() and len(set(ch.budget.tolist())) >= 1
    tp = jax.jit(lambda q, w, lo, hi, k: plan_tile(q, w, lo, hi, prepare_keys(k, None, 32),
                                                   CFG_AUTO))(inp.q, inp.w, inp.lo, inp.hi, inp.k)
    coef = jax.jit(slack.certificate_coefficients)(inp.q, inp.w, ch, CFG_AUTO)
    np.testing.assert_allclose(np.asarray(coef.beta), np.asarray(tp.details.beta), rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(coef.w_fold), np.asarray(tp.details.w_fold),
                               rtol=1e-6, atol=1e-7)
    # the real-number allowance is below the plan's certified one, and close to it
    E, Ec = np.asarray(coef.residual), np.asarray(tp.details.residual)
    assert (E <= Ec).all() and (Ec <= E * 1.001 + 1e-6).all()
    assert ch.omitted_pos.any() and ch.support.any()            # the pieces are exercised


@pytest.mark.parametrize("key_dtype,cfg", [("float32", CFG_AUTO), ("float8_e4m3fn", CFG_ABS)],
                         ids=["best_auto", "fp8_absolute_triangle"])
def test_real_certificate_bounds_the_score_in_float64(key_dtype, cfg):
    inp = _inputs(key_dtype)
    ch = _choices(key_dtype, cfg)
    if cfg.certificate_form == "absolute":
        assert ch.linear.any()                       # Eq. 24–25 exercised
    f64 = lambda v: None if v is None else jnp.asarray(np.asarray(v, np.float32), jnp.float64)
    with jax.enable_x64(True):
        ks = jax.jit(slack.per_key_slack)(f64(inp.q), f64(inp.k), f64(inp.w),
                                          k_scale=f64(inp.k_scale), lo=inp.lo, hi=inp.hi,
                                          config=cfg, choices=ch)
        ks = jax.device_get(ks)
    assert ks.bound.dtype == np.float64
    vis = ks.visible
    q64 = np.asarray(inp.q, np.float32).astype(np.float64)
    kk = np.asarray(inp.k, np.float32).astype(np.float64)
    if inp.k_scale is not None:
        kk = kk * np.asarray(inp.k_scale, np.float64)[:, None]
    M = 4 * np.linalg.norm(kk, axis=1)[None, :] * np.einsum(
        "th,th->t", np.abs(np.asarray(inp.w, np.float64)), np.linalg.norm(q64, axis=-1))[:, None]
    tol = 2.0 ** -40 * M
    assert (ks.slack >= -tol)[vis].all()                                       # U ≥ s
    for term in ks.terms[:3]:
        assert (term >= -tol)[vis].all()                                       # Eq. 14 terms
    assert (np.abs(ks.terms.total - ks.slack) <= tol)[vis].all()               # exact split
    for t in range(inp.q.shape[0]):
        U, s = reference_bound(inp.q, inp.k, inp.w, inp.k_scale, ch, t, cfg)
        np.testing.assert_allclose(ks.bound[t], U, rtol=1e-10, atol=1e-10 * M[t].max())
        np.testing.assert_allclose(ks.score[t], s, rtol=1e-10, atol=1e-10 * M[t].max())
    assert (ks.terms.cancellation[vis] > 0).any()
    if ch.omitted_pos.any():
        assert (ks.terms.positive[vis] > tol[vis]).any()


def test_continuous_parts_check_grads_in_float64():
    inp = _inputs()
    ch = _choices("float32", CFG_AUTO)
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        q = jnp.asarray(np.asarray(inp.q, np.float64))
        k = jnp.asarray(np.asarray(inp.k, np.float64))[:64]
        w = jnp.asarray(np.asarray(inp.w, np.float64))
        a = jnp.asarray(rng.uniform(0.5, 2.0, 64))
        c = jnp.asarray(rng.standard_normal((q.shape[0], 64)))
        lo = jnp.zeros((q.shape[0],), jnp.int32)
        hi = jnp.full((q.shape[0],), 64, jnp.int32)

        @jax.jit
        def f(q, k, w, a):
            ks = slack.per_key_slack(q, k, w, k_scale=a, lo=lo, hi=hi, config=CFG_AUTO,
                                     choices=ch)
            return jnp.sum(c * ks.bound)

        check_grads(f, (q, k, w, a), order=1, modes=("rev",), eps=1e-6, atol=1e-5,
                    rtol=1e-5)


# ------------------------------------------------------------------------------ the loss

@pytest.mark.parametrize("threshold", ["seed", "exact"])
def test_tiny_temperature_counts_certificate_survivors(threshold):
    inp = _inputs()
    cfg = CFG_AUTO
    ch = _choices("float32", cfg)
    loss = functools.partial(slack.slack_loss, config=cfg, temperature=1e-7,
                             threshold=threshold)
    # per query and pooled in one program (their common part compiled once)
    per_q, pooled = jax.jit(lambda a: (loss(**a, reduce=False), loss(**a)))(_args(inp))
    per_q, pooled = np.asarray(per_q), float(pooled)
    dense = jax.device_get(jax.jit(dosa_jax.dense_topk)(**_args(inp), config=cfg))
    K = cfg.top_k
    tau = ch.tau_seed if threshold == "seed" else dense.scores[:, K - 1]
    T, N = inp.q.shape[0], inp.k.shape[0]
    counts, ns, near = [], [], []
    for t in range(T):
        U, s = reference_bound(inp.q, inp.k, inp.w, None, ch, t, cfg)
        ids = np.arange(N)
        cand = (ids >= int(inp.lo[t])) & (ids < int(inp.hi[t]))
        cand[dense.indices[t][dense.indices[t] >= 0]] = False
        scale = np.sqrt(np.mean(s[(ids >= int(inp.lo[t])) & (ids < int(inp.hi[t]))] ** 2))
        counts.append(np.sum(cand & (U >= tau[t])))
        ns.append(cand.sum())
        near.append(np.sum(cand & (np.abs(U - tau[t]) <= 1e-5 * scale)))   # float32 vs 64
        assert abs(per_q[t] * ns[t] - counts[t]) <= near[t] + 1e-3, (t, per_q[t] * ns[t],
                                                                      counts[t], near[t])
    np.testing.assert_allclose(pooled * sum(ns), sum(counts), atol=sum(near) + 1e-2)
    assert 0 < sum(counts) < sum(ns)                  # neither everything nor nothing survives


def test_descent_on_the_loss_lowers_measured_survival():
    inp = _inputs(N=512)
    cfg = CFG_AUTO.replace(retained_heads=3, top_k=32, key_block=64, seed_size=64)
    args = _args(inp)
    vg = jax.jit(jax.value_and_grad(
        lambda q, w: slack.slack_loss(**{**args, "q": q, "w": w}, config=cfg), argnums=(0, 1)))
    stats = jax.jit(lambda q, w: dosa_jax.topk(**{**args, "q": q, "w": w},
                                               config=cfg.replace(backend="reference")).stats)

    def survival(q, w):
        st = jax.device_get(stats(q, w))
        return st.survivors.sum() / st.screened.sum()

    q, w = args["q"], args["w"]
    loss0, surv0 = None, survival(q, w)
    for _ in range(5):
        loss, (gq, gw) = vg(q, w)
        loss0 = float(loss) if loss0 is None else loss0
        q = q - 0.01 * jnp.linalg.norm(q) * gq / jnp.linalg.norm(gq)   # small: τ, plan fixed
    loss1, surv1 = float(vg(q, w)[0]), survival(q, w)
    assert loss1 < 0.97 * loss0, (loss0, loss1)
    assert surv1 < surv0, (surv0, surv1)
    assert np.isfinite(np.asarray(gq)).all() and np.isfinite(np.asarray(gw)).all()


def test_slack_loss_under_vmap_and_its_margin():
    inp = _inputs(T=4, N=128, seed=5)
    cfg = CFG_AUTO
    args = _args(inp)
    f = lambda q, k, w: slack.slack_loss(q, k, w, lo=args["lo"], hi=args["hi"], config=cfg,
                                         margin=0.1)
    # the loss at margins 0.1 and 0.5 in one program (their common part compiled once)
    jitted = jax.jit(lambda a: (f(a["q"], a["k"], a["w"]),
                                slack.slack_loss(**a, config=cfg, margin=0.5)))
    eager, wider = map(float, jitted(args))
    qb = jnp.stack([args["q"], 2.0 * args["q"]])        # the loss is invariant to q's scale
    vb = jax.vmap(f, in_axes=(0, None, None))(qb, args["k"], args["w"])
    np.testing.assert_allclose(np.asarray(vb), [eager, eager], rtol=1e-5)
    assert eager < wider                                      # a larger margin counts more


def test_bad_arguments_name_themselves():
    inp = _inputs(T=4, N=128, seed=5)
    args = _args(inp)
    with pytest.raises(ValueError, match="threshold"):
        slack.slack_loss(**args, config=CFG_AUTO, threshold="tau")
    with pytest.raises(ValueError, match="temperature"):
        slack.slack_loss(**args, config=CFG_AUTO, temperature=0.0)
    with pytest.raises(ValueError, match="margin"):
        slack.slack_loss(**args, config=CFG_AUTO, margin=float("nan"))
    with pytest.raises(TypeError, match="config"):
        slack.slack_loss(**args, config={"top_k": 4})
    with pytest.raises(ValueError, match="w must have shape"):
        slack.slack_loss(**{**args, "w": args["w"][:, :3]}, config=CFG_AUTO)


# ----------------------------------------------------------------------- the regulariser

@functools.lru_cache(maxsize=None)
def _reg_problem():
    """(params, batch, indexer_fn, grads, updates), built once for the regulariser tests
    (none of them modifies it)."""
    inp = _inputs(T=4, N=128, seed=5)
    params = {"q": inp.q, "w": inp.w}
    batch = {"k": inp.k, "lo": inp.lo, "hi": inp.hi}

    def indexer_fn(p, b):
        return dict(q=p["q"], k=b["k"], w=p["w"], lo=b["lo"], hi=b["hi"], config=CFG_AUTO)

    grads = jax.jit(jax.grad(lambda p: slack.slack_loss(**indexer_fn(p, batch))))(params)
    rng = np.random.default_rng(2)
    updates = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    updates["w"] = updates["w"].at[0, 0].set(-0.0)        # bitwise identity must keep −0.0
    return params, batch, indexer_fn, grads, updates


def test_regularizer_adds_scheduled_weight_times_gradient_under_jit():
    params, batch, indexer_fn, grads, updates = _reg_problem()
    sched = optax.linear_schedule(0.5, 1.5, 2)
    reg = slack.regularizer(indexer_fn, sched)
    assert isinstance(reg, optax.GradientTransformationExtraArgs)
    state = jax.jit(reg.init)(params)
    assert state.count.shape == () and state.count.dtype == jnp.int32 and int(state.count) == 0
    update = jax.jit(reg.update)
    for step in range(3):
        out, state = update(updates, state, params, batch=batch)
        assert int(state.count) == step + 1
        wt = float(sched(step))
        for name in ("q", "w"):
            expect = np.asarray(updates[name]) + np.float32(wt) * np.asarray(grads[name])
            np.testing.assert_allclose(np.asarray(out[name]), expect, rtol=1e-5,
                                       atol=1e-6 * np.abs(expect).max())
            assert out[name].dtype == updates[name].dtype
    assert np.abs(np.asarray(grads["q"])).max() > 0      # the added term is not vacuous
    with pytest.raises(ValueError, match="batch"):
        reg.update(updates, reg.init(params), params)


def test_regularizer_zero_weight_is_the_identity_bitwise():
    params, batch, indexer_fn, _, updates = _reg_problem()
    for weight in (0.0,):    # a traced 0: tests/test_train_slack.py (bitwise, in the step)
        reg = slack.regularizer(indexer_fn, weight)
        out, state = jax.jit(reg.update)(updates, reg.init(params), params, batch=batch)
        for name in ("q", "w"):
            assert np.asarray(out[name]).tobytes() == np.asarray(updates[name]).tobytes()
        assert int(state.count) == 1


def test_regularizer_chains_before_adamw():
    params, batch, indexer_fn, grads, updates = _reg_problem()
    opt = optax.chain(slack.regularizer(indexer_fn, 0.3), optax.adamw(1e-2))
    state = opt.init(params)
    out, state = jax.jit(opt.update)(updates, state, params, batch=batch)
    adam = optax.adamw(1e-2)
    summed = jax.tree_util.tree_map(lambda u, g: u + 0.3 * g, updates, grads)
    ref, _ = adam.update(summed, adam.init(params), params)
    for name in ("q", "w"):
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(ref[name]), rtol=1e-4,
                                   atol=1e-7)
    assert int(state[0].count) == 1
    with pytest.raises(TypeError, match="weight"):
        slack.regularizer(indexer_fn, "0.1")


# ----------------------------------------------------------------------- the measured work

def test_screening_work_counts_the_dot_products_of_the_call():
    args = _args(_inputs())          # built outside the trace (numpy data, cached)
    st = jax.device_get(jax.jit(lambda a: dosa_jax.topk(**a, config=CFG_ABS.replace(
        backend="reference")).stats)(args))
    H = _inputs().q.shape[1]
    # per query: H dots per seed and per survivor, r + d_a per screened key (counted apart)
    dots = sum(H * int(st.seeds[t]) + (int(st.budget[t]) + 1) * int(st.screened[t])
               + H * int(st.survivors[t]) for t in range(st.visible.shape[0]))
    assert slack.screening_work(st, H) == pytest.approx(dots / (H * int(st.visible.sum())))
    assert 0 < sum(st.screened) and 0 < sum(st.survivors) < sum(st.screened)
    dense = st._replace(dense=np.ones_like(st.dense))
    assert slack.screening_work(dense, H) == pytest.approx(1.0)  # dense answers cost H a key
    more = st._replace(budget=st.budget + 1)
    assert slack.screening_work(more, H) > slack.screening_work(st, H)  # r is part of the cost
    with pytest.raises(ValueError, match="heads"):
        slack.screening_work(st, 0)
