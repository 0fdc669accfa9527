"""``python -m benchmarks``: every preset at its ``--quick`` shapes on the CPU, through the entry
point's Python function; the tables' rows and columns, the matrix's geometric mean recomputed
from its rows, the files written after each row, the option parsing, and ``--weights`` reaching
``datasets.trained`` and the tables (a tiny weights file as the slack weights)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

#: one worker runs this module: its module fixture (a costly run) is then built once
pytestmark = pytest.mark.xdist_group("benchmarks")

from benchmarks import __main__ as entry
from benchmarks.report import Table, geometric_mean
from benchmarks.shapes import PRESETS, QUICK


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Each preset run once, in one process (the quick presets share a config and shapes, so
    DoSA and the dense scan compile once)."""
    out = str(tmp_path_factory.mktemp("bench"))
    # the matrix's variants too: block witnesses and a survivor cost
    variant = {"matrix": ["--block-witnesses", "128", "--survivor-cost", "3"]}
    return out, {name: entry.run([name, "--quick", "--out", out] + variant.get(name, []))
                 for name in ("headline", "matrix", "kernels", "select")}


def _columns(tab):
    return [k for k, _ in tab.columns]


def test_headline_rows_and_columns(tables):
    _, t = tables
    tab = t["headline"]
    p = QUICK["headline"]
    assert [(r["case"], r["N"]) for r in tab.rows] == [(c.name, n) for c in p.cases for n in p.Ns]
    for r in tab.rows:
        assert set(_columns(tab)) <= set(r)
        assert r["dosa_eq_dense"] is True
        assert min(r["xla_ms"], r["dense_ms"], r["dosa_ms"]) > 0
        assert r["dense_over_dosa"] == pytest.approx(r["dense_ms"] / r["dosa_ms"])
        assert r["xla_over_dosa"] == pytest.approx(r["xla_ms"] / r["dosa_ms"])
        assert 0 < r["survival"] <= 1 and r["xla_index_agreement"] > 0.9


def test_matrix_geometric_mean_from_its_rows(tables):
    out, t = tables
    tab = t["matrix"]
    p = QUICK["matrix"]
    assert sorted((r["case"], r["N"]) for r in tab.rows) == sorted(
        (c.name, n) for c in p.cases for n in p.Ns)
    means = {k: v for k, v in tab.summary().items() if k.startswith("geometric mean")}
    assert len(means) == 4           # DoSA, always screened, block witnesses, survivor cost
    for path in ("dosa", "screened", "blockwit", "kappa"):
        ratios = [r["dense_ms"] / r[f"{path}_ms"] for r in tab.rows]
        name = "DoSA" if path == "dosa" else path
        (label, got), = [(k, v) for k, v in means.items() if f"dense/{name}," in k]
        assert got == pytest.approx(float(np.exp(np.mean(np.log(ratios)))), rel=1e-12)
        assert f"({len(ratios)} cases)" in label
    for name in ("blockwit", "kappa"):
        assert {f"{name}_ms", f"dense_over_{name}", f"{name}_survival", f"{name}_budget",
                f"{name}_tau_over_tau_star"} <= set(_columns(tab))
    for r in tab.rows:
        assert set(_columns(tab)) <= set(r), set(_columns(tab)) - set(r)
        assert r["dosa_eq_dense"] is True       # every variant's answer too
        assert 0 < r["blockwit_survival"] <= 1 and 0 < r["kappa_survival"] <= 1
        H = int(r["case"].split("_H")[1])      # mean retained heads: 1 ≤ r ≤ H
        assert all(1 <= r[k] <= H for k in ("budget", "blockwit_budget", "kappa_budget"))
        for name in ("blockwit", "kappa"):      # the variant's own τ, never above τ*
            t = r[f"{name}_tau_over_tau_star"]
            assert t is None or t <= 1 + 1e-6
        assert r["bound_queries"] == p.bound_queries
        # the bound's floor at τ* never exceeds survival at τ ≤ τ* on the same keys
        assert 0 <= r["survival_sub_tau_star"] <= r["survival_sub_tau"] <= 1
        assert 0 < r["floor_exact"] <= 1
        assert all(r[f"slack_{k}"] >= -1e-6 for k in ("pos", "unc", "canc"))
    saved = json.load(open(tab.json_path))
    assert [s["case"] for s in saved["rows"]] == [r["case"] for r in tab.rows]
    assert all(saved["summary"][k] == pytest.approx(v, rel=1e-12) for k, v in means.items())
    md = open(tab.md_path).read().splitlines()
    header = next(i for i, l in enumerate(md) if l.startswith("| case |"))
    assert sum(l.startswith("| ") for l in md[header + 2:]) == len(tab.rows)
    assert tab.md_path.startswith(out)


