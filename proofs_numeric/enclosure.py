"""App. C (Eq. 22–28): the numerical certificate encloses what the scorer computes.

For every (query, key) pair: ``s_ref ≤ U_num``, where ``s_ref`` is the
canonical scorer's float32 output (``scorer.score_gathered`` on a gathered
[Tq, B, D] block, exactly as the pipeline scores) and ``U_num`` is
``screen.screening_bound(plan, keys, key_norm_upper(keys), scale)`` for the plan
``planner.build_plan`` makes from the float32-widened queries (as the pipeline
calls it; τ plays no part in validity). Only plans with ``prune`` set count
(an unverified plan never prunes), and a non-finite bound is no violation (the
pipeline treats it as a fault) — both are counted separately.

Inputs are adversarial FP8 keys — payload values at the e4m3 maximum 448 and
the subnormal minimum 2^-9, alternating ±448 that cancel, sparse maxima, keys
(anti-)aligned with the heads, zero keys — with per-key scales 2^-20 … 2^20
(powers of two and arbitrary floats), and queries with near-parallel,
exactly parallel and cancelling heads, tight negative aggregates (every
omitted negative head active, so U = s in real numbers), e4m3-grid values,
weights spanning 2^±20, in float32, bfloat16 and float8_e4m3fn, D up to
256, H from 1 to 64, ``fp8_aggregate`` on and off, and every certificate
option (residual triangle/joint/grouped/best, support majority/all/none,
ranking, projection, basic/absolute form, fixed and automatic budgets).

``unenclosed=True`` evaluates the *real-number* bound instead —
α·(Û + ‖k̄‖·E) in round-to-nearest with C = 0, ε = 0 and no upward steps —
to show that the check catches a bound that is not numerically enclosed.

    python -m proofs_numeric.enclosure --pairs 100000000      # on a GPU
    python -m proofs_numeric.enclosure --pairs 2000000 --unenclosed --cases tight
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dosa_jax
from dosa_jax import enclosure as enc
from dosa_jax.bounds.heads import activation_frequencies
from dosa_jax.planner import build_plan
from dosa_jax.scorer import score_gathered, weighted_relu_sum
from dosa_jax.screen import screening_bound
from proofs_numeric import _common as cm

NAME = "enclosure"
CLAIM = "s_ref <= U_num on every (query, key) pair, adversarial FP8 inputs (App. C, Eq. 26)"
FP8_MAX = 448.0
FP8_MIN_SUBNORMAL = 2.0 ** -9
HIGHEST = lax.Precision.HIGHEST
FP8 = jnp.dtype(jnp.float8_e4m3fn)

KEY_FAMILIES = ("random", "extremes", "alternating", "aligned", "anti_aligned", "subnormal",
                "zero", "sparse_max")
QUERY_FAMILIES = ("gaussian", "near_parallel", "parallel", "cancelling", "tight_negative",
                  "wide_weights", "fp8_grid", "signed_extremes", "tiny_heads", "huge_heads")


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled configuration of the check."""

    H: int
    D: int
    q_dtype: str = "float32"          # float32 | bfloat16 | float8_e4m3fn
    fp8_aggregate: bool = False
    config: tuple = ()                # Config fields
    tight: bool = False               # every query of the tight_negative family

    def make_config(self) -> dosa_jax.Config:
        return dosa_jax.Config(**dict(self.config))

    @property
    def label(self) -> str:
        cfg = ",".join(f"{k}={v}" for k, v in self.config)
        return (f"H={self.H} D={self.D} q={self.q_dtype} fp8agg={int(self.fp8_aggregate)}"
                f"{' tight' if self.tight else ''} [{cfg}]")


