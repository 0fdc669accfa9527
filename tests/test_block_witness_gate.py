"""The pallas backend's choice of block witnesses (``Config.block_witnesses=None``): the gate on
the sampled τ gap, the witnesses it adds, and the answer, bitwise the dense scan's either way."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dosa_jax.backend
from dosa_jax import synthetic
from dosa_jax.config import Config
from dosa_jax.sample import sample_tau_gap
from pallas_kernels import dense, pipeline

pytestmark = pytest.mark.xdist_group("pallas")

TILES = dense.Tiles(BQ=4, BK=16, CH=32, refine_bk=0, compact_chunk=64)
#: the gate's configurations: block witnesses left to the backend (None), the switch off
BASE = Config(top_k=16, retained_heads=4, seed_size=64, dense_switch=float("inf"))
ALWAYS = BASE.replace(block_witness_gate=0.0)    # any positive τ gap adds them
NEVER = BASE.replace(block_witness_gate=1e12)    # a finite gate no call reaches
#: the blocks the gate adds, named: the same witnesses as ALWAYS's
EXPLICIT = BASE.replace(block_witnesses=pipeline.AUTO_BLOCK_WITNESSES)


def _inputs():
    # local windows hide the winners: the seeds' τ is far below τ*, the gap is large
    return synthetic.structured(T=12, N=600, H=8, D=16, seed=5, key_dtype="float8_e4m3fn",
                                query_dtype="bfloat16")


@functools.lru_cache(maxsize=None)
def _answers():
    """Every answer and decision of the tests from one program (compiled together)."""
    inp = _inputs()
    dosa = lambda a, cfg: pipeline.dosa_topk(*a, cfg, tiles=TILES, splits=2)
    terms = lambda a, cfg: pipeline.call_cost_terms(*a, cfg, tiles=TILES, splits=2)

    def run(*a):
        return dict(dense=pipeline.dense_topk(*a, BASE, tiles=TILES, splits=2),
                    always=dosa(a, ALWAYS), never=dosa(a, NEVER),
                    # the dense switch on: its cost terms from the plan with the blocks
                    switched=dosa(a, ALWAYS.replace(dense_switch=pipeline.DENSE_SWITCH)),
                    gate=pipeline.call_block_witness_gate(*a, ALWAYS, tiles=TILES, splits=2),
                    terms_never=terms(a, NEVER),
                    terms_plain=terms(a, BASE.replace(block_witnesses=0)),
                    terms_always=terms(a, ALWAYS), terms_explicit=terms(a, EXPLICIT))

    return inp, jax.jit(run)(inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)


def test_either_choice_equals_dense_bitwise():
    _, out = _answers()
    didx, dsc = out["dense"]
    for name in ("always", "never", "switched"):
        idx, sc, _ = out[name]
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx), err_msg=name)
        np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc), err_msg=name)


def test_the_gate_adds_the_blocks_and_raises_tau():
    inp, out = _answers()
    gap, rng, used = (float(v) for v in np.asarray(out["gate"]))
    vis = np.asarray(inp.hi - inp.lo, np.float64)
    assert gap > 0.05 and used == 1.0
    np.testing.assert_allclose(rng, vis[vis > 0].mean(), rtol=1e-6)
    _, _, st1 = out["always"]
    _, _, st0 = out["never"]
    ok = np.asarray(st0.pruning) & np.asarray(st1.pruning)
    t0, t1 = np.asarray(st0.tau_seed)[ok], np.asarray(st1.tau_seed)[ok]
    assert ok.sum() >= 4 and np.all(t1 >= t0) and np.any(t1 > t0 + 1e-3)
    assert np.all(np.asarray(st1.seeds) >= np.asarray(st0.seeds))
    assert np.sum(np.asarray(st1.survivors)) < np.sum(np.asarray(st0.survivors))
    # with the switch on, the call weighed a prediction (its answer: the bitwise test)
    assert np.isfinite(np.asarray(out["switched"][2].predicted_cost)).all()


def test_the_switch_weighs_the_chosen_witnesses():
    """The cost terms come from the plain plan when the gate says no (no second plan) and from
    the plan with the blocks when it says yes: the same terms as naming the choice."""
    _, out = _answers()
    np.testing.assert_array_equal(np.asarray(out["terms_never"]), np.asarray(out["terms_plain"]))
    np.testing.assert_array_equal(np.asarray(out["terms_always"]),
                                  np.asarray(out["terms_explicit"]))
    assert not np.array_equal(np.asarray(out["terms_always"]), np.asarray(out["terms_never"]))


def test_sample_tau_gap_counts_keys_above_tau_beyond_k():
    rng = np.random.default_rng(0)
    T, P, H, K = 5, 40, 3, 4
    dots = rng.standard_normal((T, P, H)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    valid = rng.random((T, P)) < 0.9
    valid[3] = False                                   # an empty sample
    tau = rng.standard_normal(T).astype(np.float32)
    visible = np.array([100, 3, 50, 80, 0])            # |Ω| < K on query 1, none on query 4
    got = np.asarray(sample_tau_gap(jnp.asarray(dots), jnp.asarray(valid), jnp.asarray(w),
                                    jnp.asarray(tau), jnp.asarray(visible), K))
    s = np.einsum("th,tph->tp", w.astype(np.float64), np.maximum(dots, 0).astype(np.float64))
    for t in range(T):
        n = valid[t].sum()
        if n == 0 or visible[t] == 0:
            assert got[t] == 0.0
            continue
        above = np.sum(valid[t] & (s[t] >= tau[t])) / n
        want = max(0.0, above - min(K, visible[t]) / visible[t])
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gap, rng, gate, W, want", [
    (0.02, 1 << 20, 5.0, 4096, True),       # 20,971 keys above τ > 5 · 4096
    (0.02, 1 << 17, 5.0, 4096, False),      # the same share of a 128K range: 2,621 keys
    (0.0, 1 << 20, 0.0, 4096, False),       # no gap: nothing to gain, even at gate 0
    (0.5, 1 << 10, 0.0, 4096, True),
    (5 * 4096 / (1 << 20), 1 << 20, 5.0, 4096, False),    # at the gate exactly: strict
])
def test_use_block_witnesses_weighs_keys_above_tau_against_the_witnesses(gap, rng, gate, W, want):
    assert bool(pipeline.use_block_witnesses(jnp.float32(gap), jnp.float32(rng), gate, W)) is want


def test_the_gate_defaults_and_validation():
    assert pipeline.block_witness_gate(Config(), interpret=False) == pipeline.BLOCK_WITNESS_GATE
    assert pipeline.block_witness_gate(Config(), interpret=True) == float("inf")
    assert pipeline.block_witness_gate(Config(block_witness_gate=2.0), interpret=True) == 2.0
    assert Config().block_witnesses is None
    for bad in (-1.0, True, "5", float("nan")):
        with pytest.raises(ValueError, match="block_witness_gate"):
            Config(block_witness_gate=bad)
    with pytest.raises(ValueError, match="block_witnesses"):
        Config(block_witnesses=-64)


@pytest.mark.gpu
@pytest.mark.skipif(not dosa_jax.backend.on_gpu(), reason="needs a GPU")
def test_gpu_compiled_gate_either_choice_equals_dense_bitwise():
    """The compiled kernels with the default tiles: the gate forced on, forced off, left to its
    default and bypassed (plain seeds), with and without the dense switch, all bitwise the dense
    scan's answer; the forced gate fires (the structured data's τ gap is positive)."""
    inp = synthetic.structured(T=256, N=65536, H=32, D=128, seed=9, key_dtype="float8_e4m3fn",
                               query_dtype="bfloat16")
    args = (inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi)
    base = Config(top_k=2048, dense_switch=float("inf"))
    didx, dsc = jax.jit(lambda *a: pipeline.dense_topk(*a, base))(*args)
    fired = {}
    for name, cfg in (("always", base.replace(block_witness_gate=0.0)),
                      ("never", base.replace(block_witness_gate=1e12)),
                      ("plain", base.replace(block_witnesses=0)), ("default", base),
                      ("switch", base.replace(block_witness_gate=0.0,
                                              dense_switch=pipeline.DENSE_SWITCH))):
        idx, sc, _ = jax.jit(lambda *a, c=cfg: pipeline.dosa_topk(*a, c))(*args)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx), err_msg=name)
        np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc), err_msg=name)
        fired[name] = bool(jax.jit(
            lambda *a, c=cfg: pipeline.call_block_witness_gate(*a, c)[1])(*args))
    assert fired["always"] and not fired["never"]
