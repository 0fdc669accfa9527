"""Checkpoints (resumable training state) and committed weights (int8).

* ``save_tree``/``load_tree``: any pytree of arrays to one ``.npz`` keyed by
  the tree path; loading fills a template of the same structure (so optax
  states round-trip). Writes go to a temporary file then ``os.replace``, so a
  killed run never leaves a torn checkpoint.
* ``export_weights``/``load_weights``: the committed artifact. Matrices are
  stored as int8 with one float32 scale per output column (absmax / 127);
  vectors (norm scales) stay float32. Loading dequantises to float32, and every
  reported figure (``lm/README.md``) is measured with these dequantised
  weights, i.e. with exactly what the dumps use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax.lm.indexer import IndexerConfig
from dosa_jax.lm.model import LMConfig


def _flat(tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(k), v) for k, v in leaves], treedef


def _atomic_savez(path: str, arrays: dict) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_tree(path: str, tree, **scalars) -> None:
    """Save a pytree of arrays (plus JSON-able scalars under ``__meta__``)."""
    flat, _ = _flat(tree)
    arrays = {f"t{i:05d}": np.asarray(v) for i, (_, v) in enumerate(flat)}
    arrays["__paths__"] = np.array([k for k, _ in flat])
    arrays["__meta__"] = np.array(json.dumps(scalars))
    _atomic_savez(path, arrays)


def load_tree(path: str, template):
    """Load what ``save_tree`` wrote into the structure of ``template``.

    Returns:
      (tree, scalars dict).
    """
    flat, treedef = _flat(template)
    with np.load(path, allow_pickle=False) as z:
        paths = [str(p) for p in z["__paths__"]]
        if paths != [k for k, _ in flat]:
            raise ValueError(f"{path}: tree structure differs from the template")
        leaves = []
        for i, (_, ref) in enumerate(flat):
            a = z[f"t{i:05d}"]
            if a.shape != np.shape(ref):
                raise ValueError(f"{path}: leaf {paths[i]} has shape {a.shape}, "
                                 f"expected {np.shape(ref)}")
            leaves.append(jnp.asarray(a, dtype=jnp.asarray(ref).dtype))
        scalars = json.loads(str(z["__meta__"]))
    return jax.tree_util.tree_unflatten(treedef, leaves), scalars


# ----------------------------------------------------------------------------- committed weights

def quantize_int8(a: np.ndarray):
    """Per-output-column symmetric int8: a ≈ q * scale[None, :] (a is 2-D)."""
    a = np.asarray(a, np.float32)
    amax = np.max(np.abs(a), axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(a / scale[None, :]), -127, 127).astype(np.int8)
    return q, scale


def export_weights(path: str, lm_cfg: LMConfig, lm_params, indexers: Dict[int, tuple],
                   meta: Optional[dict] = None) -> None:
    """Write the committed weights file.

    Args:
      indexers: ``{n_heads: (IndexerConfig, [per-layer params])}``.
      meta: JSON-able provenance (steps, losses, wall times ...).
    """
    tree = dict(lm=lm_params, indexers={str(h): p for h, (_, p) in indexers.items()})
    flat, _ = _flat(tree)
    arrays = {}
    for i, (k, v) in enumerate(flat):
        v = np.asarray(v, np.float32)
        if v.ndim == 2:
            q, s = quantize_int8(v)
            arrays[f"q{i:05d}"], arrays[f"s{i:05d}"] = q, s
        else:
            arrays[f"f{i:05d}"] = v
    arrays["__paths__"] = np.array([k for k, _ in flat])
    header = dict(lm_config=dataclasses.asdict(lm_cfg),
                  indexer_configs={str(h): dataclasses.asdict(c) for h, (c, _) in indexers.items()},
                  meta=meta or {})
    arrays["__header__"] = np.array(json.dumps(header))
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_weights(path: str):
    """Read a weights file written by ``export_weights``.

    Returns:
      (lm_cfg, lm_params, {n_heads: (IndexerConfig, [per-layer params])}, meta)
      with float32 (dequantised) arrays.
    """
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(str(z["__header__"]))
        paths = [str(p) for p in z["__paths__"]]
        leaves = []
        for i in range(len(paths)):
            if f"q{i:05d}" in z.files:
                leaves.append(z[f"q{i:05d}"].astype(np.float32) * z[f"s{i:05d}"][None, :])
            else:
                leaves.append(z[f"f{i:05d}"])
    lm_cfg = LMConfig(**header["lm_config"])
    idx_cfgs = {int(h): IndexerConfig(**c) for h, c in header["indexer_configs"].items()}
    from dosa_jax.lm.indexer import init_indexers
    from dosa_jax.lm.model import init_lm
    # shapes only: build the template abstractly (no random init work)
    template = jax.eval_shape(lambda: dict(
        lm=init_lm(jax.random.PRNGKey(0), lm_cfg),
        indexers={str(h): init_indexers(jax.random.PRNGKey(0), lm_cfg, c)
                  for h, c in idx_cfgs.items()}))
    flat, treedef = _flat(template)
    if [k for k, _ in flat] != paths:
        raise ValueError(f"{path}: parameter layout does not match its configs")
    for (k, ref), a in zip(flat, leaves):
        if tuple(ref.shape) != a.shape:
            raise ValueError(f"{path}: {k} has shape {a.shape}, expected {ref.shape}")
    tree = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])
    indexers = {h: (c, tree["indexers"][str(h)]) for h, c in idx_cfgs.items()}
    return lm_cfg, tree["lm"], indexers, header["meta"]
