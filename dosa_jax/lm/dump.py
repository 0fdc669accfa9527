"""Indexer inputs (q, k, w) of the trained model on held-out text.

``indexer_inputs(domain, layer, length=N, num_queries=T)`` runs the committed
model over the first N tokens of the domain's held-out stream and returns
the layer's indexer problem for causal prefill of the last T positions:

* ``k`` [N, D]: every position's indexer key, computed in float32, stored in
  bfloat16 (``key_dtype="bfloat16"``) or, as DeepSeek-V3.2 caches it, as an
  FP8 e4m3 payload with a power-of-two float32 scale per key quantised from
  those bfloat16 values (``"float8_e4m3fn"``, the default);
* ``q`` [T, H, D] (bfloat16 by default), ``w`` [T, H] float32 (the softmax
  and head scales folded in; with ``query_dtype="float8_e4m3fn"`` the
  per-(query, head) FP8 scale is folded in too);
* ``lo = 0``, ``hi = pos + 1`` for the query at position ``pos = N - T + t``.

With ``rotate=True`` (default) q and k are multiplied by the orthonormal
Walsh–Hadamard matrix, as DeepSeek-V3.2 does before quantising
(``rotate_activation``); dot products, hence scores, are unchanged.

Only what the problem needs is computed: layers below ``layer`` over all N
positions (segmented sliding-window attention, ``model.hidden_states_segmented``),
then the indexer keys of all positions and the queries of the last T.

CLI:
    python -m dosa_jax.lm.dump --fixture             # rewrite the committed CPU fixture
    python -m dosa_jax.lm.dump --time --lengths 131072 1048576   # time generation
    python -m dosa_jax.lm.dump --out DIR --lengths 131072 ...    # write dumps (.npz)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax.inputs import IndexerInputs, causal_ranges
from dosa_jax.lm import checkpoint, corpora
from dosa_jax.lm import indexer as idx
from dosa_jax.lm.model import hidden_states_segmented, rms_norm
from dosa_jax.synthetic import FP8_MAX, quantize_keys_fp8

WEIGHTS_PATH = os.path.join(corpora.DATA_DIR, "lm_weights.npz")
FIXTURE_PATH = os.path.join(corpora.DATA_DIR, "fixture_trained.npz")
#: what the committed fixture holds (written by ``--fixture``)
FIXTURE_ENTRIES = (("code", 0, 32), ("code", 3, 32), ("prose", 0, 32), ("prose", 3, 32),
                   ("code", 0, 64))
FIXTURE_LENGTH = 4096
FIXTURE_QUERIES = 64


@functools.lru_cache(maxsize=4)
def load_default_weights(path: Optional[str] = None):
    """(lm_cfg, lm_params, {heads: (cfg, layers)}, meta) of the committed weights."""
    path = path or WEIGHTS_PATH
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: train with python -m dosa_jax.lm.train")
    out = checkpoint.load_weights(path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return out + (digest,)


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester–Hadamard matrix of order n (a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dimension, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@functools.partial(jax.jit, static_argnames=("cfg", "num_queries", "rotate"))
def _indexer_rows(p, norm_scale, h, cfg, num_queries, rotate):
    """Float32 (q, k, w) of one layer from its residual stream h [N, d]."""
    N = h.shape[0]
    x = rms_norm(h, norm_scale)
    k = idx.keys(p, x[None], jnp.arange(N), cfg, dt=jnp.float32)[0]
    qpos = N - num_queries + jnp.arange(num_queries)
    q, w = idx.queries(p, x[None, N - num_queries:], qpos, cfg, dt=jnp.float32)
    q, w = q[0], w[0]
    if rotate:
        r = jnp.asarray(hadamard(cfg.head_dim), jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        q = jnp.einsum("thd,de->the", q, r, precision=hi)
        k = jnp.einsum("nd,de->ne", k, r, precision=hi)
    return q, k, w


def quantize_queries_fp8(q: np.ndarray, w: np.ndarray):
    """Per-(query, head) power-of-two FP8 scale, folded into w (DESIGN §2)."""
    amax = np.max(np.abs(q), axis=-1)
    safe = np.where(amax > 0, amax, 1.0)
    scale = np.where(amax > 0, np.exp2(np.ceil(np.log2(safe / FP8_MAX))), 1.0).astype(np.float32)
    payload = jnp.asarray(q / scale[..., None]).astype(jnp.float8_e4m3fn)
    return payload, (w * scale).astype(np.float32)


def finish(q, k_bf16, w, *, key_dtype: str, query_dtype: str, meta: dict) -> IndexerInputs:
    """The record from float32-or-bf16 q, bf16 keys and float32 w (shared by
    generation and the fixture, so both quantise identically)."""
    T, N = q.shape[0], k_bf16.shape[0]
    k32 = np.asarray(jnp.asarray(k_bf16, jnp.bfloat16).astype(jnp.float32))
    if key_dtype == "float8_e4m3fn":
        k_arr, k_scale = quantize_keys_fp8(k32)
    elif key_dtype == "bfloat16":
        k_arr, k_scale = jnp.asarray(k_bf16, jnp.bfloat16), None
    elif key_dtype == "float32":
        k_arr, k_scale = jnp.asarray(k32), None
    else:
        raise ValueError(f"key_dtype must be float8_e4m3fn, bfloat16 or float32, got {key_dtype!r}")
    q = np.asarray(jnp.asarray(q).astype(jnp.float32))
    w = np.asarray(w, np.float32)
    if query_dtype == "float8_e4m3fn":
        q_arr, w = quantize_queries_fp8(q, w)
    elif query_dtype in ("bfloat16", "float32"):
        q_arr = jnp.asarray(q).astype(jnp.dtype(query_dtype))
    else:
        raise ValueError(f"query_dtype must be bfloat16, float32 or float8_e4m3fn, got {query_dtype!r}")
    lo, hi = causal_ranges(T, N)
    meta = dict(meta, key_dtype=key_dtype, query_dtype=query_dtype,
                positions=(N - T, N - 1))
    return IndexerInputs(q=q_arr, k=k_arr, k_scale=k_scale, w=jnp.asarray(w), lo=lo, hi=hi, meta=meta)


def raw_indexer_rows(domain: str, layer: int, *, length: int, num_queries: int, heads: int = 32,
                     rotate: bool = True, weights=None, tokens=None):
    """Float32 (q [T,H,D], k [N,D], w [T,H]) as numpy, plus generation info."""
    lm_cfg, lm_params, indexers, wmeta, digest = weights or load_default_weights()
    if heads not in indexers:
        raise ValueError(f"no H={heads} indexer in the weights (have {sorted(indexers)})")
    if not 0 <= layer < lm_cfg.n_layers:
        raise ValueError(f"layer must be in [0, {lm_cfg.n_layers}), got {layer}")
    cfg, layers = indexers[heads]
    if tokens is None:
        stream = corpora.heldout_stream(domain)
        if length > len(stream):
            raise ValueError(f"length {length} exceeds the {domain} held-out stream ({len(stream)})")
        tokens = stream[:length]
    tokens = np.asarray(tokens)
    N = int(tokens.shape[0])
    if not 1 <= num_queries <= N:
        raise ValueError(f"num_queries must be in [1, {N}], got {num_queries}")
    t0 = time.perf_counter()
    h = hidden_states_segmented(lm_params, tokens, layer, lm_cfg)
    q, k, w = _indexer_rows(layers[layer], lm_params["layers"][layer]["attn_norm"], h, cfg,
                            num_queries, rotate)
    q, k, w = jax.block_until_ready((q, k, w))
    k_bf16 = k.astype(jnp.bfloat16)
    t1 = time.perf_counter()
    info = dict(kind="trained", domain=domain, layer=layer, heads=heads, length=N,
                num_queries=num_queries, rotate=rotate, weights=digest,
                device=jax.devices()[0].platform, model_seconds=t1 - t0)
    return np.asarray(q), np.asarray(k_bf16), np.asarray(w), info


def indexer_inputs(domain: str, layer: int, *, length: int, num_queries: int, heads: int = 32,
                   key_dtype: str = "float8_e4m3fn", query_dtype: str = "bfloat16",
                   rotate: bool = True, weights=None, tokens=None) -> IndexerInputs:
    """The layer's indexer problem on the first ``length`` held-out tokens (see module doc)."""
    t0 = time.perf_counter()
    q, k_bf16, w, info = raw_indexer_rows(domain, layer, length=length, num_queries=num_queries,
                                          heads=heads, rotate=rotate, weights=weights, tokens=tokens)
    res = finish(q, k_bf16, w, key_dtype=key_dtype, query_dtype=query_dtype,
                 meta=dict(info, source="generated"))
    res.meta["total_seconds"] = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- files

