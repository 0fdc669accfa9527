"""Derivatives of selected scores (dosa_jax.autodiff) against an independent float64 scorer.

The wrapper below mimics the API wiring: the pipeline runs on stop-gradient inputs
(its enclosure's ``nextafter`` and the integer selection are never differentiated) and
``selected_scores`` attaches the scorer's derivative at the selected ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import dosa_jax
from dosa_jax import autodiff, synthetic
from dosa_jax.scorer import score_ids

T, H, D, N, K = 3, 4, 8, 64, 6
CFG = dosa_jax.Config(top_k=K, key_block=16, query_tile=4, retained_heads=2, seed_size=16,
                      budget_sample=16)
sg = lax.stop_gradient


def _problem(seed=0, dtype=jnp.float32, scaled=True):
    """Gaussian inputs whose head dots all stay ≥ 0.05 away from the relu kink."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D))
    k = rng.standard_normal((N, D))
    x = np.einsum("thd,nd->tnh", q, k)
    k = k + 0.0
    bad = np.abs(x) < 0.05
    while bad.any():   # move keys off the kinks (resample the offending keys)
        rows = np.unique(np.nonzero(bad)[1])
        k[rows] = rng.standard_normal((rows.size, D))
        x = np.einsum("thd,nd->tnh", q, k)
        bad = np.abs(x) < 0.05
    w = rng.uniform(0.2, 1.0, (T, H)) * rng.choice([-1.0, 1.0], (T, H))
    a = rng.uniform(0.5, 2.0, N) if scaled else None
    cast = lambda v: jnp.asarray(v, dtype)
    return (cast(q), cast(k), jnp.asarray(w, jnp.float32),
            None if a is None else jnp.asarray(a, jnp.float32))


def run_with_grad(q, k, w, a, *, dense=False, lo=None, hi=None, config=CFG):
    """The API wiring: pipeline on stop-gradient inputs, then ``selected_scores``."""
    fn = dosa_jax.dense_topk if dense else dosa_jax.topk
    r = fn(sg(q), sg(k), sg(w), k_scale=None if a is None else sg(a), lo=lo, hi=hi,
           config=config)
    return autodiff.selected_scores(q, k, w, a, r.indices, r.scores), r.indices, r.scores


def reference_selected(q, k, w, a, idx):
    """Independent jnp scorer over the ids (float64 under x64): α Σ_h w relu(q·k); pads 0."""
    kg = jnp.take(k, jnp.clip(idx, 0, k.shape[0] - 1), axis=0)
    x = jnp.einsum("thd,tkd->tkh", q, kg, precision=lax.Precision.HIGHEST)
    s = jnp.sum(w[:, None, :] * jax.nn.relu(x), axis=-1)
    if a is not None:
        s = s * jnp.take(a, jnp.clip(idx, 0, k.shape[0] - 1))
    return jnp.where(idx >= 0, s, 0.0)


def _grads_f64(q, k, w, a, idx, ct):
    """jax.grad of Σ ct·s over the ids with every operand in float64."""
    with jax.enable_x64(True):
        f64 = lambda v: None if v is None else jnp.asarray(np.asarray(v, np.float64))
        args = tuple(f64(v) for v in (q, k, w, a))
        argnums = (0, 1, 2) + ((3,) if a is not None else ())
        loss = lambda *v: jnp.sum(f64(ct) * reference_selected(*v, jnp.asarray(idx)))
        g = jax.grad(loss, argnums=argnums)(*args)
        return [np.asarray(x) for x in g]


