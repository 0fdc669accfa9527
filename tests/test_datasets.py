"""dosa_jax.datasets: the committed trained-indexer fixture, regeneration, synthetic re-export."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import datasets
from dosa_jax.inputs import IndexerInputs
from dosa_jax.lm import dump
from dosa_jax.scorer import score_gathered


def _scores(inp: IndexerInputs) -> np.ndarray:
    """Full [T, N] score matrix through the library's canonical scorer (Eq. 1)."""
    T, N = inp.q.shape[0], inp.k.shape[0]
    keys = jnp.broadcast_to(inp.k[None], (T,) + inp.k.shape)
    scale = None if inp.k_scale is None else jnp.broadcast_to(inp.k_scale[None], (T, N))
    return np.asarray(score_gathered(inp.q, inp.w, keys, scale))


def test_list_fixture_describes_both_domains_and_head_counts():
    entries = datasets.list_fixture()
    got = {(e["domain"], e["layer"], e["heads"]) for e in entries}
    assert got == set(dump.FIXTURE_ENTRIES)
    assert {e["domain"] for e in entries} == {"code", "prose"}
    for e in entries:
        assert (e["length"], e["num_queries"], e["head_dim"]) == (4096, 64, 128)
        assert e["positions"] == (4032, 4095)
    assert os.path.getsize(dump.FIXTURE_PATH) < 8e6


@pytest.mark.parametrize("domain,layer,heads", [("code", 0, 32), ("prose", 3, 32), ("code", 0, 64)])
def test_fixture_shapes_dtypes_and_causal_ranges(domain, layer, heads):
    inp = datasets.trained(domain, layer, heads=heads)
    assert isinstance(inp, IndexerInputs)
    assert inp.q.shape == (64, heads, 128) and inp.q.dtype == jnp.bfloat16
    assert inp.k.shape == (4096, 128) and inp.k.dtype == jnp.float8_e4m3fn
    assert inp.k_scale.shape == (4096,) and inp.k_scale.dtype == jnp.float32
    scale = np.asarray(inp.k_scale)
    assert np.all(scale > 0) and np.all(np.exp2(np.round(np.log2(scale))) == scale)
    assert inp.w.shape == (64, heads) and inp.w.dtype == jnp.float32
    assert inp.lo.dtype == jnp.int32 and inp.hi.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(inp.lo), 0)
    np.testing.assert_array_equal(np.asarray(inp.hi), np.arange(4032, 4096) + 1)
    assert inp.meta["source"] == "fixture" and inp.meta["domain"] == domain
    assert inp.meta["layer"] == layer and inp.meta["heads"] == heads
    for a in (inp.q, inp.k, inp.w):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))


def test_fp8_payload_times_scale_approximates_bf16_keys():
    fp8 = datasets.trained("prose", 0, key_dtype="float8_e4m3fn")
    bf = datasets.trained("prose", 0, key_dtype="bfloat16")
    assert bf.k.dtype == jnp.bfloat16 and bf.k_scale is None
    k = np.asarray(bf.k, np.float32)
    deq = np.asarray(fp8.k, np.float32) * np.asarray(fp8.k_scale)[:, None]
    # e4m3: 3 mantissa bits (relative error <= 2^-4) down to 2^-6·scale, then absolute 2^-10·scale
    tol = np.maximum(2.0 ** -4 * np.abs(k), 2.0 ** -10 * np.asarray(fp8.k_scale)[:, None])
    assert np.all(np.abs(deq - k) <= tol + 1e-12)
    amax = np.abs(k).max(1)
    assert np.all(amax / np.asarray(fp8.k_scale) <= 448) and np.all(amax / np.asarray(fp8.k_scale) > 224)
    # scores agree to FP8 accuracy
    s8, s16 = _scores(fp8), _scores(bf)
    assert np.abs(s8 - s16).max() <= 0.1 * np.abs(s16).max()


def test_head_weights_are_signed_per_token():
    for domain, layer in (("code", 0), ("prose", 3)):
        w = np.asarray(datasets.trained(domain, layer).w)
        both = (w < 0).any(1) & (w > 0).any(1)
        assert both.mean() > 0.9, "most tokens mix positive and negative heads"
        assert np.std(w, axis=0).min() > 0, "every head's weight varies from token to token"
        assert 0.1 < (w < 0).mean() < 0.9