def test_kernels_and_select_rows(tables):
    _, t = tables
    k = t["kernels"]
    assert {r["path"] for r in k.rows} == {"dosa", "dense"}
    assert all(r["ms"] > 0 for r in k.rows)
    s = t["select"]
    assert [r["path"] for r in s.rows] == ["pallas", "reference", "lax.top_k"]
    assert all(r["equal"] and r["equal_ties_nan"] for r in s.rows[:2])
    assert s.rows[2]["vs_lax"] == 1.0


def test_geometric_mean_and_table_written_after_every_row(tmp_path):
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([0.5, 2.0, 8.0]) == pytest.approx(2.0)
    assert math.isnan(geometric_mean([]))
    tab = Table("t", "title", [("a", "A")], str(tmp_path),
                dict(date="d", commit="c", device="x", backend="cpu", jax="j", command="cmd"))
    tab.add(dict(a=1.5))
    assert json.load(open(tab.json_path))["rows"] == [dict(a=1.5)]
    tab.add(dict(a=2.5))
    assert "| 2.500 |" in open(tab.md_path).read()
    assert len(json.load(open(tab.json_path))["rows"]) == 2


def test_options_parse_and_name_the_bad_argument():
    p = PRESETS["headline"]
    assert entry.parse_sizes("", p) == p.Ns
    assert entry.parse_sizes("all", p) == p.N_options
    assert entry.parse_sizes("1m,128k,4096", p) == (1 << 20, 131072, 4096)
    with pytest.raises(ValueError, match="--N"):
        entry.parse_sizes("lots", p)
    m = PRESETS["matrix"]
    assert len(m.cases) == 16 and len({c.name for c in m.cases}) == 16
    assert [c.name for c in entry.parse_cases("code2_H32,prose1_H64", m)] == ["code2_H32",
                                                                              "prose1_H64"]
    assert {c.H for c in entry.parse_cases("H64", m)} == {64} and len(entry.parse_cases("H64", m)) == 8
    with pytest.raises(ValueError, match="--cases"):
        entry.parse_cases("nonsense", m)
    with pytest.raises(ValueError, match="--cases"):
        entry.parse_cases("H16", m)
    with pytest.raises(SystemExit):
        entry.run(["nonsense"])    # not a preset
    with pytest.raises(SystemExit):
        entry.run(["matrix", "--quick", "--block-witnesses", "100"])   # not a multiple of 64


def test_tile_specs_parse_seeds_and_anchors():
    from benchmarks.tiles import BENCH_SEEDS, parse_tiles, tiles_name
    from pallas_kernels import dense
    t, o = parse_tiles("kh:128:4:3:kh:8:4:0:32/8192/64")
    assert (t.layout, t.BK, t.num_stages, t.screen_bq, t.screen_lane_sums, t.screen_bk) == (
        "kh", 128, 3, 8, False, 32)
    cfg = o.config(2048)
    assert (cfg.seed_size, cfg.anchor_stride, cfg.backend) == (8192, 64, "pallas")
    assert tiles_name(t, o).endswith("/8192/64") and t.widen_fp8
    t, _ = parse_tiles("screen_defer=1+screen_stages=2+BK=128")
    assert t == dense.Tiles()._replace(screen_defer=True, screen_stages=2, BK=128)
    assert parse_tiles(tiles_name(t))[0] == t
    with pytest.raises(ValueError, match="screen_defr"):
        parse_tiles("screen_defr=1")
    t, o = parse_tiles("")
    assert t == dense.Tiles() and (o.seeds, o.anchor) == (BENCH_SEEDS, 0)


