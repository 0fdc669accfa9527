"""benchmarks.slack_finetune: the --quick CPU smoke run end to end, and the λ choice."""

from __future__ import annotations

import json
import math
import os
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import slack_finetune as sf
from dosa_jax.lm import checkpoint


@pytest.mark.slow
def test_quick_run_writes_rows_weights_and_timings(tmp_path):
    out = str(tmp_path)
    assert sf.main(["--quick", "--out", out]) == 0
    with open(os.path.join(out, "slack_finetune.json")) as f:
        res = json.load(f)
    rows = res["rows"]
    plan = sf.QUICK
    n_layers = 2
    assert len(rows) == len(plan.lambdas) * len(plan.heads) * n_layers
    for r in rows:
        assert r["steps"] == plan.steps
        assert math.isfinite(r["kl_heldout"]) and r["kl_heldout"] >= 0
        for N in plan.lengths:
            for d in ("code", "prose"):
                assert 0.0 <= r[f"cov_{d}_N{N}"] <= 1.0 + 1e-6
        assert 0.0 < r["survival"] <= 1.0
    chosen = res["meta"]["chosen_lambda"]
    assert chosen in plan.lambdas
    timed = [r for r in rows if "dosa_ms" in r]
    assert {r["lambda"] for r in timed} == {chosen, 0.0}
    assert len(timed) == 2 * len(plan.heads) * n_layers
    assert all(r["bitwise"] is True and r["dosa_ms"] > 0 and r["dense_ms"] > 0 for r in timed)
    # the chosen λ's weights: the base LM unchanged bit for bit, the indexers fine-tuned
    _, lm_b, ind_b, _ = checkpoint.load_weights(os.path.join(out, "quick_base_weights.npz"))
    _, lm_s, ind_s, meta = checkpoint.load_weights(os.path.join(out, sf.WEIGHTS_NAME))
    eq = lambda a, b: all(bool(jnp.all(x == y)) for x, y in
                          zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    assert eq(lm_b, lm_s)
    assert not eq(ind_b[4][1], ind_s[4][1])
    assert meta["slack_fine_tuning"]["lam"] == chosen
    assert os.path.exists(os.path.join(out, "slack_finetune.md"))
    # --evaluate measures the same files again without training: the same measurements
    out2 = os.path.join(out, "again")
    assert sf.main(["--quick", "--out", out2, "--evaluate", out]) == 0
    with open(os.path.join(out2, "slack_finetune.json")) as f:
        again = json.load(f)["rows"]
    key = lambda r: (r["lambda"], r["heads"], r["layer"])
    for a, b in zip(sorted(rows, key=key), sorted(again, key=key)):
        assert key(a) == key(b) and a["steps"] == b["steps"]
        for c in ("kl_heldout", "survival") + tuple(
                f"cov_{d}_N{N}" for d in ("code", "prose") for N in plan.lengths):
            assert a[c] == b[c], c
    # without λ = 0 nothing is chosen nor timed, and that is no error: the rows are the result;
    # --survivor-cost prices the survival calls' budget (a larger κ: never a smaller mean r)
    lam = max(plan.lambdas)
    out3 = os.path.join(out, "one")
    assert sf.main(["--quick", "--out", out3, "--evaluate", out, "--lambdas", f"{lam:g}",
                    "--survivor-cost", "64"]) == 0
    with open(os.path.join(out3, "slack_finetune.json")) as f:
        one = json.load(f)
    assert {r["lambda"] for r in one["rows"]} == {lam}
    assert any("survivor_cost=64" in n for n in one["notes"])
    assert one["meta"]["survivor_cost"] == 64.0
    key = lambda r: (r["lambda"], r["heads"], r["layer"])
    base = {key(b): b["budget"] for b in rows if b["lambda"] == lam}
    assert sorted(base) == sorted(key(r) for r in one["rows"])
    assert all(r["budget"] >= base[key(r)] for r in one["rows"])
    assert any(r["budget"] > base[key(r)] for r in one["rows"])     # the price reached the planner
    assert not any("dosa_ms" in r for r in one["rows"]) and "chosen_lambda" not in one["meta"]
    assert not os.path.exists(os.path.join(out3, sf.WEIGHTS_NAME)) and not one["errors"]


def _rows(lam, cov, surv):
    return [{"lambda": lam, "heads": 32, "layer": i, "cov_code_N1": c, "survival": s}
            for i, (c, s) in enumerate(zip(cov, surv))]


def test_choice_is_the_lowest_survival_within_the_coverage_tolerance():
    rows = (_rows(0.0, [0.90, 0.80], [0.5, 0.4]) + _rows(0.1, [0.899, 0.799], [0.3, 0.3])
            + _rows(1.0, [0.897, 0.797], [0.1, 0.2]) + _rows(3.0, [0.85, 0.80], [0.01, 0.01]))
    assert sf.choose(rows, (0.0, 0.1, 1.0, 3.0), 0.005) == (1.0, True)
    assert sf.choose(rows, (0.0, 0.1, 1.0, 3.0), 0.002) == (0.1, True)
    # none within tolerance: the least coverage drop, flagged
    assert sf.choose(rows, (0.0, 3.0), 0.005) == (3.0, False)
    assert sf.choose(rows, (0.0, 1.0, 3.0), 0.0001) == (1.0, False)
    assert sf.choose(_rows(0.0, [0.9], [0.5]), (0.0,), 0.005) == (0.0, True)


def test_next_lambda_keeps_the_timing_reserve_only_when_timings_follow():
    """A training-only run spends no seconds on the reserve kept for the timing stage, so
    a λ whose steps fit the budget is trained."""
    trainer = types.SimpleNamespace(total=85, step_seconds=2.0)
    plan = sf.FULL._replace(timing_reserve=60.0)
    assert sf.next_lambda_seconds(plan, trainer, 25.0) == 170.0 + 25.0 + 60.0
    assert sf.next_lambda_seconds(plan._replace(train_only=True), trainer, 0.0) == 170.0
    assert sf.next_lambda_seconds(plan, None, 25.0) == 25.0 + 60.0     # --evaluate


def test_bad_survivor_cost_is_rejected(tmp_path, capsys):
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            sf.main(["--quick", "--survivor-cost", bad, "--out", str(tmp_path)])
        assert "--survivor-cost must be a finite number > 0" in capsys.readouterr().err


def test_bad_lambdas_are_rejected():
    for bad in ("", "a,b", "-1", "0,nan"):
        with pytest.raises(ValueError, match="--lambdas"):
            sf.parse_lambdas(bad)
    assert sf.parse_lambdas("0, 0.5,2") == (0.0, 0.5, 2.0)
    assert sf.length_label(1048576) == "1M" and sf.length_label(131072) == "128K"
    assert sf.length_label(512) == "512"


def test_heads_must_name_the_presets_indexers(tmp_path, capsys):
    for bad, says in (("32", "has indexers of [4, 8] heads"), ("4,x", "comma-separated integers")):
        with pytest.raises(SystemExit):
            sf.main(["--quick", "--heads", bad, "--out", str(tmp_path)])
        assert says in capsys.readouterr().err


def test_layer_scale_reaches_the_training_config(tmp_path, capsys):
    for bad, says in (("1", "one finite factor >= 0 per layer (2)"),
                      ("1,x", "comma-separated numbers")):
        with pytest.raises(SystemExit):
            sf.main(["--quick", "--layer-scale", bad, "--out", str(tmp_path)])
        assert says in capsys.readouterr().err
    plan = sf.QUICK._replace(layer_scale=(4.0, 0.5))
    _, tc = sf.base_weights(plan, str(tmp_path))
    assert tc.slack_layer_scale == (4.0, 0.5)
    assert sf.base_weights(sf.QUICK, str(tmp_path))[1].slack_layer_scale == ()


def test_train_only_writes_every_lambdas_weights_and_measures_nothing(tmp_path):
    out = str(tmp_path)
    assert sf.main(["--quick", "--train-only", "--out", out]) == 0
    with open(os.path.join(out, "slack_finetune.json")) as f:
        rows = json.load(f)["rows"]
    assert sorted(r["lambda"] for r in rows) == sorted(sf.QUICK.lambdas)
    assert all(set(r) == {"lambda", "steps"} and r["steps"] == sf.QUICK.steps for r in rows)
    assert not os.path.exists(os.path.join(out, sf.WEIGHTS_NAME))   # nothing chosen
    _, lm_b, ind_b, _ = checkpoint.load_weights(os.path.join(out, "quick_base_weights.npz"))
    for lam in sf.QUICK.lambdas:
        _, lm_l, ind_l, meta = checkpoint.load_weights(
            os.path.join(out, f"weights_lambda_{lam:g}.npz"))
        assert meta["slack_fine_tuning"]["lam"] == lam
        assert all(bool(jnp.all(x == y)) for x, y in zip(jax.tree_util.tree_leaves(lm_b),
                                                          jax.tree_util.tree_leaves(lm_l)))
    with pytest.raises(SystemExit):
        sf.main(["--quick", "--train-only", "--evaluate", out, "--out", out])
