"""DeepSeek Sparse Attention in the small LM: each layer attends to its indexer's Top-K keys.

For layer ℓ with normalised input x, the layer's indexer gives q_t,h, k_s and w_t,h
(``indexer.queries``/``indexer.keys``) and the scores

    s_ts = Σ_h w_t,h · relu(q_t,h · k_s)                  (Eq. 1, DESIGN §2)

over the keys query t may read; the layer's attention then reads only the K keys of
largest s_ts (DeepSeek-V3.2's sparse attention after the dense warm-up). The keys are
selected by the library's exact Top-K as the design's usage line writes it,

    jax.jit(dosa_jax.topk)(q, k, w, lo=lo, hi=hi, config=cfg)      # selection="dosa"

or by its dense baseline ``dosa_jax.dense_topk`` (``selection="dense"``), which scores
every visible key. Both return bitwise the same indices (DESIGN §12), so the model's
outputs are bitwise the same whichever selects.

Visible keys: query t at position p reads keys [lo_t, hi_t) = [max(0, p − window + 1),
p + 1), the span the LM's attention was trained on (its attention is windowed; see
``model.py``). With K ≥ the visible count every visible key is selected and the layer
computes the windowed attention of the dense model; with fewer visible keys than K the
selection pads with −1 and attention ignores the pads.

The indexer runs in float32 (as for the dumps, ``dump.py``); attention uses the
model's compute dtype with float32 softmax.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import dosa_jax
from dosa_jax.lm import indexer as idx
from dosa_jax.lm.indexer import IndexerConfig
from dosa_jax.lm.model import (LMConfig, attention_qkv, block_output, embed, logits_from_hidden,
                               rms_norm)

Array = jax.Array

#: the key selections: DoSA's exact Top-K and the dense baseline (same indices)
SELECTIONS = {"dosa": jax.jit(dosa_jax.topk), "dense": jax.jit(dosa_jax.dense_topk)}


class SparseForward(NamedTuple):
    """logits [L, V] (float32); per layer the indexer's selection (``dosa_jax.TopKResult``:
    indices [L, K] with −1 pads, their scores, DoSA's statistics)."""

    logits: Array
    selections: list


def visible_ranges(length: int, window: int):
    """[lo, hi) int32 [L] of the queries at positions 0 … L−1: the last ``window``
    positions up to and including the query's own."""
    pos = np.arange(length)
    lo = np.maximum(0, pos - window + 1)
    return jnp.asarray(lo, jnp.int32), jnp.asarray(pos + 1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "icfg"))
def _layer_inputs(lp, ip, h, cfg: LMConfig, icfg: IndexerConfig):
    """Attention q/k/v [L, heads, head_dim] and the indexer's q [L, H, D], k [L, D],
    w [L, H] (float32) of one layer for the residual stream h [L, d] at positions 0 … L−1."""
    L = h.shape[0]
    pos = jnp.arange(L)
    x = rms_norm(h, lp["attn_norm"])[None]
    q, k, v = attention_qkv(lp, x, pos, cfg)
    iq, iw = idx.queries(ip, x, pos, icfg, dt=jnp.float32)
    ik = idx.keys(ip, x, pos, icfg, dt=jnp.float32)
    return (q[0], k[0], v[0]), (iq[0], ik[0], iw[0])


def gathered_attention(q: Array, k: Array, v: Array, indices: Array) -> Array:
    """Softmax attention of each query over its selected keys only.

    Args:
      q: [L, heads, head_dim] queries; k, v: [N, heads, head_dim] keys and values.
      indices: [L, K] int32 key ids per query; −1 marks a pad (ignored).
    Returns:
      [L, heads, head_dim] float32.
    """
    valid = indices >= 0
    safe = jnp.where(valid, indices, 0)
    ks, vs = k[safe], v[safe]  # [L, K, heads, head_dim]
    s = jnp.einsum("lhd,lkhd->lhk", q, ks, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(q.shape[-1]))
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("lhk,lkhd->lhd", p.astype(v.dtype), vs, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_output(lp, h, qkv, indices, cfg: LMConfig):
    att = gathered_attention(*qkv, indices)
    return block_output(lp, h[None], att[None], cfg)[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, h, cfg: LMConfig):
    return logits_from_hidden(params, h[None], cfg)[0]


def forward_sparse(params: dict, indexer_layers: list, tokens, cfg: LMConfig,
                   icfg: IndexerConfig, *, top_k: int, selection: str = "dosa",
                   config: Optional[dosa_jax.Config] = None) -> SparseForward:
    """Logits of one sequence from position 0, every layer's attention reading only the
    ``top_k`` keys its indexer selects (see the module docstring).

    Args:
      params: the LM's parameters (``model.init_lm`` layout).
      indexer_layers: one indexer's parameters per layer (``indexer.init_indexers``).
      tokens: [L] ints.
      top_k: K, keys read per query and layer.
      selection: ``"dosa"`` (``jax.jit(dosa_jax.topk)``) or ``"dense"``
        (``jax.jit(dosa_jax.dense_topk)``).
      config: ``dosa_jax.Config`` of the selection (its ``top_k`` is replaced by
        ``top_k``); None: the defaults.
    Returns:
      SparseForward(logits [L, V], selections per layer).
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {sorted(SELECTIONS)}, got {selection!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if len(indexer_layers) != cfg.n_layers:
        raise ValueError(f"indexer_layers has {len(indexer_layers)} layers, the LM {cfg.n_layers}")
    config = (config or dosa_jax.Config()).replace(top_k=top_k)
    tokens = jnp.asarray(np.asarray(tokens, np.int32))
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be one sequence [L], got shape {tokens.shape}")
    select = SELECTIONS[selection]
    lo, hi = visible_ranges(int(tokens.shape[0]), cfg.window)
    h = embed(params, tokens)
    selections = []
    for lp, ip in zip(params["layers"], indexer_layers):
        qkv, (iq, ik, iw) = _layer_inputs(lp, ip, h, cfg, icfg)
        res = select(iq, ik, iw, lo=lo, hi=hi, config=config)
        selections.append(res)
        h = _layer_output(lp, h, qkv, res.indices, cfg)
    return SparseForward(_logits(params, h, cfg), selections)


def next_token_loss_sparse(params: dict, indexer_layers: list, tokens, cfg: LMConfig,
                           icfg: IndexerConfig, *, top_k: int, selection: str = "dosa",
                           config: Optional[dosa_jax.Config] = None) -> float:
    """Mean next-byte cross-entropy (nats) of ``tokens`` [L+1] under sparse attention."""
    tokens = np.asarray(tokens)
    out = forward_sparse(params, indexer_layers, tokens[:-1], cfg, icfg, top_k=top_k,
                         selection=selection, config=config)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens[1:, None], jnp.int32), axis=-1)
    return float(jnp.mean(nll))
