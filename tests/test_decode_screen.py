"""The decode screen (DESIGN §11): one query slot per sequence, an upper bound per key, the
candidates rescored by the canonical tile. The bound is checked on every key; the screened
step equals the canonical step and ``dense_topk`` bitwise, with adversarial inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dosa_jax
from pallas_kernels import decode as kd
from pallas_kernels.common import scaled_f16_pieces
from test_decode import D, H, _bits, _dense_per_sequence, _keys, _paged


def _all_keys(rk, ri, cnt, slot_rows, N):
    """Per query row, the recorded order key of each id (INT32_MIN where not recorded)."""
    rk, ri, cnt = np.asarray(rk), np.asarray(ri), np.asarray(cnt)
    out = np.full((len(slot_rows), N), np.iinfo(np.int32).min, np.int64)
    for o, t in enumerate(slot_rows):
        for s in range(rk.shape[1]):
            n = cnt[t, s]
            out[o, ri[t, s, :n]] = rk[t, s, :n]
    return out


def _problem(rng, B, N, key_dtype, q_dtype):
    if key_dtype == "fp8":
        k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
        # FP8 extremes: the largest payloads, subnormals, zero keys; scales 2^±30
        k = k.at[0, :8].set(448.0).at[0, 8:16].set(2.0 ** -9).at[1, :8].set(0.0)
        s = s.at[1, 8:16].set(2.0 ** 30).at[1, 16:24].set(2.0 ** -30)
    else:
        k, s = _keys(rng, B, N, jnp.bfloat16)[0], None
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)) * 3, q_dtype)
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32)
    return q, k, s, w


def _check_bound(q, k, s, w, lengths, interpret, splits=2, **screen):
    """u_i ≥ the canonical score of every visible key (order keys of both kernels, no
    threshold, buffers large enough for all keys), and u_i − c_i is a small fraction of the
    score's magnitude α_i·n_i·Σ_h |w_h|‖q_h‖ (the bound is not vacuous; n_i the screen's
    payload norm bound: FP8's for every key, else ‖k_i‖ plus the allowance for flushed
    squares). ``screen``: the screen kernel's options (warps, stages)."""
    B, N = k.shape[:2]
    prep = kd.prepare(q, w, k, s, None)
    none4 = jnp.full((B * kd.SLOTS,), kd.THETA_NONE, jnp.int32)
    rk, ri, cnt, _ = kd.scan_records(prep, none4, lengths, 1, N, splits=splits,
                                     interpret=interpret)
    canon = _all_keys(rk, ri, cnt, range(0, B * kd.SLOTS, kd.SLOTS), N)
    rk, ri, cnt, app = kd.screen_records(prep, q, w, none4[:B], lengths, N, splits=splits,
                                         interpret=interpret, **screen)
    assert (np.asarray(app) <= rk.shape[2]).all()
    upper = _all_keys(rk, ri, cnt, range(B), N)
    kf = np.asarray(k, np.float64)
    sf = np.ones((B, N)) if s is None else np.asarray(s, np.float64)
    qf = np.asarray(q[:, 0], np.float64)
    nb = kd.payload_norm_bound(k.dtype, prep.kp.shape[2])    # FP8: one bound for every key
    norms = np.linalg.norm(kf, axis=2) + 1e-17 if nb is None else np.full((B, N), nb)
    mag = (np.abs(sf) * norms   # + the flush allowance
           * np.sum(np.abs(np.asarray(w[:, 0])) * np.linalg.norm(qf, axis=2), axis=1)[:, None])
    to_f = lambda x: dosa_jax.selection.key_to_score(jnp.asarray(x, jnp.int32))
    for b in range(B):
        n = int(lengths[b])
        c, u = canon[b, :n], upper[b, :n]
        fin = c != np.iinfo(np.int32).min
        assert fin.all() and (upper[b, :n] != np.iinfo(np.int32).min).all()
        assert (u >= c).all(), f"sequence {b}: the bound fails on {np.sum(u < c)} keys"
        gap = np.asarray(to_f(u), np.float64) - np.asarray(to_f(c), np.float64)
        assert (gap <= 1e-4 * mag[b, :n] + 1e-30).all()
        assert (canon[b, n:] == np.iinfo(np.int32).min).all()   # beyond the length: none


@pytest.mark.parametrize("key_dtype,mma", [("fp8", "auto"), ("fp8", "bf16"), ("bf16", "auto")])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_screen_bound_holds_on_every_key_and_is_tight(key_dtype, mma, q_dtype):
    """Both screen MMAs (FP8 keys: float16 of scaled query rows by default, or the canonical
    bf16 pieces)."""
    rng = np.random.default_rng(0)
    B, N = 2, 384
    q, k, s, w = _problem(rng, B, N, key_dtype, q_dtype)
    w = w.at[1].set(jnp.abs(w[1]))                     # one sequence's weights all one sign
    _check_bound(q, k, s, w, jnp.array([N, 250], jnp.int32), True, mma=mma)


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_f16_screen_bound_holds_on_queries_beyond_float16(q_dtype):
    """The float16 screen's query rows span bf16's range: heads of magnitude 2^60, 2^-70 and
    2^-100 (scaled into float16 by their own powers of two, the last one beyond the
    exponent limit), a head mixing 2^20 with elements 2^-30 (below float16's reach after
    scaling: a representation error the margin charges), a zero head, and a head whose
    weight 2^-120 cannot be scaled (it stays unscaled). The bound holds on every key."""
    rng = np.random.default_rng(11)
    B, N = 2, 256
    q, k, s, w = _problem(rng, B, N, "fp8", jnp.float32)
    qf = np.asarray(q, np.float64)
    qf[0, 0, 0] *= 2.0 ** 60
    qf[0, 0, 1] *= 2.0 ** -70
    qf[0, 0, 2] *= 2.0 ** -100
    qf[0, 0, 3, :64] *= 2.0 ** 20
    qf[0, 0, 3, 64:] *= 2.0 ** -30
    qf[1, 0, 0] = 0.0
    q = jnp.asarray(qf, q_dtype)
    w = w.at[1, 0, 1].set(2.0 ** -120)
    pieces, e = scaled_f16_pieces(q[:, 0], w[:, 0])
    e = np.asarray(e)
    assert e[0, 0] < 0 and e[0, 1] > 0 and e[0, 2] == 64 and e[1, 0] == 0 and e[1, 1] == 0
    assert np.isfinite(np.asarray(pieces, np.float32)).all()
    _check_bound(q, k, s, w, jnp.array([N, 200], jnp.int32), True)