def _bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of a bfloat16/fp8 array (npz cannot store those dtypes)."""
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def entry_name(domain: str, layer: int, heads: int, length: int) -> str:
    return f"{domain}_layer{layer}_H{heads}_N{length}"


def save_rows(path: str, entries: dict) -> None:
    """Write ``{name: (q_bf16, k_bf16, w, info)}`` to one compressed npz."""
    arrays, index = {}, {}
    for name, (q, k, w, info) in entries.items():
        arrays[f"{name}/q_bf16"] = _bits(np.asarray(jnp.asarray(q).astype(jnp.bfloat16)))
        arrays[f"{name}/k_bf16"] = _bits(np.asarray(k))
        arrays[f"{name}/w"] = np.asarray(w, np.float32)
        index[name] = info
    arrays["__index__"] = np.array(json.dumps(index))
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_rows(path: str):
    """Inverse of ``save_rows``: {name: (q bf16, k bf16, w f32, info)}."""
    out = {}
    with np.load(path, allow_pickle=False) as z:
        index = json.loads(str(z["__index__"]))
        for name, info in index.items():
            q = z[f"{name}/q_bf16"].view(jnp.bfloat16)
            k = z[f"{name}/k_bf16"].view(jnp.bfloat16)
            out[name] = (q, k, z[f"{name}/w"], info)
    return out


def write_fixture(path: str = FIXTURE_PATH, entries: Sequence[tuple] = FIXTURE_ENTRIES,
                  length: int = FIXTURE_LENGTH, num_queries: int = FIXTURE_QUERIES) -> dict:
    rows = {}
    for domain, layer, heads in entries:
        q, k, w, info = raw_indexer_rows(domain, layer, length=length, num_queries=num_queries,
                                         heads=heads)
        info = dict(info, stored="q bf16, k bf16, w float32; Hadamard-rotated")
        rows[entry_name(domain, layer, heads, length)] = (q, k, w, info)
    save_rows(path, rows)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate trained-indexer dumps (see module doc).")
    ap.add_argument("--fixture", action="store_true", help="rewrite the committed CPU fixture")
    ap.add_argument("--out", default=None, help="write dumps to this directory")
    ap.add_argument("--time", action="store_true", help="time generation, print a table")
    ap.add_argument("--domains", nargs="+", default=list(corpora.DOMAINS))
    ap.add_argument("--layers", nargs="+", type=int, default=None)
    ap.add_argument("--heads", nargs="+", type=int, default=[32])
    ap.add_argument("--lengths", nargs="+", type=int, default=[131072, 262144, 524288, 1048576])
    ap.add_argument("--num-queries", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2, help="timing: runs per case (first compiles)")
    a = ap.parse_args(argv)
    if a.fixture:
        rows = write_fixture()
        print(f"wrote {FIXTURE_PATH} ({os.path.getsize(FIXTURE_PATH) / 1e6:.2f} MB): {list(rows)}")
    if not (a.out or a.time):
        return
    lm_cfg = load_default_weights()[0]
    layers = a.layers if a.layers is not None else list(range(lm_cfg.n_layers))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for heads in a.heads:
        for domain in a.domains:
            for N in a.lengths:
                rows = {}
                for layer in layers:
                    times = []
                    for _ in range(a.repeats if a.time else 1):
                        t0 = time.perf_counter()
                        inp = indexer_inputs(domain, layer, length=N, num_queries=a.num_queries,
                                             heads=heads)
                        jax.block_until_ready(inp.k)
                        times.append(time.perf_counter() - t0)
                    if a.time:
                        print(f"generate {domain:5s} layer {layer} H={heads} N={N:8d} "
                              f"T={a.num_queries}: " + ", ".join(f"{t:.2f}s" for t in times),
                              flush=True)
                    if a.out:
                        rows[entry_name(domain, layer, heads, N)] = raw_indexer_rows(
                            domain, layer, length=N, num_queries=a.num_queries, heads=heads)
                if a.out:
                    os.makedirs(a.out, exist_ok=True)
                    p = os.path.join(a.out, f"dump_{domain}_H{heads}_N{N}.npz")
                    save_rows(p, rows)
                    print(f"wrote {p} ({os.path.getsize(p) / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