def _assert_close(g, g64, rtol):
    g = np.asarray(g, np.float64)
    scale = np.max(np.abs(g64)) + 1e-30
    np.testing.assert_allclose(g, g64, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("dense", [False, True], ids=["topk", "dense_topk"])
@pytest.mark.parametrize("scaled", [False, True], ids=["no_scale", "k_scale"])
def test_grads_equal_float64_scorer_over_the_same_ids(dense, scaled):
    q, k, w, a = _problem(1, scaled=scaled)
    s, idx, s_pipe = run_with_grad(q, k, w, a, dense=dense)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_pipe))   # forward: bitwise
    assert (np.asarray(idx) >= 0).all()
    ct = jnp.asarray(np.random.default_rng(5).standard_normal((T, K)), jnp.float32)
    argnums = (0, 1, 2) + ((3,) if scaled else ())
    g = jax.grad(lambda *v: jnp.sum(ct * run_with_grad(*v, dense=dense)[0]),
                 argnums=argnums)(q, k, w, a)
    g64 = _grads_f64(q, k, w, a, np.asarray(idx), ct)
    for gi, ri in zip(g, g64):
        assert gi.dtype == jnp.float32
        _assert_close(gi, ri, 2e-6)    # float32 sums of ≤ K·D products
    assert np.abs(g[0]).max() > 0 and np.abs(g[1]).max() > 0   # not vacuous


def test_topk_and_dense_topk_gradients_agree():
    q, k, w, a = _problem(2)
    loss = lambda dense: (lambda q: jnp.sum(run_with_grad(q, k, w, a, dense=dense)[0]))
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(False))(q)),
                                  np.asarray(jax.grad(loss(True))(q)))


def test_check_grads_fwd_and_rev_away_from_kinks():
    q, k, w, a = _problem(3)
    _, idx, _ = run_with_grad(q, k, w, a, dense=True)
    idx = np.asarray(idx)
    assert (idx >= 0).all()

    def f(q, k, w, a):   # forward value moves with the inputs, so finite differences see it
        s = score_ids(sg(q), sg(w), sg(k), sg(a), jnp.asarray(idx))
        return autodiff.selected_scores(q, k, w, a, jnp.asarray(idx), s)

    check_grads(f, (q, k, w, a), order=1, modes=("fwd", "rev"), eps=1e-3, atol=2e-2, rtol=2e-2)


def test_padding_slots_get_zero_gradient():
    q, k, w, a = _problem(4)
    lo = jnp.asarray([0, 10, 30], jnp.int32)
    hi = jnp.asarray([64, 13, 30], jnp.int32)    # 3 visible keys, then an empty range
    s, idx, _ = run_with_grad(q, k, w, a, dense=True, lo=lo, hi=hi)
    idx = np.asarray(idx)
    assert (idx[1, 3:] == -1).all() and (idx[2] == -1).all()
    assert np.isneginf(np.asarray(s)[idx < 0]).all()
    # the plain sum includes −inf pads: their cotangent (1) must not reach any input
    g = jax.grad(lambda *v: jnp.sum(run_with_grad(*v, dense=True, lo=lo, hi=hi)[0]),
                 argnums=(0, 1, 2, 3))(q, k, w, a)
    g64 = _grads_f64(q, k, w, a, idx, jnp.ones((T, K), jnp.float32))
    for gi, ri in zip(g, g64):
        assert np.isfinite(np.asarray(gi)).all()
        _assert_close(gi, ri, 2e-6)
    assert np.all(np.asarray(g[0])[2] == 0) and np.all(np.asarray(g[2])[2] == 0)  # empty range