ON_GPU = dosa_jax.backend.on_gpu()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_compiled_screen_bound_holds_on_every_key():
    """Compiled kernels (the GPU's MMA, square root and flushing): the bound on every key of
    a trained indexer's FP8 keys (code, layer 3, its last query; the screen at three Triton
    warp and stage counts) and of Gaussian FP8 keys with extreme payloads and scales."""
    from dosa_jax import datasets
    inp = datasets.trained("code", 3, length=32768, num_queries=1)
    q = inp.q[None].astype(jnp.bfloat16)
    for warps, stages in ((0, 0), (2, 2), (8, 4)):   # the default, and other Triton configs
        _check_bound(q, inp.k[None], inp.k_scale[None], inp.w[None],
                     jnp.array([inp.k.shape[0]], jnp.int32), False, splits=8, warps=warps,
                     stages=stages)
    rng = np.random.default_rng(3)
    q, k, s, w = _problem(rng, 2, 8192, "fp8", jnp.bfloat16)
    _check_bound(q, k, s, w, jnp.array([8192, 5000], jnp.int32), False, splits=4)
    _check_bound(q, k.astype(jnp.bfloat16), None, w, jnp.array([8192, 5000], jnp.int32), False,
                 splits=4)                                  # each key's norm, in registers


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_screen_reading_scales_ahead_records_what_each_tile_reads(paged):
    """The screen reading each tile's key scales a tile ahead (and the weights once; the
    default): the same records, counts and appended numbers, bitwise, as reading them in
    each tile — with splits of several tiles, splits holding no visible key, an empty
    sequence and a split of one tile, at 8 and 2 splits."""
    rng = np.random.default_rng(11)
    B, N = 3, 512
    q, k, s, w = _problem(rng, B, N, "fp8", jnp.bfloat16)
    s = s * jnp.asarray(rng.uniform(0.5, 2.0, size=s.shape), jnp.float32)
    lengths = jnp.array([N, 0, 70], jnp.int32)
    kp, sp, pt = (k, s, None) if not paged else _paged(k, s, 64, rng)
    prep = kd.prepare(q, w, kp, sp, pt)
    theta = jnp.full((B,), kd.THETA_NONE, jnp.int32)
    for splits in (8, 2):    # 128-key tiles: one tile a split, then two
        got = [kd.screen_records(prep, q, w, theta, lengths, N, splits=splits, interpret=True,
                                 ahead=ahead) for ahead in (True, False)]
        assert kd.same_records(*got)
        cnt = np.asarray(got[0][2])
        assert cnt[0].sum() == N and cnt[1].sum() == 0 and cnt[2].sum() == 70


