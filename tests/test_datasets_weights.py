"""datasets.trained(weights=...): the slack-regularised weights file and other weights files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dosa_jax import datasets
from dosa_jax.lm import dump


def test_missing_slack_weights_name_the_command(monkeypatch, tmp_path):
    missing = str(tmp_path / "lm_weights_slack.npz")
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", missing)
    with pytest.raises(FileNotFoundError, match="benchmarks.slack_finetune") as e:
        datasets.trained("code", 0, length=256, heads=4, weights="slack")
    assert missing in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such file"):
        datasets.trained("code", 0, weights=str(tmp_path / "nope.npz"))
    with pytest.raises(TypeError, match="weights"):
        datasets.trained("code", 0, weights=None)


def test_slack_weights_load_from_the_committed_path(monkeypatch, tiny_weights):
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", tiny_weights)
    inp = datasets.trained("prose", 1, length=256, num_queries=16, heads=4, weights="slack",
                           key_dtype="float32", query_dtype="float32")
    assert inp.q.shape == (16, 4, 16) and inp.k.shape == (256, 16)
    assert inp.meta["weights_file"] == tiny_weights and inp.meta["source"] == "generated"
    # exactly what the dump generator makes from that file
    ref = dump.indexer_inputs("prose", 1, length=256, num_queries=16, heads=4,
                              key_dtype="float32", query_dtype="float32",
                              weights=dump.load_default_weights(tiny_weights))
    for name in ("q", "k", "w", "lo", "hi"):
        np.testing.assert_array_equal(np.asarray(getattr(inp, name)), np.asarray(getattr(ref, name)))
    assert inp.meta["weights"] == dump.load_default_weights(tiny_weights)[4]
    # a file path works the same; the committed fixture is never used for other weights
    by_path = datasets.trained("prose", 1, length=256, num_queries=16, heads=4,
                               weights=tiny_weights, key_dtype="float32", query_dtype="float32")
    np.testing.assert_array_equal(np.asarray(by_path.q), np.asarray(inp.q))
    with pytest.raises(ValueError, match="fixture"):
        datasets.trained("code", 0, heads=4, weights="slack", source="fixture")
    with pytest.raises(ValueError, match="no H=32"):
        datasets.trained("code", 0, length=256, heads=32, weights="slack")


def test_a_dump_of_other_weights_is_refused(monkeypatch, tiny_weights, tmp_path):
    monkeypatch.setattr(datasets, "SLACK_WEIGHTS_PATH", tiny_weights)
    rows = {dump.entry_name("code", 0, 4, 256): dump.raw_indexer_rows(
        "code", 0, length=256, num_queries=16, heads=4,
        weights=dump.load_default_weights(tiny_weights))}
    dump.save_rows(os.path.join(tmp_path, "dump_code_H4_N256.npz"), rows)
    ok = datasets.trained("code", 0, length=256, num_queries=16, heads=4, weights="slack",
                          dump_dir=str(tmp_path))
    assert ok.q.shape == (16, 4, 16)
    other = dict(rows)
    name = dump.entry_name("code", 0, 4, 256)
    q, k, w, info = other[name]
    other[name] = (q, k, w, dict(info, weights="0123456789abcdef"))
    dump.save_rows(os.path.join(tmp_path, "dump_code_H4_N256.npz"), other)
    with pytest.raises(ValueError, match="generated from weights"):
        datasets.trained("code", 0, length=256, num_queries=16, heads=4, weights="slack",
                         dump_dir=str(tmp_path))
