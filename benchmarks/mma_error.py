"""Measure the tensor-core dot error of Pallas Triton tiles against exact float64 dots.

Reports max over many (row, key) pairs of |dot_kernel − dot_exact| / Σ_j |a_j b_j|
for bf16 × bf16, float16 × float16 (the decode screen's MMA) and fp8 × fp8 operands (float32 accumulation requested), and
compares with the model bound ``pallas_kernels.numerics.mma_gamma(D)``.
Inputs: random normals, plus a cancellation-heavy set (half the products large
and positive, half large and negative, small remainders).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.common import compiler_params, interpret_default
from pallas_kernels.numerics import mma_gamma


def _dot_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...].T, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("bm", "bn", "interpret"))
def tile_dots(a, b, bm=128, bn=64, interpret=False):
    M, D = a.shape
    N = b.shape[0]
    return pl.pallas_call(
        _dot_kernel, grid=(M // bm, N // bn),
        in_specs=[pl.BlockSpec((bm, D), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, D), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        compiler_params=compiler_params(4, 2), interpret=interpret)(a, b)


def _operands(rng, M, N, D, kind):
    if kind == "normal":
        a = rng.standard_normal((M, D))
        b = rng.standard_normal((N, D))
    else:  # cancellation: large products of both signs and small remainders
        a = rng.standard_normal((M, D))
        b = np.abs(rng.standard_normal((N, D)))
        a[:, : D // 2] = np.abs(a[:, : D // 2]) * 64
        a[:, D // 2: D] = -np.abs(a[:, D // 2: D]) * 64
        a[:, -4:] = rng.standard_normal((M, 4)) / 64
        b = b * np.exp2(rng.integers(-6, 6, (N, D)))
    return a, b


def measure(dtype, M=4096, N=4096, D=128, kinds=("normal", "cancel"), seed=0, interpret=None):
    interpret = interpret_default() if interpret is None else interpret
    rng = np.random.default_rng(seed)
    out = {}
    for kind in kinds:
        a, b = _operands(rng, M, N, D, kind)
        aj = jnp.asarray(a, jnp.float32).astype(dtype)
        bj = jnp.asarray(b, jnp.float32).astype(dtype)
        got = np.asarray(tile_dots(aj, bj, interpret=interpret), np.float64)
        a64 = np.asarray(aj.astype(jnp.float32), np.float64)
        b64 = np.asarray(bj.astype(jnp.float32), np.float64)
        exact = a64 @ b64.T
        absd = np.abs(a64) @ np.abs(b64).T
        rel = np.abs(got - exact) / np.maximum(absd, 1e-300)
        out[kind] = dict(pairs=M * N, max_rel=float(rel.max()),
                         p99999_rel=float(np.quantile(rel, 0.99999)),
                         model_gamma=mma_gamma(D), within_model=bool(rel.max() <= mma_gamma(D)))
    return out


if __name__ == "__main__":  # pragma: no cover
    import json
    print(json.dumps({str(jnp.dtype(d)): measure(d) for d in (jnp.bfloat16, jnp.float16,
                                                     jnp.float8_e4m3fn)},
                     indent=1))
