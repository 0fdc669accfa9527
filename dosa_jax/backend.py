"""Which implementation answers a call: the one place that detects a GPU.

``"reference"`` is the pure-jnp pipeline; ``"pallas"`` runs the Pallas kernels
(``pallas_kernels``; interpret mode without a GPU); ``"auto"`` picks pallas on a
GPU and the reference elsewhere (DESIGN §12, §13).
"""

from __future__ import annotations

import jax

#: Backend names accepted by ``Config.backend`` and ``exact_topk``.
BACKENDS = ("reference", "pallas", "auto")
#: ``jax.default_backend()`` names of a GPU (jax 0.10 says "gpu", later versions may
#: say "cuda"; "rocm" for AMD).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def on_gpu() -> bool:
    """Whether JAX's default backend is a CUDA or ROCm GPU."""
    try:
        return jax.default_backend() in GPU_PLATFORMS
    except RuntimeError:  # pragma: no cover - no backend could be initialised
        return False


def resolve_backend(name: str) -> str:
    """``"reference"`` or ``"pallas"`` for backend ``name`` on this machine."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "pallas" if on_gpu() else "reference"
    return name


def candidates(name: str) -> tuple:
    """Implementations to try for backend ``name``, in order: ``"auto"`` tries pallas on a
    GPU and falls back to the reference (on ``NotImplementedError``); an explicit name is
    the only candidate."""
    if name == "auto":
        return ("pallas", "reference") if on_gpu() else ("reference",)
    return (resolve_backend(name),)
