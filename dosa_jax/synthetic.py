"""Synthetic indexer inputs with named, documented parameters (DESIGN §15).

Two families:

* ``gaussian``: i.i.d. standard normal queries and keys, weights drawn
  uniformly with random signs. No geometry for the certificate to exploit:
  most keys survive. This is the worst-case *test* input, not a benchmark.
* ``structured``: a geometry resembling trained DSA indexers, with every
  knob named. Keys are mixtures of a few latent "topics" plus anisotropic
  noise; heads of a query are correlated (they share a query-level direction);
  head weights are mixed-sign, with negative heads that react to a
  "background" direction present in most keys. This is what the demo and the
  quick studies use until real dumps (``dosa_jax.datasets.trained``) exist.

All generators are deterministic in ``seed`` and return an
:class:`~dosa_jax.inputs.IndexerInputs` (the same record the trained-data
loader returns). ``key_dtype="float8_e4m3fn"`` stores keys as FP8 payloads
with per-key float32 scales, as DeepSeek-V3.2 / DeepGEMM ``fp8_mqa_logits``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from dosa_jax.inputs import IndexerInputs, causal_ranges

FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class StructuredParams:
    """Parameters of the ``structured`` generator (all dimensionless).

    Attributes:
      n_topics: number of latent key directions (topics).
      topic_strength: norm of the topic component of a key relative to noise.
      background_strength: norm of the shared "background" component present in
        every key (what negative heads fire on).
      key_anisotropy: per-coordinate noise std decays as ``(1+i)^-key_anisotropy``.
      head_correlation: in [0, 1]; weight of the query-level shared direction in
        each head (0 = independent heads).
      negative_fraction: fraction of heads with negative weight.
      negative_background_alignment: how strongly negative heads point along the
        background direction (they fire on most keys, as the paper observes).
      weight_scale: typical |w_h|.
      query_topic_focus: how strongly a query's heads point at one topic.
      segment_length: keys come in contiguous segments of this many positions that
        share a topic (locality: recent context is on the query's topic).
      query_local_prob: probability that a query's topic is the one of the segment
        it sits in (otherwise a random topic).
    """

    n_topics: int = 32
    topic_strength: float = 3.0
    background_strength: float = 1.0
    key_anisotropy: float = 0.5
    head_correlation: float = 0.6
    negative_fraction: float = 0.5
    negative_background_alignment: float = 0.5
    weight_scale: float = 1.0
    query_topic_focus: float = 1.5
    segment_length: int = 4096
    query_local_prob: float = 0.8


def quantize_keys_fp8(k: np.ndarray):
    """Per-key FP8 e4m3 quantisation: ``k ≈ scale[:, None] * payload``.

    The scale is a power of two chosen so that the key's largest magnitude maps
    to at most 448 (the e4m3 maximum); zero keys get scale 1.

    Returns:
      (payload float8_e4m3fn [N, D], scale float32 [N]).
    """
    k = np.asarray(k, np.float32)
    amax = np.max(np.abs(k), axis=-1)
    safe = np.where(amax > 0, amax, 1.0)
    scale = np.exp2(np.ceil(np.log2(safe / FP8_MAX))).astype(np.float32)
    scale = np.where(amax > 0, scale, 1.0).astype(np.float32)
    payload = jnp.asarray(k / scale[:, None]).astype(jnp.float8_e4m3fn)
    return payload, jnp.asarray(scale)


def _finish(q, k, w, lo, hi, key_dtype, query_dtype, meta):
    if key_dtype == "float8_e4m3fn":
        payload, scale = quantize_keys_fp8(k)
        k_arr, k_scale = payload, scale
    else:
        k_arr, k_scale = jnp.asarray(k).astype(jnp.dtype(key_dtype)), None
    q_arr = jnp.asarray(q).astype(jnp.dtype(query_dtype))
    meta = dict(meta, key_dtype=str(key_dtype), query_dtype=str(query_dtype))
    return IndexerInputs(q=q_arr, k=k_arr, k_scale=k_scale,
                         w=jnp.asarray(w, jnp.float32), lo=lo, hi=hi, meta=meta)


def _ranges(T, N, causal, lo, hi):
    if lo is not None:
        return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    if causal:
        return causal_ranges(T, N)
    return jnp.zeros((T,), jnp.int32), jnp.full((T,), N, jnp.int32)


def gaussian(*, T: int = 64, N: int = 4096, H: int = 32, D: int = 128, seed: int = 0,
             causal: bool = True, key_dtype: str = "float32", query_dtype: str = "float32",
             weight_scale: float = 1.0, lo=None, hi=None) -> IndexerInputs:
    """Worst case: i.i.d. N(0, 1/D) queries, N(0, 1) keys, weights ±U(0.1, 1)·scale."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D)).astype(np.float32) / np.sqrt(D)
    k = rng.standard_normal((N, D)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, H)) * rng.choice([-1.0, 1.0], (T, H)) * weight_scale)
    lo, hi = _ranges(T, N, causal, lo, hi)
    return _finish(q, k, w.astype(np.float32), lo, hi, key_dtype, query_dtype,
                   dict(kind="gaussian", seed=seed, T=T, N=N, H=H, D=D, causal=causal))


