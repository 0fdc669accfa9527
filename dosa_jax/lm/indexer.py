"""The DSA lightning indexer, one per layer, as in DeepSeek-V3.2.

For the layer input ``x_t`` (the normalised hidden state the attention reads):

    c_t   = RMSNorm(x_t W_qa)                    query latent (rank ``q_rank``)
    q_t,h = RoPE_t(c_t W_qb[h])                  H heads of dimension D
    k_t   = RoPE_t(LayerNorm(x_t W_k))           one key per token (MQA-style)
    w_t,h = (x_t W_w)[h] · H^-1/2 · D^-1/2       signed, per token, no constraint
    s_ts  = Σ_h w_t,h · relu(q_t,h · k_s)        (DESIGN §2, Eq. 1)

RoPE rotates the first ``rope_dim`` of the D dimensions (DeepSeek-V3.2:
64 of 128). The softmax scale D^-1/2 and the head scale H^-1/2 are folded into
``w`` as DeepSeek's ``weights_proj`` output is, so the dumped (q, k, w) give
exactly the indexer's logits through the library's scorer.

Training is DeepSeek's dense warm-up: the language model is frozen and the
indexer minimises KL(p_t || softmax_s(s_ts)) where p_t is the layer's
attention distribution of query t summed over heads and L1-normalised
(``distillation_loss``). ``coverage`` measures how much of p_t the indexer's
Top-K keys hold.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from dosa_jax.lm.model import LMConfig, rms_norm, rope

Array = jax.Array
NEG = -1e9  # masked logit (finite: 0 · NEG must stay 0 in the KL cross term)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Indexer shape (frozen, hashable).

    Attributes:
      n_heads: H (32 as GLM-5.2's, 64 as DeepSeek-V3.2's).
      head_dim: D = 128.
      rope_dim: leading dimensions of q and k that RoPE rotates.
      q_rank: rank of the query latent c_t (DeepSeek's q_lora latent).
      rope_theta: RoPE base.
      compute_dtype: dtype of matrix-product operands in training.
    """

    n_heads: int = 32
    head_dim: int = 128
    rope_dim: int = 64
    q_rank: int = 96
    rope_theta: float = 10000.0
    compute_dtype: str = "bfloat16"

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)


def init_indexer(rng, d_model: int, cfg: IndexerConfig) -> dict:
    """One layer's indexer parameters (fan-in scaled normals)."""
    H, D, r = cfg.n_heads, cfg.head_dim, cfg.q_rank
    k = jax.random.split(rng, 4)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape) / math.sqrt(fan_in)).astype(jnp.float32)

    return dict(wq_a=normal(k[0], (d_model, r), d_model),
                q_norm=jnp.ones((r,), jnp.float32),
                wq_b=normal(k[1], (r, H * D), r),
                wk=normal(k[2], (d_model, D), d_model),
                k_norm_scale=jnp.ones((D,), jnp.float32),
                k_norm_bias=jnp.zeros((D,), jnp.float32),
                ww=normal(k[3], (d_model, H), d_model))


def init_indexers(rng, lm_cfg: LMConfig, cfg: IndexerConfig) -> list:
    return [init_indexer(k, lm_cfg.d_model, cfg) for k in jax.random.split(rng, lm_cfg.n_layers)]


def _precision(dt):
    # float32 products must not silently run as TF32 on GPUs
    return lax.Precision.HIGHEST if jnp.dtype(dt) == jnp.float32 else None


def _mm(a, b, dt):
    return jnp.einsum("...i,ij->...j", a.astype(dt), b.astype(dt),
                      preferred_element_type=jnp.float32, precision=_precision(dt))


def _rope_part(v: Array, positions: Array, cfg: IndexerConfig, head_axis: bool) -> Array:
    r = cfg.rope_dim
    if r == 0:
        return v.astype(jnp.float32)
    pe = rope(v[..., :r], positions, cfg.rope_theta, head_axis=head_axis)
    return jnp.concatenate([pe, v[..., r:].astype(jnp.float32)], axis=-1)


