"""A small byte-level causal transformer with sliding-window attention.

Pre-norm blocks (RMSNorm), multi-head attention with RoPE, GELU MLP. The
attention of every layer is causal and restricted to the last ``window``
positions (the query itself included). Training crops are twice the window,
so half of the training queries already see a full window without the
sequence start: the model at position 1M computes exactly what it was trained
to compute, and a long sequence costs O(N·window) instead of O(N²). The DSA
indexer (``indexer.py``) is the part that scores *all* previous tokens;
``sparse_attention.py`` runs the model with each layer's attention reading only
the keys its indexer selects (DeepSeek Sparse Attention).

Everything is plain ``jax.numpy``; parameters are nested dicts of float32
arrays; matrix products run in ``compute_dtype`` (bfloat16 by default) with
float32 accumulation, softmax and norms in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Language-model shape (frozen, hashable: usable as a static jit argument).

    Attributes:
      vocab_size: 256 bytes.
      d_model, n_layers, n_heads, d_ff: the usual transformer sizes.
      window: attention span in positions (the query included).
      block: query block of the blocked window attention (divides ``window``).
      rope_theta: RoPE base of the attention heads.
      compute_dtype: dtype of matrix-product operands.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    window: int = 4096
    block: int = 512
    rope_theta: float = 10000.0
    compute_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension must be even (RoPE)")
        if self.window % self.block:
            raise ValueError(f"window {self.window} must be a multiple of block {self.block}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)


def init_lm(rng, cfg: LMConfig) -> dict:
    """GPT-2-style init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
    d, f = cfg.d_model, cfg.d_ff
    keys = jax.random.split(rng, 2 + cfg.n_layers)
    std, res_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)

    def normal(k, shape, s):
        return (s * jax.random.normal(k, shape)).astype(jnp.float32)

    layers = []
    for i in range(cfg.n_layers):
        k = jax.random.split(keys[2 + i], 4)
        layers.append(dict(
            attn_norm=jnp.ones((d,), jnp.float32),
            wqkv=normal(k[0], (d, 3 * d), std),
            wo=normal(k[1], (d, d), res_std),
            mlp_norm=jnp.ones((d,), jnp.float32),
            w1=normal(k[2], (d, f), std),
            w2=normal(k[3], (f, d), res_std),
        ))
    return dict(embed=normal(keys[0], (cfg.vocab_size, d), std),
                layers=layers,
                final_norm=jnp.ones((d,), jnp.float32),
                unembed=normal(keys[1], (d, cfg.vocab_size), std))


def rms_norm(x: Array, scale: Array, eps: float = 1e-6) -> Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


_POSITION_BITS = 24  # positions < 2**24


