"""FP8 dots on Hopper's FP8 tensor-core path, for uncertified FP8-MMA probes (benchmark only).

Pallas's Triton lowering emits ``tt.dot`` without ``maxNumImpreciseAcc``. For FP8 operands
Triton then falls back to ``mma.sync`` after converting both tiles to f16 (``HMMA.16816`` in
the sm_90 code instead of ``wgmma``, with more registers and spills). With
``maxNumImpreciseAcc = 2^30`` the same IR compiles to ``QGMMA.64x128x32.F32.E4M3.E4M3``
(read on CPU with ``benchmarks.kernel_sass``).

:func:`fast_fp8_accumulation` sets that attribute on the FP8 dots lowered inside it. It
patches jaxlib's Triton dialect binding for the duration of the ``with`` block, so *compile*
inside it (``jax.jit(f).lower(*args).compile()``); the compiled executable keeps the attribute.
Hopper accumulates FP8 products with reduced precision unless the kernel promotes partial sums,
and NVIDIA documents no error bound for it: scores from such a kernel may not enter DoSA's
certificate. Use it only for throughput probes whose scores are not certified.
"""

from __future__ import annotations

import contextlib

#: Triton's "never promote" value of ``maxNumImpreciseAcc`` (as its Python ``tl.dot`` uses).
NO_PROMOTION = 1 << 30


def _is_fp8(value) -> bool:
    from jaxlib.mlir import ir
    elt = str(ir.RankedTensorType(value.type).element_type)
    return elt.startswith("f8")


@contextlib.contextmanager
def fast_fp8_accumulation(max_num_imprecise_acc: int = NO_PROMOTION):
    """Within the block, FP8 × FP8 ``tt.dot`` ops are emitted with ``maxNumImpreciseAcc``."""
    from jax._src.pallas.triton import lowering
    tt = lowering.tt_dialect
    orig = tt.dot

    def dot(a, b, c, **kw):
        if kw.get("max_num_imprecise_acc") is None and _is_fp8(a) and _is_fp8(b):
            kw["max_num_imprecise_acc"] = max_num_imprecise_acc
        return orig(a, b, c, **kw)

    tt.dot = dot
    try:
        yield
    finally:
        tt.dot = orig