def queries(p: dict, x: Array, positions: Array, cfg: IndexerConfig, dt=None):
    """q [..., L, H, D] and w [..., L, H] (float32) for inputs x [..., L, d]."""
    dt = cfg.dtype if dt is None else dt
    c = rms_norm(_mm(x, p["wq_a"], dt), p["q_norm"])
    q = _mm(c, p["wq_b"], dt)
    q = q.reshape(q.shape[:-1] + (cfg.n_heads, cfg.head_dim))
    q = _rope_part(q, positions, cfg, head_axis=True)
    w = _mm(x, p["ww"], dt) * (1.0 / math.sqrt(cfg.n_heads * cfg.head_dim))
    return q, w


def keys(p: dict, x: Array, positions: Array, cfg: IndexerConfig, dt=None) -> Array:
    """k [..., L, D] (float32) for inputs x [..., L, d]."""
    dt = cfg.dtype if dt is None else dt
    k = _mm(x, p["wk"], dt)
    mu = jnp.mean(k, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(k - mu), axis=-1, keepdims=True)
    k = (k - mu) * lax.rsqrt(var + 1e-6) * p["k_norm_scale"] + p["k_norm_bias"]
    return _rope_part(k, positions, cfg, head_axis=False)


def logits(q: Array, w: Array, k: Array, *, dt=jnp.bfloat16) -> Array:
    """s[b, t, s] = Σ_h w[b,t,h] relu(q[b,t,h] · k[b,s]) for q [B,T,H,D], k [B,S,D].

    ``dt`` is the operand dtype of both products (bfloat16 in training,
    float32 for measurements).
    """
    x = jnp.einsum("bthd,bsd->btsh", q.astype(dt), k.astype(dt),
                   preferred_element_type=dt, precision=_precision(dt))
    return jnp.einsum("btsh,bth->bts", jnp.maximum(x, 0), w.astype(dt),
                      preferred_element_type=jnp.float32, precision=_precision(dt))


def _block_rows(p, x, k, i, cfg: IndexerConfig, lm_cfg: LMConfig, dt):
    """Masked logits of query block i against every key of the crop: [B, C, L]."""
    B, L, d = x.shape
    C = lm_cfg.block
    xs = lax.dynamic_slice(x, (0, i * C, 0), (B, C, d))
    qpos = i * C + jnp.arange(C)
    q, w = queries(p, xs, qpos, cfg)
    lg = logits(q, w, k, dt=dt)
    causal = jnp.arange(L)[None, :] <= qpos[:, None]
    return jnp.where(causal[None], lg, NEG)


def _window_rows(lg, i, lm_cfg: LMConfig):
    """The logits of the keys in query block i's attention window: [B, C, W + C]."""
    B, C, _ = lg.shape
    W = lm_cfg.window
    return lax.dynamic_slice(lg, (0, 0, i * C - W), (B, C, W + C))


