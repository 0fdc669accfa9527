"""Theorem 1: DoSA returns exactly the dense Top-K (DESIGN §10, §12).

For every Config variant (retained budget fixed/automatic, residual
triangle/joint/grouped/best, negative support majority/all/none, ranking,
projection on/off, absolute form, seed strategies, threshold raising off,
capacities far below the survivor count so that candidates overflow into
further rounds) and several input kinds (float32, bf16, FP8 keys with
per-key scales), over batches of problems from random and adversarial
families (Gaussian, structured, small integers with massive ties, all
scores equal, zero keys, zero heads, all-positive/all-negative/all-zero
weights, head vectors of magnitude 2^-64 and 2^40) with per-query ranges that are full, causal, arbitrary, empty,
smaller than K, exactly K:

* ``topk(...).indices == dense_topk(...).indices`` and the scores, bitwise;
* every query returns min(K, |Ω|) keys, each visible and distinct;
* against a float64 NumPy reference: the returned scores are within the
  scorer's rounding bound err_i of the exact score, and no unselected visible
  key is certainly better than a selected one (s64_j − err_j > s64_i + err_i);
  on the ``integer`` family (exact arithmetic) the indices equal the reference
  order (score desc, index asc) exactly, ties included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

import dosa_jax
from dosa_jax import synthetic
from proofs_numeric import _common as cm

NAME = "exact_selection"
CLAIM = "Theorem 1: DoSA indices == dense indices bitwise; float64 reference agrees off the near-tie band"
PROBLEM_FAMILIES = ("gaussian", "structured", "integer", "all_equal", "zero_keys", "zero_heads",
                    "all_positive", "all_negative", "all_zero", "fp8_extremes", "tiny_heads",
                    "huge_heads")
U32 = 2.0 ** -24


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled configuration: shape, input kind and Config fields."""

    name: str
    H: int = 8
    D: int = 32
    N: int = 512
    T: int = 8
    kind: str = "f32"  # f32 | bf16 | fp8
    config: tuple = ()  # Config(**dict(config)) with top_k and key_block

    def make_config(self) -> dosa_jax.Config:
        kw = dict(top_k=16, key_block=64, query_tile=self.T)
        kw.update(dict(self.config))
        return dosa_jax.Config(**kw)


VARIANTS = (
    Variant("r1_triangle_cap1block", config=(("retained_heads", 1), ("positive_residual", "triangle"),
                                             ("capacity", 64))),
    Variant("auto_best_fp8", kind="fp8", config=(("retained_heads", "auto"), ("top_k", 32))),
    Variant("joint_allsupport_k1", config=(("retained_heads", 2), ("positive_residual", "joint"),
                                           ("negative_support", "all"), ("top_k", 1))),
    Variant("grouped_nosupport_strength_bf16", kind="bf16",
            config=(("retained_heads", 4), ("positive_residual", "grouped"), ("residual_groups", 8),
                    ("negative_support", "none"), ("negative_ranking", "strength"),
                    ("capacity", 64))),
    Variant("noproj_absolute_local_noraise", config=(
        ("retained_heads", 4), ("positive_projection", False), ("certificate_form", "absolute"),
        ("seed_strategy", "local"), ("raise_threshold", False), ("capacity", 128))),
    Variant("rHm1_sinks_minseeds_k64", config=(("retained_heads", 7), ("seed_strategy", "sinks"),
                                               ("seed_size", 64), ("top_k", 64), ("capacity", 64))),
    Variant("strided_H32_D128", H=32, D=128, N=1024, config=(
        ("retained_heads", 8), ("seed_strategy", "strided"), ("top_k", 24), ("capacity", 64))),
    Variant("auto_H64_D128_fp8", H=64, D=128, N=1024, kind="fp8", config=(
        ("retained_heads", "auto"), ("top_k", 48), ("capacity", 128))),
)
#: A subset covering every input kind, the overflow path and H ∈ {8, 64} (CPU tests).
VARIANTS_SMALL = ("r1_triangle_cap1block", "auto_best_fp8", "grouped_nosupport_strength_bf16",
                  "noproj_absolute_local_noraise", "auto_H64_D128_fp8")


# ----------------------------------------------------------------------------- problems

def _ranges(rng, T: int, N: int, K: int):
    """Per-query ranges: full, causal, arbitrary, empty, |Ω| < K, |Ω| = K, |Ω| = K + 1."""
    lo, hi = np.zeros(T, np.int64), np.full(T, N, np.int64)
    for t in range(T):
        kind = rng.integers(7)
        if kind == 1:
            hi[t] = N - T + t + 1
        elif kind == 2:
            a, b = sorted(rng.integers(0, N + 1, 2))
            lo[t], hi[t] = a, b
        elif kind == 3:
            lo[t] = hi[t] = rng.integers(0, N + 1)
        elif kind in (4, 5, 6):
            n = {4: rng.integers(1, max(K, 2)), 5: K, 6: K + 1}[kind]
            n = min(n, N)
            lo[t] = rng.integers(0, N - n + 1)
            hi[t] = lo[t] + n
    return lo.astype(np.int32), hi.astype(np.int32)