def rope_angles(positions: Array, half: int, theta: float) -> Array:
    """Angles ``pos · theta^(-i/half)`` mod 2π, accurate at any position < 2**24.

    ``pos · freq`` in float32 loses ~0.06 rad at pos ≈ 1M; instead each bit of
    the position contributes ``(2^b · freq) mod 2π``, tabulated in float64, so
    the float32 sum errs by ~1e-5 rad whatever the position.
    """
    freq = theta ** (-np.arange(half, dtype=np.float64) / half)
    table = np.mod(np.exp2(np.arange(_POSITION_BITS))[:, None] * freq[None, :], 2 * np.pi)
    bits = (positions.astype(jnp.int32)[:, None] >> jnp.arange(_POSITION_BITS)) & 1
    ang = jnp.einsum("lb,bf->lf", bits.astype(jnp.float32), jnp.asarray(table, jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.mod(ang, 2 * np.pi)


def rope(x: Array, positions: Array, theta: float, *, head_axis: bool = True) -> Array:
    """Rotary embedding (half-split pairs) over the last axis of ``x``.

    ``x`` is [..., L, h, dim] (``head_axis``) or [..., L, dim]; ``positions`` [L].
    """
    dim = x.shape[-1]
    half = dim // 2
    ang = rope_angles(positions, half, theta)  # [L, half]
    if head_axis:
        ang = ang[:, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x = x.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def window_attention(q: Array, k_ext: Array, v_ext: Array, first_pos, *, window: int,
                     block: int, return_probs: bool = False):
    """Causal sliding-window attention, blocked so memory is O(S·window).

    Args:
      q: [B, S, h, dh] queries at positions ``first_pos + s``.
      k_ext, v_ext: [B, window + S, h, dh]; row j holds position
        ``first_pos - window + j`` (rows at negative positions are masked).
      first_pos: scalar int (may be traced).
      window, block: static; S and window are multiples of block.
      return_probs: also return the head-averaged probabilities
        [B, S/block, block, window + block]: query ``first_pos + n·block + a``
        against key row ``n·block + kk`` of ``k_ext``.
    Returns:
      out [B, S, h, dh] (float32), and probs if asked.
    """
    B, S, h, dh = q.shape
    if S % block or window % block:
        raise ValueError(f"S={S} and window={window} must be multiples of block={block}")
    nb, nw = S // block, window // block
    kb = k_ext.reshape(B, nw + nb, block, h, dh)
    vb = v_ext.reshape(B, nw + nb, block, h, dh)
    span = (nw + 1) * block
    kw = jnp.stack([kb[:, j:j + nb] for j in range(nw + 1)], axis=2).reshape(B, nb, span, h, dh)
    vw = jnp.stack([vb[:, j:j + nb] for j in range(nw + 1)], axis=2).reshape(B, nb, span, h, dh)
    qb = q.reshape(B, nb, block, h, dh)
    s = jnp.einsum("bnqhd,bnkhd->bnhqk", qb, kw, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(dh))
    a = jnp.arange(block)[:, None]
    kk = jnp.arange(span)[None, :]
    rel = nw * block + a - kk  # query position minus key position
    blk = jnp.arange(nb)[:, None, None]
    kpos = first_pos - window + blk * block + kk[None]  # [nb, 1, span]
    valid = (rel >= 0)[None] & (rel < window)[None] & (kpos >= 0)  # [nb, block, span]
    s = jnp.where(valid[None, :, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bnhqk,bnkhd->bnqhd", p.astype(v_ext.dtype), vw,
                     preferred_element_type=jnp.float32).reshape(B, S, h, dh)
    if return_probs:
        return out, jnp.mean(p, axis=2)
    return out


def block_apply(lp: dict, h: Array, first_pos, cfg: LMConfig, *, h_ctx: Optional[Array] = None,
                return_probs: bool = False):
    """One transformer block on a segment.

    Args:
      lp: the layer's parameters.
      h: [B, S, d] residual stream entering the layer, positions ``first_pos + s``.
      first_pos: position of ``h[:, 0]``.
      h_ctx: [B, window, d] residual stream of the ``window`` positions before
        the segment (None: none, as at the start of a sequence).
      return_probs: also return the head-averaged attention probabilities.
    Returns:
      (h_out [B, S, d], x [B, S, d] the normalised layer input (the indexer's
      input), probs or None).
    """
    B, S, d = h.shape
    W, nh, dh, dt = cfg.window, cfg.n_heads, cfg.head_dim, cfg.dtype
    x = rms_norm(h, lp["attn_norm"])
    q, k, v = attention_qkv(lp, x, first_pos + jnp.arange(S), cfg)
    if h_ctx is None:
        k_ext = jnp.pad(k, ((0, 0), (W, 0), (0, 0), (0, 0)))
        v_ext = jnp.pad(v, ((0, 0), (W, 0), (0, 0), (0, 0)))
    else:
        xc = rms_norm(h_ctx, lp["attn_norm"])
        cpos = first_pos - W + jnp.arange(W)
        kv = jnp.einsum("bsd,de->bse", xc.astype(dt), lp["wqkv"][:, d:].astype(dt),
                        preferred_element_type=jnp.float32).reshape(B, W, 2, nh, dh)
        k_ext = jnp.concatenate([rope(kv[:, :, 0], cpos, cfg.rope_theta).astype(dt), k], axis=1)
        v_ext = jnp.concatenate([kv[:, :, 1].astype(dt), v], axis=1)
    res = window_attention(q, k_ext, v_ext, first_pos, window=W, block=cfg.block,
                           return_probs=return_probs)
    att, probs = res if return_probs else (res, None)
    return block_output(lp, h, att, cfg), x, probs


def attention_qkv(lp: dict, x: Array, positions: Array, cfg: LMConfig):
    """RoPE'd queries and keys and the values [B, S, heads, head_dim] (compute dtype) of
    the normalised layer input x [B, S, d] at ``positions`` [S]."""
    B, S, _ = x.shape
    dt = cfg.dtype
    qkv = jnp.einsum("bsd,de->bse", x.astype(dt), lp["wqkv"].astype(dt),
                     preferred_element_type=jnp.float32).reshape(B, S, 3, cfg.n_heads, cfg.head_dim)
    q = rope(qkv[:, :, 0], positions, cfg.rope_theta).astype(dt)
    k = rope(qkv[:, :, 1], positions, cfg.rope_theta).astype(dt)
    return q, k, qkv[:, :, 2].astype(dt)


def block_output(lp: dict, h: Array, att: Array, cfg: LMConfig) -> Array:
    """The block's residual stream after its attention output att [B, S, heads, head_dim]:
    output projection, then the GELU MLP, each added to the residual stream h [B, S, d]."""
    B, S, d = h.shape
    dt = cfg.dtype
    h = h + jnp.einsum("bse,ed->bsd", att.reshape(B, S, d).astype(dt), lp["wo"].astype(dt),
                       preferred_element_type=jnp.float32)
    y = rms_norm(h, lp["mlp_norm"])
    y = jnp.einsum("bsd,df->bsf", y.astype(dt), lp["w1"].astype(dt),
                   preferred_element_type=jnp.float32)
    y = jax.nn.gelu(y)
    return h + jnp.einsum("bsf,fd->bsd", y.astype(dt), lp["w2"].astype(dt),
                          preferred_element_type=jnp.float32)


def embed(params: dict, tokens: Array) -> Array:
    return jnp.take(params["embed"], tokens.astype(jnp.int32), axis=0)


def logits_from_hidden(params: dict, h: Array, cfg: LMConfig) -> Array:
    x = rms_norm(h, params["final_norm"])
    return jnp.einsum("bsd,dv->bsv", x.astype(cfg.dtype), params["unembed"].astype(cfg.dtype),
                      preferred_element_type=jnp.float32)


def forward(params: dict, tokens: Array, cfg: LMConfig, *, collect: bool = False,
            remat: bool = False):
    """Logits of a batch of sequences starting at position 0.

    Args:
      tokens: [B, L] int, L a multiple of ``cfg.block``.
      collect: also return, per layer, the indexer input x [B, L, d] and the
        head-averaged attention probabilities (see ``window_attention``).
      remat: recompute each block in the backward pass (saves memory).
    Returns:
      logits [B, L, V] (and a list of (x, probs) per layer if ``collect``).
    """
    h = embed(params, tokens)
    per_layer = []

    def blk(lp, h):
        return block_apply(lp, h, 0, cfg, return_probs=collect)

    if remat:
        blk = jax.checkpoint(blk)
    for lp in params["layers"]:
        h, x, probs = blk(lp, h)
        if collect:
            per_layer.append((x, probs))
    logits = logits_from_hidden(params, h, cfg)
    return (logits, per_layer) if collect else logits


def next_token_loss(params: dict, tokens: Array, cfg: LMConfig, *, remat: bool = False):
    """Mean next-byte cross-entropy (nats) of ``tokens`` [B, L+1]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = forward(params, inputs, cfg, remat=remat)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(nll)


def hidden_states_segmented(params: dict, tokens: np.ndarray, upto_layer: int, cfg: LMConfig,
                            *, segment: int = 65536):
    """Residual stream entering layer ``upto_layer`` for one long sequence.

    Runs layers ``0 … upto_layer-1`` segment by segment (each segment carries
    the previous ``window`` positions as context), so an N-token sequence
    costs O(N·window) time and O(segment·window) memory. One jit compile per
    segment size serves every length.

    Args:
      tokens: [N] ints.
      upto_layer: 0 … n_layers.
      segment: positions per step (rounded to a multiple of ``window``).
    Returns:
      h [N, d] float32 (a device array).
    """
    h = embed_sequence(params, tokens)
    for li in range(upto_layer):
        h = advance_layer(params, h, li, cfg, segment=segment)
    return h


def embed_sequence(params: dict, tokens: np.ndarray) -> Array:
    """Embeddings [N, d] of one token sequence (the residual stream entering layer 0)."""
    return embed(params, jnp.asarray(np.asarray(tokens, np.int32)))


def advance_layer(params: dict, h: Array, layer: int, cfg: LMConfig, *, segment: int = 65536):
    """Apply layer ``layer`` to the residual stream h [N, d] of one sequence (segmented)."""
    N = int(h.shape[0])
    W = cfg.window
    seg = max(W, min(segment, -(-N // W) * W))
    seg = -(-seg // W) * W
    n_seg = -(-N // seg)
    h_all = jnp.pad(h, ((0, n_seg * seg - N), (0, 0)))  # causal: the padding affects nothing before N
    lp = params["layers"][layer]
    outs = []
    for s in range(n_seg):
        h_seg = h_all[s * seg:(s + 1) * seg][None]
        if s == 0:  # no real context: zero rows at negative positions are masked
            ctx = jnp.zeros((1, W, cfg.d_model), jnp.float32)
        else:
            ctx = h_all[s * seg - W:s * seg][None]
        outs.append(_segment_step(lp, h_seg, ctx, s * seg, cfg)[0])
    return jnp.concatenate(outs, axis=0)[:N]


def _segment_step_impl(lp, h_seg, ctx, first_pos, cfg):
    return block_apply(lp, h_seg, first_pos, cfg, h_ctx=ctx)[0]


_segment_step = jax.jit(_segment_step_impl, static_argnames=("cfg",))


def num_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
