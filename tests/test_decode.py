"""Decode (DESIGN §11): ``decode_topk`` against ``dense_topk`` bitwise over consecutive steps.

Every comparison is bitwise (indices, and scores as int32 bit patterns) against the dense path
of the same backend on each sequence's visible keys. The step sequences are random-walk
queries with a topic change (witnesses useless for a step) and a small candidate buffer (the
exact fallback runs); the tests check that both regimes were actually reached.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dosa_jax
from dosa_jax import decode as dec

H, D = 4, 32


def _bits(x):
    return np.asarray(x, np.float32).view(np.int32)


def _keys(rng, B, N, dtype=jnp.float32):
    k = rng.normal(size=(B, N, D)).astype(np.float32)
    if dtype == jnp.float8_e4m3fn:
        return jnp.asarray(k, dtype), jnp.asarray(2.0 ** rng.integers(-2, 3, size=(B, N)),
                                                  jnp.float32)
    return jnp.asarray(k, dtype), None


def _problem(rng, B, N):
    """Keys [B, N, D], one query [B, H, D] and weights [B, H] per sequence (Gaussian)."""
    k, _ = _keys(rng, B, N)
    q = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    return k, q, jnp.asarray(rng.normal(size=(B, H)), jnp.float32)


def _walk(rng, steps, B, M=1, change=None, step_size=0.05, heads=H, dim=D):
    """Random-walk queries [steps, B, M, H, D] (fresh directions at step ``change``)."""
    q = rng.normal(size=(B, M, heads, dim))
    out = []
    for t in range(steps):
        if t == change:
            q = rng.normal(size=(B, M, heads, dim))
        q = q + step_size * rng.normal(size=q.shape)
        out.append(q)
    w = rng.normal(size=(B, M, heads))
    return jnp.asarray(np.stack(out), jnp.float32), jnp.asarray(w, jnp.float32)


def _dense_per_sequence(q, k, w, k_scale, lengths, cfg):
    """dense_topk of each sequence's queries [M, H, D] over its first lengths[b] keys."""
    out_i, out_s = [], []
    for b in range(q.shape[0]):
        M = q.shape[1]
        r = dosa_jax.dense_topk(q[b], k[b], w[b], k_scale=None if k_scale is None else k_scale[b],
                                lo=jnp.zeros((M,), jnp.int32),
                                hi=jnp.full((M,), lengths[b], jnp.int32), config=cfg)
        out_i.append(r.indices)
        out_s.append(r.scores)
    return jnp.stack(out_i), jnp.stack(out_s)


def _run_steps(qs, k, w, k_scale, lengths0, cfg, *, page_table=None, k_paged=None,
               s_paged=None, dense=True):
    """lax.scan of decode steps (one key more per step), and the dense answers (None without
    ``dense``), jitted. ``w`` [B, M, H], or [steps, B, M, H] per step."""
    B, M = qs.shape[1], qs.shape[2]
    ws = w if w.ndim == 4 else jnp.broadcast_to(w, (qs.shape[0],) + w.shape)

    def body(state, xs):
        q, w, t = xs
        lengths = lengths0 + t
        if page_table is None:
            res, state = dosa_jax.decode_topk(q, k, w, state, k_scale=k_scale, lengths=lengths,
                                              config=cfg)
        else:
            res, state = dosa_jax.decode_topk(q, k_paged, w, state, k_scale=s_paged,
                                              lengths=lengths, page_table=page_table, config=cfg)
        di, ds = _dense_per_sequence(q, k, w, k_scale, lengths, cfg) if dense else (None, None)
        return state, (res.indices, res.scores, di, ds, res.stats)

    run = jax.jit(lambda qs: lax.scan(body, dec.decode_init(B, cfg, queries=M),
                                      (qs, ws, jnp.arange(qs.shape[0], dtype=jnp.int32))))
    return run(qs)[1]


def test_consecutive_steps_bitwise_with_topic_change_and_overflow():
    """200 steps: witnesses prune (candidates ≪ visible), a topic change and the buffer's
    overflow force the fallback; every step equals dense_topk bitwise."""
    rng = np.random.default_rng(0)
    B, N, K, steps = 2, 2048, 32, 200
    k, _ = _keys(rng, B, N)
    qs, w = _walk(rng, steps, B, change=120)
    cfg = dosa_jax.Config(top_k=K, backend="reference", capacity=48)
    lengths0 = jnp.array([1500, 1700], jnp.int32)
    idx, sc, di, ds, st = _run_steps(qs, k, w, None, lengths0, cfg)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(di))
    np.testing.assert_array_equal(_bits(sc), _bits(ds))
    over = np.asarray(st.overflow)[..., 0]
    cand = np.asarray(st.candidates)[..., 0]
    assert over[0].all()                          # no witnesses: every key a candidate
    assert over[120].any()                        # the topic change: witnesses useless
    assert (cand[1:120] < 200).mean() > 0.9       # witnesses prune most of the time
    assert np.isfinite(np.asarray(st.tau_witness)[1:, :, 0]).all()