def make_problem(rng, v: Variant, family: str, K: int):
    """One problem (numpy): q [T, H, D] f32 values, k [N, D] values, scale [N] or None, w, lo, hi."""
    T, N, H, D = v.T, v.N, v.H, v.D
    g = rng.standard_normal
    q = g((T, H, D)) / np.sqrt(D)
    k = g((N, D))
    w = rng.uniform(0.1, 1.0, (T, H)) * rng.choice([-1.0, 1.0], (T, H))
    if family == "structured":
        inp = synthetic.structured(T=T, N=N, H=H, D=D, seed=int(rng.integers(1 << 30)), causal=False)
        q, k, w = np.asarray(inp.q, np.float64), np.asarray(inp.k, np.float64), np.asarray(inp.w)
    elif family == "integer":
        q = rng.integers(-2, 3, (T, H, D)).astype(np.float64)
        k = rng.integers(-1, 2, (N, D)).astype(np.float64)
        w = rng.integers(-3, 4, (T, H)).astype(np.float64)
    elif family == "all_equal":
        k = np.repeat(g((1, D)), N, axis=0)
    elif family == "zero_keys":
        k[rng.uniform(size=N) < 0.5] = 0.0
    elif family == "zero_heads":
        q[rng.uniform(size=(T, H)) < 0.5] = 0.0
    elif family == "all_positive":
        w = np.abs(w)
    elif family == "all_negative":
        w = -np.abs(w)
    elif family == "all_zero":
        w = np.zeros_like(w)
    elif family == "tiny_heads":  # float32 squares of the head entries underflow
        q = q * 2.0 ** -64
    elif family == "huge_heads":
        q = q * 2.0 ** 40
    elif family == "fp8_extremes":
        k = rng.choice([448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 1.0, 0.0], (N, D))
    lo, hi = _ranges(rng, T, N, K)
    scale = None
    if v.kind == "fp8":
        scale = np.exp2(rng.integers(-20, 21, N)).astype(np.float32)
        if family not in ("fp8_extremes", "integer"):
            payload, sc = synthetic.quantize_keys_fp8(k)
            k, scale = np.asarray(payload.astype(jnp.float32), np.float64), np.asarray(sc) * scale
        k = np.asarray(jnp.asarray(k, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    q = np.asarray(jnp.asarray(q, jnp.float32).astype(_q_dtype(v.kind)).astype(jnp.float32))
    if v.kind == "bf16":
        k = np.asarray(jnp.asarray(k, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    return dict(q=q.astype(np.float32), k=np.asarray(k, np.float32), w=w.astype(np.float32),
                scale=scale, lo=lo, hi=hi, family=family)


def _q_dtype(kind):
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}[kind]


def _k_dtype(kind):
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[kind]


@functools.lru_cache(maxsize=None)
def _compiled(v: Variant):
    cfg = v.make_config()
    dense_cfg = dosa_jax.Config(top_k=cfg.top_k, key_block=cfg.key_block, query_tile=cfg.query_tile)

    def both(q, k, w, scale, lo, hi):
        sc = scale if v.kind == "fp8" else None
        a = dosa_jax.topk(q, k, w, k_scale=sc, lo=lo, hi=hi, config=cfg)
        b = dosa_jax.dense_topk(q, k, w, k_scale=sc, lo=lo, hi=hi, config=dense_cfg)
        return a.indices, a.scores, b.indices, b.scores, a.stats

    return jax.jit(jax.vmap(both))


# ----------------------------------------------------------------------------- reference

def reference_scores(q, k, w, scale):
    """float64 scores [T, N] and the scorer's rounding bound err [T, N] (float32 dots of
    D products and a left-to-right head sum: (D + H + 4)·u relative to Σ|w||q||k̄|)."""
    T, H, D = q.shape
    q64, k64, w64 = q.astype(np.float64), k.astype(np.float64), w.astype(np.float64)
    x = np.einsum("thd,nd->tnh", q64, k64)
    s = np.einsum("th,tnh->tn", w64, np.maximum(x, 0.0))
    mag = np.einsum("th,tnh->tn", np.abs(w64), np.einsum("thd,nd->tnh", np.abs(q64), np.abs(k64)))
    err = (D + H + 4) * U32 * mag + (np.sum(np.abs(w64), axis=1)[:, None] * D + H) * 2.0 ** -126
    if scale is not None:
        a = scale.astype(np.float64)[None, :]
        s, err = s * a, err * a + np.abs(s * a) * U32 + 2.0 ** -126
    return s, err


def check_problem(prob, K, idx, sc, didx, dsc) -> Dict[str, int]:
    """Per-query checks of one problem against the dense path and the float64 reference."""
    out = dict(bitwise=0, count=0, reference_scores=0, reference_order=0, exact_order=0,
               band_keys=0)
    out["bitwise"] = int(np.sum(np.any(idx != didx, axis=1) | np.any(
        (sc != dsc) & ~(np.isnan(sc) & np.isnan(dsc)), axis=1)))
    s64, err = reference_scores(prob["q"], prob["k"], prob["w"], prob["scale"])
    N = s64.shape[1]
    for t in range(idx.shape[0]):
        lo, hi = int(prob["lo"][t]), int(prob["hi"][t])
        n_vis = max(hi - lo, 0)
        sel = idx[t][idx[t] >= 0]
        ok = (len(sel) == min(K, n_vis) and len(set(sel.tolist())) == len(sel)
              and np.all((sel >= lo) & (sel < hi)) and np.all(idx[t][len(sel):] == -1))
        out["count"] += int(not ok)
        if not ok or n_vis == 0:
            continue
        s_t, e_t = s64[t], err[t]
        out["reference_scores"] += int(np.sum(~(np.abs(sc[t][: len(sel)] - s_t[sel]) <= e_t[sel])))
        vis = np.zeros(N, bool)
        vis[lo:hi] = True
        rest = vis.copy()
        rest[sel] = False
        if rest.any():
            worst_sel = np.min(s_t[sel] + e_t[sel])
            best_rest = np.max(s_t[rest] - e_t[rest])
            out["reference_order"] += int(best_rest > worst_sel)
            kth = s_t[sel[-1]]
            out["band_keys"] += int(np.sum(vis & (np.abs(s_t - kth) <= e_t + e_t[sel[-1]])))
        if prob["family"] == "integer":
            ids = np.arange(lo, hi)
            order = ids[np.lexsort((ids, -s_t[lo:hi]))][: len(sel)]
            out["exact_order"] += int(not np.array_equal(order, sel))
    return out


def check(n_instances: int = 40, seed: int = 0, variants=None) -> dict:
    """``n_instances`` problems (of T queries each) per variant. Counts: instances
    (problems), queries, keys (visible query–key pairs ranked), violations per claim,
    and coverage of the pipeline's paths (overflow rounds, survivors, pruning)."""
    names = variants if variants is not None else tuple(v.name for v in VARIANTS)
    chosen = [v for v in VARIANTS if v.name in names]
    if len(chosen) != len(names):
        raise ValueError(f"unknown variants: {set(names) - {v.name for v in VARIANTS}}")
    rng = np.random.default_rng(seed)
    totals: Dict[str, int] = {}
    cover = dict(overflow_rounds=0, survivors=0, screened=0, pruning_queries=0, recoveries=0)
    by_family: Dict[str, int] = {}
    n_problems = n_queries = n_keys = 0
    for v in chosen:
        cfg = v.make_config()
        K = cfg.top_k
        probs = [make_problem(rng, v, PROBLEM_FAMILIES[i % len(PROBLEM_FAMILIES)], K)
                 for i in range(n_instances)]
        stack = lambda key, dt: jnp.asarray(np.stack([p[key] for p in probs])).astype(dt)
        scale = np.stack([p["scale"] if p["scale"] is not None else np.ones(v.N, np.float32)
                          for p in probs])
        idx, sc, didx, dsc, st = jax.device_get(_compiled(v)(
            stack("q", _q_dtype(v.kind)), stack("k", _k_dtype(v.kind)), stack("w", jnp.float32),
            jnp.asarray(scale, jnp.float32), stack("lo", jnp.int32), stack("hi", jnp.int32)))
        for i, prob in enumerate(probs):
            r = check_problem(prob, K, idx[i], sc[i], didx[i], dsc[i])
            viol = sum(val for key, val in r.items() if key != "band_keys")
            cm.add_by_family(by_family, [f"{v.name}/{prob['family']}"], [viol])
            for key, val in r.items():
                totals[key] = totals.get(key, 0) + val
            n_keys += int(np.sum(np.maximum(prob["hi"] - prob["lo"], 0)))
        cover["overflow_rounds"] += int(st.overflows.sum())
        cover["survivors"] += int(st.survivors.sum())
        cover["screened"] += int(st.screened.sum())
        cover["pruning_queries"] += int(st.pruning.sum())
        cover["recoveries"] += int(st.recoveries.sum())
        n_problems += n_instances
        n_queries += n_instances * v.T
    band = totals.pop("band_keys", 0)
    return cm.result(NAME, CLAIM, instances=n_problems, variants=[v.name for v in chosen],
                     queries=n_queries, keys=n_keys, violations=int(sum(totals.values())),
                     violations_by_claim=totals, violations_by_family=by_family,
                     keys_in_near_tie_band=band, coverage=cover)


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--variants", nargs="*", default=None,
                        help=f"subset of: {' '.join(v.name for v in VARIANTS)}")
    return cm.cli(check, __doc__.splitlines()[0], argv, extra)


if __name__ == "__main__":
    raise SystemExit(main())
