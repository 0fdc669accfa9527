"""Where the Pallas kernels spend their time on the GPU: ablations timed side by side.

    python -m benchmarks.profile_kernels --T 4096 --N 1048576 [--data trained:code:2] \
        [--tiles kc:4:64:4:3,...] [--dosa kc:64:4:3:kc:4:4,...] [--stages] [--runs a,b] [--ncu]
        [--kernels 30]

Times (median of ``--iters`` after 2 warm-up calls, wall time around
``block_until_ready``) at the shape:

* ``dense`` / ``dosa``: ``dense_topk`` and ``dosa_topk`` with the default tiles;
* ``no_records[@layout:BQ:BK:warps:stages]``: the dense scan with θ₀ above every
  score (scores, order keys and the accept test run; nothing is appended, no
  compaction), with the default or the given tiles;
* ``dosa@spec`` / ``dense@spec`` (``--dosa``, :func:`benchmarks.run.parse_tiles`
  specs), each pair first checked bitwise (``check@spec``), and with ``--stages``
  DoSA cut after its seeds, screen and refine, cut after a screen that writes
  no survivor (τ = +inf: ``dosa_until_screen_nowrite``), and cut after a refinement
  that appends no record (θ₀ above every score: the gathers, scores and accept tests
  run, no append, no compaction: ``dosa_until_refine_norecords``).

With ``--kernels N`` each timed run is traced three more times and its N costliest kernels
(device ms per call, launches, XLA's op name), its busy and idle device time are printed
(:func:`benchmarks.devtime.device_breakdown`).

With ``--ncu`` the script runs each jitted function once (for Nsight Compute;
it then times nothing). Output: a JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn, *args, iters=7):
    """(median ms, wall median ms, clock) of ``iters`` timed calls after 2 warm-up calls
    (:func:`benchmarks.run.timeit`: device time on a GPU)."""
    from benchmarks.run import LAST_TIMING, timeit
    ms = timeit(fn, *args, iters=iters)[0] * 1e3
    return ms, LAST_TIMING["wall_median"] * 1e3, LAST_TIMING["clock"]


def _with_pipeline_stage(name, wrap, fn):
    """Trace ``fn`` with ``pallas_kernels.pipeline.<name>`` replaced by ``wrap(original)``."""
    from pallas_kernels import pipeline
    orig = getattr(pipeline, name)
    setattr(pipeline, name, wrap(orig))
    try:
        return fn()
    finally:
        setattr(pipeline, name, orig)


def _without_survivors(fn):
    """Trace ``fn`` with the pipeline's screen given τ = +inf (every key rejected: the
    kernel computes every bound and survival test and writes zero masks; the compaction
    finds no survivor)."""
    return _with_pipeline_stage("screen_masks", lambda orig: lambda sops, *a, **kw: orig(
        sops._replace(tau=jnp.full_like(sops.tau, jnp.inf)), *a, **kw), fn)


def _without_records(fn):
    """Trace ``fn`` with the pipeline's refinement given θ₀ above every order key (nothing is
    appended, no buffer ever compacts)."""
    return _with_pipeline_stage("refine", lambda orig: lambda ops, lists, count, theta0, *a, **kw:
                                orig(ops, lists, count, jnp.full_like(theta0, 2 ** 31 - 1), *a,
                                     **kw), fn)


def main(argv=None):
    from benchmarks.run import make_inputs
    from benchmarks.shapes import Shape
    from dosa_jax.config import Config
    from pallas_kernels import dense as dm

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--N", type=int, default=1 << 20)
    ap.add_argument("--data", default="trained:code:2")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--tiles", default="kh:4:128:4:3,kc:4:128:4:3,kc:8:128:4:3,kc:4:64:4:3",
                    help="no-records scans: layout:BQ:BK:warps:stages")
    ap.add_argument("--dosa", default="",
                    help="DoSA and dense with these tiles (benchmarks.run.parse_tiles specs), "
                         "checked bitwise against each other")
    ap.add_argument("--dense-tiles", default="",
                    help="dense_topk (plain and seeded, 8192 seeds) with these tiles "
                         "(layout:BQ:BK:warps:stages[:CH]), each checked bitwise against the "
                         "default tiles' dense_topk")
    ap.add_argument("--runs", default="", help="comma-separated run names to keep (default all)")
    ap.add_argument("--stages", action="store_true", help="time DoSA cut after each stage")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--kernels", type=int, default=0,
                    help="after timing each run, print its top N kernels by device time per call "
                         "and its idle time (benchmarks.devtime.device_breakdown)")
    a = ap.parse_args(argv)
    shape = Shape("prof", a.T, a.N)
    inp = make_inputs(shape, a.data)
    q, k, w, sc, lo, hi = inp.q, inp.k, inp.w, inp.k_scale, inp.lo, inp.hi
    visible = float(jnp.sum((hi - lo).astype(jnp.float32)))
    flops = 2.0 * shape.H * shape.D * visible
    cfg = Config(top_k=shape.K, backend="pallas")

    def report(name, timing):
        ms, wall, clock = timing
        print(json.dumps(dict(name=name, ms=ms, wall_ms=wall, clock=clock,
                              tflops=flops / ms / 1e9, T=a.T, N=a.N)), flush=True)

    def scan(tiles, theta):
        def f(q, k, w, sc, lo, hi):
            ops = dm.prepare_operands(q, w, k, sc, tiles.BQ, jnp.bfloat16, tiles.layout,
                                      tiles.widen_fp8, tiles.lane_sums)
            S = dm.default_splits(q.shape[0], k.shape[0], tiles.BQ, tiles.BK)
            th = jnp.full((q.shape[0],), theta, jnp.int32)
            c = dm.dense_candidates(ops, lo, hi, th, shape.K, splits=S, tiles=tiles)
            return c.count, c.theta
        return jax.jit(f)

    args = (q, k, w, sc, lo, hi)
    from pallas_kernels import pipeline
    dcfg = Config(top_k=shape.K, backend="pallas", seed_size=16384)
    runs = [("dense", jax.jit(lambda *x: dm.dense_topk(*x, cfg))),
            ("dosa", jax.jit(lambda *x: pipeline.dosa_topk(*x, dcfg)[:2])),
            ("no_records", scan(dm.Tiles(), 2 ** 31 - 1))]
    for spec in filter(None, a.tiles.split(",")):
        lay, rest = spec.split(":", 1)
        bq, bk, wp, st = map(int, rest.split(":"))
        t = dm.Tiles(BQ=bq, BK=bk, num_warps=wp, num_stages=st, layout=lay)
        runs.append((f"no_records@{spec}", scan(t, 2 ** 31 - 1)))
    from benchmarks.run import parse_tiles
    for spec in filter(None, a.dosa.split(",")):
        t, opts = parse_tiles(spec)
        c = opts.config(shape.K)
        fd = jax.jit(lambda *x, t=t, c=c: pipeline.dosa_topk(*x, c, tiles=t))   # (idx, sc, stats)
        fe = jax.jit(lambda *x, t=t, c=c: pipeline.dense_topk(*x, c, tiles=t, seeded=False))
        fs = jax.jit(lambda *x, t=t, c=c: pipeline.dense_topk(*x, c, tiles=t, seeded=True))
        try:
            (di, ds, st), (ei, es), (si, ss) = fd(*args), fe(*args), fs(*args)
            vis = jnp.maximum(st.visible, 1).astype(jnp.float32)
            rs, nr = np.unique(np.asarray(st.budget), return_counts=True)
            print(json.dumps(dict(name=f"check@{spec}", indices_equal=bool(jnp.all(di == ei)),
                                  scores_equal=bool(jnp.all(ds == es)),
                                  seeded_dense_equal=bool(jnp.all(si == ei) & jnp.all(ss == es)),
                                  survival=float(jnp.mean(st.survivors / vis)),
                                  recoveries=int(jnp.sum(st.recoveries)),
                                  overflows=int(jnp.sum(st.overflows)),
                                  budgets={int(r_): int(n_) for r_, n_ in zip(rs, nr)})),
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(name=f"check@{spec}", error=repr(e)[:400])), flush=True)
        runs += [(f"dosa@{spec}", fd), (f"dense@{spec}", fe), (f"dense_seeded@{spec}", fs)]
        for stage in (("seeds", "screen", "refine") if a.stages else ()):
            runs.append((f"dosa_until_{stage}@{spec}", jax.jit(
                lambda *x, t=t, c=c, s_=stage: pipeline.dosa_topk(*x, c, tiles=t, stop_after=s_))))
        if a.stages:   # the screen with τ = +inf: the same bound work, no survivor ever written
            runs.append((f"dosa_until_screen_nowrite@{spec}", jax.jit(
                lambda *x, t=t, c=c: _without_survivors(
                    lambda: pipeline.dosa_topk(*x, c, tiles=t, stop_after="screen")))))
            runs.append((f"dosa_until_refine_norecords@{spec}", jax.jit(
                lambda *x, t=t, c=c: _without_records(
                    lambda: pipeline.dosa_topk(*x, c, tiles=t, stop_after="refine")))))
    ref = None
    for spec in filter(None, a.dense_tiles.split(",")):
        f = spec.split(":")
        t = dm.Tiles(BQ=int(f[1]), BK=int(f[2]), num_warps=int(f[3]), num_stages=int(f[4]),
                     layout=f[0], refine_bk=0, **({"CH": int(f[5])} if len(f) > 5 else {}))
        c8 = Config(top_k=shape.K, backend="pallas", seed_size=8192)
        fe = jax.jit(lambda *x, t=t: pipeline.dense_topk(*x, c8, tiles=t, seeded=False))
        fs = jax.jit(lambda *x, t=t: pipeline.dense_topk(*x, c8, tiles=t, seeded=True))
        try:
            if ref is None:
                ref = jax.jit(lambda *x: pipeline.dense_topk(*x, c8))(*args)
            (ei, es), (si, ss) = fe(*args), fs(*args)
            print(json.dumps(dict(
                name=f"check_dense@{spec}",
                equal=bool(jnp.all(ei == ref[0]) & jnp.all(es == ref[1])),
                seeded_equal=bool(jnp.all(si == ref[0]) & jnp.all(ss == ref[1])))), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(name=f"check_dense@{spec}", error=repr(e)[:400])), flush=True)
        runs += [(f"dense_tiles@{spec}", fe), (f"dense_tiles_seeded@{spec}", fs)]
    keep = set(filter(None, a.runs.split(",")))
    for name, f in runs:
        if keep and name not in keep:
            continue
        try:
            if a.ncu:
                jax.block_until_ready(f(*args))
                print(json.dumps(dict(name=name, ncu=True)), flush=True)
            else:
                report(name, _time(f, *args, iters=a.iters))
                if a.kernels:
                    from benchmarks.devtime import device_breakdown
                    print(json.dumps(dict(name=f"kernels@{name}", **(device_breakdown(
                        f, *args, warmup=0, iters=3, top=a.kernels) or {}))), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(name=name, error=repr(e)[:400])), flush=True)


if __name__ == "__main__":
    main()