def test_witnesses_certify_a_tight_threshold_along_trained_decode_steps():
    """A trained indexer (fixture: code, layer 3) along consecutive positions: the carried
    witnesses give τ_w close to τ* (τ* > 0 steps), candidates a small multiple of K and
    rarely an overflow. Carrying only the previous selection (W = K) fails every bound:
    τ_w is then the lowest current score of the previous winners (median τ_w/τ* ≈ −3,
    ≈ 5.6·K candidates, the buffer overflowing on ~98 % of the steps)."""
    from dosa_jax import datasets
    inp = datasets.trained("code", 3)
    T, N = inp.q.shape[0], inp.k.shape[0]
    B, K, steps = 2, 128, 24
    t = np.arange(steps)[:, None] + 32 * np.arange(B)[None, :]   # consecutive positions
    k, s = jnp.tile(inp.k[None], (B, 1, 1)), jnp.tile(inp.k_scale[None], (B, 1))
    cfg = dosa_jax.Config(top_k=K, backend="reference")

    def body(st, x):
        r, st = dosa_jax.decode_topk(x[0], k, x[1], st, k_scale=s, lengths=x[2], config=cfg)
        return st, (r.scores[:, -1], r.stats.tau_witness, r.stats.candidates, r.stats.overflow)

    xs = (inp.q[t], inp.w[t], jnp.asarray(N - T + t + 1, jnp.int32))
    _, out = jax.jit(lambda xs: lax.scan(body, dec.decode_init(B, cfg), xs))(xs)
    tau, tau_w, cand, over = (np.asarray(x)[1:] for x in out)   # step 0: no witnesses yet
    pos = tau > 0
    assert pos.mean() > 0.5
    assert np.median(tau_w[pos] / tau[pos]) > 0.6
    assert cand.mean() < 2 * K and over.mean() < 0.25


def test_fp8_keys_and_ragged_lengths_including_zero_and_below_k():
    rng = np.random.default_rng(1)
    B, N, K = 4, 256, 16
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    qs, w = _walk(rng, 5, B)
    cfg = dosa_jax.Config(top_k=K, backend="reference", capacity=24)
    lengths0 = jnp.array([0, 3, 16, 200], jnp.int32)   # grows by one per step
    idx, sc, di, ds, st = _run_steps(qs, k, w, s, lengths0, cfg)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(di))
    np.testing.assert_array_equal(_bits(sc), _bits(ds))
    idx = np.asarray(idx)[..., 0, :]
    assert (idx[0, 0] == -1).all() and (idx[1, 0, 1:] >= 0).sum() == 0   # length 0: all pads
    assert (idx[0, 1, :3] >= 0).all() and (idx[0, 1, 3:] == -1).all()    # length 3 < K
    assert np.isneginf(np.asarray(st.tau_witness)[:, 1, 0]).all()        # < K witnesses


def _paged(k, s, page, rng, extra_pages=3):
    """The contiguous caches [B, N, D] as shuffled pages [P, page, D] and a page table."""
    B, N, D = k.shape
    per = N // page
    P = B * per + extra_pages
    perm = rng.permutation(P)[:B * per].reshape(B, per)
    kp = jnp.zeros((P, page, D), k.dtype).at[perm.reshape(-1)].set(k.reshape(B * per, page, D))
    sp = None if s is None else jnp.ones((P, page), jnp.float32).at[perm.reshape(-1)].set(
        s.reshape(B * per, page))
    return kp, sp, jnp.asarray(perm, jnp.int32)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_equals_contiguous_and_dense(backend):
    rng = np.random.default_rng(2)
    B, N, K, page = 2, 256, 16, 32
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    kp, sp, pt = _paged(k, s, page, rng)
    qs, w = _walk(rng, 3, B, change=2)
    qs = qs.astype(jnp.bfloat16)
    cfg = dosa_jax.Config(top_k=K, backend=backend, capacity=24)
    lengths0 = jnp.array([130, 37], jnp.int32)
    a = _run_steps(qs, k, w, s, lengths0, cfg)
    b = _run_steps(qs, k, w, s, lengths0, cfg, page_table=pt, k_paged=kp, s_paged=sp,
                   dense=False)
    for x, y in ((a[0], a[2]), (b[0], a[2]), (a[0], b[0])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in ((a[1], a[3]), (b[1], a[3])):
        np.testing.assert_array_equal(_bits(x), _bits(y))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_multiple_queries_per_sequence(backend):
    rng = np.random.default_rng(3)
    B, N, K, M = 2, 256, 16, 3
    k, _ = _keys(rng, B, N)
    qs, w = _walk(rng, 3, B, M=M)
    cfg = dosa_jax.Config(top_k=K, backend=backend)
    idx, sc, di, ds, st = _run_steps(qs, k, w, None, jnp.array([200, 60], jnp.int32), cfg)
    assert idx.shape == (3, B, M, K)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(di))
    np.testing.assert_array_equal(_bits(sc), _bits(ds))
    assert (np.asarray(st.witnesses)[1:] > 0).all()


