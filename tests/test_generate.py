"""Generation with DSA selection by ``decode_topk``: the same tokens as with dense selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

#: one worker runs this module: its module fixture (a costly run) is then built once
pytestmark = pytest.mark.xdist_group("generate")

import dosa_jax
from dosa_jax.lm import generate as gen
from dosa_jax.lm.indexer import IndexerConfig, init_indexers
from dosa_jax.lm.model import LMConfig, init_lm

CFG = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, window=64, block=16,
               compute_dtype="float32")
ICFG = IndexerConfig(n_heads=4, head_dim=16, rope_dim=8, q_rank=8, compute_dtype="float32")


@pytest.fixture(scope="module")
def model():
    params = init_lm(jax.random.PRNGKey(0), CFG)
    # larger weights than the init's: varied tokens, and selections that matter
    params = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, params)
    return params, init_indexers(jax.random.PRNGKey(1), CFG, ICFG)


PROMPT = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 256)
GEN_CFG = dosa_jax.Config(backend="reference", capacity=12)
K, STEPS = 8, 30


#: the generations of PROMPT the tests compare: dense selection, decode_topk selection with
#: contiguous and with paged indexer keys, and dense selection of 2 keys
RUNS = {"dense": dict(top_k=K, selection="dense"), "contiguous": dict(top_k=K, page_size=0),
        "paged": dict(top_k=K, page_size=8), "dense_2": dict(top_k=2, selection="dense")}


@pytest.fixture(scope="module")
def runs(model):
    """Every generation of RUNS, from one program (the four loops compiled together)."""
    return jax.jit(lambda params, ilayers, prompt: {
        name: gen.generate(params, ilayers, prompt, CFG, ICFG, steps=STEPS, config=GEN_CFG, **kw)
        for name, kw in RUNS.items()})(*model, PROMPT)


@pytest.fixture(scope="module")
def dense(runs):
    """Dense-selection generation of PROMPT (shared by the tests that compare with it)."""
    return runs["dense"]


@pytest.mark.parametrize("name", ["contiguous", "paged"])
def test_decode_generation_equals_dense_generation(runs, dense, name):
    prompt, steps, b = PROMPT, STEPS, dense
    a = runs[name]
    assert a.tokens.shape == (2, 12 + steps)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.tokens[:, :12]), np.asarray(prompt))
    assert len(np.unique(np.asarray(a.tokens[:, 12:]))) > 3     # not a constant continuation
    st = a.stats
    assert st.candidates.shape == (steps, CFG.n_layers, 2)
    vis = np.asarray(st.visible)
    assert (vis[:, 0, 0] == 13 + np.arange(steps)).all()
    cand = np.asarray(st.candidates)
    assert (cand[-10:] < vis[-10:]).mean() > 0.5                 # the witnesses prune
    assert (np.asarray(st.witnesses) >= K).all()                 # at least K witnesses


def test_selection_changes_the_tokens(runs, dense):
    """The selection is not idle: reading fewer keys changes the continuation."""
    assert not np.array_equal(np.asarray(runs["dense_2"].tokens), np.asarray(dense.tokens))


def test_bad_arguments(model):
    params, ilayers = model
    p = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="selection"):
        gen.generate(params, ilayers, p, CFG, ICFG, steps=2, top_k=2, selection="x")
    with pytest.raises(ValueError, match="steps"):
        gen.generate(params, ilayers, p, CFG, ICFG, steps=0, top_k=2)
    with pytest.raises(ValueError, match="page_size"):
        gen.generate(params, ilayers, p, CFG, ICFG, steps=2, top_k=2, selection="dense",
                     page_size=4)
    with pytest.raises(ValueError, match="prompt"):
        gen.generate(params, ilayers, p[0], CFG, ICFG, steps=2, top_k=2)