def structured(*, T: int = 64, N: int = 4096, H: int = 32, D: int = 128, seed: int = 0,
               causal: bool = True, key_dtype: str = "float32", query_dtype: str = "float32",
               params: Optional[StructuredParams] = None, lo=None, hi=None) -> IndexerInputs:
    """Correlated heads, anisotropic topic-mixture keys, mixed-sign weights.

    See :class:`StructuredParams` for the meaning of every parameter.
    """
    p = params or StructuredParams()
    rng = np.random.default_rng(seed)
    noise_std = (1.0 + np.arange(D)) ** (-p.key_anisotropy)
    noise_std = noise_std / np.sqrt(np.mean(noise_std ** 2))
    topics = rng.standard_normal((p.n_topics, D))
    topics /= np.linalg.norm(topics, axis=-1, keepdims=True)
    background = rng.standard_normal(D)
    background /= np.linalg.norm(background)
    # keys: background + one dominant topic (sparse mixture) + anisotropic noise
    n_seg = -(-N // p.segment_length)
    key_topic = np.repeat(rng.integers(0, p.n_topics, n_seg), p.segment_length)[:N]
    topic_amp = rng.gamma(2.0, 0.5, N) * p.topic_strength
    k = (rng.standard_normal((N, D)) * noise_std / np.sqrt(D) * 4.0
         + topic_amp[:, None] * topics[key_topic]
         + p.background_strength * background[None, :] * rng.uniform(0.5, 1.5, (N, 1)))
    # queries: each query attends to one topic; heads share a query direction
    lo, hi = _ranges(T, N, causal, lo, hi)
    pos = np.clip(np.asarray(hi) - 1, 0, N - 1)
    local = rng.uniform(size=T) < p.query_local_prob
    q_topic = np.where(local, key_topic[pos], rng.integers(0, p.n_topics, T))
    shared = rng.standard_normal((T, D)) / np.sqrt(D)
    shared += p.query_topic_focus * topics[q_topic]
    indiv = rng.standard_normal((T, H, D)) / np.sqrt(D)
    q = np.sqrt(p.head_correlation) * shared[:, None, :] + np.sqrt(1 - p.head_correlation) * indiv
    n_neg = int(round(p.negative_fraction * H))
    sign = np.ones((T, H))
    sign[:, :n_neg] = -1.0
    for t in range(T):  # heads are not ordered by sign in real models
        rng.shuffle(sign[t])
    neg = sign < 0
    # negative heads fire on the background (present in most keys): large, frequent
    q = np.where(neg[..., None],
                 q * 0.5 + p.negative_background_alignment * background[None, None, :], q)
    w = sign * rng.uniform(0.2, 1.0, (T, H)) * p.weight_scale
    meta = dict(kind="structured", seed=seed, T=T, N=N, H=H, D=D, causal=causal,
                params=dataclasses.asdict(p))
    return _finish(q.astype(np.float32), k.astype(np.float32), w.astype(np.float32), lo, hi,
                   key_dtype, query_dtype, meta)


GENERATORS = {"gaussian": gaussian, "structured": structured}


def synthetic(kind: str = "structured", **kwargs) -> IndexerInputs:
    """Dispatch to a named generator: ``"gaussian"`` or ``"structured"``."""
    if kind not in GENERATORS:
        raise ValueError(f"kind must be one of {sorted(GENERATORS)}, got {kind!r}")
    return GENERATORS[kind](**kwargs)
