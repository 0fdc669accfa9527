"""The screen with queries of similar budgets sharing tiles (``pipeline.screen_by_budget``).

Each screening program runs in the kernel of its budget class (the largest budget among its
screening queries) with the plan rows cut to that budget; the kernels write one set of
survivor lists in turn. Checked against the screening twin on every (query, key), against the
one-kernel screen with all rows, and end to end (DoSA == dense bitwise with two classes used).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import synthetic
from dosa_jax.config import Config
from dosa_jax.enclosure import key_norm_upper
from pallas_kernels import dense, pipeline, screen
from kernel_checks import (assert_screening_bound_holds_on_every_key, jit_dosa_details_many,
                           unpack_survivors)

pytestmark = pytest.mark.xdist_group("pallas_kernels")
TILES = dense.Tiles(BQ=4, BK=16, CH=32, refine_bk=0)
TILES_KC = TILES._replace(layout="kc", screen_layout="kc")


def _class_inputs(T=32, N=400, seed=5):
    inp = synthetic.structured(T=T, N=N, H=8, D=32, seed=seed, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    rng = np.random.default_rng(seed)
    # budgets 2 or 6; queries 0-15: all 2 except 9 (so in the "hk" tiles, 16-query programs,
    # the first program is class 6 by one query); 16-19 all 2; 20-31 mixed
    budget = np.full(T, 2, np.int32)
    budget[[9, 21, 24, 25, 30]] = 6
    R = 6
    q32 = inp.q.astype(jnp.float32)
    keep = jnp.arange(R)[None, :] < jnp.asarray(budget)[:, None]
    rows = jnp.where(keep[..., None], q32[:, :R], 0.0)
    row_w = jnp.where(keep, jnp.abs(inp.w[:, :R]), 0.0)
    cols, cw, _ = screen.aggregate_columns(q32[:, R:R + 1] * 0.3, jnp.zeros((T,), bool),
                                           split=True, absolute=False)      # A = 2 columns
    plan = types.SimpleNamespace(rows=rows, row_weights=row_w)
    coef = jnp.full((T,), 0.05, jnp.float32)
    eps = jnp.full((T,), 1e-30, jnp.float32)
    tau = jnp.asarray(rng.uniform(-0.5, 1.0, T), jnp.float32)
    prune = jnp.asarray(rng.random(T) < 0.9)
    lo = inp.lo.at[13].set(inp.hi[13])             # a query that skips the screen
    ops = dense.prepare_operands(inp.q, inp.w, inp.k, inp.k_scale, 4)
    return inp, plan, jnp.asarray(budget), (cols, cw), coef, eps, tau, prune, lo, ops


@pytest.mark.parametrize("tiles", [TILES_KC, TILES, TILES_KC._replace(screen_defer=False)],
                         ids=["kc", "hk", "kc_plain_loop"])
def test_budget_classes_screen_matches_twin_and_one_kernel(tiles):
    inp, plan, budget, agg, coef, eps, tau, prune, lo, ops = _class_inputs()
    T, N = budget.shape[0], inp.k.shape[0]
    knorm = key_norm_upper(inp.k)
    kw = dict(splits=2, capacity=512, single_piece=True, tiles=tiles)
    args = (*agg, coef, eps, tau, prune, lo, inp.hi, ops, knorm)
    surv = pipeline.screen_by_budget(plan, budget, (2, 6), *args, **kw)
    one = pipeline.screen_by_budget(plan, budget, (6,), *args, **kw)   # one kernel, all rows
    U = screen.screening_bound_reference(plan.rows, plan.row_weights, *agg, coef, eps, ops.k,
                                         knorm, ops.scale, single_piece=True)
    m = np.asarray(screen.survivors_reference(U, tau, prune, lo, inp.hi))
    near = np.abs(np.asarray(U) - np.asarray(tau)[:, None]) <= 1e-5 * (1 + np.abs(np.asarray(U)))
    got = unpack_survivors(surv.packed, surv.count, T, N)
    got1 = unpack_survivors(one.packed, one.count, T, N)
    assert np.all((got == m) | near), f"{int(np.sum((got != m) & ~near))} keys differ from twin"
    assert np.all((got == got1) | near)
    assert np.array_equal(np.asarray(surv.per_query).sum(1), got.sum(1))
    assert np.array_equal(np.asarray(surv.count).sum(1)[:T // 4],
                          [int(np.any(got[4 * g:4 * g + 4], axis=0).sum()) for g in range(T // 4)])
    assert got[13].sum() == 0                                   # no keys screened for it
    assert int(m.sum()) > 0 and int((~m).sum()) > 0             # pruned and kept keys both


def test_dosa_with_two_budget_classes_equals_dense_bitwise():
    """End to end with the automatic budget over two candidates (two screen kernels run):
    the answer is bitwise the dense kernel's, and the bound holds on every key."""
    inp = synthetic.structured(T=32, N=1500, H=8, D=32, seed=5, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    # survivors priced as dot products (κ = 1): on this data both candidates are chosen
    cfg = Config(top_k=32, retained_heads="auto", budget_candidates=(2, 6), seed_size=256,
                 capacity=1024, survivor_cost=1.0)
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    # budgets chosen per query, the aggregate as two columns, the plain screen loop
    per_query = TILES_KC._replace(budget_share="query", aggregate_hi_only=False,
                                  screen_defer=False)
    # shared by each 8-query screening program, the aggregate as one column, the
    # software-pipelined screen; survivors priced 4x (more heads)
    cfg4 = cfg.replace(survivor_cost=4.0)
    prog = TILES_KC._replace(budget_share="program")
    variants = [(cfg, dict(tiles=per_query, splits=2)), (cfg4, dict(tiles=prog, splits=2)),
                # packed masks: both classes' kernels write one byte per key for each pair of
                # groups
                (cfg, dict(tiles=per_query._replace(screen_pack=True), splits=2)),
                # the default: one budget for the wave (here the call), one class, one kernel
                (cfg, dict(tiles=TILES_KC, splits=2))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "DIRECT_SURVIVAL", 2.0)            # every group screens
        # the four variants and the dense scan in one program (compiled together)
        ((idx, sc, st, det), (idx4, sc4, st4, det4), (idxp, scp, stp, _),
         (idxw, scw, stw, detw), (didx, dsc)) = jit_dosa_details_many(
            args, variants, dense=(cfg, dict(tiles=TILES_KC, splits=2)))
    np.testing.assert_array_equal(np.asarray(stp.survivors), np.asarray(st.survivors))
    for i, s_ in ((idx, sc), (idx4, sc4), (idxp, scp), (idxw, scw)):
        np.testing.assert_array_equal(np.asarray(i), np.asarray(didx))
        np.testing.assert_array_equal(np.asarray(s_), np.asarray(dsc))
    b = np.asarray(st.budget).reshape(-1, 8).max(axis=1)       # program classes (8 queries)
    assert len(set(b.tolist())) == 2, f"one class only: {b}"
    b4 = np.asarray(st4.budget).reshape(-1, 8)
    assert np.all(b4 == b4[:, :1]), "budgets differ inside a screening program"
    bw = np.asarray(stw.budget)
    assert np.all(bw == bw[0]), f"budgets differ inside the wave: {bw}"
    assert float(jnp.mean(st.survivors / st.visible)) < 1.0
    assert_screening_bound_holds_on_every_key(inp, det)
    assert_screening_bound_holds_on_every_key(inp, det4)
    assert_screening_bound_holds_on_every_key(inp, detw)


def test_budget_between_classes_goes_to_the_next_class():
    """A budget that is not itself a class (here 4 with classes 2 and 6) screens in the next
    larger class: no program is left out of every kernel (its keys would be lost)."""
    inp, plan, budget, agg, coef, eps, tau, prune, lo, ops = _class_inputs()
    T, N = budget.shape[0], inp.k.shape[0]
    knorm = key_norm_upper(inp.k)
    keep = jnp.arange(6)[None, :] < jnp.where(budget == 6, 4, budget)[:, None]
    plan = types.SimpleNamespace(rows=jnp.where(keep[..., None], plan.rows, 0.0),
                                 row_weights=jnp.where(keep, plan.row_weights, 0.0))
    budget = jnp.where(budget == 6, 4, budget)
    surv = pipeline.screen_by_budget(plan, budget, (2, 6), *agg, coef, eps, tau, prune, lo,
                                     inp.hi, ops, knorm, splits=2, capacity=512,
                                     single_piece=True, tiles=TILES_KC)
    U = screen.screening_bound_reference(plan.rows, plan.row_weights, *agg, coef, eps, ops.k,
                                         knorm, ops.scale, single_piece=True)
    m = np.asarray(screen.survivors_reference(U, tau, prune, lo, inp.hi))
    near = np.abs(np.asarray(U) - np.asarray(tau)[:, None]) <= 1e-5 * (1 + np.abs(np.asarray(U)))
    got = unpack_survivors(surv.packed, surv.count, T, N)
    assert np.all((got == m) | near)
    assert int(got.sum()) > 0


def test_budget_block_follows_the_share():
    """Queries sharing one automatic budget: the whole wave, the widest screening program of
    the classes (8 queries in the default "kc" screen), or each query alone."""
    classes = (3, 7, 15)
    assert pipeline.budget_block(classes, 1, 2048, TILES_KC) == 2048
    assert pipeline.budget_block(classes, 1, 2048, TILES_KC._replace(budget_share="program")) == 8
    assert pipeline.budget_block(classes, 1, 2048, TILES_KC._replace(budget_share="query")) == 1