def test_jit_vmap_and_forward_mode():
    q, k, w, a = _problem(5)
    loss = lambda q, w: jnp.sum(run_with_grad(q, k, w, a, dense=True)[0] ** 2)
    gq, gw = jax.grad(loss, argnums=(0, 1))(q, w)
    jq, jw = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, w)
    np.testing.assert_allclose(np.asarray(jq), np.asarray(gq), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jw), np.asarray(gw), rtol=1e-6, atol=1e-6)
    # vmap over a leading batch of two problems
    q2 = jnp.stack([q, q[::-1]])
    w2 = jnp.stack([w, -w])
    vg = jax.vmap(jax.grad(loss, argnums=(0, 1)))(q2, w2)
    for b in range(2):
        eg = jax.grad(loss, argnums=(0, 1))(q2[b], w2[b])
        np.testing.assert_allclose(np.asarray(vg[0][b]), np.asarray(eg[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(vg[1][b]), np.asarray(eg[1]), rtol=1e-6, atol=1e-6)
    # forward mode equals the reference's JVP at the same ids
    _, idx, _ = run_with_grad(q, k, w, a, dense=True)
    dq = jnp.asarray(np.random.default_rng(0).standard_normal(q.shape), jnp.float32)
    _, t = jax.jvp(lambda q: run_with_grad(q, k, w, a, dense=True)[0], (q,), (dq,))
    _, t_ref = jax.jvp(lambda q: reference_selected(q, k, w, a, idx), (q,), (dq,))
    np.testing.assert_allclose(np.asarray(t), np.asarray(t_ref), rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_get_bfloat16_cotangents():
    q, k, w, a = _problem(6, dtype=jnp.bfloat16)
    g = jax.grad(lambda q, k: jnp.sum(run_with_grad(q, k, w, a, dense=True)[0]),
                 argnums=(0, 1))(q, k)
    assert g[0].dtype == jnp.bfloat16 and g[1].dtype == jnp.bfloat16
    _, idx, _ = run_with_grad(q, k, w, a, dense=True)
    g64 = _grads_f64(q, k, w, a, np.asarray(idx), jnp.ones((T, K), jnp.float32))
    for gi, ri in zip(g, g64[:2]):
        _assert_close(np.asarray(gi, np.float32), ri, 1e-2)   # one bfloat16 rounding


def test_float8_payloads_raise_but_scales_and_queries_differentiate():
    q, k, w, _ = _problem(7)
    from dosa_jax.synthetic import quantize_keys_fp8
    k8, a8 = (jnp.asarray(v) for v in quantize_keys_fp8(np.asarray(k)))
    loss = lambda q, k, w, a: jnp.sum(run_with_grad(q, k, w, a, dense=True)[0])
    with pytest.raises(TypeError, match="float8_e4m3fn k"):
        jax.grad(loss, argnums=1)(q, k8, w, a8)
    g = jax.grad(loss, argnums=(0, 2, 3))(q, k8, w, a8)
    _, idx, _ = run_with_grad(q, k8, w, a8, dense=True)
    g64 = _grads_f64(q, k8.astype(jnp.float32), w, a8, np.asarray(idx), jnp.ones((T, K)))
    for gi, ri in zip(g, [g64[0], g64[2], g64[3]]):
        _assert_close(gi, ri, 2e-6)


def test_exact_topk_values_carry_the_rows_gradient():
    rng = np.random.default_rng(8)
    rows = jnp.asarray(rng.standard_normal((4, 50)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)

    def ours(r):
        idx, vals = autodiff.exact_topk_with_grad(r, 7)
        return jnp.sum(ct * vals)

    def lax_ref(r):
        return jnp.sum(ct * lax.top_k(r, 7)[0])

    idx, vals = autodiff.exact_topk_with_grad(rows, 7)
    ref_vals, ref_idx = lax.top_k(rows, 7)           # no ties in Gaussian rows
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.asarray(jax.grad(ours)(rows)),
                                  np.asarray(jax.grad(lax_ref)(rows)))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(ours))(rows)),
                                  np.asarray(jax.grad(lax_ref)(rows)))
    # pads (k > valid entries) get no gradient; bf16 rows get a bf16 cotangent
    valid = jnp.arange(50)[None, :] < jnp.asarray([[50], [3], [0], [50]])
    g = jax.grad(lambda r: jnp.sum(autodiff.exact_topk_with_grad(r, 7, valid=valid)[1]))(
        rows.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16
    g = np.asarray(g, np.float32)
    assert g[1].sum() == 3 and g[2].sum() == 0 and g[0].sum() == 7 and np.isfinite(g).all()


def test_raise_if_differentiated():
    x = jnp.arange(3.0)

    def f(x):
        tau = autodiff.raise_if_differentiated(lax.stop_gradient(x).max(), x, name="stats.tau",
                                               hint="use the scores")
        return jnp.sum(x ** 2), tau

    with pytest.raises(TypeError, match="stats.tau is not differentiable; use the scores"):
        jax.grad(lambda x: f(x)[1])(x)
    with pytest.raises(TypeError, match="stats.tau"):
        jax.jit(jax.grad(lambda x: f(x)[1] + f(x)[0]))(x)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: f(x)[0])(x)), 2 * np.arange(3.0))
    assert float(jax.jit(lambda x: f(x)[1])(x)) == 2.0       # forward value unchanged


