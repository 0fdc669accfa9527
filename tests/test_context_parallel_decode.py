"""Context-parallel decode (DESIGN §17): each sequence's keys sharded along a mesh axis.

The CPU needs ``--xla_force_host_platform_device_count=8`` before jax starts, so the sharded
steps run in one child process (this file run as a script), which checks every case against
the unsharded ``decode_topk`` and prints one JSON line per case; the tests assert on those.

Every case runs consecutive steps along a sequence of queries (witnesses carried in the
state) over ragged lengths: a full sequence, one ending inside a shard, one shorter than K
(|Ω| < K) and an empty one.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("context_parallel_decode")

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = {
    "mesh1": "1-device mesh: bitwise the unsharded decode_topk, every step",
    "mesh2": "2 devices",
    "mesh4_multi": "4 devices, M = 2 queries per sequence",
    "mesh8": "8 devices",
    "shared_tau": "with the same witnesses, τ_w and the candidate count equal the unsharded "
                  "step's",
    "overflow": "capacity K and useless witnesses: overflows counted, answers still bitwise",
    "fp8_mesh4": "FP8 keys with scales, 4 devices",
    "paged_user_shard_map": "paged keys in a user's shard_map (each device its pool and table)",
    "state_replicated": "the next state is the same on every device",
    "gradients": "gradients of the selected scores wrt q and w equal the unsharded call's",
    "pallas_mesh2": "backend='pallas' (kernels in interpret mode), 2 devices",
    "outside_shard_map_raises": "Config(context_axis) outside a shard_map raises ValueError",
}

B, N, H, D, K, STEPS = 4, 256, 4, 16, 16, 5


def _report(name, ok, detail=""):
    print(json.dumps({"case": name, "ok": bool(ok), "detail": str(detail)[:2000]}), flush=True)


def _child():
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import dosa_jax
    from dosa_jax import context_parallel

    rng = np.random.default_rng(7)
    lengths = jnp.array([N, 150, K - 5, 0], jnp.int32)     # full, inside a shard, < K, empty
    # keys with a slowly drifting direction, so consecutive queries share winners
    base = rng.standard_normal((B, N, D)).astype(np.float32)
    k32 = jnp.asarray(base)

    def queries(M=None, seed=0):
        r = np.random.default_rng(seed)
        drift = r.standard_normal((B, H, D)).astype(np.float32)
        out = []
        for t in range(STEPS):
            shape = (B, H, D) if M is None else (B, M, H, D)
            noise = r.standard_normal(shape).astype(np.float32)
            d = drift if M is None else drift[:, None]
            q = jnp.asarray(d + 0.3 * noise)
            w = jnp.asarray(r.uniform(-0.5, 1.0, shape[:-1]).astype(np.float32))
            out.append((q, w))
        return out

    def mesh(n):
        return Mesh(np.array(jax.devices()[:n]), ("cp",))

    def bitwise(a, b):
        return (np.array_equal(np.asarray(a.indices), np.asarray(b.indices)) and
                np.array_equal(np.asarray(a.scores).view(np.int32),
                               np.asarray(b.scores).view(np.int32)))

    def run(n, cfg, k=k32, k_scale=None, M=None, seed=0):
        m = mesh(n)
        one = jax.jit(lambda q, w, s: dosa_jax.decode_topk(q, k, w, s, k_scale=k_scale,
                                                           lengths=lengths, config=cfg))
        shd = jax.jit(lambda q, w, s: dosa_jax.sharded_decode_topk(
            q, k, w, s, mesh=m, k_scale=k_scale, lengths=lengths, config=cfg))
        s1 = s2 = dosa_jax.decode_init(B, cfg, queries=1 if M is None else M)
        ok, detail = True, []
        for t, (q, w) in enumerate(queries(M, seed)):
            r1, s1 = one(q, w, s1)
            r2, s2 = shd(q, w, s2)
            if not bitwise(r1, r2):
                ok = False
                detail.append(f"step {t}")
        return ok, detail, r2

    cfg = dosa_jax.Config(top_k=K, backend="reference")

    for name, n in (("mesh1", 1), ("mesh2", 2), ("mesh8", 8)):
        try:
            ok, detail, _ = run(n, cfg)
            _report(name, ok, detail)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            _report(name, False, repr(e))

    try:
        ok, detail, r = run(4, cfg, M=2, seed=1)
        _report("mesh4_multi", ok and r.indices.shape == (B, 2, K), detail)
    except Exception as e:  # noqa: BLE001
        _report("mesh4_multi", False, repr(e))

    try:   # the same state into both: the shared τ_w is the unsharded one
        m = mesh(4)
        one = jax.jit(lambda q, w, s: dosa_jax.decode_topk(q, k32, w, s, lengths=lengths,
                                                           config=cfg))
        shd = jax.jit(lambda q, w, s: dosa_jax.sharded_decode_topk(
            q, k32, w, s, mesh=m, lengths=lengths, config=cfg))
        st = dosa_jax.decode_init(B, cfg)
        good = True
        for q, w in queries(seed=2):
            r1, nxt = one(q, w, st)
            r2, _ = shd(q, w, st)
            good &= bool(np.array_equal(np.asarray(r1.stats.tau_witness),
                                        np.asarray(r2.stats.tau_witness)))
            good &= bool(np.array_equal(np.asarray(r1.stats.candidates),
                                        np.asarray(r2.stats.candidates)))
            good &= bool(np.array_equal(np.asarray(r1.stats.witnesses),
                                        np.asarray(r2.stats.witnesses)))
            good &= bitwise(r1, r2)
            st = nxt
        finite = bool(np.isfinite(np.asarray(r2.stats.tau_witness)).any())
        _report("shared_tau", good and finite, f"finite τ_w on some sequence: {finite}")
    except Exception as e:  # noqa: BLE001
        _report("shared_tau", False, repr(e))

    try:   # stale witnesses of another sequence of keys and a buffer of K: overflows
        ocfg = dosa_jax.Config(top_k=K, backend="reference", capacity=K)
        m = mesh(4)
        st = dosa_jax.DecodeState(jnp.tile(jnp.arange(4 * K, dtype=jnp.int32)[None], (B, 1)))
        q, w = queries(seed=3)[0]
        r1, _ = jax.jit(lambda q, w, s: dosa_jax.decode_topk(
            q, k32, w, s, lengths=lengths, config=ocfg))(q, w, st)
        r2, _ = jax.jit(lambda q, w, s: dosa_jax.sharded_decode_topk(
            q, k32, w, s, mesh=m, lengths=lengths, config=ocfg))(q, w, st)
        over = int(np.asarray(r2.stats.overflow).sum())
        _report("overflow", bitwise(r1, r2) and over > 0, f"overflowed sequences: {over}")
    except Exception as e:  # noqa: BLE001
        _report("overflow", False, repr(e))

    try:
        scale = jnp.asarray(rng.uniform(0.01, 4.0, (B, N)).astype(np.float32))
        payload = jnp.asarray(np.clip(base * 100, -448, 448)).astype(jnp.float8_e4m3fn)
        ok, detail, _ = run(4, cfg, k=payload, k_scale=scale, seed=4)
        _report("fp8_mesh4", ok, detail)
    except Exception as e:  # noqa: BLE001
        _report("fp8_mesh4", False, repr(e))

    try:   # paged: device d's pool holds its pages; its table maps its positions to them
        n_dev, page = 4, 16
        n_loc = N // n_dev
        mp = n_loc // page
        perm = rng.permutation(B * mp)                 # each device's pages shuffled
        pools, tables = [], []
        for d in range(n_dev):
            blocks = base[:, d * n_loc:(d + 1) * n_loc].reshape(B * mp, page, D)
            pool = np.empty_like(blocks)
            pool[perm] = blocks
            pools.append(pool)
            tables.append(perm.reshape(B, mp))
        pool_all = jnp.asarray(np.concatenate(pools))                # [n_dev·B·mp, page, D]
        table_all = jnp.asarray(np.concatenate(tables, axis=1), jnp.int32)  # [B, n_dev·mp]
        pcfg = cfg.replace(context_axis="cp")
        m = mesh(n_dev)

        def body(q, w, ids, lengths, pool, table):
            res, nxt = dosa_jax.decode_topk(q, pool, w, dosa_jax.DecodeState(ids),
                                            lengths=lengths, page_table=table, config=pcfg)
            return tuple(res), nxt.ids

        sm = getattr(jax, "shard_map", None)
        if sm is None:
            from jax.experimental.shard_map import shard_map as sm
        f = jax.jit(sm(body, mesh=m, in_specs=(P(), P(), P(), P(), P("cp"), P(None, "cp")),
                       out_specs=P()))
        one = jax.jit(lambda q, w, s: dosa_jax.decode_topk(q, k32, w, s, lengths=lengths,
                                                           config=cfg))
        s1 = dosa_jax.decode_init(B, cfg)
        ids = s1.ids
        ok, detail = True, []
        for t, (q, w) in enumerate(queries(seed=5)):
            r1, s1 = one(q, w, s1)
            res, ids = f(q, w, ids, lengths, pool_all, table_all)
            r2 = dosa_jax.TopKResult(*res)
            if not bitwise(r1, r2):
                ok, detail = False, detail + [f"step {t}"]
        _report("paged_user_shard_map", ok, detail)
    except Exception as e:  # noqa: BLE001
        _report("paged_user_shard_map", False, repr(e))

    try:   # every device's next state, stacked: all rows equal
        m = mesh(4)
        scfg = cfg.replace(context_axis="cp")

        def body(q, w, ids, lengths, k):
            _, nxt = dosa_jax.decode_topk(q, k, w, dosa_jax.DecodeState(ids), lengths=lengths,
                                          config=scfg)
            return nxt.ids[None]

        sm = getattr(jax, "shard_map", None)
        if sm is None:
            from jax.experimental.shard_map import shard_map as sm
        f = jax.jit(sm(body, mesh=m, in_specs=(P(), P(), P(), P(), P(None, "cp")),
                       out_specs=P("cp"), check_vma=False))
        ids = dosa_jax.decode_init(B, cfg).ids
        same = True
        for q, w in queries(seed=6):
            per = np.asarray(f(q, w, ids, lengths, k32))
            same &= all(np.array_equal(per[0], per[d]) for d in range(4))
            ids = jnp.asarray(per[0])
        _report("state_replicated", same and (np.asarray(ids) >= 0).any())
    except Exception as e:  # noqa: BLE001
        _report("state_replicated", False, repr(e))

    try:
        m = mesh(4)
        q, w = queries(seed=8)[0]
        st = dosa_jax.decode_init(B, cfg)
        loss1 = lambda q, w: dosa_jax.decode_topk(q, k32, w, st, lengths=lengths,
                                                  config=cfg)[0].scores.clip(-1e9).sum()
        loss2 = lambda q, w: dosa_jax.sharded_decode_topk(
            q, k32, w, st, mesh=m, lengths=lengths, config=cfg)[0].scores.clip(-1e9).sum()
        g1 = jax.jit(jax.grad(loss1, argnums=(0, 1)))(q, w)
        g2 = jax.jit(jax.grad(loss2, argnums=(0, 1)))(q, w)
        ok = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
                 for a, b in zip(g1, g2))
        nonzero = all(float(np.abs(np.asarray(a)).max()) > 0 for a in g1)
        _report("gradients", ok and nonzero, f"nonzero: {nonzero}")
    except Exception as e:  # noqa: BLE001
        _report("gradients", False, repr(e))

    try:
        ok, detail, _ = run(2, cfg.replace(backend="pallas"), seed=9)
        _report("pallas_mesh2", ok, detail)
    except Exception as e:  # noqa: BLE001
        _report("pallas_mesh2", False, repr(e))

    try:
        q, w = queries()[0]
        dosa_jax.decode_topk(q, k32, w, dosa_jax.decode_init(B, cfg), lengths=lengths,
                             config=cfg.replace(context_axis="cp"))
        _report("outside_shard_map_raises", False, "no error")
    except ValueError as e:
        _report("outside_shard_map_raises", "context_axis" in str(e), str(e))
    except Exception as e:  # noqa: BLE001
        _report("outside_shard_map_raises", False, repr(e))


@pytest.fixture(scope="module")
def child_results():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[r["case"]] = r
    if not rows:
        raise AssertionError(f"the child reported nothing: {out.stderr[-3000:]}")
    return rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_decode_case(child_results, case):
    assert case in child_results, f"{case} ({CASES[case]}) not reported"
    r = child_results[case]
    assert r["ok"], f"{case} ({CASES[case]}): {r['detail']}"


def test_child_reports_every_case(child_results):
    assert set(child_results) == set(CASES)


def test_sharded_decode_refuses_bad_arguments():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import dosa_jax
    m = Mesh(np.array(jax.devices()[:1]), ("cp",))
    q, w = jnp.ones((2, 4, 8)), jnp.ones((2, 4))
    k = jnp.ones((2, 32, 8))
    st = dosa_jax.decode_init(2, dosa_jax.Config(top_k=4))
    with pytest.raises(ValueError, match="mesh has no axis"):
        dosa_jax.sharded_decode_topk(q, k, w, st, mesh=m, axis="x",
                                     config=dosa_jax.Config(top_k=4))
    with pytest.raises(ValueError, match=r"k must have shape \[B, N, D\]"):
        dosa_jax.sharded_decode_topk(q, jnp.ones((64, 8)), w, st, mesh=m,
                                     config=dosa_jax.Config(top_k=4))


@pytest.mark.gpu
def test_one_device_mesh_decode_on_gpu_equals_plain_decode():
    """On a GPU the kernels answer the sharded step: bitwise the plain decode_topk over
    consecutive steps (FP8 keys, paged rows are the plain path's own tests)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import dosa_jax
    if not dosa_jax.backend.on_gpu():
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(0)
    Bg, Ng, Hg, Dg, Kg = 8, 65536, 32, 128, 2048
    k = jnp.asarray(rng.standard_normal((Bg, Ng, Dg)).astype(np.float32) * 50).astype(
        jnp.float8_e4m3fn)
    s = jnp.asarray(rng.uniform(0.01, 0.1, (Bg, Ng)).astype(np.float32))
    cfg = dosa_jax.Config(top_k=Kg)
    m = Mesh(np.array(jax.devices()[:1]), ("cp",))
    one = jax.jit(lambda q, w, st: dosa_jax.decode_topk(q, k, w, st, k_scale=s, config=cfg))
    shd = jax.jit(lambda q, w, st: dosa_jax.sharded_decode_topk(q, k, w, st, mesh=m, k_scale=s,
                                                                config=cfg))
    s1 = s2 = dosa_jax.decode_init(Bg, cfg)
    drift = rng.standard_normal((Bg, Hg, Dg)).astype(np.float32)
    for _ in range(4):
        q = jnp.asarray(drift + 0.3 * rng.standard_normal((Bg, Hg, Dg))).astype(jnp.bfloat16)
        w = jnp.asarray(rng.uniform(-0.5, 1.0, (Bg, Hg)).astype(np.float32))
        r1, s1 = one(q, w, s1)
        r2, s2 = shd(q, w, s2)
        np.testing.assert_array_equal(np.asarray(r1.indices), np.asarray(r2.indices))
        np.testing.assert_array_equal(np.asarray(r1.scores).view(np.int32),
                                      np.asarray(r2.scores).view(np.int32))


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