def test_same_records_compares_what_was_recorded():
    """``same_records``: slots past a split's count are ignored; any recorded key or id, count
    or appended number that differs makes the records differ."""
    rng = np.random.default_rng(5)
    rk = jnp.asarray(rng.integers(-9, 9, size=(2, 3, 8)), jnp.int32)
    ri = jnp.asarray(rng.integers(0, 99, size=(2, 3, 8)), jnp.int32)
    cnt = jnp.array([[8, 3, 0], [1, 0, 5]], jnp.int32)
    app = cnt.at[0, 0].set(11)
    a = (rk, ri, cnt, app)
    assert kd.same_records(a, (rk.at[0, 1, 3:].add(1), ri.at[1, 1].add(7), cnt, app))
    for b in ((rk.at[0, 1, 2].add(1), ri, cnt, app), (rk, ri.at[1, 2, 4].add(1), cnt, app),
              (rk, ri, cnt.at[0, 2].set(1), app), (rk, ri, cnt, app.at[1, 1].set(1))):
        assert not kd.same_records(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_compiled_screen_reading_scales_ahead_records_the_same():
    """Compiled kernels: the default screen (scales a tile ahead, weights once) records the
    same keys, ids and counts as the screen reading each tile's scales in that tile, on a
    trained indexer's FP8 keys (code, layer 2) at 8 and 64 splits, from a threshold that
    records a few thousand keys."""
    from dosa_jax import datasets
    inp = datasets.trained("code", 2, length=65536, num_queries=2)
    q = jnp.stack([inp.q[-1], inp.q[-2]])[:, None].astype(jnp.bfloat16)
    k = jnp.stack([inp.k, inp.k])
    s = jnp.stack([inp.k_scale, inp.k_scale])
    w = jnp.stack([inp.w[-1], inp.w[-2]])[:, None]
    lengths = jnp.array([inp.k.shape[0], inp.k.shape[0] - 1000], jnp.int32)
    prep = kd.prepare(q, w, k, s, None)
    N = inp.k.shape[0]
    none = jnp.full((2,), kd.THETA_NONE, jnp.int32)
    every = [kd.screen_records(prep, q, w, none, lengths, N, splits=8, ahead=a)
             for a in (True, False)]                  # every visible key's bound recorded
    assert kd.same_records(*every)
    upper = _all_keys(*every[0][:3], range(2), N)
    theta = jnp.asarray(np.sort(upper, axis=1)[:, -4000], jnp.int32)
    for splits in (8, 64):
        got = [kd.screen_records(prep, q, w, theta, lengths, 2048, splits=splits, ahead=a)
               for a in (True, False)]
        assert int(jnp.sum(got[0][2])) > 2048
        assert kd.same_records(*got)


def _steps(q0, k, s, w, lengths, K, steps, rng, change=None, page=None):
    """Consecutive screened and canonical steps from the same witnesses; both against
    dense_topk. Returns how often the screen certified the step. Each step is one program
    (the same shapes every step: compiled once)."""
    B = k.shape[0]
    cfg = dosa_jax.Config(top_k=K, capacity=3 * K)
    ids = jnp.full((B, 4 * K), -1, jnp.int32)
    kp, sp, pt = (k, s, None) if page is None else _paged(k, s, page, rng)

    @jax.jit
    def step(qt, ids, lengths, k, s, w, kp, sp, pt):
        a = kd.decode_topk(qt, kp, w, ids, sp, lengths, pt, cfg, interpret=True, splits=2,
                           screen=True)
        e = kd.decode_topk(qt, kp, w, ids, sp, lengths, pt, cfg, interpret=True, splits=2,
                           screen=False)
        dense = _dense_per_sequence(qt, k, w, s, lengths, cfg.replace(backend="pallas"))
        prep = kd.prepare(qt, w, kp, sp, pt)
        theta, _, wk, wids = kd.witness_threshold(prep, ids, lengths, 1, K, interpret=True)
        out, need_exact, retry = kd.screened_step(prep, qt, w, theta, wk, wids, lengths, B, K,
                                                  kd.candidate_capacity(cfg), 4 * K, 2, True)
        return a, e, dense, retry(out, need_exact)[1]

    certified = 0
    q = q0
    for t in range(steps):
        q = (rng.normal(size=q.shape) if t == change else q) + 0.05 * rng.normal(size=q.shape)
        qt = jnp.asarray(q, jnp.bfloat16)
        a, e, (di, ds), need_exact = step(qt, ids, lengths, k, s, w, kp, sp, pt)
        for x, y in ((a[0], e[0]), (a[0], di)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(_bits(a[1]), _bits(ds))
        np.testing.assert_array_equal(_bits(a[1]), _bits(e[1]))
        # the canonical scan counts keys above its running threshold (raised by compactions)
        assert (np.asarray(a[2].candidates) >= np.asarray(e[2].candidates)).all()
        certified += int(not bool(jnp.any(need_exact)))
        ids = a[3].reshape(B, -1)
        lengths = lengths + 1
    return certified


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_screened_steps_equal_the_canonical_steps_and_dense(paged):
    """FP8 keys with scales along a random walk with a topic change: the first step (no
    witnesses) and the change take the canonical scan, the others the screen; every step
    equals the canonical step and dense_topk bitwise."""
    rng = np.random.default_rng(1)
    B, N, K = 2, 512, 16
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    q0 = rng.normal(size=(B, 1, H, D))
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32)
    certified = _steps(q0, k, s, w, jnp.array([400, 333], jnp.int32), K, 6, rng, change=4,
                       page=64 if paged else None)
    assert 2 <= certified <= 5


def test_adversarial_inputs_screened_or_not_equal_dense():
    """Zero keys (massive ties), NaN payloads, an infinite query component (its margin is
    infinite: every key a candidate, the canonical scan answers), lengths 0 and < K, all
    weights one sign, bf16 keys: every answer equals dense_topk bitwise."""
    rng = np.random.default_rng(2)
    B, N, K = 4, 256, 16
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    k = k.at[0, 100:200].set(0.0).at[1, 7].set(jnp.nan)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.bfloat16)
    q = q.at[2, 0, 1, 3].set(jnp.inf)
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32).at[3].set(-1.0)
    cfg = dosa_jax.Config(top_k=K, capacity=3 * K)
    # one program per key dtype, each called with both sets of lengths
    dense = jax.jit(lambda kk, ss, lengths, q, w: _dense_per_sequence(
        q, kk, w, ss, lengths, cfg.replace(backend="pallas")))
    step = jax.jit(lambda kk, ss, ids, lengths, q, w: kd.decode_topk(
        q, kk, w, ids, ss, lengths, None, cfg, interpret=True, splits=2))
    for lengths in (jnp.array([256, 200, 256, 150], jnp.int32),
                    jnp.array([0, 5, 16, 256], jnp.int32)):
        di, ds = dense(k, s, lengths, q, w)
        ids = jnp.asarray(np.asarray(di[:, 0]), jnp.int32)      # witnesses: last answer
        ids = jnp.concatenate([ids, jnp.full((B, 3 * K), -1, jnp.int32)], axis=1)
        for kk, ss in ((k, s), (k.astype(jnp.bfloat16), None)):
            if ss is None:
                di, ds = dense(kk, None, lengths, q, w)
            a = step(kk, ss, ids, lengths, q, w)
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(di))
            np.testing.assert_array_equal(_bits(a[1]), _bits(ds))
    assert 7 not in np.asarray(a[0][1])


