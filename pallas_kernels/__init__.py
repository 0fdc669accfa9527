"""Pallas (Triton) GPU kernels of the DoSA pipeline, each beside its jnp twin.

Modules: ``scoring`` (the one scoring routine), ``records`` (candidate buffers
with an online threshold), ``dense`` (dense fused indexer), ``select``
(exact Top-K of score rows), ``screen`` (certificate screening), ``refine``
(survivor refinement and seed scoring), ``numerics`` (the kernels' error
coefficient), ``pipeline`` (DoSA composed from them; ``backend="pallas"``).

Entry points: ``pipeline.dosa_topk`` and ``pipeline.dense_topk`` (called by
``dosa_jax.topk`` / ``dosa_jax.dense_topk`` with ``Config(backend="pallas")``)
and ``select.exact_topk`` (exact Top-K of score rows by a threshold select instead of
``lax.top_k``'s sort). Operand preparation and record buffers are in ``operands``, the
static tile configuration in ``tiles``.
"""