def test_invalid_stale_and_repeated_witnesses_are_harmless():
    rng = np.random.default_rng(4)
    B, N, K = 3, 300, 16
    k, q, w = _problem(rng, B, N)
    lengths = jnp.array([300, 50, 17], jnp.int32)
    cfg = dosa_jax.Config(top_k=K, backend="reference", capacity=20)
    di, ds = _dense_per_sequence(q[:, None], k, w[:, None], None, lengths, cfg)
    garbage = np.concatenate([rng.integers(-5, 400, size=(B, 40)),
                              np.full((B, 8), 7), np.full((B, 8), 2 ** 31 - 1)], axis=1)
    for ids in (garbage, np.asarray(di[:, 0])[:, ::-1], np.full((B, 5), 3)):
        res, st = dosa_jax.decode_topk(q, k, w, dosa_jax.DecodeState(jnp.asarray(ids, jnp.int32)),
                                       lengths=lengths, config=cfg)
        np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(di[:, 0]))
        np.testing.assert_array_equal(_bits(res.scores), _bits(ds[:, 0]))
        assert st.ids.shape == (B, ids.shape[1])
    # witnesses that are exactly the answer: τ_w = τ*, the candidates are the keys ≥ τ*
    res, _ = dosa_jax.decode_topk(q, k, w, dosa_jax.DecodeState(di[:, 0]), lengths=lengths,
                                  config=cfg)
    for b in range(B):
        s = dosa_jax.score(q[b:b + 1], k[b], w[b:b + 1], lo=jnp.zeros((1,), jnp.int32),
                           hi=lengths[b:b + 1])
        assert int(res.stats.candidates[b]) == int(jnp.sum(s >= ds[b, 0, -1])) >= K
        assert float(res.stats.tau_witness[b]) == float(ds[b, 0, -1])


@pytest.mark.parametrize("strategy", ["union", "local", "sinks", "strided"])
def test_seed_at_is_the_seed_set_local_keys_most_recent_first(strategy):
    """seed_at ranks the seed_ids set: local window newest first, then sinks, then strided;
    −1 past the seed count and for negative ranks; every key of a short range."""
    from dosa_jax.seeds import seed_at, seed_ids, seed_layout
    lo = jnp.array([0, 0, 5, 0, 3], jnp.int32)
    hi = jnp.array([1000, 40, 900, 0, 3], jnp.int32)
    size = 64
    lay = seed_layout(lo, hi, strategy, size, 8, 0.5)
    rank = jnp.broadcast_to(jnp.arange(-1, size + 3, dtype=jnp.int32), (5, size + 4))
    got = np.asarray(seed_at(lay, rank))
    want, valid = (np.asarray(x) for x in seed_ids(lay, size))
    a, b = np.asarray(lay.sinks), np.asarray(lay.local)
    for t in range(5):
        g = got[t, 1:size + 1]
        n = int(valid[t].sum())
        assert got[t, 0] == -1 and (got[t, size + 1:] == -1).all() and (g[n:] == -1).all()
        assert sorted(g[:n]) == sorted(want[t][valid[t]])              # the same set
        assert list(g[:b[t]]) == list(range(hi[t] - 1, hi[t] - 1 - b[t], -1))   # newest first
        assert list(g[b[t]:a[t] + b[t]]) == list(range(lo[t], lo[t] + a[t]))
    assert sorted(got[1, 1:41]) == list(range(40))                 # a short range: every key
    assert (got[3] == -1).all() and (got[4] == -1).all()           # empty ranges: no seed


