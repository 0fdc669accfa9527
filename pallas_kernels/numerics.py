"""The Pallas kernels' arithmetic, bounded (App. C, Eq. 26–28 for this backend).

Exactness needs ``s_kernel ≤ U_kernel`` for every pruned key, where both are
what the *kernels* compute. The plan (``dosa_jax.planner``) bounds the real
certificate; this module bounds, per query and relative to the key-norm bound
``n_i ≥ ‖k̄_i‖``, how far the kernels' arithmetic can move the score and the
bound away from their real values. The pipeline adds the result to the
plan's coefficient (``coef = E + C + C_kernel``).

Error model of one tile dot (bf16 × bf16 → float32 on Hopper tensor cores):
products are exact; the D-term accumulation aligns and truncates, modelled as
``|fl(a·b) − a·b| ≤ γ_{D + D/8}(u_mma) Σ_j |a_j b_j|`` with ``u_mma = 2^-22``
(twice float32's unit roundoff, to cover truncation instead of rounding and
the per-instruction alignment; published tensor-core models, e.g. Fasi et al.
2021, Khattak & Mikaitis 2024). This is a *model*: the GPU benchmark measures
the largest observed error against it (BENCHMARKS.md). FP8 × FP8 MMA
accumulates with far fewer bits (DeepSeek-V3 report: ~14) and is **not**
used where a certificate is needed (it is offered for the dense baseline only).

Operand pieces (:func:`pallas_kernels.common.mma_pieces`): a float32 row is
``hi + lo`` in bf16; ``‖q − hi − lo‖`` is computed and bounded upward. Split
float32/float16 keys add a relative representation error ``δ_k ≤ 2^-14``.
"""

from __future__ import annotations

import jax.numpy as jnp

from dosa_jax import numerics as nm
from pallas_kernels.common import (BF16, FP8, mma_pieces, pieces_value, row_pieces,
                                   scaled_f16_error)

#: Unit roundoff assumed for the tensor-core accumulation of bf16 products.
U_MMA = 2.0 ** -22