CASES = (
    Case(32, 128, "bfloat16", False, (("retained_heads", 8),)),
    Case(64, 128, "float8_e4m3fn", True, (("retained_heads", "auto"),)),
    Case(32, 256, "float32", True, (("retained_heads", 12), ("positive_residual", "joint"),
                                    ("negative_support", "all"))),
    Case(8, 64, "bfloat16", True, (("retained_heads", 2), ("positive_residual", "grouped"),
                                   ("residual_groups", 8), ("negative_ranking", "strength"))),
    Case(16, 32, "float32", False, (("retained_heads", 4), ("positive_projection", False),
                                    ("negative_support", "none"))),
    Case(32, 128, "float8_e4m3fn", False, (("retained_heads", 16), ("certificate_form", "absolute"),
                                           ("positive_residual", "triangle"))),
    Case(64, 256, "bfloat16", True, (("retained_heads", 32), ("certificate_form", "absolute"))),
    Case(2, 2, "float32", False, (("retained_heads", 1),)),
    Case(1, 16, "float8_e4m3fn", True, (("retained_heads", 1),)),
    Case(32, 128, "float32", False, (("retained_heads", 31), ("certificate_form", "absolute")),
         tight=True),
    Case(64, 128, "bfloat16", True, (("retained_heads", 48),), tight=True),
    Case(8, 256, "float32", True, (("retained_heads", 4), ("positive_residual", "best")),
         tight=True),
)
#: Cases designed so the real-number bound is tight (U = s in reals on most pairs).
TIGHT_CASES = tuple(c for c in CASES if c.tight)
#: The CPU test suite's subset: every query dtype, fp8_aggregate on and off, D = 256,
#: fixed and tight cases, cheap enough for 10^7 pairs in well under a minute.
CASES_CPU = (CASES[3], CASES[4], CASES[5], CASES[7], CASES[9], CASES[11])
CASE_SETS = {"all": CASES, "tight": TIGHT_CASES, "cpu": CASES_CPU,
             "cpu-tight": tuple(c for c in CASES_CPU if c.tight)}


# ----------------------------------------------------------------------------- inputs

def to_fp8(x):
    """Round to the e4m3fn grid, saturating at ±448 (NumPy, float8_e4m3fn dtype)."""
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def make_keys(rng: np.random.Generator, B: int, D: int, v, tight: bool = False):
    """B FP8 payloads [B, D] from the key families, and per-key scales [B] float32.

    ``v`` [D] is the batch's shared head direction (for (anti-)aligned keys); with
    ``tight`` three keys in four are aligned with it.
    """
    fam = rng.integers(0, len(KEY_FAMILIES), B)
    if tight:
        fam = np.where(rng.uniform(size=B) < 0.75, KEY_FAMILIES.index("aligned"), fam)
    out = np.empty((B, D), np.float32)
    n = np.bincount(fam, minlength=len(KEY_FAMILIES))
    for f, name in enumerate(KEY_FAMILIES):
        m = int(n[f])
        if name == "random":
            x = rng.standard_normal((m, D)) * np.exp2(rng.integers(-6, 7, (m, 1)))
        elif name == "extremes":
            x = rng.choice([FP8_MAX, -FP8_MAX, FP8_MIN_SUBNORMAL, -FP8_MIN_SUBNORMAL, 0.0], (m, D))
        elif name == "alternating":  # ±448 that cancel in q·k̄, up to one subnormal coordinate
            x = np.tile(FP8_MAX * np.where(np.arange(D) % 2 == 0, 1.0, -1.0), (m, 1))
            poke = rng.integers(0, D, m)
            hit = rng.uniform(size=m) < 0.5
            x[np.arange(m)[hit], poke[hit]] = FP8_MIN_SUBNORMAL
        elif name in ("aligned", "anti_aligned"):
            amp = FP8_MAX / (np.max(np.abs(v)) + 1e-30) * rng.uniform(0.01, 1.0, (m, 1))
            x = amp * v[None, :] + 4.0 * rng.standard_normal((m, D))
            x = -x if name == "anti_aligned" else x
        elif name == "subnormal":
            x = FP8_MIN_SUBNORMAL * rng.choice([-1.0, 1.0], (m, D))
        elif name == "zero":
            x = np.zeros((m, D))
        else:  # sparse_max
            x = np.where(rng.uniform(size=(m, D)) < 4.0 / max(D, 4),
                         FP8_MAX * rng.choice([-1.0, 1.0], (m, D)), 0.0)
        out[fam == f] = x
    exp = np.exp2(rng.integers(-20, 21, B).astype(np.float64))
    frac = np.where(rng.uniform(size=B) < 0.5, 1.0, rng.uniform(1.0, 2.0, B))
    return to_fp8(out), (exp * frac).astype(np.float32)


