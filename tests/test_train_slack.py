"""The slack regulariser in the indexer training step (dosa_jax.lm.train), tiny model, CPU.

λ = 0 must leave the distillation step unchanged bit for bit (the regulariser with weight
0 is the identity), and λ > 0 must lower the slack loss the step was not trained on
(a held-out batch) relative to λ = 0 on the same batches, and with it what ``topk``
measures: the survival at a fixed budget and the screening work at the planner's budget.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import dosa_jax
from dosa_jax.lm import indexer as idx
from dosa_jax.lm import train
from dosa_jax.lm.model import init_lm
from dosa_jax.slack import RegularizerState, screening_work

TC = dataclasses.replace(train.PRESETS["tiny"], indexers=train.PRESETS["tiny"].indexers[:1])
STEPS = 12


@pytest.fixture(scope="module")
def setup():
    lm = init_lm(jax.random.PRNGKey(0), TC.lm)
    c = TC.indexers[0]
    params = {str(c.n_heads): idx.init_indexers(jax.random.PRNGKey(1), TC.lm, c)}
    return lm, params, train.device_streams("train")


def _run(setup, tc, weight=None, steps=STEPS):
    lm, params, streams = setup
    p = jax.tree_util.tree_map(jnp.array, params)
    w = () if weight is None else (jnp.float32(weight),)
    o = train.make_indexer_optimizer(p, tc, *w).init(p)
    for s in range(steps):
        p, o, parts = train.indexer_train_step(p, o, lm, jnp.int32(s), jnp.int32(steps), streams,
                                               tc, *w)
    return p, o


def _equal(a, b):
    return jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)), a, b))


def test_zero_weight_reproduces_the_distillation_step(setup):
    plain, o_plain = _run(setup, TC, steps=3)
    zero, o_zero = _run(setup, TC, weight=0.0, steps=3)
    assert _equal(plain, zero)
    # the regularisers are in the chain (one per layer), and they counted the steps
    regs = [s for s in o_zero if isinstance(s, RegularizerState)]
    assert len(regs) == TC.lm.n_layers and all(int(s.count) == 3 for s in regs)
    assert not any(isinstance(s, RegularizerState) for s in o_plain)


@functools.lru_cache(maxsize=None)
def _stats_fn(tc, retained_heads):
    """One layer's indexer inputs (``train.slack_inputs``) and topk's stats on them: one
    program for every layer and parameter set."""
    c = tc.indexers[0]
    cfg = train.slack_config(tc).replace(backend="reference", retained_heads=retained_heads)

    def stats(p, x, positions):
        kw = train.slack_inputs(p, x, positions, c, tc)
        return dosa_jax.topk(**{n: kw[n] for n in ("q", "k", "w", "lo", "hi")}, config=cfg).stats

    return jax.jit(stats)


def _measured(params, batch, tc, retained_heads):
    """Summed over layers: topk's (survival, screening work) on the batch's queries."""
    c = tc.indexers[0]
    call = _stats_fn(tc, retained_heads)
    surv = work = 0.0
    for li in range(tc.lm.n_layers):
        st = jax.device_get(call(params[str(c.n_heads)][li], batch["x"][li],
                                 batch["positions"]))
        surv += st.survivors.sum() / st.visible.sum()
        work += screening_work(st, c.n_heads)
    return surv, work


@pytest.mark.slow
def test_positive_weight_lowers_the_slack_loss_and_the_measured_work(setup):
    lm, _, streams = setup
    tokens = train.sample_batch(1234, 0, streams, TC.idx_batch, TC.seq_len)
    held = dataclasses.replace(TC, slack_queries=64)     # held-out crop, more queries
    batch = train.slack_batch(train.frozen_layers(lm, tokens, TC), 99, 0, held)
    plain, _ = _run(setup, TC)
    reg, _ = _run(setup, dataclasses.replace(TC, slack_weight=100.0))  # the --slack path
    objective = jax.jit(lambda p, b: train.slack_objective(p, b, held)[0])   # one program
    s_plain = float(objective(plain, batch))
    s_reg = float(objective(reg, batch))
    assert s_reg < 0.97 * s_plain, (s_reg, s_plain)
    assert not _equal(plain, reg)
    # what the loss is for, measured by topk: fewer survivors at a fixed budget, and less
    # work with the planner's own budget (which may spend the slack on a smaller r)
    fixed = [_measured(p, batch, held, 1)[0] for p in (plain, reg)]
    assert fixed[1] < 0.97 * fixed[0], fixed
    work = [_measured(p, batch, held, "auto")[1] for p in (plain, reg)]
    assert work[1] < 0.99 * work[0], work


def test_slack_batch_samples_distillation_queries(setup):
    lm, _, streams = setup
    tokens = train.sample_batch(7, 0, streams, TC.idx_batch, TC.seq_len)
    per_layer = train.frozen_layers(lm, tokens, TC)
    b = train.slack_batch(per_layer, 0, 3, TC)
    pos = b["positions"]
    assert b["x"].shape == (TC.lm.n_layers, TC.seq_len, TC.lm.d_model)
    assert bool(jnp.all(b["x"][0] == per_layer[0][0][3 % TC.idx_batch]))
    assert pos.shape == (TC.slack_queries,) and len(set(pos.tolist())) == TC.slack_queries
    assert int(pos.min()) >= TC.lm.window and int(pos.max()) < TC.seq_len
    kw = train.slack_inputs(setup[1]["4"][0],
                            b["x"][0], pos, TC.indexers[0], TC)
    assert kw["q"].shape == (TC.slack_queries, 4, 16) and kw["k"].shape == (TC.seq_len, 16)
    assert bool(jnp.all(kw["hi"] == pos + 1)) and bool(jnp.all(kw["lo"] == 0))


def test_cli_rejects_a_negative_lambda(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--preset", "tiny", "--workdir", str(tmp_path), "--slack", "-1"])
    with pytest.raises(SystemExit):
        train.main(["--preset", "tiny", "--workdir", str(tmp_path), "--slack", "1",
                    "--slack-layer-scale", "1,-1"])
    assert "--slack-layer-scale: slack_layer_scale must hold" in capsys.readouterr().err


@pytest.mark.slow
def test_layer_scales_weight_each_layers_slack_gradient(setup):
    """The chained regularisers add λ · ∇ slack_objective, whose layer l term is scaled by
    slack_layer_scale[l]: a factor 0 leaves that layer's updates exactly zero, and the
    updates are linear in the factors."""
    lm, params, streams = setup
    tokens = train.sample_batch(5, 0, streams, TC.idx_batch, TC.seq_len)
    batch = train.slack_batch(train.frozen_layers(lm, tokens, TC), 0, 0, TC)
    p = jax.tree_util.tree_map(jnp.array, params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, p)

    tcs = [dataclasses.replace(TC, slack_layer_scale=s) for s in ((0.0, 1.0), (1.0, 0.0),
                                                                   (3.0, 0.5))]

    def added(p, batch, lam=2.0):
        """The chained updates under each of ``tcs``, and ∇ slack_objective under the last."""
        ups = []
        for tc in tcs:
            chain = optax.chain(*train.slack_regularizers(tc, jnp.float32(lam)))
            ups.append(chain.update(zeros, chain.init(p), p, batch=batch)[0])
        return ups, jax.grad(lambda q: train.slack_objective(q, batch, tcs[-1])[0])(p)

    h = str(TC.indexers[0].n_heads)
    # one program (op by op, the three updates and the gradient compile hundreds of programs)
    (only1, only0, mixed), gm = jax.jit(added)(p, batch)
    assert all(bool(jnp.all(x == 0)) for x in jax.tree_util.tree_leaves(only1[h][0]))
    assert any(bool(jnp.any(x != 0)) for x in jax.tree_util.tree_leaves(only1[h][1]))
    for a, b, c, g in zip(*(jax.tree_util.tree_leaves(t) for t in (mixed, only0, only1, gm))):
        assert jnp.allclose(a, 3.0 * b + 0.5 * c, rtol=1e-5, atol=1e-7)
        assert jnp.allclose(a, 2.0 * g, rtol=1e-4, atol=1e-6)    # λ · ∇ slack_objective
    assert train.slack_layer_scales(TC) == (1.0, 1.0)
    for bad in ((1.0,), (1.0, -1.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="slack_layer_scale"):
            train.slack_layer_scales(dataclasses.replace(TC, slack_layer_scale=bad))
    assert train.with_slack_layer_scale(TC, "4, 1").slack_layer_scale == (4.0, 1.0)
    with pytest.raises(ValueError, match="comma-separated"):
        train.with_slack_layer_scale(TC, "4,x")