def test_empty_witness_slots_take_the_sequences_seeds():
    """seeded_witnesses keeps every visible id in its slot and gives the r-th empty slot
    (−1, negative, past the sequence's length) the r-th seed of that sequence."""
    from dosa_jax.seeds import seed_at, seed_layout
    cfg = dosa_jax.Config(top_k=8, sink_size=4, local_fraction=0.5)
    ids = jnp.array([[-1, 500, 7, -1, 999, 12, -3, -1],
                     [3, 3, 60, -1, 2, 1, 0, 5],
                     [-1] * 8, [4, -1, 9, -1, 0, 1, 2, 3]], jnp.int32)
    lengths = jnp.array([1000, 50, 0, 6], jnp.int32)
    got = np.asarray(dec.seeded_witnesses(ids, lengths, cfg))
    lay = seed_layout(jnp.zeros((4,), jnp.int32), lengths, "union", 8, 4, 0.5)
    seeds = np.asarray(seed_at(lay, jnp.broadcast_to(jnp.arange(8), (4, 8))))
    ids = np.asarray(ids)
    for b in range(4):
        empty = (ids[b] < 0) | (ids[b] >= int(lengths[b]))
        np.testing.assert_array_equal(got[b][~empty], ids[b][~empty])
        np.testing.assert_array_equal(got[b][empty], seeds[b][:empty.sum()])
    assert list(got[0][[0, 3, 6, 7]]) == [999, 998, 997, 996]   # the newest keys first
    assert (got[2] == -1).all()                                  # nothing visible: no seed
    assert list(got[3]) == [4, 0, 1, 2, 0, 1, 2, 3]               # short: every key, in order


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_a_cold_state_takes_its_threshold_from_the_seeds(backend):
    """A trained indexer (fixture: code, layer 3) stepped from decode_init: the seeds give
    every sequence τ_w on the first step, so candidates stay near K and no buffer overflows;
    the same ids given to the step unseeded have no τ_w and overflow everywhere. The
    answers equal dense_topk's bitwise either way."""
    from dosa_jax import datasets
    inp = datasets.trained("code", 3)
    T, N = inp.q.shape[0], inp.k.shape[0]
    B, K = 4, 128
    t = np.array([T - 1, T - 17, T - 33, T - 49])
    k, s = jnp.tile(inp.k[None], (B, 1, 1)), jnp.tile(inp.k_scale[None], (B, 1))
    cfg = dosa_jax.Config(top_k=K, backend=backend, capacity=2 * K)
    lengths = jnp.asarray(N - T + t + 1, jnp.int32)
    res, nxt = dosa_jax.decode_topk(inp.q[t], k, inp.w[t], dec.decode_init(B, cfg), k_scale=s,
                                    lengths=lengths, config=cfg)
    di, ds = _dense_per_sequence(inp.q[t][:, None], k, inp.w[t][:, None], s, lengths, cfg)
    np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(di[:, 0]))
    np.testing.assert_array_equal(_bits(res.scores), _bits(ds[:, 0]))
    assert np.isfinite(np.asarray(res.stats.tau_witness)).all()
    assert (np.asarray(res.stats.overflow) == 0).all()
    assert (np.asarray(res.stats.candidates) < 2 * K).all()
    assert (np.asarray(res.stats.witnesses) == 4 * K).all()       # every slot a distinct seed
    np.testing.assert_array_equal(np.asarray(nxt.ids)[:, :K], np.asarray(res.indices))
    none = jnp.full((B, 4 * K), -1, jnp.int32)
    _, _, bare, _ = dec.decode_topk_reference(inp.q[t][:, None], k, inp.w[t][:, None], none, s,
                                              lengths, None, cfg)
    assert np.isneginf(np.asarray(bare.tau_witness)).all() and np.asarray(bare.overflow).all()


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_nan_keys_zero_weights_and_massive_ties(backend):
    """NaN scores are never selected (nor witnesses), all-zero scores tie everywhere (the
    buffer overflows, the fallback answers in id order), one-sign weights."""
    rng = np.random.default_rng(11)
    B, N, K = 3, 128, 8
    k, q, w = _problem(rng, B, N)
    k = k.at[0, 5].set(jnp.nan).at[0, 40:44].set(jnp.inf)
    w = w.at[1].set(0.0).at[2].set(jnp.abs(w[2]))
    cfg = dosa_jax.Config(top_k=K, backend=backend, capacity=K)
    lengths = jnp.array([128, 100, 64], jnp.int32)
    di, ds = _dense_per_sequence(q[:, None], k, w[:, None], None, lengths, cfg)
    st = dosa_jax.DecodeState(jnp.tile(jnp.arange(K + 4, dtype=jnp.int32)[None], (B, 1)))
    step = jax.jit(lambda st: dosa_jax.decode_topk(q, k, w, st, lengths=lengths, config=cfg))
    for _ in range(2):
        res, st = step(st)
        np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(di[:, 0]))
        np.testing.assert_array_equal(_bits(res.scores), _bits(ds[:, 0]))
    assert 5 not in np.asarray(res.indices[0])
    assert list(np.asarray(res.indices[1])) == list(range(K)) and int(res.stats.overflow[1]) == 1


def test_while_loop_and_plain_jit():
    rng = np.random.default_rng(5)
    B, N, K = 2, 128, 8
    k, q, w = _problem(rng, B, N)
    cfg = dosa_jax.Config(top_k=K, backend="reference")
    step = jax.jit(dosa_jax.decode_topk)
    res, st = step(q, k, w, dosa_jax.decode_init(B, cfg), lengths=jnp.array([100, 128]),
                   config=cfg)

    def body(c):
        i, st, _ = c
        r, st = dosa_jax.decode_topk(q, k, w, st, lengths=jnp.array([100, 128]), config=cfg)
        return i + 1, st, r.indices

    _, st2, idx = jax.jit(lambda st: lax.while_loop(lambda c: c[0] < 3, body,
                                                    (0, st, res.indices)))(st)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(res.indices))
    assert st2.ids.shape == (B, dec.WITNESS_FACTOR * K)
    np.testing.assert_array_equal(np.asarray(st2.ids[:, :K]), np.asarray(res.indices))


