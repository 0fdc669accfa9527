"""Could key-block summaries reject whole blocks of keys? (SPEC §16, a CPU study.)

For the last ``--queries`` queries of a trained indexer's dump, with the reference planner's
plans (default config, ``--seeds`` seeds), this compares, per block of ``BK`` consecutive
keys:

* **ideal**: the block holds no key whose certificate U (Eq. 9, real numbers, float64)
  reaches τ — what a perfect block bound could reject;
* **summaries**: a block bound from a per-block summary of the key payloads — the box
  (per-dimension min/max), the ball (centroid and radius), both, and a rank-m PCA box with a
  residual ball — evaluated with interval arithmetic on each plan row's dot product:
  ``Σ w̃ relu(max y) (w̃ ≥ 0) + Σ w̃ relu(min y) (w̃ < 0) − relu(min z) + max n · coef + ε``,
  times the block's largest (or, for a negative value, smallest) key scale.

Both are counted per query and per program of 8 queries (a screening program can skip a block
only when all its queries reject it). ``--budgets r,...`` also prints, for plans with a fixed
retained-head budget r, the key survival and the fraction of (8-query program, block) pairs
with no survivor: what a cheaper pre-screen with fewer rows could let the full screen skip. The summaries' bounds use real numbers, not an upward
enclosure: they overstate what a sound kernel could reject, never understate it.

    python -m benchmarks.block_bounds_study --length 131072 --queries 64 [--npz dump.npz]
"""

from __future__ import annotations

import argparse

import numpy as np


def load(a):
    """(q, k payloads, w, scales, lo, hi) as float arrays, the last ``a.queries`` queries."""
    if a.npz:
        d = np.load(a.npz)
        q, k, w, sc, lo, hi = (d[x] for x in ("q", "k", "w", "sc", "lo", "hi"))
    else:
        from dosa_jax import datasets
        inp = datasets.trained("code", a.layer, length=a.length, num_queries=a.queries)
        q, k, w, sc, lo, hi = (np.asarray(x) for x in (inp.q, inp.k, inp.w, inp.k_scale,
                                                       inp.lo, inp.hi))
    f = lambda x: np.asarray(x, np.float32)
    n = a.queries
    return f(q[-n:]), f(k), f(w[-n:]), f(sc), np.asarray(lo[-n:]), np.asarray(hi[-n:])


def plans(q, k, w, sc, lo, hi, seeds: int, tile: int = 32, budget="auto"):
    """The reference planner's plan fields (float64) and τ per query."""
    import jax.numpy as jnp
    from dosa_jax.config import Config
    from dosa_jax.pipeline import plan_tile, prepare_keys
    cfg = Config(top_k=2048, seed_size=seeds, retained_heads=budget)
    keys = prepare_keys(jnp.asarray(k), jnp.asarray(sc), cfg.key_block)
    tps = [plan_tile(*(jnp.asarray(x[i:i + tile]) for x in (q, w, lo, hi)), keys, cfg)
           for i in range(0, q.shape[0], tile)]
    cat = lambda f: np.concatenate([np.asarray(f(t)) for t in tps]).astype(np.float64)
    return dict(rows=cat(lambda t: t.plan.rows), w=cat(lambda t: t.plan.row_weights),
                A=cat(lambda t: t.plan.aggregate).sum(1),
                lin=cat(lambda t: t.plan.aggregate_linear) > 0,
                coef=cat(lambda t: t.plan.residual + t.plan.error),
                eps=cat(lambda t: t.plan.eps_raw), tau=cat(lambda t: t.tau))


def certificate(p, kb, kn, al):
    """U (Eq. 9, real numbers) for every (query, key) [T, N]."""
    y = np.einsum("trd,nd->tnr", p["rows"], kb)
    z = np.einsum("td,nd->tn", p["A"], kb)
    return ((np.maximum(y, 0) * p["w"][:, None, :]).sum(-1)
            - np.where(p["lin"][:, None], z, np.maximum(z, 0))
            + kn[None] * p["coef"][:, None] + p["eps"][:, None]) * al[None]


