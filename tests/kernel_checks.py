"""Checks shared by the Pallas kernel tests (imported by them; not a test module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dense, pipeline, screen
from pallas_kernels.common import ID_BITS, ID_MASK, mma_pieces


def unpack_survivors(packed, count, T: int, N: int) -> np.ndarray:
    """[T, N] survival mask from per-group lists ``id | mask << ID_BITS``; checks each list
    holds distinct ascending ids."""
    packed, count = np.asarray(packed), np.asarray(count)
    got = np.zeros((T, N), bool)
    for g in range(packed.shape[0]):
        for s in range(packed.shape[1]):
            e = packed[g, s, :count[g, s]]
            ids = e & ID_MASK
            assert np.all(np.diff(ids) > 0), f"group {g} split {s}: ids not ascending"
            for b in range(4):
                if 4 * g + b < T:
                    got[4 * g + b, ids[((e >> ID_BITS) >> b & 1) == 1]] = True
    return got


def assert_screening_bound_holds_on_every_key(inp, det):
    """The Pallas pipeline's screening bound (plan + kernel coefficient, one or two MMA pieces)
    is ≥ the kernels' score on every (query, key): checked on the twins, all keys. Without the
    kernel's arithmetic allowance (plan residual only) the check fails on bf16 inputs."""
    from dosa_jax.enclosure import key_norm_upper
    from pallas_kernels.scoring import score_reference
    single = det["single_piece"]
    assert single == (inp.q.dtype == jnp.bfloat16)
    plan = det["plan"]
    ops = dense.prepare_operands(inp.q, inp.w, inp.k, inp.k_scale, 4)
    U = screen.screening_bound_reference(plan.rows, plan.row_weights, det["aggregate_columns"],
                                         det["aggregate_weights"], det["coef"], det["eps"], ops.k,
                                         key_norm_upper(inp.k), ops.scale, single_piece=single)
    s = score_reference(mma_pieces(inp.q), inp.w, mma_pieces(inp.k), inp.k_scale)
    U, s = np.asarray(U), np.asarray(s)
    assert np.all(U >= s), f"{int(np.sum(U < s))} keys with U < s"


def jit_dosa_details(args, cfg, **kw):
    """``pipeline.dosa_topk(*args, cfg, return_details=True, **kw)`` under jax.jit: one program
    for a test whose shapes no other test shares (op by op, such shapes compile hundreds of
    small programs, several times the whole program's time). The details' Python values
    (sizes, flags) are taken from the trace."""
    static = {}

    def run(*a):
        idx, sc, st, det = pipeline.dosa_topk(*a, cfg, return_details=True, **kw)
        static.update({k: v for k, v in det.items() if isinstance(v, (bool, int))})
        return idx, sc, st, {k: v for k, v in det.items() if k not in static}

    idx, sc, st, det = jax.jit(run)(*args)
    return idx, sc, st, dict(det, **static)


def jit_dosa_details_many(args, variants, dense=None):
    """``jit_dosa_details(args, cfg, **kw)`` for every ``(cfg, kw)`` of ``variants``, and with
    ``dense = (cfg, kw)`` also ``pipeline.dense_topk(*args, cfg, **kw)``, all in one program:
    XLA compiles several variants of the pipeline together in about half the time of as many
    programs (their interpret-mode kernels and shared stages once). Returns the list of
    ``(idx, sc, st, details)``, then ``(didx, dsc)`` when ``dense`` is given."""
    static = [{} for _ in variants]

    def run(*a):
        out = []
        for (cfg, kw), st_ in zip(variants, static):
            idx, sc, st, det = pipeline.dosa_topk(*a, cfg, return_details=True, **kw)
            st_.update({k: v for k, v in det.items() if isinstance(v, (bool, int))})
            out.append((idx, sc, st, {k: v for k, v in det.items() if k not in st_}))
        if dense is not None:
            out.append(tuple(pipeline.dense_topk(*a, dense[0], **dense[1])))
        return out

    out = jax.jit(run)(*args)
    res = [(idx, sc, st, dict(det, **st_)) for (idx, sc, st, det), st_ in zip(out, static)]
    return res + ([tuple(out[-1])] if dense is not None else [])
