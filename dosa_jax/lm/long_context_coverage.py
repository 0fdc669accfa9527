"""Is the indexer still a functioning indexer at dump lengths (128K … 1M)?

``train.evaluate`` measures coverage on 8K-token crops, the training length.
Here the committed model runs over the first N held-out tokens, and for the
last T positions we compare, per layer:

* the layer's attention distribution (head-averaged; its window is the last
  4096 positions, so it holds no mass further back), with
* the indexer's Top-K over **all** N visible keys (float32 scores),

reporting the attention mass the indexer's Top-K holds, the same for the K
most recent keys, the oracle (the K keys of highest attention), and how many
of the indexer's Top-K lie outside the attention window (picked from the
far past, where this model's attention never looks).

    python -m dosa_jax.lm.long_context_coverage --lengths 131072 1048576
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dosa_jax.lm import corpora, dump
from dosa_jax.lm import indexer as idx
from dosa_jax.lm.model import advance_layer, block_apply, embed_sequence


@partial(jax.jit, static_argnames=("cfg",))
def _last_queries_attention(lp, h_ctx, h_q, first_pos, cfg):
    """Head-averaged attention [T, W + T] of the last T positions (window layout)."""
    _, _, probs = block_apply(lp, h_q[None], first_pos, cfg, h_ctx=h_ctx[None], return_probs=True)
    T, C, W = h_q.shape[0], cfg.block, cfg.window
    p = probs[0]  # [T/C, C, W + C]: block n row kk <-> k_ext row n*C + kk
    n = T // C
    full = jnp.zeros((n, C, W + T), p.dtype)
    for b in range(n):
        full = full.at[b, :, b * C:b * C + W + C].set(p[b])
    return full.reshape(T, W + T)


@partial(jax.jit, static_argnames=("top_k",))
def _indexer_topk(q, w, k, top_k):
    """Top-K key positions of each query over all keys (float32, causal mask)."""
    N = k.shape[0]
    T = q.shape[0]
    qpos = N - T + jnp.arange(T)

    def one(args):
        qc, wc, pc = args
        lg = idx.logits(qc[None], wc[None], k[None], dt=jnp.float32)[0]
        lg = jnp.where(jnp.arange(N)[None, :] <= pc[:, None], lg, idx.NEG)
        return jax.lax.top_k(lg, top_k)[1]

    chunk = 8
    out = jax.lax.map(one, (q.reshape(T // chunk, chunk, *q.shape[1:]), w.reshape(T // chunk, chunk, -1),
                            qpos.reshape(T // chunk, chunk)))
    return out.reshape(T, top_k)


def layer_coverage(probs: np.ndarray, top_idx: np.ndarray, N: int, W: int, Ks) -> dict:
    """Mass statistics for queries at N-T … N-1 (probs over positions N-T-W … N-1)."""
    T = probs.shape[0]
    first = N - T - W  # position of probs[:, 0]
    qpos = N - T + np.arange(T)
    out = {}
    for K in Ks:
        sel = top_idx[:, :K]
        col = sel - first
        ok = col >= 0
        mass = np.where(ok, np.take_along_axis(probs, np.clip(col, 0, probs.shape[1] - 1), 1), 0.0)
        out[f"indexer@{K}"] = float(mass.sum(1).mean())
        out[f"oracle@{K}"] = float(np.sort(probs, 1)[:, ::-1][:, :K].sum(1).mean())
        rel = qpos[:, None] - (first + np.arange(probs.shape[1]))[None, :]
        out[f"recent@{K}"] = float(np.where((rel >= 0) & (rel < K), probs, 0).sum(1).mean())
        out[f"outside_window@{K}"] = float((qpos[:, None] - sel >= W).mean())
    return out


def run(domains, layers, lengths, heads_list, num_queries, Ks, weights=None, log=print):
    weights = weights or dump.load_default_weights()
    lm_cfg, lm, indexers, _, _ = weights
    W = lm_cfg.window
    results = {}
    for domain in domains:
        stream = corpora.heldout_stream(domain)
        for N in lengths:
            t0 = time.perf_counter()
            h = embed_sequence(lm, stream[:N])
            for layer in range(max(layers) + 1):
                if layer in layers:
                    lp = lm["layers"][layer]
                    probs = np.asarray(_last_queries_attention(
                        lp, h[N - num_queries - W:N - num_queries], h[N - num_queries:],
                        N - num_queries, lm_cfg))
                    for heads in heads_list:
                        cfg, ip = indexers[heads]
                        q, k, w = dump._indexer_rows(ip[layer], lp["attn_norm"], h, cfg,
                                                     num_queries, False)
                        top = np.asarray(_indexer_topk(q, w, k, max(Ks)))
                        r = layer_coverage(probs, top, N, W, Ks)
                        results[f"{domain}/N{N}/layer{layer}/H{heads}"] = r
                        log(f"{domain:5s} N={N:8d} layer {layer} H={heads}: "
                            + " ".join(f"{k}={v:.4f}" for k, v in r.items()))
                if layer + 1 <= max(layers):
                    h = advance_layer(lm, h, layer, lm_cfg)
            log(f"  ({time.perf_counter() - t0:.1f}s for {domain} N={N})")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domains", nargs="+", default=list(corpora.DOMAINS))
    ap.add_argument("--layers", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--lengths", nargs="+", type=int, default=[131072, 1048576])
    ap.add_argument("--heads", nargs="+", type=int, default=[32])
    ap.add_argument("--num-queries", type=int, default=512)
    ap.add_argument("--top-ks", nargs="+", type=int, default=[64, 256, 2048])
    ap.add_argument("--json", default=None)
    ap.add_argument("--weights", default=None, help="weights file (default: the committed one)")
    a = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    weights = dump.load_default_weights(a.weights) if a.weights else None
    res = run(a.domains, a.layers, a.lengths, a.heads, a.num_queries, a.top_ks, weights=weights,
              log=lambda s: print(s, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