def test_screens_only_one_query_of_one_piece_keys():
    assert kd.screens(jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 8, 8), jnp.float8_e4m3fn))
    assert kd.screens(jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 8, 8), jnp.bfloat16))
    assert not kd.screens(jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 8, 8), jnp.float32))
    assert not kd.screens(jnp.zeros((2, 2, 4, 8)), jnp.zeros((2, 8, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="one query per sequence"):
        kd.decode_topk(jnp.zeros((1, 2, H, D)), jnp.zeros((1, 64, D), jnp.bfloat16),
                       jnp.ones((1, 2, H)), jnp.full((1, 8), -1, jnp.int32), None,
                       jnp.array([64]), None, dosa_jax.Config(top_k=4), interpret=True,
                       screen=True)


def test_decode_parts_benchmark_runs_on_cpu(tmp_path, monkeypatch):
    """``python -m benchmarks.decode_parts`` at tiny shapes: every part timed, files written."""
    import json
    from benchmarks import decode_parts
    with pytest.raises(SystemExit):
        decode_parts.main(["--studies", "mma,nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        decode_parts.main(["--loop-steps", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        decode_parts.main(["--loop-compiles", "default,nope", "--out", str(tmp_path)])
    assert decode_parts.main(["--N", "2048", "--B", "2", "--K", "32", "--repeats", "1",
                              "--loop-steps", "3", "--tag", "cpu", "--kernels",
                              "--screen-configs", "64:4:3", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "decode_parts_cpu.json").read_text())
    listed = json.loads((tmp_path / "decode_kernels_cpu.json").read_text())
    assert listed["rows"] == [] and any("no GPU activity" in n for n in listed["notes"])
    parts = [r["part"] for r in saved["rows"]]
    assert parts[:4] == ["step", "witness", "screen", "screened"]
    assert sum(p.startswith("screen BK=") and "warps=" not in p for p in parts) == 6
    assert sum(p.startswith("screen BK=") and "warps=" in p for p in parts) == 13
    assert parts[-1].startswith("screen BK=64 warps=4 stages=3 (")   # --screen-configs
    share = {r["part"]: r["copy"] for r in saved["rows"]}
    assert share["step"] is None and share["screened"] is None
    assert all(share[p] > 0 for p in parts if p == "screen" or p.startswith("screen "))
    assert any(n.startswith("copy bandwidth of the run ") for n in saved["notes"])
    assert {"screened select", "screened select, sorted pool", "screen splits=16"} <= set(parts)
    assert sum(p.startswith("screen fp8 x fp8 MMA, not certified") for p in parts) == 1
    assert sum(p.startswith("screen bf16 MMA, canonical pieces") for p in parts) == 1
    assert "screen, scales read in each tile (records bitwise the same)" in parts
    assert "screen, scales a tile ahead, 4 stages (records bitwise the same)" in parts
    assert {"witness rows read in place", "witness rows from a gathered table"} <= set(parts)
    assert {"step, sequence 0 stale", "step, sequence 0 stale, unseeded",
            "step, every sequence by the canonical scan",
            "canonical scan of the sequences left (their keys only), with selection",
            "stale: screened step and second round, no canonical scan", "second round: θ₂",
            "second round: ids at or above θ₂",
            "second round: rescoring and selection"} <= set(parts)
    assert sum(p.startswith("second round: records laid end to end (") for p in parts) == 1
    stale_listed = json.loads((tmp_path / "decode_kernels_cpu_stale.json").read_text())
    assert stale_listed["rows"] == []
    loops = json.loads((tmp_path / "decode_loop_cpu.json").read_text())
    assert [r["variant"] for r in loops["rows"]] == [
        "decode_topk, default compile", "the certified path and a lax.cond on its predicate "
        "whose branches do nothing but a fill (the conditional's own cost)",
        "the certified path alone: no lax.cond (not exact where a sequence needs the fallback)"]
    assert all(r["ms"] > 0 and r["ms_again"] > 0 for r in loops["rows"])
    assert (tmp_path / "decode_loop_cpu.md").read_text().startswith("# 3 steps in one lax.scan")
    assert sum("bitwise the same; sequence-steps needing the fallback: " in n
               for n in loops["notes"]) == 2
    # the CPU compile has no command buffers; the decode loop has its scan and conditionals
    placed = [n for n in loops["notes"] if n.startswith("decode_topk, default compile: "
                                                        "optimized HLO: conditionals ")]
    assert len(placed) == 1 and "; no command-buffer computation (" in placed[0]
    assert sum(n.startswith("sequence 0 stale: ") and "second round certifies it: " in n
               for n in saved["notes"]) == 1
    assert any("sorted pool" in n and "bitwise" in n for n in saved["notes"])
    assert all(r["ms"] > 0 for r in saved["rows"])
    assert (tmp_path / "decode_parts_cpu.md").exists()
    assert [p for p in parts[:len(decode_parts.PARTS)]] == list(decode_parts.PARTS)
    # --parts: only the named parts are timed, no study
    with pytest.raises(SystemExit):
        decode_parts.main(["--parts", "screen,nope", "--out", str(tmp_path)])

    # --parts with --studies named (the A/B stage): the loop study runs beside those parts, at
    # the named compiles only; --parts alone runs no study
    calls = []

    class Done:
        write = markdown = staticmethod(lambda: "")

    def fake_run(*args, **kw):
        calls.append((args, kw))
        return Done()
    monkeypatch.setattr(decode_parts, "run", fake_run)
    decode_parts.main(["--parts", "step", "--studies", "loop", "--loop-compiles",
                       "default,no_cub", "--out", str(tmp_path)])
    decode_parts.main(["--parts", "step", "--out", str(tmp_path)])
    decode_parts.main(["--parts", "screen", "--screen-configs", "128:2:2,64:4:3", "--out",
                       str(tmp_path)])
    for bad in ("128:2", "128:0:2", "a:b:c"):
        with pytest.raises(SystemExit):
            decode_parts.main(["--screen-configs", bad, "--out", str(tmp_path)])
    (a1, k1), (a2, k2), (_, k3) = calls
    assert a1[9:11] == (("loop",), "") and a1[11] == ("step",) and a1[14] == ("default", "no_cub")
    assert k1 == dict(loop_with_parts=True, screen_configs=())
    assert k2 == dict(loop_with_parts=False, screen_configs=())
    assert k3 == dict(loop_with_parts=False, screen_configs=((128, 2, 2), (64, 4, 3)))
    assert a2[9] == decode_parts.STUDIES and a2[14] == tuple(decode_parts.LOOP_COMPILES)
    rows = [(p, None, None) for p in parts]
    assert [r[0] for r in decode_parts.chosen(rows, ("gather", "screen"))] == ["screen", "gather"]
    assert decode_parts.chosen(rows, ()) == rows


def test_fp8_mma_screen_study_is_the_screen_on_queries_exact_in_fp8():
    """The timing study's fp8 × fp8 screen (``screen_records(fp8_mma=True)``) computes the
    screen's function: on integer queries and keys (every product and sum exact, so any
    summation order agrees) it records the same keys with the same bounds as the certified
    screen of the canonical pieces (``mma="bf16"``, the same margin). Keys other than FP8
    are refused."""
    rng = np.random.default_rng(5)
    B, N = 2, 256
    k = jnp.asarray(rng.integers(-4, 5, size=(B, N, D)), jnp.float8_e4m3fn)
    s = jnp.asarray(2.0 ** rng.integers(-2, 3, size=(B, N)), jnp.float32)
    q = jnp.asarray(rng.integers(-2, 3, size=(B, 1, H, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32)
    lengths = jnp.array([N, 200], jnp.int32)
    prep = kd.prepare(q, w, k, s, None)
    theta = jnp.full((B,), kd.THETA_NONE, jnp.int32)
    got = [kd.screen_records(prep, q, w, theta, lengths, N, splits=2, interpret=True,
                             fp8_mma=f, mma="bf16") for f in (False, True)]
    keys = [_all_keys(rk, ri, cnt, range(B), N) for rk, ri, cnt, _ in got]
    assert (keys[0] != np.iinfo(np.int32).min).sum() == N + 200
    np.testing.assert_array_equal(keys[0], keys[1])
    q3 = q * jnp.bfloat16(1.0 + 2.0 ** -6)      # exact in bf16, rounded in FP8 (3 bits)
    got = [kd.screen_records(kd.prepare(q3, w, k, s, None), q3, w, theta, lengths, N, splits=2,
                             interpret=True, fp8_mma=f, mma="bf16")[:3] for f in (False, True)]
    assert not np.array_equal(*(_all_keys(*g, range(B), N) for g in got))   # the study rounds
    bf = kd.prepare(q, w, k.astype(jnp.bfloat16), None, None)
    with pytest.raises(ValueError, match="needs FP8 keys"):
        kd.screen_records(bf, q, w, theta, lengths, N, interpret=True, fp8_mma=True)


@pytest.mark.parametrize("K,n", [(16, 40), (16, 8), (24, 24)])
def test_one_selection_gives_the_top_k_and_the_next_witnesses_of_the_sorted_pool(K, n):
    """``select_and_witness`` (a binary search for the witnesses among the candidates) equals
    the candidates' Top-K and ``best_witnesses`` of ``distinct_pool`` (a sort of the pool),
    bitwise, when every witness at or above τ_w is a candidate: ties, repeated and invalid
    witnesses, empty candidate slots and witness keys at the extremes included."""
    from dosa_jax.decode import best_witnesses, distinct_pool, select_and_witness
    imin = np.iinfo(np.int32).min
    rng = np.random.default_rng(7)
    M, N, C, W = 6, 400, 64, 48
    ck = np.full((M, C), imin, np.int32)
    ci = np.full((M, C), -1, np.int32)
    wk = np.full((M, W), imin, np.int32)
    wi = np.full((M, W), -1, np.int32)
    for m in range(M):
        c = C - 5 * m                                   # row m: 5·m empty candidate slots
        ids = np.sort(rng.choice(N, c, replace=False)).astype(np.int32)
        keys = rng.integers(-40, 40, c).astype(np.int32) * 1000    # many equal keys
        keys[:3] = np.iinfo(np.int32).max                          # the largest order key
        ck[m, :c], ci[m, :c] = keys, ids
        theta = np.sort(keys)[::-1][K - 1]
        above = np.flatnonzero(keys >= theta)
        inside = rng.choice(c, W // 2, replace=False)
        inside = np.union1d(inside, above[:W // 2])[:W // 2]      # witnesses among candidates
        outside = np.setdiff1d(np.arange(N), ids)[:W - len(inside)]
        wid = np.concatenate([ids[inside], outside]).astype(np.int32)
        wkey = np.concatenate([keys[inside], rng.integers(imin + 1, theta, len(outside))])
        perm = rng.permutation(W)
        wi[m], wk[m] = wid[perm], wkey[perm].astype(np.int32)
        wi[m, :2], wk[m, :2] = -1, imin                             # invalid witnesses
        wk[m, 2] = imin                                             # a repeated one
    args = [jnp.asarray(x) for x in (ck, ci, wk, wi)]
    idx, top, (nid, nkey) = jax.jit(select_and_witness, static_argnums=(4, 5))(*args, K, n)
    tk, tp = jax.lax.top_k(args[0], K)
    ref_idx = jnp.where(tk == imin, -1, jnp.take_along_axis(args[1], tp, axis=1))
    ref_id, ref_key = best_witnesses(*distinct_pool(*args), n)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(top), np.asarray(tk))
    np.testing.assert_array_equal(np.asarray(nid), np.asarray(ref_id))
    np.testing.assert_array_equal(np.asarray(nkey), np.asarray(ref_key))
    assert np.all(np.asarray(nid)[:, 0] >= 0)


@pytest.mark.parametrize("paged", [False, True])
def test_witness_rows_read_in_place_score_as_the_gathered_table(paged):
    """The seed kernel reading each witness's row straight from the key cache
    (``direct_rows``) gives the order keys it gives on a table of the rows gathered first,
    bitwise, for every slot: repeated, invisible, negative and out-of-range ids included."""
    rng = np.random.default_rng(11)
    B, N = 3, 512
    q, k, s, w = _problem(rng, B, N, "fp8", jnp.bfloat16)
    pt = None
    if paged:
        k, s, pt = _paged(k, s, 128, rng)
    lengths = jnp.asarray([N, 300, 0], jnp.int32)
    prep = kd.prepare(q, w, k, s, pt)
    assert kd.direct_rows(prep.kp, prep.scale) and kd.reads_rows_in_place(q, w, k, s, pt)
    ids = rng.integers(-5, N + 40, size=(B, 200)).astype(np.int32)
    ids[:, 50:60] = ids[:, 40:50]                       # repeated ids
    ids = jnp.asarray(ids)
    first = dosa_jax.seeds.distinct_visible(ids, jnp.zeros((B,), jnp.int32), lengths)
    rows = kd.key_rows(prep, ids)
    got = kd.witness_keys(prep.ops, prep.kp, prep.scale, rows, first, 1, prep.tiles, True,
                          direct=True)
    want = kd.witness_keys(prep.ops, prep.kp, prep.scale, rows, first, 1, prep.tiles, True,
                           direct=False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    real = np.asarray(got)[::kd.SLOTS, :200]
    assert (real[~np.asarray(first)] == np.iinfo(np.int32).min).all()
    assert (real[np.asarray(first)] != np.iinfo(np.int32).min).any()
    assert not kd.direct_rows(prep.kp, None)
    with pytest.raises(ValueError, match="direct=True"):
        kd.witness_keys(prep.ops, prep.kp, None, rows, first, 1, prep.tiles, True, direct=True)
    big = jax.ShapeDtypeStruct((1, 1 << 24, 128), jnp.float8_e4m3fn)   # 2^31 elements
    assert not kd.direct_rows(big, prep.scale)


def test_exact_rows_scans_only_the_rows_that_need_it():
    """exact_rows: the canonical step sees the lengths of the rows that need it and 0 for the
    others (no key tile of theirs is scanned); each output row comes from the canonical step
    where needed, from the screen elsewhere."""
    lengths = jnp.array([50, 60, 70], jnp.int32)
    need = jnp.array([False, True, False])
    seen = []

    def exact(n, tag):
        seen.append(np.asarray(n))
        return (jnp.broadcast_to(n[:, None], (3, 2)), n + 1000)

    screened = (jnp.full((3, 2), -7, jnp.int32), jnp.full((3,), -8, jnp.int32))
    out = kd.exact_rows(exact, need, lengths, ("tag",), screened)
    np.testing.assert_array_equal(seen[0], [0, 60, 0])
    np.testing.assert_array_equal(np.asarray(out[0]), [[-7, -7], [60, 60], [-7, -7]])
    np.testing.assert_array_equal(np.asarray(out[1]), [-8, 1060, -8])


def _stale_batch(N, K, interpret, seed=4):
    """Three sequences answered in one step twice: each carrying its last answer, and with
    sequence 1's witnesses gone. Checks the second against dense_topk bitwise and its
    certified rows (0, 2) against the first, every output bitwise."""
    rng = np.random.default_rng(seed)
    B = 3
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32)
    lengths = jnp.array([N - 112, N, N - 179], jnp.int32)
    cfg = dosa_jax.Config(top_k=K, capacity=3 * K)
    di, ds = jax.jit(lambda *a: _dense_per_sequence(*a, cfg.replace(backend="pallas")))(
        q, k, w, s, lengths)
    last = jnp.concatenate([jnp.asarray(np.asarray(di[:, 0]), jnp.int32),
                            jnp.full((B, 3 * K), -1, jnp.int32)], axis=1)
    stale = last.at[1].set(-1)
    # one program, called with either set of witnesses
    run = jax.jit(lambda ids, q, k, w, s, lengths: kd.decode_topk(
        q, k, w, ids, s, lengths, None, cfg, interpret=interpret, splits=2))
    mixed, certified = (run(ids, q, k, w, s, lengths) for ids in (stale, last))
    assert np.isneginf(np.asarray(mixed[2].tau_witness)[1]).all()
    assert np.isfinite(np.asarray(certified[2].tau_witness)).all()
    assert int(np.asarray(mixed[2].overflow)[1].sum()) == 1
    np.testing.assert_array_equal(np.asarray(mixed[0]), np.asarray(di))
    np.testing.assert_array_equal(_bits(mixed[1]), _bits(ds))
    same = lambda x: _bits(x) if x.dtype == jnp.float32 else np.asarray(x)
    for a, b in zip(jax.tree_util.tree_leaves(mixed), jax.tree_util.tree_leaves(certified)):
        np.testing.assert_array_equal(same(a)[[0, 2]], same(b)[[0, 2]])


def test_a_stale_sequence_leaves_its_batch_mates_screened():
    """A batch where one sequence has no witnesses (its step needs the canonical scan) and the
    others carry their last answer: every answer equals dense_topk bitwise, and every output
    of a certified sequence (indices, scores, statistics, next witnesses) is what it gets in a
    batch where no sequence needs the canonical scan: its batch mates do not change its step."""
    _stale_batch(512, 16, True)


@pytest.mark.gpu
@pytest.mark.skipif(not dosa_jax.backend.on_gpu(), reason="needs a GPU")
def test_gpu_compiled_stale_sequence_leaves_its_batch_mates_screened():
    """The same with the compiled kernels at 32K keys, K = 512."""
    _stale_batch(32768, 512, False)


def test_bound_threshold_and_records_at_least_against_numpy():
    """θ₂ is the least order key with at most ``cap`` recorded keys at or above it (counts
    per split honoured, slots past them ignored; more than ``cap`` tied at the largest order
    key: no θ₂), and the records
    at or above it come out in slot order (id order), padded with −1."""
    rng = np.random.default_rng(3)
    B, S, C, cap = 4, 5, 16, 12
    rk = rng.integers(-40, 40, size=(B, S, C)).astype(np.int32)
    rk[1] = np.iinfo(np.int32).max - rng.integers(0, 3, size=(S, C))   # near the top
    rk[2, :, :] = 7                                                     # all tied
    rk[3, 0, 0] = np.iinfo(np.int32).min + 1                           # the lowest keys
    ri = np.arange(B * S * C, dtype=np.int32).reshape(B, S, C)
    cnt = rng.integers(0, C + 1, size=(B, S)).astype(np.int32)
    cnt[2] = C
    cnt[3, 2] = 0                                                       # an empty split
    theta, exists = (np.asarray(x) for x in kd.bound_threshold(jnp.asarray(rk),
                                                                jnp.asarray(cnt), cap))
    for b in range(B):
        v = np.concatenate([rk[b, s, :cnt[b, s]] for s in range(S)]).astype(np.int64)
        count = lambda t: int(np.sum(v >= t))
        options = [t for t in np.unique(np.concatenate([v, v + 1]))
                   if t <= np.iinfo(np.int32).max and count(t) <= cap]
        if not options:       # more than cap keys tie at the largest order key
            assert b == 1 and not exists[b]
            continue
        assert exists[b] and theta[b] == min(options)    # all tied at 7: θ₂ = 8, no record
        ids, valid = (np.asarray(x) for x in kd.records_at_least(
            jnp.asarray(ri), jnp.asarray(rk), jnp.asarray(cnt), jnp.asarray(theta), cap))
        want = np.concatenate([ri[b, s, :cnt[b, s]][rk[b, s, :cnt[b, s]] >= theta[b]]
                               for s in range(S)])
        n = len(want)
        assert n <= cap and valid[b].sum() == n
        np.testing.assert_array_equal(ids[b, :n], want)
        assert (ids[b, n:] == -1).all()
    # the records laid end to end first (the second round's layout): the same θ₂ and ids;
    # with fewer slots than records, the first ones in split order
    total = cnt.sum(axis=1)
    for slots in (int(total.max()), int(total.max()) + 5, 7):
        counted, searched = (kd.record_slots(jnp.asarray(cnt), C, slots, search=x)
                             for x in (False, True))
        for x, y in zip(counted, searched):    # the two ways of finding a slot's split agree
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        ck, ci, cc, tot = (np.asarray(x) for x in kd.compact_records(
            jnp.asarray(rk), jnp.asarray(ri), jnp.asarray(cnt), slots))
        assert ck.shape == ci.shape == (B, 1, slots) and cc.shape == (B, 1)
        np.testing.assert_array_equal(tot, total)
        for b in range(B):
            v = np.concatenate([rk[b, s, :cnt[b, s]] for s in range(S)])[:slots]
            i = np.concatenate([ri[b, s, :cnt[b, s]] for s in range(S)])[:slots]
            n = len(v)
            assert cc[b, 0] == n
            np.testing.assert_array_equal(ck[b, 0, :n], v)
            np.testing.assert_array_equal(ci[b, 0, :n], i)
            assert (ck[b, 0, n:] == np.iinfo(np.int32).min).all() and (ci[b, 0, n:] == -1).all()
        if slots >= total.max():
            t2, e2 = (np.asarray(x) for x in kd.bound_threshold(jnp.asarray(ck),
                                                                 jnp.asarray(cc), cap))
            np.testing.assert_array_equal(e2, exists)
            np.testing.assert_array_equal(t2[exists], theta[exists])
            a = kd.records_at_least(jnp.asarray(ci), jnp.asarray(ck), jnp.asarray(cc),
                                    jnp.asarray(theta), cap)
            b_ = kd.records_at_least(jnp.asarray(ri), jnp.asarray(rk), jnp.asarray(cnt),
                                     jnp.asarray(theta), cap)
            for x, y in zip(a, b_):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_bound_threshold_digit_search_against_sorted_slots(bits, monkeypatch):
    """θ₂ found a digit at a time (any digit width) is one above the (cap + 1)-th largest
    slot (unused slots count as ``INT32_MIN``), keys over the whole int32 range, ties at the
    cut and a split layout with no more slots than cap (θ₂ the least key)."""
    monkeypatch.setattr(kd, "THRESHOLD_DIGIT_BITS", bits)
    rng = np.random.default_rng(11 + bits)
    info = np.iinfo(np.int32)
    B, S, C = 6, 4, 32
    rk = rng.integers(info.min, info.max, size=(B, S, C), endpoint=True).astype(np.int32)
    rk[1] = rng.integers(-3, 3, size=(S, C))                     # many ties around zero
    rk[2, :, :5] = info.min                                      # recorded keys at INT32_MIN
    rk[3] = info.max                                             # every key the largest
    cnt = rng.integers(0, C + 1, size=(B, S)).astype(np.int32)
    cnt[3] = C
    cnt[4] = 0                                                   # nothing recorded
    for cap in (1, 7, 40, S * C - 1, S * C):
        theta, exists = (np.asarray(x) for x in kd.bound_threshold(
            jnp.asarray(rk), jnp.asarray(cnt), cap))
        for b in range(B):
            slots = np.full(S * C, info.min, np.int64)
            v = np.concatenate([rk[b, s, :cnt[b, s]] for s in range(S)]).astype(np.int64)
            slots[:len(v)] = v
            if S * C <= cap:
                assert exists[b] and theta[b] == info.min
                continue
            cut = np.sort(slots)[::-1][cap]                      # the (cap + 1)-th largest
            if cut == info.max:
                assert not exists[b] and theta[b] == info.max, (b, cap)
            else:
                assert exists[b] and theta[b] == cut + 1, (b, cap)
                assert np.sum(slots >= theta[b]) <= cap < np.sum(slots >= cut)


def _second_round(N, K, splits, interpret, seed=5):
    """Weak witnesses (4·K random visible ids) at two sequences of about N keys: the second
    round certifies both; checks against the canonical step and dense_topk bitwise."""
    rng = np.random.default_rng(seed)
    B = 2
    k, s = _keys(rng, B, N, jnp.float8_e4m3fn)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(B, 1, H)), jnp.float32)
    lengths = jnp.array([N, N - N // 8], jnp.int32)
    cfg = dosa_jax.Config(top_k=K, capacity=3 * K)
    cap = kd.candidate_capacity(cfg)
    ids = jnp.asarray(rng.integers(0, N - N // 8, size=(B, 4 * K)), jnp.int32)
    prep = kd.prepare(q, w, k, s, None)
    theta, _, wk, wids = kd.witness_threshold(prep, ids, lengths, 1, K, interpret=interpret)
    out, need_exact, retry = kd.screened_step(prep, q, w, theta, wk, wids, lengths, B, K, cap,
                                              4 * K, splits, interpret)
    assert np.asarray(need_exact).all()            # the first round cannot certify them
    # fewer second-round slots than records: the second round leaves both to the canonical scan
    few = kd.screened_step(prep, q, w, theta, wk, wids, lengths, B, K, cap, 4 * K, splits,
                           interpret, second_slots=cap + 1)
    assert np.asarray(few[2](*few[:2])[1]).all()
    out, need_exact = retry(out, need_exact)
    assert not np.asarray(need_exact).any()
    assert (np.asarray(out[2]) > 3 * cap).all() and (np.asarray(out[3]) == 1).all()
    a = kd.decode_topk(q, k, w, ids, s, lengths, None, cfg, interpret=interpret, splits=splits)
    e = kd.decode_topk(q, k, w, ids, s, lengths, None, cfg, interpret=interpret, splits=2,
                       screen=False)
    di, ds = _dense_per_sequence(q, k, w, s, lengths, cfg.replace(backend="pallas"))
    for x in (a[0], e[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(di))
    np.testing.assert_array_equal(_bits(a[1]), _bits(ds))
    np.testing.assert_array_equal(_bits(e[1]), _bits(ds))
    np.testing.assert_array_equal(np.asarray(a[0])[:, 0], np.asarray(out[0]))
    np.testing.assert_array_equal(np.asarray(a[3])[:, 0, :K], np.asarray(a[0])[:, 0])


def test_a_second_round_certifies_more_candidates_than_the_buffer_holds():
    """Weak witnesses (random visible ids): several times ``capacity`` keys clear τ_w, every
    screen buffer holds its split's keys (none lost). The second round — the ``capacity``
    keys of largest bound, rescored — certifies every sequence without the canonical scan
    (``need_exact`` False, ``overflow`` 1, candidates the screen's records), and the answers
    equal the canonical step's and dense_topk's bitwise, the next witnesses the selection
    first."""
    _second_round(1024, 16, 16, True)


@pytest.mark.gpu
@pytest.mark.skipif(not dosa_jax.backend.on_gpu(), reason="needs a GPU")
def test_gpu_compiled_second_round_certifies_more_candidates_than_the_buffer_holds():
    """The same with the compiled kernels at 32K keys, K = 512, 16 key splits."""
    _second_round(32768, 512, 16, False)