@pytest.mark.slow
def test_witness_timing_rows_checked_against_dense(tmp_path):
    """``benchmarks.witness_timing`` on tiny shapes (the committed fixture's code3 rows, N =
    4096): one row per (case, W, κ), each answer bitwise the dense scan's, a larger κ never a
    smaller automatic budget, and both files written."""
    from benchmarks import witness_timing
    rows = witness_timing.main(["--cases", "code3", "--widths", "128", "--survivor-costs", "1,8",
                                "--no-stages", "--length", "4096", "--queries", "4",
                                "--repeats", "1", "--out", str(tmp_path)])
    assert [(r["case"], r["W"], r["kappa"]) for r in rows] == [("code3", 128, 1.0),
                                                               ("code3", 128, 8.0)]
    assert all(r["eq"] for r in rows)
    assert rows[1]["budget_mean"] >= rows[0]["budget_mean"]
    assert all(len(r["terms"]) == 4 and 0 <= r["surv_all"] <= 1 for r in rows)
    assert all(0 <= r["records"] <= r["surv_screened"] for r in rows)
    assert all(r[f"{s}_ms"] is None for r in rows for s in witness_timing.STAGES)
    for r in rows:   # "r:share" per budget, budgets of H = 32 (1 … 31), shares summing to ≤ 1
        shares = {int(a): float(b) for a, b in (x.split(":") for x in r["budgets"].split())}
        assert all(1 <= a <= 31 for a in shares) and sum(shares.values()) <= 1.001
    saved = json.loads((tmp_path / "witness_timing.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert "| code3 | 128 | 8.000 | 0 | True |" in (tmp_path / "witness_timing.md").read_text()
    # two key splits: the kernels' pipeline called directly (interpreted here, while the
    # public rows above ran the CPU's reference backend), checked against the kernels' dense,
    # with each of its stages timed alone from the call's start
    two = witness_timing.main(["--cases", "code3", "--widths", "0", "--survivor-costs", "8",
                               "--splits", "2", "--length", "4096",
                               "--queries", "4", "--repeats", "1", "--out", str(tmp_path)])
    assert [(r["splits"], r["eq"]) for r in two] == [(2, True)]
    assert 0 < two[0]["surv_all"] <= 1 and two[0]["seeds_mean"] > 0
    assert all(two[0][f"{s}_ms"] > 0 for s in witness_timing.STAGES)


def _spy_trained(monkeypatch, fail=False):
    """Record every datasets.trained call's weights (and the loaded file); fail: raise after."""
    from dosa_jax import datasets
    real, calls = datasets.trained, []

    def spy(*args, **kw):
        calls.append(kw.get("weights", "committed"))
        inp = real(*args, **kw)
        calls[-1] = (calls[-1], inp.meta.get("weights_file"))
        if fail:
            raise RuntimeError("stop after loading")
        return inp

    monkeypatch.setattr(datasets, "trained", spy)
    return calls


def test_weights_slack_reaches_trained_and_the_table(monkeypatch, tmp_path, tiny_weights):
    from dosa_jax import datasets
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", tiny_weights)
    calls = _spy_trained(monkeypatch)
    tab = entry.run(["headline", "--quick", "--weights", "slack", "--cases", "code0_H4",
                     "--N", "256", "--out", str(tmp_path)])
    assert calls == [("slack", tiny_weights)]
    assert [r["case"] for r in tab.rows] == ["code0_H4"] and tab.rows[0]["dosa_eq_dense"] is True
    assert (tab.meta["weights"], tab.meta["weights_file"]) == ("slack", tiny_weights)
    note = "indexer weights: slack (datasets.trained(..., weights='slack'): lm_weights_slack.npz)"
    assert note in tab.notes and note in open(tab.md_path).read()
    assert tab.json_path == str(tmp_path / "headline_slack.json")     # never the committed name
    saved = json.load(open(tab.json_path))
    assert saved["meta"]["weights"] == "slack" and note in saved["notes"]


def test_weights_reach_every_loading_preset(monkeypatch, capsys, tmp_path, tiny_weights):
    """matrix and decode (each case's failure recorded, not raised) load the slack weights;
    a missing slack file is one argument error naming the command that writes it."""
    from dosa_jax import datasets
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", tiny_weights)
    calls = _spy_trained(monkeypatch, fail=True)
    m = entry.run(["matrix", "--quick", "--weights", "slack", "--cases", "code0_H4", "--N", "256",
                   "--tag", "1m_h32", "--out", str(tmp_path)])
    assert calls == [("slack", tiny_weights)] and "stop after loading" in m.errors[0]
    assert m.json_path == str(tmp_path / "matrix_1m_h32_slack.json")
    calls.clear()
    d = entry.run(["decode", "--quick", "--weights", "slack", "--cases", "code0_H4", "--N", "256",
                   "--out", str(tmp_path)])
    assert calls and set(calls) == {("slack", tiny_weights)} and d.meta["weights"] == "slack"
    assert any(n.startswith("indexer weights: slack") for n in d.notes)
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", str(tmp_path / "absent.npz"))
    calls.clear()
    with pytest.raises(SystemExit):
        entry.run(["matrix", "--quick", "--weights", "slack", "--out", str(tmp_path)])
    assert "benchmarks.slack_finetune" in capsys.readouterr().err and calls == []
    with pytest.raises(SystemExit):
        entry.run(["matrix", "--quick", "--weights", "other", "--out", str(tmp_path)])
    assert "weights='other': no such file" in capsys.readouterr().err and calls == []


def test_weights_file_path_reaches_trained_and_names_the_outputs(monkeypatch, tmp_path,
                                                                 tiny_weights):
    path = str(tmp_path / "weights lambda 3.npz")
    shutil.copyfile(tiny_weights, path)
    calls = _spy_trained(monkeypatch, fail=True)
    m = entry.run(["matrix", "--quick", "--weights", path, "--cases", "code0_H4", "--N", "256",
                   "--tag", "1m_h32", "--out", str(tmp_path)])
    assert calls == [(path, path)] and "stop after loading" in m.errors[0]
    assert m.json_path == str(tmp_path / "matrix_1m_h32_weights_lambda_3.json")
    assert (m.meta["weights"], m.meta["weights_file"]) == (path, path)
    assert entry.weights_tag("", path) == "weights_lambda_3"
    assert entry.weights_tag("1m_weights_lambda_3", path) == "1m_weights_lambda_3"


def test_witness_timing_loads_the_chosen_weights(monkeypatch, tmp_path, tiny_weights):
    from benchmarks import witness_timing
    from dosa_jax import datasets
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", tiny_weights)
    calls = _spy_trained(monkeypatch, fail=True)
    with pytest.raises(ValueError, match="no H=32 indexer"):    # the tiny file has H = 4 only
        witness_timing.main(["--cases", "code2", "--weights", "slack", "--length", "256",
                             "--queries", "4", "--out", str(tmp_path)])
    assert calls == ["slack"]


def test_committed_weights_by_default(tables):
    _, t = tables
    assert all(tab.meta["weights"] == "committed" for tab in t.values())
    for name in ("headline", "matrix", "kernels"):
        assert "indexer weights: committed (dosa_jax/data/lm_weights.npz)" in t[name].notes
        assert t[name].json_path.endswith(f"{name}.json")
    assert entry.weights_tag("", "committed") == "" and entry.weights_tag("", "slack") == "slack"
    assert entry.weights_tag("1m_h64", "slack") == "1m_h64_slack"
    assert entry.weights_tag("1m_h64_slack", "slack") == "1m_h64_slack"


def test_block_witness_study_rows_and_survivor_cost(tmp_path):
    """``benchmarks.block_witnesses`` on tiny shapes at a given κ: every call is checked
    against the dense scan inside (it raises otherwise); perfect witnesses give τ = τ*; the
    block witnesses, extra to the seeds, close a share of the seeds' gap to τ* in [0, 1]."""
    from benchmarks import block_witnesses
    block_witnesses.main(["--length", "8192", "--queries", "4", "--cases", "code:1",
                          "--widths", "256", "--survivor-cost", "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "block_witnesses.json").read_text())
    (row,) = saved["rows"]
    assert "error" not in row, row
    assert row["kappa"] == 3.0 and saved["args"]["survivor_cost"] == 3.0
    perfect, seeds, wit = row["perfect"], row["seeds"], row["W256"]
    assert perfect["tau_over_tau_star"] == pytest.approx(1.0)
    assert seeds["tau_over_tau_star"] < 1 and 0 < seeds["survival"] <= 1
    assert seeds["tau_over_tau_star"] <= wit["tau_over_tau_star"] <= 1
    assert 0 <= wit["gap_closed"] <= 1 and 0 < perfect["survival"] <= 1
    md = (tmp_path / "block_witnesses.md").read_text()
    assert "survivor cost κ: 3" in md and "| code1 (N=8192, T=4) |" in md


def test_slack_analysis_on_a_weights_file(tmp_path, tiny_weights, capsys):
    """``benchmarks.slack_analysis`` with ``--weights``/``--heads``: rows name the indexers, the
    survival split adds up, a fixed budget is the budget used, and the report labels them."""
    from benchmarks import slack_analysis
    out = tmp_path / "sa.json"
    rows = slack_analysis.main(["--layers", "0", "--length", "512", "--queries", "4", "--K", "16",
                                "--budgets", "auto,2", "--extra", "", "--heads", "4",
                                "--weights", tiny_weights, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows))
    (row,) = rows
    assert (row["heads"], row["weights"], row["layer"]) == (4, tiny_weights, 0)
    assert set(row["configs"]) == {"r=auto", "r=2 (seed p)"}
    for c in row["configs"].values():
        parts = c["survival_top"] + c["survival_seed_deficit"] + c["survival_slack"]
        assert 0 < c["survival"] <= 1 and math.isclose(parts, c["survival"], abs_tol=1e-9)
    assert {int(r) for r in row["configs"]["r=2 (seed p)"]["budget"]} == {2}
    capsys.readouterr()
    slack_analysis.main(["--report", str(out)])
    assert "| code | 0 (H=4, lm_weights_slack.npz) |" in capsys.readouterr().out


def test_query_rounding_margin_counts_and_rounding(tmp_path):
    """``benchmarks.query_rounding_margin``: the FP8 rounding of query rows (exact rows stay,
    zero rows stay zero, the error within e4m3's half-ulp), and on a tiny trained case every
    Top-K key counted by both screens, the rounded query's margin never the smaller."""
    import numpy as np
    from benchmarks import query_rounding_margin as qrm
    exact = np.array([[[448.0, -0.5, 3.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]], np.float32) * 2.0 ** -20
    np.testing.assert_array_equal(qrm.fp8_rounded_rows(exact), exact)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32) * np.float32(7.3)
    r = qrm.fp8_rounded_rows(q)
    mx = np.abs(q).max(axis=-1, keepdims=True)
    assert np.all(np.abs(r - q) <= mx * 2.0 ** -4)      # |x| ≤ max: half an ulp of 3 bits
    assert np.any(r != q)
    rows = qrm.main(["--cases", "code:2:32", "--length", "2048", "--queries", "2", "--K", "64",
                     "--out", str(tmp_path)])
    assert len(rows) == 1 and "error" not in rows[0], rows
    for p in rows[0]["per_query"]:
        assert min(64, p["visible"]) <= p["certified"] <= p["fp8_query"] <= p["visible"]
        assert p["margin_fp8"] >= p["margin_cert"] >= 0
    saved = json.loads((tmp_path / "query_rounding_margin.json").read_text())
    assert saved["rows"][0]["certified"] == rows[0]["certified"]
    assert "| code2_H32 | 2048 | 2 |" in (tmp_path / "query_rounding_margin.md").read_text()
