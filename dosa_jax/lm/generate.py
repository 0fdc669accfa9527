"""Greedy generation with DeepSeek Sparse Attention: every layer of every generated token reads
only the K keys its indexer selects, by ``dosa_jax.decode_topk``.

The prompt is prefilled with ``dosa_jax.topk`` (each prompt query's exact Top-K over its
causal keys); every generated token then runs one decode step per layer: the token's
attention and indexer keys are appended to the layer's caches, ``decode_topk`` selects the
Top-K of the indexer's scores over the ``pos + 1`` keys cached so far, with the previous
token's best keys as witnesses (the last prompt query's selection for the first generated
token), and the attention reads those K keys. The whole loop is one ``jax.jit`` (a
``lax.scan`` over steps, static shapes, caches of ``prompt + steps`` positions). With
``page_size`` the indexer keys live in pages addressed by a page table (``decode_topk``'s
paged form), as a serving cache holds them.

``selection="dense"`` runs the same model with ``dosa_jax.dense_topk`` for prefill and
every step. Both select bitwise the same keys, so both generate the same tokens.

Visible keys: all causal keys ``[0, pos + 1)`` (DSA's selection domain). The LM's own
attention was trained on a window of ``LMConfig.window`` positions, which is the same range
while ``pos < window``. The indexer runs in float32, as for the dumps and
:mod:`dosa_jax.lm.sparse_attention`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

import dosa_jax
from dosa_jax.lm import indexer as idx
from dosa_jax.lm.indexer import IndexerConfig
from dosa_jax.lm.model import (LMConfig, attention_qkv, block_output, embed, logits_from_hidden,
                               rms_norm)
from dosa_jax.lm.sparse_attention import gathered_attention

Array = jax.Array

#: Key selections of :func:`generate`: decode steps with witnesses, or the dense baseline.
SELECTIONS = ("decode", "dense")


class Generation(NamedTuple):
    """tokens [B, P + steps] (the prompt, then the generated tokens); per generated token and
    layer the decode statistics ([steps, layers, B] arrays of ``dosa_jax.decode.DecodeStats``;
    None for ``selection="dense"``)."""

    tokens: Array
    stats: object


def _indexer_inputs(ip, x, positions, icfg: IndexerConfig):
    q, w = idx.queries(ip, x, positions, icfg, dt=jnp.float32)
    return q, idx.keys(ip, x, positions, icfg, dt=jnp.float32), w


def _prefill_select(selection: str, config):
    fn = dosa_jax.topk if selection == "decode" else dosa_jax.dense_topk

    def select(q, k, w):   # one sequence's causal prefill: query p sees keys [0, p + 1)
        P = q.shape[0]
        hi = jnp.arange(1, P + 1, dtype=jnp.int32)
        return fn(q, k, w, lo=jnp.zeros_like(hi), hi=hi, config=config).indices

    return select


def paged_cache(keys: Array, page: int):
    """Keys [B, L, D] as pages [B·L/page, page, D] (page j of sequence b is page j·B + b:
    a sequence's pages are not adjacent) and the page table [B, L/page]."""
    B, L, D = keys.shape
    n = L // page
    pages = keys.reshape(B, n, page, D).transpose(1, 0, 2, 3).reshape(n * B, page, D)
    table = jnp.arange(n, dtype=jnp.int32)[None, :] * B + jnp.arange(B, dtype=jnp.int32)[:, None]
    return pages, table


def _prefill(params, indexer_layers, prompt, cfg: LMConfig, icfg: IndexerConfig, config,
             selection: str, length: int):
    """Prompt forward; per layer (attention k, v caches, indexer key cache, last query's
    selection) with room for ``length`` positions; the last position's logits."""
    B, P = prompt.shape
    pos = jnp.arange(P)
    h = embed(params, prompt)
    select = _prefill_select(selection, config)
    caches = []
    for lp, ip in zip(params["layers"], indexer_layers):
        x = rms_norm(h, lp["attn_norm"])
        q, k, v = attention_qkv(lp, x, pos, cfg)
        iq, ik, iw = _indexer_inputs(ip, x, pos, icfg)
        sel = lax.map(lambda a: select(*a), (iq, ik, iw))                 # [B, P, K]
        h = block_output(lp, h, jax.vmap(gathered_attention)(q, k, v, sel), cfg)
        grow = lambda c: jnp.pad(c, ((0, 0), (0, length - P)) + ((0, 0),) * (c.ndim - 2))
        caches.append((grow(k), grow(v), grow(ik), sel[:, -1]))
    return caches, logits_from_hidden(params, h[:, -1:], cfg)[:, 0]


def _decode_layer(lp, ip, h, pos, cache, cfg, icfg, config, selection, table=None):
    """One layer of one generated token at position ``pos`` for every sequence (``table``:
    the indexer keys ``ikc`` are pages, :func:`paged_cache`)."""
    kc, vc, ikc, state = cache
    B = h.shape[0]
    p1 = pos[None]
    x = rms_norm(h, lp["attn_norm"])
    q, k, v = attention_qkv(lp, x, p1, cfg)
    iq, ik, iw = _indexer_inputs(ip, x, p1, icfg)
    kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (0, pos, 0, 0))
    vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (0, pos, 0, 0))
    if table is None:
        ikc = lax.dynamic_update_slice(ikc, ik.astype(ikc.dtype), (0, pos, 0))
    else:
        page = ikc.shape[1]
        ikc = ikc.at[table[:, pos // page], pos % page].set(ik[:, 0].astype(ikc.dtype))
    n = jnp.full((B,), pos + 1, jnp.int32)
    if selection == "decode":
        res, state = dosa_jax.decode_topk(iq[:, 0], ikc, iw[:, 0], state, lengths=n,
                                          page_table=table, config=config)
        sel, stats = res.indices, res.stats
    else:
        def one(a):
            qb, kb, wb = a
            return dosa_jax.dense_topk(qb[None], kb, wb[None], lo=jnp.zeros((1,), jnp.int32),
                                       hi=(pos + 1)[None].astype(jnp.int32),
                                       config=config).indices[0]
        sel, stats = lax.map(one, (iq[:, 0], ikc, iw[:, 0])), None
    att = jax.vmap(gathered_attention)(q, kc, vc, sel[:, None, :])
    return block_output(lp, h, att, cfg), (kc, vc, ikc, state), stats


@functools.partial(jax.jit, static_argnames=("cfg", "icfg", "steps", "selection", "config",
                                             "page_size"))
def _generate(params, indexer_layers, prompt, *, cfg: LMConfig, icfg: IndexerConfig, steps: int,
              selection: str, config, page_size):
    B, P = prompt.shape
    length = P + steps if not page_size else -(-(P + steps) // page_size) * page_size
    caches, logits = _prefill(params, indexer_layers, prompt, cfg, icfg, config, selection,
                              length)
    table = None
    if page_size:
        paged = [paged_cache(ikc, page_size) for _, _, ikc, _ in caches]
        table = paged[0][1]
        caches = [(kc, vc, pg, last) for (kc, vc, _, last), (pg, _) in zip(caches, paged)]
    if selection == "decode":   # witnesses: the last prompt query's selection, per layer,
        empty = dosa_jax.decode_init(B, config).ids   # in a state of the default width
        caches = [(kc, vc, ikc, dosa_jax.DecodeState(empty.at[:, :last.shape[1]].set(last)))
                  for kc, vc, ikc, last in caches]
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def step(carry, _):
        tok, pos, caches = carry
        h = embed(params, tok[:, None])
        new, stats = [], []
        for lp, ip, cache in zip(params["layers"], indexer_layers, caches):
            h, cache, st = _decode_layer(lp, ip, h, pos, cache, cfg, icfg, config, selection,
                                         table)
            new.append(cache)
            stats.append(st)
        nxt = jnp.argmax(logits_from_hidden(params, h, cfg)[:, 0], axis=-1).astype(jnp.int32)
        stats = None if selection == "dense" else jax.tree_util.tree_map(
            lambda *xs: jnp.stack(xs), *stats)
        return (nxt, pos + 1, new), (tok, stats)

    _, (toks, stats) = lax.scan(step, (first, jnp.int32(P), caches), None, length=steps)
    return jnp.concatenate([prompt, toks.T], axis=1), stats


def generate(params: dict, indexer_layers: list, prompt, cfg: LMConfig, icfg: IndexerConfig, *,
             steps: int, top_k: int, selection: str = "decode",
             config: Optional[dosa_jax.Config] = None, page_size: int = 0) -> Generation:
    """Greedy continuation of ``prompt`` [B, P] by ``steps`` tokens under sparse attention.

    Args:
      params, indexer_layers: the LM's and one indexer's parameters per layer.
      prompt: [B, P] int token ids (P ≥ 1, the same length for every sequence).
      steps: tokens to generate (≥ 1).
      top_k: K keys read per token and layer.
      selection: ``"decode"`` (``topk`` prefill, ``decode_topk`` steps) or ``"dense"``
        (``dense_topk`` everywhere; the same tokens).
      config: ``dosa_jax.Config`` of the selection (``top_k`` replaced by ``top_k``).
      page_size: > 0: the indexer key caches are pages of that many keys with a page table
        (:func:`paged_cache`; ``decode_topk``'s paged form; ``selection="decode"`` only);
        0: contiguous [B, L, D].
    Returns:
      :class:`Generation`.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    for name, v in (("steps", steps), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 0:
        raise ValueError(f"page_size must be an int >= 0, got {page_size!r}")
    if page_size and selection != "decode":
        raise ValueError("page_size (paged indexer keys) needs selection='decode'")
    if len(indexer_layers) != cfg.n_layers:
        raise ValueError(f"indexer_layers has {len(indexer_layers)} layers, the LM {cfg.n_layers}")
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be an int array [B, P] with P >= 1, got "
                         f"{prompt.dtype} {tuple(prompt.shape)}")
    config = (config or dosa_jax.Config()).replace(top_k=top_k)
    toks, stats = _generate(params, indexer_layers, prompt.astype(jnp.int32), cfg=cfg, icfg=icfg,
                            steps=steps, selection=selection, config=config,
                            page_size=page_size)
    return Generation(toks, stats)
