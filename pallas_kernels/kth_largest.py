"""The K-th largest int32 order key of each row (Pallas Triton), and its jnp twin.

A decode step's witness threshold τ_w (DESIGN §11) is the K-th largest of each query's witness
order keys (:func:`dosa_jax.selection.order_key`). ``lax.top_k(x, K)[0][:, K - 1]`` sorts the
row to get it (on the H200, 43 µs for one row of 8192 keys at K = 2048, whatever the number of
rows). Only the value is needed, so this kernel finds it without sorting: one program per row
holds the row in registers and builds the answer bit by bit, from the top, in the keys'
unsigned order (``x ^ INT32_MIN``): a bit is kept when at least K keys are ≥ the prefix with
it set. After 32 counts the prefix is the largest v with #{x ≥ v} ≥ K — the K-th largest key,
ties included, exactly what ``lax.top_k`` gives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dosa_jax.selection import INT32_MIN
from pallas_kernels.common import compiler_params, interpret_default, next_pow2, pad_axis

Array = jax.Array

#: Triton warps per row: 8 keep a row of 8192 keys in 32 registers a thread.
WARPS = 8


def _kernel(x_ref, o_ref, *, K: int, W: int):
    r = pl.program_id(0)
    x = x_ref[pl.ds(r, 1), pl.ds(0, W)]          # [1, W]: the whole row

    def bit(i, prefix):   # prefix: the answer's top i bits, unsigned order, as int32 bits
        t = prefix | jnp.left_shift(jnp.int32(1), jnp.int32(31) - i)
        count = jnp.sum((x >= (t ^ jnp.int32(INT32_MIN))).astype(jnp.int32))
        return jnp.where(count >= K, t, prefix)

    kth = lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ jnp.int32(INT32_MIN)
    o_ref[pl.ds(r, 1)] = jnp.full((1,), kth, jnp.int32)


@functools.partial(jax.jit, static_argnames=("K", "interpret"))
def kth_largest(x: Array, K: int, *, interpret=None) -> Array:
    """The K-th largest of each row of int32 keys ``x`` [R, W] (1 ≤ K ≤ W): [R] int32,
    bitwise ``lax.top_k(x, K)[0][:, K - 1]`` (:func:`kth_largest_reference`). Rows are
    padded with ``INT32_MIN`` to a power of two (never above the K-th largest)."""
    if x.ndim != 2 or jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"kth_largest: x must be int32 [rows, width], got {x.dtype} {x.shape}")
    R, W = x.shape
    if not 1 <= K <= W:
        raise ValueError(f"kth_largest: K must be in [1, {W}] (the row width), got {K}")
    if interpret is None:
        interpret = interpret_default()
    Wp = next_pow2(max(W, 16))
    xp = pad_axis(x, 1, Wp, INT32_MIN)
    return pl.pallas_call(
        functools.partial(_kernel, K=K, W=Wp), out_shape=jax.ShapeDtypeStruct((R,), jnp.int32),
        grid=(R,), compiler_params=compiler_params(WARPS, 1), interpret=interpret,
        name="dosa_kth_largest")(xp)


def kth_largest_reference(x: Array, K: int) -> Array:
    """jnp twin of :func:`kth_largest`: the K-th value of ``lax.top_k``."""
    return lax.top_k(x, K)[0][:, K - 1]


__all__ = ["kth_largest", "kth_largest_reference"]