def query_blocks(lm_cfg: LMConfig, seq_len: int, tail_blocks: int = 0):
    """Query blocks used for distillation and coverage.

    Default: the second half of the crop. Those queries see a full attention
    window plus earlier keys outside it, the regime of every long-context dump
    (requires seq_len >= 2·window). ``tail_blocks > 0``: only the last that
    many blocks (long crops: keys up to seq_len back at the cost of a short crop).
    """
    C, W = lm_cfg.block, lm_cfg.window
    if seq_len < 2 * W or seq_len % C:
        raise ValueError(f"seq_len={seq_len} must be >= 2*window={2 * W} and a multiple of {C}")
    first = W // C if tail_blocks <= 0 else max(W // C, seq_len // C - tail_blocks)
    return jnp.arange(first, seq_len // C)


def distillation_loss(p: dict, x: Array, probs: Array, cfg: IndexerConfig, lm_cfg: LMConfig,
                      tail_blocks: int = 0) -> Array:
    """Mean KL(p_t || softmax(s_t)) over the crop's second-half (or last) queries.

    Args:
      p: one layer's indexer parameters.
      x: [B, L, d] the layer's normalised input (LM frozen: pass stop_gradient).
      probs: [B, L/C, C, W + C] head-averaged attention in window layout
        (``model.window_attention``).
      tail_blocks: see ``query_blocks``.
    """
    L = x.shape[1]
    pos = jnp.arange(L)
    k = keys(p, x, pos, cfg)

    @jax.checkpoint
    def one(i):
        lg = _block_rows(p, x, k, i, cfg, lm_cfg, cfg.dtype)
        lse = jax.nn.logsumexp(lg, axis=-1)
        pw = lax.dynamic_index_in_dim(probs, i, axis=1, keepdims=False)
        cross = jnp.sum(pw * _window_rows(lg, i, lm_cfg), axis=-1)
        ent = jnp.sum(jnp.where(pw > 0, pw * jnp.log(jnp.where(pw > 0, pw, 1.0)), 0.0), axis=-1)
        return jnp.mean(ent - cross + lse * jnp.sum(pw, axis=-1))

    return jnp.mean(lax.map(one, query_blocks(lm_cfg, L, tail_blocks)))


def coverage(p: dict, x: Array, probs: Array, cfg: IndexerConfig, lm_cfg: LMConfig,
             top_ks=(64, 256, 2048)) -> dict:
    """Attention mass held by the indexer's Top-K, against oracle and recency.

    For every second-half query: the fraction of its head-averaged attention
    mass on (a) the indexer's K highest-scoring visible keys ("indexer"), (b)
    the K keys of highest attention ("oracle", the best any K-subset can do),
    (c) the K most recent keys ("recent"). Float32 logits; ties broken by
    ``lax.top_k``. Also the KL of the distillation objective.

    Returns:
      dict of scalars: ``{f"{kind}@{K}": mean mass}`` and ``"kl"``.
    """
    B, L, d = x.shape
    C, W = lm_cfg.block, lm_cfg.window
    k = keys(p, x, jnp.arange(L), cfg, dt=jnp.float32)

    def one(i):
        lg = _block_rows(p, x, k, i, cfg, lm_cfg, jnp.float32)
        pw = lax.dynamic_index_in_dim(probs, i, axis=1, keepdims=False)  # [B, C, W+C]
        lse = jax.nn.logsumexp(lg, axis=-1)
        cross = jnp.sum(pw * _window_rows(lg, i, lm_cfg), axis=-1)
        ent = jnp.sum(jnp.where(pw > 0, pw * jnp.log(jnp.where(pw > 0, pw, 1.0)), 0.0), axis=-1)
        out = {"kl": jnp.mean(ent - cross + lse)}
        a = jnp.arange(C)[:, None]
        rel = W + a - jnp.arange(W + C)[None, :]  # query minus key position
        for K in top_ks:
            idx = lax.top_k(lg, K)[1]  # [B, C, K] key positions
            wi = idx - (i * C - W)
            ok = (wi >= 0) & (wi < W + C)
            got = jnp.take_along_axis(pw, jnp.clip(wi, 0, W + C - 1), axis=-1)
            out[f"indexer@{K}"] = jnp.mean(jnp.sum(jnp.where(ok, got, 0.0), axis=-1))
            out[f"oracle@{K}"] = jnp.mean(jnp.sum(lax.top_k(pw, K)[0], axis=-1))
            out[f"recent@{K}"] = jnp.mean(jnp.sum(jnp.where((rel >= 0) & (rel < K), pw, 0.0), -1))
        return out

    res = lax.map(one, query_blocks(lm_cfg, L))
    return {name: jnp.mean(v) for name, v in res.items()}
