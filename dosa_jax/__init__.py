"""dosa_jax: exact DoSA Top-K for DeepSeek-style sparse-attention indexers.

    import dosa_jax
    res = dosa_jax.topk(q, k, w, top_k=2048)           # DoSA
    ref = dosa_jax.dense_topk(q, k, w, top_k=2048)     # full scoring, same indices
    jax.jit(dosa_jax.topk)(q, k, w, config=dosa_jax.Config(top_k=2048))

Submodules (``dosa_jax.datasets``, ``dosa_jax.diagnostics``, ``dosa_jax.lm``, …)
are attributes of the package, imported on first access: ``import dosa_jax``
loads neither the language model nor the Pallas kernels.
"""

import importlib

from dosa_jax.api import dense_topk, exact_topk, score, sharded_topk, topk
from dosa_jax.config import Config
from dosa_jax.api import decode_topk, sharded_decode_topk
from dosa_jax.decode import DecodeState, decode_init
from dosa_jax.inputs import IndexerInputs, causal_ranges
from dosa_jax.results import Stats, TopKResult

__all__ = [
    "Config", "IndexerInputs", "Stats", "TopKResult", "causal_ranges", "dense_topk",
    "exact_topk", "score", "sharded_topk", "topk",
    "DecodeState", "decode_init", "decode_topk", "sharded_decode_topk",
]
__version__ = "0.1.0"

#: Public submodules, imported on first attribute access (PEP 562).
SUBMODULES = (
    "agreement", "api", "autodiff", "backend", "bounds", "budget", "config", "datasets",
    "decode",
    "dense", "diagnostics", "enclosure", "inputs", "keys", "lm", "numerics", "pipeline",
    "plan", "planner", "results", "sample", "scorer", "screen", "seeds", "selection",
    "slack", "synthetic", "tiling", "witnesses", "manual_axes",
    "context_parallel",
)


def __getattr__(name):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES))