def test_dispatch_falls_back_to_the_reference_and_names_the_reason(monkeypatch):
    from dosa_jax import api, backend
    rng = np.random.default_rng(8)
    k, q, w = _problem(rng, 2, 64)
    cfg = dosa_jax.Config(top_k=8, backend="pallas")

    def unavailable():
        raise NotImplementedError("kernels unavailable here")

    monkeypatch.setitem(api.IMPLEMENTATIONS, "pallas", unavailable)
    with pytest.raises(NotImplementedError, match="pallas: kernels unavailable here"):
        dosa_jax.decode_topk(q, k, w, dosa_jax.decode_init(2, cfg), config=cfg)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)   # auto: pallas first, then reference
    auto = cfg.replace(backend="auto")
    got, _ = dosa_jax.decode_topk(q, k, w, dosa_jax.decode_init(2, cfg), config=auto)
    want, _ = dosa_jax.decode_topk(q, k, w, dosa_jax.decode_init(2, cfg),
                                   config=cfg.replace(backend="reference"))
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))


def test_scores_are_differentiable_as_dense_topk():
    rng = np.random.default_rng(6)
    B, N, K = 2, 64, 8
    k, q, w = _problem(rng, B, N)
    cfg = dosa_jax.Config(top_k=K, backend="reference")
    st = dosa_jax.decode_init(B, cfg)
    g = jax.grad(lambda q, k: jnp.sum(dosa_jax.decode_topk(q, k, w, st, config=cfg)[0].scores),
                 argnums=(0, 1))(q, k)
    want = [jax.grad(lambda qb, kb: jnp.sum(dosa_jax.dense_topk(qb, kb, w[b:b + 1],
                                                                config=cfg).scores),
                     argnums=(0, 1))(q[b:b + 1], k[b]) for b in range(B)]
    np.testing.assert_allclose(np.asarray(g[0]), np.concatenate([x[0] for x in want]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g[1]), np.stack([x[1] for x in want]), rtol=1e-6)
    assert float(jnp.abs(g[0]).sum()) > 0


def test_bad_arguments_name_the_argument():
    B, N, K = 2, 64, 8
    q = jnp.zeros((B, H, D))
    k = jnp.zeros((B, N, D))
    w = jnp.zeros((B, H))
    cfg = dosa_jax.Config(top_k=K, backend="reference")
    st = dosa_jax.decode_init(B, cfg)
    call = functools.partial(dosa_jax.decode_topk, config=cfg)
    cases = [
        (lambda: call(q[0], k, w, st), ValueError, "q must"),
        (lambda: call(jnp.zeros((B, 5, H, D)), k, jnp.zeros((B, 5, H)), st), ValueError, "M"),
        (lambda: call(q, k, w[:, :2], st), ValueError, "w must"),
        (lambda: call(q, k[:1], w, st), ValueError, "k must"),
        (lambda: call(q, k[..., :4], w, st), ValueError, "head dimension"),
        (lambda: call(q, k.astype(jnp.float8_e4m3fn), w, st), ValueError, "k_scale"),
        (lambda: call(q, k, w, st, k_scale=jnp.ones((B, 3))), ValueError, "k_scale"),
        (lambda: call(q, k, w, st, lengths=jnp.ones((3,), jnp.int32)), ValueError, "lengths"),
        (lambda: call(q, k, w, st, lengths=jnp.ones((B,))), TypeError, "lengths"),
        (lambda: call(q, k, w, st, page_table=jnp.zeros((B, 2), jnp.int32)), ValueError,
         "lengths is required"),
        (lambda: call(q, k, w, st, page_table=jnp.zeros((3, 2), jnp.int32),
                      lengths=jnp.ones((B,), jnp.int32)), ValueError, "page_table"),
        (lambda: call(q, k, w, st.ids), TypeError, "state"),
        (lambda: call(q, k, w, dosa_jax.DecodeState(jnp.zeros((3, 4), jnp.int32))), ValueError,
         "state.ids"),
        (lambda: call(q, k, w.astype(jnp.int32), st), TypeError, "w must"),
        (lambda: dosa_jax.decode_topk(q, k, w, st, config="x"), TypeError, "config"),
        (lambda: dosa_jax.decode_init(0, cfg), ValueError, "batch"),
        (lambda: dosa_jax.decode_init(2, cfg, queries=5), ValueError, "queries"),
    ]
    for fn, exc, text in cases:
        with pytest.raises(exc, match=text):
            fn()