def test_num_queries_takes_the_last_positions_and_query_dtypes():
    full = datasets.trained("code", 3, key_dtype="bfloat16")
    few = datasets.trained("code", 3, num_queries=16, key_dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(few.q, np.float32), np.asarray(full.q, np.float32)[-16:])
    np.testing.assert_array_equal(np.asarray(few.hi), np.arange(4080, 4096) + 1)
    q8 = datasets.trained("code", 3, num_queries=16, key_dtype="bfloat16", query_dtype="float8_e4m3fn")
    assert q8.q.dtype == jnp.float8_e4m3fn
    s8, s = _scores(q8), _scores(few)
    assert np.abs(s8 - s).max() <= 0.1 * np.abs(s).max()
    # the scores are not degenerate: keys are ranked, not tied
    assert np.mean([len(np.unique(r)) for r in s]) > 0.9 * s.shape[1]


def test_generation_on_cpu_reproduces_the_fixture():
    """Regenerating the fixture's rows from the committed weights gives the same data.

    Not bitwise: XLA's CPU code for the LM's forward pass differs between processors (bf16
    keys may land one bf16 step away, q and w within a fraction of a percent of their largest
    entry). So values are compared
    relative to their largest entry, and what the library consumes, each query's Top-256 of the
    scores, must be the same keys.
    """
    fx = datasets.trained("prose", 3, key_dtype="bfloat16", query_dtype="float32")
    gen = datasets.trained("prose", 3, key_dtype="bfloat16", query_dtype="float32", source="generate")
    assert gen.meta["source"] == "generated" and fx.meta["source"] == "fixture"
    kf, kg = np.asarray(fx.k, np.float32), np.asarray(gen.k, np.float32)
    assert np.mean(kf == kg) > 0.5 and np.abs(kf - kg).max() <= 2 ** -6 * np.abs(kf).max()
    for a, b in ((gen.w, fx.w), (gen.q, fx.q)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 0.01 * np.abs(b).max()
    sf, sg = _scores(fx), _scores(gen)
    top = lambda s: np.argsort(-s, axis=1)[:, :256]
    overlap = [len(np.intersect1d(a, b)) / 256 for a, b in zip(top(sf), top(sg))]
    assert min(overlap) >= 0.9 and np.mean(overlap) >= 0.97, (min(overlap), np.mean(overlap))


def test_dump_dir_roundtrip(tmp_path):
    rows = dump.load_rows(dump.FIXTURE_PATH)
    name = dump.entry_name("code", 0, 32, 4096)
    dump.save_rows(str(tmp_path / "dump_code_H32_N4096.npz"), {name: rows[name]})
    a = datasets.trained("code", 0, length=4096, num_queries=8, dump_dir=str(tmp_path))
    b = datasets.trained("code", 0, num_queries=8)
    for x, y in ((a.q, b.q), (a.k, b.k), (a.k_scale, b.k_scale), (a.w, b.w), (a.hi, b.hi)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with pytest.raises(ValueError):
        datasets.trained("code", 1, length=4096, dump_dir=str(tmp_path))


def test_bad_arguments():
    with pytest.raises(ValueError, match="domain"):
        datasets.trained("poetry", 0)
    with pytest.raises(ValueError, match="fixture"):
        datasets.trained("code", 1, source="fixture")
    with pytest.raises(ValueError, match="fixture"):
        datasets.trained("code", 0, num_queries=65, source="fixture")
    with pytest.raises(ValueError, match="source"):
        datasets.trained("code", 0, source="disk")
    with pytest.raises(ValueError, match="key_dtype"):
        datasets.trained("code", 0, key_dtype="int8")
    with pytest.raises(ValueError, match="exceeds"):
        dump.indexer_inputs("code", 0, length=10 ** 8, num_queries=1)


def test_synthetic_is_reexported():
    a = datasets.synthetic("gaussian", T=4, N=64, H=4, D=8, key_dtype="float8_e4m3fn")
    b = datasets.gaussian(T=4, N=64, H=4, D=8, key_dtype="float8_e4m3fn")
    assert isinstance(a, IndexerInputs) and a.k_scale is not None
    np.testing.assert_array_equal(np.asarray(a.w), np.asarray(b.w))
    assert datasets.structured(T=2, N=32, H=4, D=8).q.shape == (2, 4, 8)


def test_trained_through_the_package_attribute():
    """``import dosa_jax; dosa_jax.datasets.trained(...)`` in a fresh interpreter (the
    package exposes its submodules as attributes, imported on first use)."""
    import pathlib
    import subprocess
    import sys

    import dosa_jax
    if "__getattr__" not in vars(dosa_jax):
        pytest.skip("this build of dosa_jax has no lazy submodule attributes")
    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import dosa_jax; inp = dosa_jax.datasets.trained('prose', 0, num_queries=4); "
            "print(inp.q.shape, inp.k.shape, inp.meta['source'])")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["(4,", "32,", "128)", "(4096,", "128)", "fixture"], out.stdout