def make_queries(rng: np.random.Generator, Tq: int, H: int, D: int, v, q_dtype, tight: bool,
                 n_pos: int):
    """Queries [Tq, H, D] (NumPy, in ``q_dtype``) and weights [Tq, H] float32.

    ``tight_negative``: ``n_pos`` positive heads (all retained when n_pos ≤ r), the
    other heads negative and along the shared direction ``v``, so they are active on
    the aligned keys and the negative aggregate is exact there (U = s in reals).
    """
    fam = np.full(Tq, QUERY_FAMILIES.index("tight_negative")) if tight else \
        rng.integers(0, len(QUERY_FAMILIES), Tq)
    q = np.empty((Tq, H, D))
    w = rng.uniform(0.05, 1.0, (Tq, H)) * rng.choice([-1.0, 1.0], (Tq, H))
    for t in range(Tq):
        name = QUERY_FAMILIES[fam[t]]
        g = rng.standard_normal((H, D)) / np.sqrt(D)
        c = rng.uniform(0.25, 2.0, (H, 1))
        if name == "gaussian":
            q[t] = g * np.exp2(rng.integers(-4, 4, (H, 1)))
        elif name == "near_parallel":
            q[t] = c * v[None, :] + 1e-3 * g
        elif name == "parallel":  # exact multiples of one direction, some antiparallel
            q[t] = np.round(c) * v[None, :] * rng.choice([-1.0, 1.0], (H, 1), p=[0.3, 0.7])
        elif name == "cancelling":  # constant heads: q·k̄ cancels on alternating keys
            q[t] = c * np.ones((1, D)) / np.sqrt(D) + 1e-4 * g
        elif name == "tight_negative":
            q[t] = np.where(np.arange(H)[:, None] < n_pos, g, c * v[None, :] + 0.05 * g)
        elif name == "wide_weights":
            q[t] = g
            w[t] *= np.exp2(rng.integers(-20, 21, H))
        elif name == "fp8_grid":
            q[t] = np.asarray(to_fp8(g * np.exp2(rng.integers(-2, 10, (H, 1)))), np.float64)
        elif name == "tiny_heads":  # float32 squares of the entries fall below 2^-126
            q[t] = g * 2.0 ** -64
        elif name == "huge_heads":
            q[t] = g * 2.0 ** 50
        else:  # signed_extremes
            q[t] = rng.choice([FP8_MAX, -FP8_MAX, FP8_MIN_SUBNORMAL, -FP8_MIN_SUBNORMAL, 0.0, 1.0],
                              (H, D)) / 64.0
        if name == "tight_negative":
            w[t] = np.where(np.arange(H) < n_pos, np.abs(w[t]), -np.abs(w[t]))
        else:
            mode = rng.integers(6)  # all positive, all negative, some zero, mixed
            w[t] = {0: np.abs(w[t]), 1: -np.abs(w[t]),
                    2: w[t] * (rng.uniform(size=H) < 0.7)}.get(mode, w[t])
    names = [QUERY_FAMILIES[f] for f in fam]
    if np.dtype(q_dtype) == np.dtype(FP8):
        return to_fp8(q), w.astype(np.float32), names
    return np.asarray(q, np.float32).astype(q_dtype), w.astype(np.float32), names


def make_batch(rng: np.random.Generator, case: "Case", Tq: int, B: int, n_pos: int):
    """Host-side inputs of one batch: queries, weights, keys, scales, adversarial p."""
    H, D = case.H, case.D
    v = rng.standard_normal(D) / np.sqrt(D)
    payload, scale = make_keys(rng, B, D, v, case.tight)
    q, w, names = make_queries(rng, Tq, H, D, v, np.dtype(case.q_dtype), case.tight, n_pos)
    if case.tight:  # p = 1: every omitted negative head is in the support (and active)
        p_adv, p_mode = np.ones((Tq, H), np.float32), np.ones((Tq, 1), bool)
    else:
        p_adv = rng.choice([0.0, 0.5, 1.0], (Tq, H)).astype(np.float32)
        p_mode = rng.uniform(size=(Tq, 1)) < 0.3
    return (q, w, payload, scale, p_adv, p_mode), names


# ----------------------------------------------------------------------------- bounds

