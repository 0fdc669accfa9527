"""dosa_jax: exact DoSA Top-K for DeepSeek-style sparse-attention indexers.

    import dosa_jax
    res = dosa_jax.topk(q, k, w, top_k=2048)           # DoSA
    ref = dosa_jax.dense_topk(q, k, w, top_k=2048)     # full scoring, same indices
    jax.jit(dosa_jax.topk)(q, k, w, config=dosa_jax.Config(top_k=2048))
"""

from dosa_jax.api import TopKResult, dense_topk, exact_topk, score, topk
from dosa_jax.config import Config
from dosa_jax.inputs import IndexerInputs, causal_ranges
from dosa_jax.pipeline import Stats

__all__ = [
    "Config", "IndexerInputs", "Stats", "TopKResult", "causal_ranges", "dense_topk",
    "exact_topk", "score", "topk",
]
__version__ = "0.1.0"
