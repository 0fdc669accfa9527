"""benchmarks.fp8_dot: FP8 dots lowered inside ``fast_fp8_accumulation`` carry
``maxNumImpreciseAcc`` (what lets Triton use wgmma for them); bf16 dots and dots lowered
outside the block do not. Checked on the Triton IR of a CUDA lowering, which needs no GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.fp8_dot import NO_PROMOTION, fast_fp8_accumulation
from benchmarks.kernel_sass import triton_modules


def _dot_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)


def _triton_ir(dtype) -> str:
    """The Triton IR of a 64×32 · (64×32)ᵀ Pallas dot lowered for CUDA."""
    f = pl.pallas_call(_dot_kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                       compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    x = jax.ShapeDtypeStruct((64, 32), dtype)
    with triton_modules() as seen:
        jax.jit(f).trace(x, x).lower(lowering_platforms=("cuda",))
    assert len(seen) == 1
    return seen[0][1]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_fast_fp8_accumulation_marks_fp8_dots_only(dtype):
    with fast_fp8_accumulation():
        inside = _triton_ir(dtype)
    outside = _triton_ir(dtype)
    attr = f"maxNumImpreciseAcc = {NO_PROMOTION}"
    assert "tt.dot" in inside and "tt.dot" in outside
    assert (attr in inside) == (dtype == jnp.float8_e4m3fn)
    assert "maxNumImpreciseAcc" not in outside    # the patch is undone after the block