def mma_gamma(D: int) -> float:
    """γ of one tile dot of D products (plus one alignment step per 8 products)."""
    return nm.gamma(D + max(1, D // 8), U_MMA)


def key_split_error(k_dtype) -> float:
    """Relative representation error of the keys' MMA pieces (0 when exact in bf16)."""
    return 0.0 if jnp.dtype(k_dtype) in (BF16, FP8) else 2.0 ** -14


def representation_error(x, single_piece: bool = False):
    """‖x − pieces(x)‖ upper bound along the last axis (float32 in, any float dtype).

    ``single_piece``: the one-bf16-piece representation of screening rows
    (:func:`pallas_kernels.common.row_pieces`), 0 for rows exact in bf16.
    """
    xf = x.astype(jnp.float32)
    pieces = row_pieces(x, True) if single_piece else mma_pieces(x)
    diff = xf - pieces_value(pieces).astype(jnp.float32)
    return nm.norm_upper(diff)


def dot_error_per_norm(vec_norm_up, rep_err_up, D: int, k_dtype, n_pairs: int):
    """Bound on |kernel dot − real dot| / n_i for vectors with norm ≤ vec_norm_up."""
    g = mma_gamma(D) * (1.0 + 2.0 ** -6) + nm.gamma(n_pairs + 1) + key_split_error(k_dtype) * 1.1
    return rep_err_up + vec_norm_up * jnp.float32(g)


def _scorer_error(qn, rep, w, D: int, k_dtype, n_pairs: int):
    """Σ_h |w_h| e_h + γ_{H+3} Σ_h |w_h| (‖q_h‖ + e_h), inflated: e_h the head's dot error
    per key norm (representation ``rep`` + MMA) through the 1-Lipschitz ReLU, then the tree
    sum of the H weighted terms."""
    H = qn.shape[-1]
    e = dot_error_per_norm(qn, rep, D, k_dtype, n_pairs)
    aw = jnp.abs(w.astype(jnp.float32))
    head = jnp.sum(aw * e, axis=-1)
    tree = jnp.sum(aw * (qn + e), axis=-1) * jnp.float32(nm.gamma(H + 3))
    return nm.inflate(head + tree, 2 * H + 4)


def scorer_error_coefficient(q, w, k_dtype):
    """E_s: |s_kernel − α s_real| ≤ α n_i E_s (+ the final nudge) for every key.

    Per head: the dot error (representation + MMA) through the 1-Lipschitz ReLU
    times |w_h|; the tree sum of H weighted terms: γ_{H+2} Σ|w_h| (‖q_h‖ + e_h).
    """
    D = q.shape[-1]
    qn = nm.norm_upper(q.astype(jnp.float32))
    n_pairs = 1 + (jnp.dtype(q.dtype) not in (BF16, FP8)) + (jnp.dtype(k_dtype) not in (BF16, FP8))
    return _scorer_error(qn, representation_error(q), w, D, k_dtype, n_pairs)


def scaled_f16_scorer_error_coefficient(q, w, k_dtype, pieces, e):
    """E_s of a scorer whose query rows are :func:`pallas_kernels.common.scaled_f16_pieces`
    (``pieces``, exponents ``e``) and whose weights are w_h·2^-e_h: the same bound with the
    float16 pieces' representation error. The scaling by powers of two moves no rounding
    (no product or partial sum of those pieces with FP8 keys is subnormal), so the MMA model
    holds unchanged; the pieces are exact for bf16 queries in range (representation 0)."""
    D = q.shape[-1]
    qn = nm.norm_upper(q.astype(jnp.float32))
    rep = scaled_f16_error(q, pieces, e)
    return _scorer_error(qn + rep, rep, w, D, k_dtype, pieces.shape[0] + (
        jnp.dtype(k_dtype) not in (BF16, FP8)))


def screening_error_coefficient(rows, row_w, aggregate, k_dtype, coef_plan,
                                single_piece: bool = False):
    """E_u: |Û_kernel − Û_real| ≤ n_i E_u for the screening expression (rows f32 in pieces).

    Retained rows through the ReLU times |w̃_r|, aggregate columns through theirs
    times |±1| (:func:`pallas_kernels.screen.aggregate_columns`), then the tree sums over
    Rp columns and the ``+ n·coef + ε`` epilogue (γ_{Rp+6} of every magnitude involved).
    """
    T, R, D = rows.shape
    A = aggregate.shape[1]
    rn = nm.norm_upper(rows.astype(jnp.float32))
    an = nm.norm_upper(aggregate.astype(jnp.float32))
    n_pairs = (1 if single_piece else 2) + (jnp.dtype(k_dtype) not in (BF16, FP8))
    er = dot_error_per_norm(rn, representation_error(rows, single_piece), D, k_dtype, n_pairs)
    ea = dot_error_per_norm(an, representation_error(aggregate, single_piece), D, k_dtype,
                            n_pairs)
    aw = jnp.abs(row_w.astype(jnp.float32))
    dots = jnp.sum(aw * er, axis=-1) + jnp.sum(ea, axis=-1)
    mag = (jnp.sum(aw * (rn + er), axis=-1) + jnp.sum(an + ea, axis=-1)
           + jnp.abs(coef_plan.astype(jnp.float32)))
    Rp = 1 << max(0, (R + A - 1).bit_length())
    tree = mag * jnp.float32(nm.gamma(Rp + 8))
    return nm.inflate(dots + tree, 2 * (R + A) + 8)


def kernel_coefficient(q, w, plan, k_dtype, single_piece: bool = False, aggregate=None,
                       aggregate_error=None):
    """coef for the screening kernel: plan residual + plan error + E_s + E_u (upward).

    ``aggregate``/``aggregate_error``: the columns the screen actually uses for the
    negative aggregate and ‖a − hi − lo‖ (:func:`pallas_kernels.screen.aggregate_columns`),
    in place of ``plan.aggregate``; ``single_piece`` as the screen's rows.
    """
    coef_plan = plan.residual + plan.error
    if aggregate_error is not None:
        coef_plan = nm.upper_sum(coef_plan, aggregate_error)
    agg = plan.aggregate if aggregate is None else aggregate
    e_s = scorer_error_coefficient(q, w, k_dtype)
    e_u = screening_error_coefficient(plan.rows, plan.row_weights, agg, k_dtype, coef_plan,
                                      single_piece)
    return nm.upper_sum(coef_plan, e_s, e_u)