def test_known_page_ids_out_of_range_raise_lengths_and_traced_ids_are_clipped():
    """An eager call names a page id outside the pool that holds visible keys (page ids past
    a sequence's length, −1 padding, are fine; so are ids beyond a length clipped to the
    capacity). Lengths are clipped to [0, capacity], eager or traced: the answer is
    dense_topk's over the clipped length; under jit a page id outside the pool is clipped
    (the step reads no key outside k)."""
    rng = np.random.default_rng(12)
    B, N, K, page = 2, 128, 8, 32
    k, q, w = _problem(rng, B, N)
    cfg = dosa_jax.Config(top_k=K, backend="reference")
    st = dosa_jax.decode_init(B, cfg)
    call = functools.partial(dosa_jax.decode_topk, config=cfg)
    kp, _, pt = _paged(k, None, page, rng)
    padded = pt.at[1, 2:].set(-1)                     # sequence 1: two pages in use
    cases = [
        (lambda: call(q, kp, w, st, page_table=padded, lengths=jnp.array([N, 2 * page + 1])),
         r"page_table\[1, 2\] = -1 is not a page of k \(0 \.\. 10\)"),
        (lambda: call(q, kp, w, st, page_table=pt.at[0, 0].set(kp.shape[0]),
                      lengths=jnp.array([1, 0])), r"page_table\[0, 0\] = 11"),
        (lambda: call(q, kp, w, st, page_table=pt.at[0, 3].set(-2),
                      lengths=jnp.array([N + 9, 0])), r"page_table\[0, 3\] = -2"),
    ]
    for fn, text in cases:
        with pytest.raises(ValueError, match=text):
            fn()
    n = jnp.array([N, 2 * page])
    want = _dense_per_sequence(q[:, None], k, w[:, None], None, n, cfg)
    for got in (call(q, kp, w, st, page_table=padded, lengths=n)[0],
                call(q, kp, w, st, page_table=padded, lengths=jnp.array([N + 50, 2 * page]))[0],
                jax.jit(lambda t: call(q, kp, w, st, page_table=t, lengths=n)[0])(padded)):
        np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want[0][:, 0]))
        np.testing.assert_array_equal(_bits(got.scores), _bits(want[1][:, 0]))
    clipped = jax.jit(lambda t: call(q, kp, w, st, page_table=t, lengths=n)[0])(
        pt.at[0, 0].set(kp.shape[0] + 7))
    want = _dense_per_sequence(q[:, None], jnp.stack([
        jnp.concatenate([kp[-1], kp[pt[0, 1:]].reshape(-1, D)]), k[1]]), w[:, None], None, n,
        cfg)
    np.testing.assert_array_equal(np.asarray(clipped.indices), np.asarray(want[0][:, 0]))


def test_select_compacted_overflow_rows_and_ties():
    """The bounded buffer: rows over capacity take the full selection, ties at θ are kept."""
    keys = jnp.asarray(np.array([[5, 5, 5, 5, 1, 5, 0, 5],
                                 [1, 2, 3, 4, 5, 6, 7, 8]], np.int32))
    theta = jnp.asarray([5, 7], jnp.int32)
    idx, sc, count, over, _ = dec.select_compacted(keys, theta, 3, 3)
    assert list(np.asarray(count)) == [6, 2] and list(np.asarray(over)) == [True, False]
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2], [7, 6, -1]])
    want_i, want_s = dec._select_keys(keys, 3)
    np.testing.assert_array_equal(np.asarray(idx[0]), np.asarray(want_i[0]))
    assert np.isneginf(np.asarray(sc)[1, 2])