def real_number_bound(plan, keys, scale):
    """The unenclosed bound: α·(Û + ‖k̄‖·E) in round-to-nearest float32 — C = 0, ε = 0,
    no upward steps (the same Û as ``screening_bound``)."""
    kf = keys.astype(jnp.float32)
    y = jnp.einsum("trd,bd->tbr", plan.rows, kf, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    z = jnp.einsum("tad,bd->tb", plan.aggregate, kf, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    u_hat = weighted_relu_sum(y, plan.row_weights)
    u_hat = u_hat - jnp.where(plan.aggregate_linear[:, None], z, jnp.maximum(z, 0.0))
    norm = jnp.sqrt(jnp.sum(kf * kf, axis=-1))
    return (u_hat + plan.residual[:, None] * norm[None, :]) * scale[None, :]


def _sample_args(x, norms, s):
    """build_plan's sample arguments for an automatic budget: the first keys of the block."""
    Tq = x.shape[0]
    valid = jnp.ones(x.shape[:2], bool)
    tau = jnp.quantile(s, 0.9, axis=1)
    return dict(sample_dots=x, sample_norms=jnp.broadcast_to(norms[None], (Tq, norms.shape[0])),
                sample_valid=valid, tau=tau)


@functools.lru_cache(maxsize=None)
def _compiled(case: Case, Tq: int, B: int):
    """The jitted bounds of one batch: s_ref, U_num, the real-number U and the scale M.

    They are returned (stored float32 values) and compared by :func:`_count`: inside
    one fused program XLA may re-evaluate a producer in a consumer, with multiply-adds
    contracted to FMAs, so a comparison there need not see the values the scorer and
    the screening actually output.
    """
    cfg = case.make_config()
    n_sample = min(B, 256)

    def run(q, w, payload, scale, p_adv, p_mode):
        keys_b = jnp.broadcast_to(payload[None], (Tq, B, case.D))
        s_ref, x = score_gathered(q, w, keys_b, jnp.broadcast_to(scale[None], (Tq, B)),
                                  return_head_dots=True)
        # activation frequencies: measured on the first keys (as the pipeline's seed
        # sample) or adversarial values (0, ½, 1)
        p_meas = jax.vmap(activation_frequencies)(x[:, :n_sample], jnp.ones((Tq, n_sample), bool))
        p = jnp.where(p_mode, p_adv, p_meas)
        knorm = enc.key_norm_upper(payload)
        extra = {}
        if not isinstance(cfg.retained_heads, int):
            extra = _sample_args(x[:, :n_sample], knorm[:n_sample], s_ref[:, :n_sample])
        plan, _, budget = build_plan(q.astype(jnp.float32), w, p, cfg,
                                     fp8_aggregate=case.fp8_aggregate, **extra)
        u_num = screening_bound(plan, payload, knorm, scale)
        u_real = real_number_bound(plan, payload, scale)
        qn = jnp.sqrt(jnp.sum(q.astype(jnp.float32) ** 2, axis=-1))
        M = scale[None, :] * knorm[None, :] * jnp.sum(jnp.abs(w) * qn, axis=-1)[:, None]
        return s_ref, u_num, u_real, M, plan.prune, budget

    return jax.jit(run)


@jax.jit
def _count(s_ref, u_num, u_real, M, prune):
    """Counts on stored values, for the enclosed (``""``) and real-number (``real_``) bound."""
    out = dict(unpruned_plan_pairs=jnp.sum(~prune) * s_ref.shape[1])
    for tag, U in (("", u_num), ("real_", u_real)):
        counted = prune[:, None] & jnp.isfinite(U) & jnp.isfinite(s_ref)
        viol = counted & ~(s_ref <= U)
        # closeness: (U − s_ref)/M with M = α‖k̄‖Σ|w_h|‖q_h‖ (the scorer's magnitude)
        rel = jnp.where(counted & (M > 0), (U - s_ref) / jnp.where(M > 0, M, 1.0), jnp.inf)
        out.update({
            tag + "pairs": jnp.sum(counted),
            tag + "violations": jnp.sum(viol),
            tag + "violations_per_query": jnp.sum(viol, axis=1),
            tag + "nonfinite_bound_pairs": jnp.sum(prune[:, None] & ~jnp.isfinite(U)),
            tag + "tight_pairs": jnp.sum(counted & (rel <= 2.0 ** -20)),
            tag + "min_rel_margin": jnp.min(rel),
            tag + "max_rel_violation": jnp.max(jnp.where(
                viol, (s_ref - U) / jnp.maximum(jnp.abs(s_ref), 1e-30), 0.0)),
        })
    return out


def default_block(case: Case) -> tuple:
    """(Tq, B): queries and keys per compiled batch — 16 × 2^14 on CPU, 64 × 2^16 on an
    accelerator, fewer keys for large H·D so the gathered [Tq, B, D] block stays small."""
    big = jax.default_backend() != "cpu"
    Tq = 64 if big else 16
    B = (1 << 16 if big else 1 << 14) // max(1, (case.H * case.D) // 2048)
    return Tq, int(max(1024, B))


def check(n_instances: Optional[int] = None, seed: int = 0, pairs: int = 10_000_000,
          unenclosed: bool = False, cases: Sequence[Case] = CASES, verbose: bool = False) -> dict:
    """Check ``s_ref ≤ U_num`` on at least ``pairs`` (query, key) pairs spread over ``cases``.

    ``n_instances`` (optional) fixes the number of batches per case instead (a
    batch = Tq queries planned once, against B fresh keys). With ``unenclosed``
    the real-number bound is checked instead (and should show violations).
    Returns counts: instances (query plans), pairs (checked pairs), violations,
    the other bound's violations, unpruned / non-finite pairs (not counted as
    checked), tight pairs ((U − s_ref)/M ≤ 2^-20), and the same per case.
    """
    rng = np.random.default_rng(seed)
    per_case = -(-pairs // len(cases))
    tag, other = ("real_", "") if unenclosed else ("", "real_")
    fields = ("pairs", "violations", "nonfinite_bound_pairs", "tight_pairs")
    totals = dict.fromkeys(fields + ("unpruned_plan_pairs", "other_bound_violations"), 0)
    min_margin, max_viol = math.inf, 0.0
    by_case, by_family = {}, {}
    n_plans = 0
    t0 = time.perf_counter()
    for case in cases:
        Tq, B = default_block(case)
        cfg = case.make_config()
        n_pos = cfg.budgets(case.H)[0] if isinstance(cfg.retained_heads, int) else max(1, case.H // 4)
        fn = _compiled(case, Tq, B)
        n_batches = n_instances if n_instances is not None else -(-per_case // (Tq * B))
        acc = dict.fromkeys(totals, 0)
        for _ in range(n_batches):
            args, names = make_batch(rng, case, Tq, B, n_pos)
            s_ref, u_num, u_real, M, prune, _ = fn(*args)
            out = jax.device_get(_count(s_ref, u_num, u_real, M, prune))
            cm.add_by_family(by_family, names, out[tag + "violations_per_query"])
            for f in fields:
                acc[f] += int(out[tag + f])
            acc["unpruned_plan_pairs"] += int(out["unpruned_plan_pairs"])
            acc["other_bound_violations"] += int(out[other + "violations"])
            min_margin = min(min_margin, float(out[tag + "min_rel_margin"]))
            max_viol = max(max_viol, float(out[tag + "max_rel_violation"]))
        for k in totals:
            totals[k] += acc[k]
        n_plans += n_batches * Tq
        by_case[case.label] = dict(acc, batches=n_batches, block=[Tq, B])
        if verbose:
            print(f"[{time.perf_counter() - t0:7.1f}s] {case.label}: {acc}", flush=True)
    return cm.result(
        NAME + (" (unenclosed)" if unenclosed else ""),
        "real-number bound: no C, no eps, no upward rounding (expected to fail)" if unenclosed
        else CLAIM,
        instances=n_plans, pairs=int(totals["pairs"]), violations=int(totals["violations"]),
        other_bound_violations=int(totals["other_bound_violations"]),
        unpruned_plan_pairs=int(totals["unpruned_plan_pairs"]),
        nonfinite_bound_pairs=int(totals["nonfinite_bound_pairs"]),
        tight_pairs=int(totals["tight_pairs"]), min_rel_margin=min_margin,
        max_violation=max_viol, violations_by_query_family=by_family,
        backend=jax.default_backend(), by_case=by_case)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10_000_000, help="(query, key) pairs to check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unenclosed", action="store_true",
                    help="check the real-number bound instead (expected to show violations)")
    ap.add_argument("--cases", choices=sorted(CASE_SETS), default="all",
                    help="which cases: all, cpu (the test suite's), tight, cpu-tight")
    args = ap.parse_args(argv)
    cases = CASE_SETS[args.cases]
    r = cm.timed(check, seed=args.seed, pairs=args.pairs, unenclosed=args.unenclosed,
                 cases=cases, verbose=True)
    print(cm.format_result(r))
    print(f"violations: {r['violations']} of {r['pairs']} pairs")
    if args.unenclosed:
        return 0 if r["violations"] > 0 else 1
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