def block_bound(p, ylo, yhi, zlo, nmax, amax, amin):
    """U over a block from intervals of the row dots [T, nb, R] and of z [T, nb]."""
    rw = p["w"][:, None, :]
    pos = np.where(rw >= 0, rw * np.maximum(yhi, 0), rw * np.maximum(ylo, 0)).sum(-1)
    neg = np.where(p["lin"][:, None], zlo, np.maximum(zlo, 0))
    v = pos - neg + nmax[None] * p["coef"][:, None] + p["eps"][:, None]
    return np.where(v >= 0, v * amax[None], v * amin[None])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=8192)
    ap.add_argument("--npz", default="", help="cached q, k (payloads), w, sc, lo, hi")
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--budgets", default="", help="fixed budgets r for the pre-screen table")
    a = ap.parse_args(argv)
    q, k, w, sc, lo, hi = load(a)
    p = plans(q, k, w, sc, lo, hi, a.seeds)
    kb, al = k.astype(np.float64), sc.astype(np.float64)
    T, N = q.shape[0], kb.shape[0]
    kn = np.linalg.norm(kb, axis=1)
    U = certificate(p, kb, kn, al)
    ids = np.arange(N)
    vis = (ids[None] >= lo[:, None]) & (ids[None] < hi[:, None])
    surv = (U >= p["tau"][:, None]) & vis
    print(f"T={T} queries, N={N} keys, {a.seeds} seeds: key survival (real-number U) "
          f"{surv.sum() / vis.sum():.4f}\n")
    print("| block | summary | rejected per query | ideal | rejected per 8-query program | ideal |")
    print("|---|---|---|---|---|---|")
    for BK in map(int, a.blocks.split(",")):
        nb = N // BK
        kk = kb[:nb * BK].reshape(nb, BK, -1)
        per = lambda x: x[:nb * BK].reshape(nb, BK)
        nmax, amax, amin = per(kn).max(1), per(al).max(1), per(al).min(1)
        bvis = vis[:, :nb * BK].reshape(T, nb, BK).any(2)
        ideal = ~surv[:, :nb * BK].reshape(T, nb, BK).any(2)
        c = kk.mean(1)
        X = kk - c[:, None]
        blo, bhi = kk.min(1), kk.max(1)
        rho = np.linalg.norm(X, axis=2).max(1)

        def box(v):
            pv, nv = np.maximum(v, 0), np.minimum(v, 0)
            return (np.einsum("trd,bd->tbr", pv, blo) + np.einsum("trd,bd->tbr", nv, bhi),
                    np.einsum("trd,bd->tbr", pv, bhi) + np.einsum("trd,bd->tbr", nv, blo))

        def ball(v, centre=c, radius=rho):
            m = np.einsum("trd,bd->tbr", v, centre)
            r = np.linalg.norm(v, axis=-1)[:, None, :] * radius[None, :, None]
            return m - r, m + r

        def both(v):
            (l1, h1), (l2, h2) = box(v), ball(v)
            return np.maximum(l1, l2), np.minimum(h1, h2)

        summaries = [("box", box), ("ball", ball), ("box ∩ ball", both)]
        if BK == 64:
            _, _, Vt = np.linalg.svd(X, full_matrices=False)
            for m in map(int, a.ranks.split(",")):
                V = Vt[:, :m]
                u = np.einsum("bkd,bmd->bkm", X, V)
                ulo, uhi = u.min(1), u.max(1)
                res = np.linalg.norm(X - np.einsum("bkm,bmd->bkd", u, V), axis=2).max(1)

                def pca(v, V=V, ulo=ulo, uhi=uhi, res=res):
                    g = np.einsum("trd,bmd->tbrm", v, V)
                    lo_c, hi_c = ball(v, c, res)
                    return (lo_c + (np.maximum(g, 0) * ulo[None, :, None]
                                    + np.minimum(g, 0) * uhi[None, :, None]).sum(-1),
                            hi_c + (np.maximum(g, 0) * uhi[None, :, None]
                                    + np.minimum(g, 0) * ulo[None, :, None]).sum(-1))
                summaries.append((f"PCA rank {m} (residual radius median {np.median(res):.0f}, "
                                  f"key norm median {np.median(kn):.0f})", pca))
        for name, fn in summaries:
            ylo, yhi = fn(p["rows"])
            zlo = fn(p["A"][:, None])[0][..., 0]
            rej = (block_bound(p, ylo, yhi, zlo, nmax, amax, amin) < p["tau"][:, None]) | ~bvis
            r8 = rej.reshape(T // 8, 8, nb).all(1)
            i8 = ideal.reshape(T // 8, 8, nb).all(1)
            print(f"| {BK} | {name} | {rej.mean():.3f} | {ideal.mean():.3f} | {r8.mean():.3f} | "
                  f"{i8.mean():.3f} |", flush=True)

    if a.budgets:
        print("\n| fixed budget r | key survival | 8-query x 64-key blocks with no survivor |")
        print("|---|---|---|")
        nb = N // 64
        for r in map(int, a.budgets.split(",")):
            s_r = (certificate(plans(q, k, w, sc, lo, hi, a.seeds, budget=r), kb, kn, al)
                   >= p["tau"][:, None]) & vis
            none8 = ~s_r[:, :nb * 64].reshape(T // 8, 8, nb, 64).any(axis=(1, 3))
            print(f"| {r} | {s_r.sum() / vis.sum():.4f} | {none8.mean():.3f} |", flush=True)


if __name__ == "__main__":
    main()