def test_bad_arguments_name_themselves():
    q, k, w, a = _problem(0)
    idx = jnp.zeros((T, K), jnp.int32)
    s = jnp.zeros((T, K), jnp.float32)
    with pytest.raises(ValueError, match="indices and scores"):
        autodiff.selected_scores(q, k, w, a, idx[:, :2], s)
    with pytest.raises(TypeError, match="indices must be integer"):
        autodiff.selected_scores(q, k, w, a, s, s)
    with pytest.raises(ValueError, match="k_scale"):
        autodiff.selected_scores(q, k, w, a[:3], idx, s)
    with pytest.raises(ValueError, match="shapes disagree"):
        autodiff.selected_scores(q, k[:, :3], w, a, idx, s)


@pytest.mark.parametrize("fn", ["topk", "dense_topk"])
def test_public_topk_scores_carry_the_scorer_gradient(fn):
    """Through the public API (the pipeline runs on constants, the scores get the scorer's
    derivative at the selected ids): jax.grad w.r.t. q, k, w and k_scale equals the gradient of
    an independent jnp scorer over the same ids; no silent zero."""
    inp = synthetic.structured(T=8, N=384, H=8, D=16, seed=3, key_dtype="float8_e4m3fn")
    cfg = dosa_jax.Config(top_k=16, backend="reference")
    q = jnp.asarray(inp.q, jnp.float32)
    k32 = jnp.asarray(inp.k, jnp.float32)      # float32 keys: a gradient w.r.t. k exists
    call = getattr(dosa_jax, fn)

    def ours(q, k, w, s):     # the selected ids as auxiliary output: one program, one call
        res = call(q, k, w, k_scale=s, lo=inp.lo, hi=inp.hi, config=cfg)
        return jnp.sum(res.scores * jnp.arange(16.0)), res.indices

    got, ids = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k32, inp.w, inp.k_scale)
    ids = np.asarray(ids)

    def theirs(q, k, w, s):
        kk = k[jnp.maximum(ids, 0)]
        x = jnp.einsum("thd,tkd->tkh", q, kk, precision="highest")
        sc = s[jnp.maximum(ids, 0)] * jnp.sum(w[:, None, :] * jax.nn.relu(x), -1)
        return jnp.sum(jnp.where(ids >= 0, sc, 0.0) * jnp.arange(16.0))

    want = jax.grad(theirs, argnums=(0, 1, 2, 3))(q, k32, inp.w, inp.k_scale)
    for g, t in zip(got, want):
        assert float(jnp.max(jnp.abs(t))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=2e-5, atol=1e-6)


def test_public_exact_topk_values_carry_the_rows_gradient():
    rows = jnp.asarray(np.random.default_rng(0).standard_normal((3, 40)), jnp.float32)
    g = jax.grad(lambda r: jnp.sum(dosa_jax.exact_topk(r, 5, backend="reference")[1]))(rows)
    _, idx = jax.lax.top_k(rows, 5)
    want = jnp.zeros_like(rows).at[jnp.arange(3)[:, None], idx].set(1.0)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