def test_kernel_matches_its_jnp_twin_on_exact_inputs():
    """Small-integer inputs make every product and sum exact: the kernels and their twin
    compute identical scores, so indices and scores agree bitwise (ties everywhere)."""
    from pallas_kernels import decode as kd
    rng = np.random.default_rng(7)
    B, M, N, K = 2, 2, 192, 16
    q = jnp.asarray(rng.integers(-2, 3, size=(B, M, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.integers(-2, 3, size=(B, N, D)), jnp.float8_e4m3fn)
    s = jnp.asarray(2.0 ** rng.integers(-1, 2, size=(B, N)), jnp.float32)
    w = jnp.asarray(rng.integers(-2, 3, size=(B, M, H)), jnp.float32)
    lengths = jnp.array([192, 70], jnp.int32)
    cfg = dosa_jax.Config(top_k=K, capacity=20)
    ids = jnp.asarray(rng.integers(-3, 200, size=(B, 40)), jnp.int32)
    ki, ks, kst, kw = kd.decode_topk(q, k, w, ids, s, lengths, None, cfg, interpret=True,
                                     splits=2)
    ri, rs, rst, rw = kd.decode_topk_reference(q, k, w, ids, s, lengths, None, cfg)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_array_equal(_bits(ks), _bits(rs))
    np.testing.assert_array_equal(_bits(kst.tau_witness), _bits(rst.tau_witness))
    np.testing.assert_array_equal(np.asarray(kw)[..., :K], np.asarray(ki))   # selection first
    # a second step from the carried witnesses (the same shapes): τ_w tight, no overflow, and
    # the same next witnesses (the best of the candidates and the witnesses below τ_w)
    ids2 = rw.reshape(B, -1)
    ki, ks, kst, kw = kd.decode_topk(q, k, w, ids2, s, lengths, None, cfg, interpret=True,
                                     splits=2)
    ri, rs, rst, rw = kd.decode_topk_reference(q, k, w, ids2, s, lengths, None, cfg)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_array_equal(_bits(ks), _bits(rs))
    fine = np.asarray(kst.overflow) == 0
    assert fine.any() and np.isfinite(np.asarray(kst.tau_witness)).all()
    np.testing.assert_array_equal(np.asarray(kw)[fine], np.asarray(rw)[fine])
    # no witnesses, small tiles and two splits: every buffer is compacted during the scan and
    # the splits' records overflow the selection buffer (both exact fallbacks run)
    none = jnp.full((B, 40), -1, jnp.int32)
    ki, ks, kst, kw = kd.decode_topk(q, k, w, none, s, lengths, None, cfg, interpret=True,
                                     splits=2, key_tile=32)
    ri, rs, rst, _ = kd.decode_topk_reference(q, k, w, none, s, lengths, None, cfg)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_array_equal(_bits(ks), _bits(rs))
    assert np.asarray(kst.overflow)[0].all() and np.isneginf(np.asarray(kst.tau_witness)).all()
    np.testing.assert_array_equal(np.asarray(kw)[..., :K], np.asarray(ki))
    # one page per sequence, pages swapped: the page table is read, not assumed
    pt = jnp.array([[1], [0]], jnp.int32)
    ki, ks, _, _ = kd.decode_topk(q, k[::-1], w, ids, s[::-1], lengths, pt, cfg, interpret=True)
    ri, rs, _, _ = kd.decode_topk_reference(q, k, w, ids, s, lengths, None, cfg)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_array_equal(_bits(ks), _bits(rs))


def test_workspace_is_what_the_kernels_allocate_and_does_not_grow_with_n():
    from pallas_kernels import decode as kd
    rng = np.random.default_rng(12)
    B, K = 2, 16
    sizes = []
    for N in (512, 1024):
        k, q, w = _problem(rng, B, N)
        prep = kd.prepare(q[:, None], w[:, None], k, None, None)
        theta = jnp.full((B * kd.SLOTS,), kd.THETA_NONE, jnp.int32)
        rk, ri, cnt, app = kd.scan_records(prep, theta, jnp.array([N, N // 2]), 1, K, splits=2,
                                           interpret=True)
        sizes.append(rk.nbytes + ri.nbytes + cnt.nbytes + app.nbytes)
        srk, sri, scnt, sapp = kd.screen_records(prep, q[:, None], w[:, None], theta[::kd.SLOTS],
                                                 jnp.array([N, N // 2]), K, interpret=True)
        bk = kd.scan_tile(N, kd.screen_key_tile(H))
        S, C = kd.screen_layout(B, N // bk, K, bk)
        assert srk.shape == (B, S, C)
        assert srk.nbytes + sri.nbytes + scnt.nbytes + sapp.nbytes == kd.workspace_bytes(
            B, K, K, D, splits=2, screen_splits=S, screen_slots=C)["screen"]
    ws = kd.workspace_bytes(B, K, K, D, splits=2)
    assert sizes[0] == sizes[1] == ws["records"] + ws["counts"]
    # rows read in place: the tables hold each slot's entry (B) and order keys (4 slots)
    wd = kd.workspace_bytes(B, K, 64, D, splits=2, direct=True)
    assert wd["witness_table"] == B * 64 * 4 + B * kd.SLOTS * 64 * 4
    assert ws["witness_table"] - kd.workspace_bytes(B, K, K, D, splits=2, direct=True)[
        "witness_table"] == B * 64 * (D + 4)
    big = [kd.workspace_bytes(8, 2048, 2048, 128, splits=kd.default_splits(8, n // 64))["total"]
           for n in (1 << 17, 1 << 20, 1 << 24)]
    assert big[0] == big[1] == big[2]
    # the screen's buffers at any N stay within the bound that workspace_bytes states
    bound = kd.workspace_bytes(8, 2048, 2048, 128, splits=64)["screen"]
    for n in (1 << 12, 1 << 17, 1 << 20, 1 << 24):
        S, C = kd.screen_layout(8, n // 64, 2048, 64)
        assert 8 * S * (C * 8 + 8) <= bound
        assert C >= min(-(-n // 64 // S) * 64, 2 * 2048)   # every key of a split, or 2·K


ON_GPU = dosa_jax.backend.on_gpu()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_compiled_kernels_bitwise_dense_over_steps(paged):
    """Compiled kernels: 60 consecutive steps (a topic change at 30, a small buffer) equal the
    pallas dense_topk of each sequence bitwise."""
    from dosa_jax import synthetic
    B, N, K, steps = 4, 32768, 512, 60
    inp = synthetic.structured(T=1, N=N, H=32, D=128, seed=9, key_dtype="float8_e4m3fn")
    k = jnp.tile(inp.k[None], (B, 1, 1))
    s = jnp.tile(inp.k_scale[None], (B, 1))
    qs, ws = _walk(np.random.default_rng(9), steps, B, change=30, heads=32, dim=128)
    qs = qs.astype(jnp.bfloat16)
    lengths0 = jnp.asarray(N - steps - 8 * np.arange(B), jnp.int32)
    cfg = dosa_jax.Config(top_k=K, backend="pallas", capacity=2 * K)
    kp, sp, pt = _paged(k, s, 256, np.random.default_rng(0)) if paged else (None, None, None)
    idx, sc, di, ds, st = _run_steps(qs, k, ws, s, lengths0, cfg, page_table=pt, k_paged=kp,
                                     s_paged=sp)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(di))
    np.testing.assert_array_equal(_bits(sc), _bits(ds))
    assert np.asarray(st.overflow)[30].any() and not np.asarray(st.overflow)[5:30].all()


def test_decode_benchmark_quick(tmp_path):
    """``python -m benchmarks decode --quick``: every row bitwise, the exactness run, files."""
    import json
    from benchmarks import __main__ as entry
    from benchmarks.shapes import QUICK
    tab = entry.run(["decode", "--quick", "--repeats", "1", "--out", str(tmp_path)])
    p = QUICK["decode"]
    timed = [r for r in tab.rows if r["layout"] != "exactness"]
    assert sorted((r["B"], r["layout"]) for r in timed) == sorted(
        (B, lay) for B in p.batches for lay in ("contiguous", "paged"))
    for r in timed:
        assert r["decode_eq_dense"] is True
        assert min(r["decode_ms"], r["dense_ms"], r["xla_ms"], r["scan_gbs"], r["screen_gbs"]) > 0
        assert r["dense_over_decode"] == pytest.approx(r["dense_ms"] / r["decode_ms"])
        assert 0 < r["candidates"] and r["workspace_mib"] > 0
        assert r["tau_ratio"] > 0.5 and r["overflow_share"] < 0.5   # the witnesses work
        assert 0 < r["first_candidates"] and 0 <= r["first_overflow_share"] <= 1
    ex, = [r for r in tab.rows if r["layout"] == "exactness"]
    assert ex["mismatches"] == 0 and ex["steps"] == p.check_steps and not tab.errors
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert len(saved["rows"]) == len(tab.rows)
    gm = np.exp(np.mean(np.log([r["xla_over_decode"] for r in timed])))
    key = f"geometric mean of XLA/decode over {len(timed)} rows"
    assert tab.summary()[key] == pytest.approx(gm, abs=1e-3)
    assert key in (tmp_path / "decode.md").read_text()
    with pytest.raises(SystemExit):
        entry.run(["decode", "--out", str(tmp_path)])     # the full preset: a GPU only
    # --batches / --check-steps / --layouts / --graphs: the contiguous row of that batch size
    # only, the exactness run skipped, each path also compiled with the loop compile options
    # (ignored by the CPU compiler: the same answer), timed beside the default
    g = entry.run(["decode", "--quick", "--repeats", "1", "--batches", str(p.batches[-1]),
                   "--check-steps", "0", "--layouts", "contiguous", "--graphs", "--tag", "g",
                   "--out", str(tmp_path)])
    r, = g.rows
    assert (r["B"], r["layout"]) == (p.batches[-1], "contiguous")
    assert r["graphs_eq"] is True and not g.errors
    assert min(r["decode_graph_ms"], r["decode_ms_again"], r["dense_graph_ms"],
               r["xla_graph_ms"]) > 0
    assert r["xla_over_decode_graphs"] == pytest.approx(r["xla_graph_ms"] / r["decode_graph_ms"])
    assert "XLA/decode, graphs" in (tmp_path / "decode_g.md").read_text()
    for bad in (["--batches", "0"], ["--batches", "x"], ["--check-steps", "-1"],
                ["--layouts", "ragged"], ["--layouts", ","]):
        with pytest.raises(SystemExit):
            entry.run(["decode", "--quick", *bad, "--out", str(tmp_path)])
    for bad in (["--batches", "1"], ["--graphs"], ["--layouts", "paged"]):
        with pytest.raises(SystemExit):
            entry.run(["matrix", "--quick", *bad, "--out", str(tmp_path)])
