"""Indexer inputs for tests, notebooks and benchmarks: trained or synthetic.

* :func:`trained` — q/k/w of the DSA indexers of the small byte-level LM in
  ``dosa_jax.lm`` (trained on CPython's standard library and Shakespeare, the
  indexers distilled from the layers' attention as in DeepSeek-V3.2) on
  held-out text. By default it reads the committed fixture (4096 keys, the
  last 64 positions as queries); with ``length=`` it regenerates from the
  committed weights (a GPU for long contexts; small lengths are
  fine on a CPU); with ``dump_dir=`` it reads dumps written by
  ``python -m dosa_jax.lm.dump --out``.
* :func:`synthetic` — the named generators of :mod:`dosa_jax.synthetic`.

Both return :class:`~dosa_jax.inputs.IndexerInputs` (q [T,H,D], k [N,D] with
``k_scale`` for FP8 payloads, w [T,H] float32, lo/hi int32 causal ranges:
the query at position p sees keys [0, p+1)).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

from dosa_jax.inputs import IndexerInputs
from dosa_jax.synthetic import GENERATORS, gaussian, structured, synthetic

__all__ = ["DOMAINS", "GENERATORS", "gaussian", "list_fixture", "structured", "synthetic", "trained"]

DOMAINS = ("code", "prose")
#: ``trained(weights="slack")``: the slack-regularised indexers (the same LM), written to
#: ``$OUT/lm_weights_slack.npz`` by ``python -m benchmarks.slack_finetune --out $OUT``
SLACK_WEIGHTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                  "lm_weights_slack.npz")
SLACK_WEIGHTS_COMMAND = "python -m benchmarks.slack_finetune --out DIR"


def weights_file(weights: str) -> Optional[str]:
    """The weights file ``trained(weights=...)`` reads: None for ``"committed"`` (the
    default weights, ``dosa_jax/data/lm_weights.npz``), :data:`SLACK_WEIGHTS_PATH` for
    ``"slack"``, else ``weights`` itself (a path to a file written by
    ``dosa_jax.lm.checkpoint.export_weights``).

    Raises:
      FileNotFoundError: the file does not exist (for ``"slack"``: naming the command that
        writes it).
    """
    if not isinstance(weights, str) or not weights:
        raise TypeError(f"weights must be 'committed', 'slack' or a file path, got {weights!r}")
    if weights == "committed":
        return None
    path = SLACK_WEIGHTS_PATH if weights == "slack" else weights
    if not os.path.exists(path):
        if weights == "slack":
            raise FileNotFoundError(
                f"weights='slack': {path} does not exist; {SLACK_WEIGHTS_COMMAND} (on a GPU) "
                f"writes DIR/lm_weights_slack.npz, to be copied to {path}")
        raise FileNotFoundError(f"weights={weights!r}: no such file")
    return path


@functools.lru_cache(maxsize=2)
def _fixture_rows(path: str):
    from dosa_jax.lm import dump
    return dump.load_rows(path)


def _fixture_path() -> str:
    from dosa_jax.lm import dump
    return dump.FIXTURE_PATH


def list_fixture(path: Optional[str] = None) -> list:
    """What the committed fixture holds: one dict per (domain, layer, heads).

    Keys: name, domain, layer, heads, length (N keys), num_queries (T),
    positions of the queries, head_dim, weights digest, stored dtypes.
    """
    rows = _fixture_rows(path or _fixture_path())
    out = []
    for name, (q, k, w, info) in rows.items():
        out.append(dict(name=name, domain=info["domain"], layer=info["layer"], heads=info["heads"],
                        length=int(k.shape[0]), num_queries=int(q.shape[0]), head_dim=int(k.shape[1]),
                        positions=(int(k.shape[0]) - int(q.shape[0]), int(k.shape[0]) - 1),
                        weights=info.get("weights"), stored=info.get("stored")))
    return out


def trained(domain: str = "code", layer: int = 0, *, length: Optional[int] = None,
            num_queries: Optional[int] = None, heads: int = 32,
            key_dtype: str = "float8_e4m3fn", query_dtype: str = "bfloat16", rotate: bool = True,
            source: str = "auto", dump_dir: Optional[str] = None,
            weights: str = "committed") -> IndexerInputs:
    """A trained indexer's inputs for causal prefill of the last ``num_queries`` positions.

    Args:
      domain: ``"code"`` (CPython stdlib) or ``"prose"`` (Shakespeare), held-out documents.
      layer: transformer layer 0 … 3 (each has its own indexer).
      length: N keys (the first N held-out tokens). None: the fixture's 4096.
      num_queries: T (the last T positions are queries). Default 64 without
        ``length`` (the fixture's), else ``min(4096, length)``.
      heads: H = 32 or 64 (two separately distilled indexers).
      key_dtype: ``"float8_e4m3fn"`` (payload + per-key power-of-two float32
        scale, quantised from the bfloat16 keys), ``"bfloat16"`` or ``"float32"``.
      query_dtype: ``"bfloat16"``, ``"float32"`` or ``"float8_e4m3fn"`` (scale
        folded into w).
      rotate: Hadamard-rotated q and k (as DeepSeek-V3.2; scores unchanged).
      source: ``"auto"`` (fixture when it holds the case, else generate),
        ``"fixture"`` (error if absent) or ``"generate"``.
      dump_dir: read ``dump_<domain>_H<heads>_N<length>.npz`` written by
        ``python -m dosa_jax.lm.dump --out dump_dir`` instead.
      weights: ``"committed"`` (the committed weights), ``"slack"`` (the slack-regularised
        indexers of the same LM, :data:`SLACK_WEIGHTS_PATH`; FileNotFoundError naming
        the command that writes it while it is absent) or a weights file path
        (:func:`weights_file`). Other weights than the committed ones are always
        generated (the fixture holds the committed weights' rows; ``source="fixture"``
        is an error); a ``dump_dir`` dump must record their digest.

    Returns:
      IndexerInputs; ``meta`` records domain, layer, heads, length, positions,
      dtypes, the weights digest and where the data came from.
    """
    from dosa_jax.lm import dump

    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if source not in ("auto", "fixture", "generate"):
        raise ValueError(f"source must be auto, fixture or generate, got {source!r}")
    path_w = weights_file(weights)
    loaded = None if path_w is None else dump.load_default_weights(path_w)
    N = dump.FIXTURE_LENGTH if length is None else int(length)
    if num_queries is None:
        num_queries = dump.FIXTURE_QUERIES if length is None else min(4096, N)
    name = dump.entry_name(domain, layer, heads, N)

    def from_rows(rows, origin):
        q, k, w, info = rows[name]
        T = q.shape[0]
        if num_queries > T:
            raise ValueError(f"{origin} holds {T} queries for {name}, asked for {num_queries}")
        meta = dict(info, source=origin, num_queries=num_queries)
        return dump.finish(q[T - num_queries:], k, w[T - num_queries:], key_dtype=key_dtype,
                           query_dtype=query_dtype, meta=meta)

    if dump_dir is not None:
        path = os.path.join(dump_dir, f"dump_{domain}_H{heads}_N{N}.npz")
        rows = dump.load_rows(path)
        if name not in rows:
            raise ValueError(f"{path} has no {name} (has {sorted(rows)})")
        if loaded is not None and rows[name][3].get("weights") != loaded[4]:
            raise ValueError(f"{path}: {name} was generated from weights "
                             f"{rows[name][3].get('weights')}, not {path_w} ({loaded[4]})")
        return from_rows(rows, path)
    if loaded is not None:
        if source == "fixture":
            raise ValueError(f"the fixture holds the committed weights' rows, not weights={weights!r}")
        res = dump.indexer_inputs(domain, layer, length=N, num_queries=num_queries, heads=heads,
                                  key_dtype=key_dtype, query_dtype=query_dtype, rotate=rotate,
                                  weights=loaded)
        res.meta["weights_file"] = path_w
        return res
    if source != "generate" and rotate:
        path = _fixture_path()
        rows = _fixture_rows(path) if os.path.exists(path) else {}
        if name in rows and num_queries <= rows[name][0].shape[0]:
            return from_rows(rows, "fixture")
        if source == "fixture":
            raise ValueError(f"the fixture has no {name} with {num_queries} queries; "
                             f"it holds {[e['name'] for e in list_fixture()] if rows else 'nothing'}")
    elif source == "fixture":
        raise ValueError("the fixture stores Hadamard-rotated data only (rotate=True)")
    return dump.indexer_inputs(domain, layer, length=N, num_queries=num_queries, heads=heads,
                               key_dtype=key_dtype, query_dtype=query_dtype, rotate=rotate)
