"""The pallas backend's decision to answer by the dense scan: the call-level switch on the
predicted cost ratio, and the deferred dense pass of the groups that cannot prune. Exact
either way: every path equals the dense scan bitwise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax import synthetic
from dosa_jax.config import Config
from pallas_kernels import dense, pipeline

pytestmark = pytest.mark.xdist_group("pallas")

TILES = dense.Tiles(BQ=4, BK=16, CH=32, refine_bk=0, compact_chunk=64)


def _inputs(T=12):
    return synthetic.structured(T=T, N=600, H=8, D=16, seed=5, key_dtype="float8_e4m3fn",
                                query_dtype="bfloat16")


BASE = Config(top_k=16, retained_heads=4, seed_size=64)
#: the deferred-dense test's configuration: the call-level switch off
DEFERRED = BASE.replace(dense_switch=float("inf"))
BAD_KEY = 594                      # its scale made invalid: queries seeing it cannot prune


@functools.lru_cache(maxsize=None)
def _answers():
    """Both pipeline tests' answers from one program (their pipelines compiled together):
    on the inputs, the dense scan, the switched call and two waves under the GPU's default
    switch; with key BAD_KEY's scale 0, the dense scan and waves of 4 with the switch off."""
    inp = _inputs()
    scale = np.asarray(inp.k_scale).copy()
    scale[BAD_KEY] = 0.0
    dosa = lambda a, cfg, **kw: pipeline.dosa_topk(*a, cfg, tiles=TILES, splits=2, **kw)
    dense_scan = lambda a, cfg: pipeline.dense_topk(*a, cfg, tiles=TILES, splits=2)

    def run(q, k, w, k_scale, bad_scale, lo, hi):
        a, b = (q, k, w, k_scale, lo, hi), (q, k, w, bad_scale, lo, hi)
        return dict(dense=dense_scan(a, BASE),
                    switched=dosa(a, BASE.replace(dense_switch=1e-6)),  # any prediction exceeds it
                    # two waves, the GPU's default switch (interpret mode's default screens)
                    auto=dosa(a, BASE.replace(dense_switch=pipeline.DENSE_SWITCH), wave=8),
                    bad_dense=dense_scan(b, DEFERRED), bad_waves=dosa(b, DEFERRED, wave=4))

    return jax.jit(run)(inp.q, inp.k, inp.w, inp.k_scale, jnp.asarray(scale), inp.lo, inp.hi)


def test_every_path_equals_dense_bitwise_and_is_counted():
    out = _answers()
    didx, dsc = out["dense"]
    switched, auto = out["switched"], out["auto"]
    for idx, sc, _ in (switched, auto):
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
        np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    st = switched[2]
    vis = np.asarray(st.visible) > 0
    assert np.asarray(st.dense)[vis].all() and not np.asarray(st.pruning).any()
    assert np.array_equal(np.asarray(st.survivors), np.asarray(st.visible))
    ratio = np.asarray(st.predicted_cost)
    assert np.all(np.isfinite(ratio)) and np.all(ratio == ratio[0]) and ratio[0] > 0
    # the default path made the same prediction (the screened path makes none: next test)
    np.testing.assert_array_equal(np.asarray(auto[2].predicted_cost), ratio)
    assert pipeline.default_dense_switch(interpret=False) == pipeline.DENSE_SWITCH
    assert pipeline.default_dense_switch(interpret=True) == float("inf")


def test_deferred_direct_groups_are_answered_by_one_dense_pass():
    """Queries that cannot prune (a bad key scale in
    their range) are dense groups; with waves they are answered after all waves by one dense
    pass, bitwise equal to the dense scan, counted in ``Stats.dense``."""
    inp = _inputs()
    out = _answers()
    didx, dsc = out["bad_dense"]
    idx, sc, st = out["bad_waves"]
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(didx))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(dsc))
    sees = np.asarray(inp.hi) > BAD_KEY
    assert sees.any() and (~sees).any()
    d = np.asarray(st.dense)
    assert d[sees].all()
    assert np.isnan(np.asarray(st.predicted_cost)).all()      # switch off: no prediction made
    assert int(jnp.sum(st.pruning)) > 0                        # the other queries screened
    assert np.array_equal(np.asarray(st.survivors)[sees], np.asarray(st.visible)[sees])


def test_predicted_cost_is_the_range_weighted_model():
    direct = jnp.array([True, False, False])
    rows = jnp.array([0, 8, 16])
    use = jnp.array([0.0, 50.0, 10.0])
    rng = jnp.array([100, 200, 300])
    terms = np.asarray(pipeline.predicted_cost_terms(direct, rows, use, rng, 32))
    np.testing.assert_allclose(terms, [(8 / 32 * 200 + 16 / 32 * 300) / 600, 60 / 600, 100 / 600,
                                       32 / (600 / 3)], rtol=1e-6)
    got = float(pipeline.predicted_cost_ratio(terms, screen_row_cost=0.5, refine_key_cost=2.0,
                                              dense_pass_cost=1.5, per_query_cost=10.0))
    want = (1.5 * 100 + (0.5 * 8 / 32 * 200 + 2 * 50) + (0.5 * 16 / 32 * 300 + 2 * 10)) / 600 \
        + 10.0 * 32 / 200
    assert got == pytest.approx(want, rel=1e-6)
    # a group that sees no key adds nothing to the per-query term's mean range
    some = np.asarray(pipeline.predicted_cost_terms(
        jnp.array([False, False]), jnp.array([8, 8]), jnp.array([1.0, 0.0]),
        jnp.array([400, 0]), 32))
    assert some[3] == pytest.approx(32 / 400, rel=1e-6)
    # empty ranges cost nothing and do not divide by zero
    empty = pipeline.predicted_cost_terms(direct[:1], rows[:1], use[:1], jnp.array([0]), 32)
    assert float(pipeline.predicted_cost_ratio(empty)) == 0.0


def test_default_cost_model_separates_the_measured_matrix():
    """The default constants against the H200 matrix they were fitted to: every case whose
    always-screened call ran slower than the dense scan is predicted above the switch, every
    faster one below (the cost terms and times are the committed measurement)."""
    import json
    import pathlib
    res = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    cases = 0
    for name in ("matrix_1m_h32.json", "matrix_1m_h64.json", "matrix_128k.json"):
        for r in json.loads((res / name).read_text())["rows"]:
            if len(r["cost_terms"]) < 4:   # measured before the per-query term: add it
                H = int(r["case"].split("_H")[1])
                r["cost_terms"] = list(r["cost_terms"]) + [H / (r["N"] - 8192)]
            pred = float(pipeline.predicted_cost_ratio(jnp.asarray(r["cost_terms"])))
            faster = r["dense_over_screened"] > 1.0
            assert (pred < pipeline.DENSE_SWITCH) == faster, (name, r["case"], pred)
            cases += 1
    assert cases == 32


def test_dense_switch_is_validated():
    with pytest.raises(ValueError, match="dense_switch"):
        Config(dense_switch=0.0)
    with pytest.raises(ValueError, match="dense_switch"):
        Config(dense_switch="x")
