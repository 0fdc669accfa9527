"""Regression on the trained-indexer fixture: the automatic budget must find the
budgets that prune (a bug once compared payload-unit bounds with score-unit τ for
scaled FP8 keys, so "auto" picked r=4 and pruned nothing), and DoSA == dense."""

import jax
import numpy as np
import pytest

import dosa_jax
from dosa_jax import datasets


@pytest.mark.slow
def test_auto_budget_prunes_on_trained_fp8_fixture():
    inp = datasets.trained("prose", 0)
    assert inp.k.dtype == np.dtype("float8_e4m3fn") or str(inp.k.dtype) == "float8_e4m3fn"
    cfg = dosa_jax.Config(top_k=256, query_tile=64)
    r = jax.jit(dosa_jax.topk)(**inp.as_kwargs(), config=cfg)
    d = jax.jit(dosa_jax.dense_topk)(**inp.as_kwargs(), config=cfg)
    np.testing.assert_array_equal(np.asarray(r.indices), np.asarray(d.indices))
    np.testing.assert_array_equal(np.asarray(r.scores), np.asarray(d.scores))
    st = r.stats
    surv = float(np.sum(st.survivors) / np.sum(st.screened))
    assert surv < 0.5, surv
    assert np.median(np.asarray(st.budget)) > 4
