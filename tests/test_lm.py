"""The small LM with DSA indexers (dosa_jax.lm): corpora, model, training, checkpoints."""

import ast
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dosa_jax.lm import checkpoint, corpora, dump, sparse_attention, tokenizer
from dosa_jax.lm import indexer as idx
from dosa_jax.lm import train as T
from dosa_jax.lm.model import (embed_sequence, forward, hidden_states_segmented, init_lm,
                               rms_norm, rope_angles, window_attention)
from dosa_jax.scorer import score_gathered

TINY = T.PRESETS["tiny"]
# one layer, one indexer: the training tests compile in a few seconds
TINY1 = dataclasses.replace(TINY, lm=dataclasses.replace(TINY.lm, n_layers=1),
                            indexers=(TINY.indexers[0],))


def test_tokenizer_roundtrip():
    text = "def f(x):\n    return 'héllo' + x  # ünïcode\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint8 and ids.max() < tokenizer.VOCAB_SIZE
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_corpora_snapshots_and_document_split():
    info = corpora.describe()
    for domain in corpora.DOMAINS:
        c = corpora.load(domain)  # checks the sha256 of the decompressed text
        assert len(c.names) == len(set(c.names)) == info[domain]["documents"]
        train, held = corpora.split(c)
        assert set(train).isdisjoint(held) and len(train) + len(held) == len(c.names)
        held_bytes = sum(len(c.texts[i]) for i in held)
        assert held_bytes >= 2 ** 20, "a 1M-token dump needs 1 MiB of held-out text"
        assert held_bytes < 0.35 * c.num_bytes
        assert all(bytes([corpora.SEPARATOR]) not in t for t in c.texts)
        s = corpora.heldout_stream(domain)
        assert s.dtype == np.uint8 and int((s == corpora.SEPARATOR).sum()) == len(held)
    code = corpora.load("code")
    assert info["code"]["bytes"] > 10e6 and info["prose"]["bytes"] > 4e6
    for i in range(0, len(code.names), max(1, len(code.names) // 5)):
        ast.parse(code.texts[i].decode("utf-8"))  # it is Python source
    prose = b"".join(corpora.load("prose").texts)
    assert b"HAMLET." in prose and b"To be, or not to be" in prose


def test_rope_angles_exact_at_million_positions():
    pos = np.array([0, 1, 4095, 2 ** 20 - 1, 2 ** 20 + 12345])
    got = np.asarray(rope_angles(jnp.asarray(pos), 32, 10000.0), np.float64)
    freq = 10000.0 ** (-np.arange(32) / 32)
    err = np.abs(np.angle(np.exp(1j * (got - pos[:, None] * freq[None]))))
    assert err.max() < 1e-4
    naive = (pos[:, None].astype(np.float32) * freq[None].astype(np.float32)).astype(np.float64)
    assert np.abs(np.angle(np.exp(1j * (naive - pos[:, None] * freq[None])))).max() > 1e-3


def _dense_window_reference(q, k, v, qpos, kpos, window):
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    rel = qpos[:, None] - kpos[None, :]
    ok = (rel >= 0) & (rel < window) & (kpos[None, :] >= 0)
    s = np.where(ok[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v), p


@pytest.mark.parametrize("first_pos", [0, 40])
def test_window_attention_matches_dense_reference(rng, first_pos):
    B, S, h, dh, W, C = 2, 32, 2, 8, 16, 8
    q = rng.standard_normal((B, S, h, dh)).astype(np.float32)
    k = rng.standard_normal((B, W + S, h, dh)).astype(np.float32)
    v = rng.standard_normal((B, W + S, h, dh)).astype(np.float32)
    out, probs = window_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), first_pos,
                                  window=W, block=C, return_probs=True)
    qpos = first_pos + np.arange(S)
    kpos = first_pos - W + np.arange(W + S)
    ref, p = _dense_window_reference(q, k, v, qpos, kpos, W)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    # head-averaged probabilities in window layout: block n, key row n*C + kk
    pm = p.mean(1)
    for n in range(S // C):
        np.testing.assert_allclose(np.asarray(probs[:, n]), pm[:, n * C:(n + 1) * C, n * C:n * C + W + C],
                                   atol=1e-6)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)


def test_segmented_long_sequence_forward_equals_training_forward():
    cfg = TINY.lm
    params = init_lm(jax.random.PRNGKey(1), cfg)
    toks = corpora.heldout_stream("code")[:320].astype(np.int32)
    _, per_layer = forward(params, jnp.asarray(toks)[None], cfg, collect=True)
    for layer in range(cfg.n_layers + 1):
        h = hidden_states_segmented(params, toks, layer, cfg, segment=cfg.window)  # 5 segments
        if layer < cfg.n_layers:
            x = rms_norm(h, params["layers"][layer]["attn_norm"])
            np.testing.assert_allclose(np.asarray(x), np.asarray(per_layer[layer][0][0]), atol=2e-5)


def _eval_loss(params, tc, crop):
    return float(T._lm_loss(params, jnp.asarray(crop), tc.lm))


def test_lm_training_lowers_loss_and_resumes_exactly(tmp_path):
    tc = TINY1
    crop = T.eval_crops(corpora.heldout_stream("prose"), 2, tc.seq_len + 1)
    init = init_lm(jax.random.PRNGKey(tc.seed), tc.lm)
    straight, info = T.train_lm(tc, str(tmp_path / "a"), steps=30)
    assert info["steps"] == 30
    before, after = _eval_loss(init, tc, crop), _eval_loss(straight, tc, crop)
    assert before > math.log(256) - 0.2 and after < before - 1.0, (before, after)
    # the same run stopped at step 20 and resumed from its checkpoint
    T.train_lm(tc, str(tmp_path / "b"), steps=30, stop_after=20)
    _, scalars = checkpoint.load_tree(str(tmp_path / "b" / "lm_ckpt.npz"),
                                      (init, T.make_optimizer(init, tc).init(init)))
    assert scalars["step"] == 20 and scalars["total_steps"] == 30
    resumed, info_b = T.train_lm(tc, str(tmp_path / "b"), steps=30)
    assert info_b["steps"] == 30
    for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_save_tree_roundtrip_with_optax_state(tmp_path):
    params = init_lm(jax.random.PRNGKey(3), TINY1.lm)
    opt = T.make_optimizer(params, TINY1)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, state = jax.jit(opt.update)(grads, state, params)
    p = str(tmp_path / "t.npz")
    checkpoint.save_tree(p, (params, state), step=7)
    template = (init_lm(jax.random.PRNGKey(0), TINY1.lm), opt.init(params))
    (p2, s2), sc = checkpoint.load_tree(p, template)
    assert sc == {"step": 7}
    for a, b in zip(jax.tree_util.tree_leaves((params, state)), jax.tree_util.tree_leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        checkpoint.load_tree(p, init_lm(jax.random.PRNGKey(0), TINY1.lm))


def test_query_blocks_second_half_or_tail():
    cfg = TINY.lm  # window 64, block 16
    np.testing.assert_array_equal(np.asarray(idx.query_blocks(cfg, 128)), [4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(idx.query_blocks(cfg, 512, tail_blocks=2)), [30, 31])
    with pytest.raises(ValueError):
        idx.query_blocks(cfg, 96)


def test_indexer_distillation_lowers_kl_from_given_init(tmp_path):
    # long-crop variant: 256-token crops (4 windows), loss on the last 2 query blocks
    tc = dataclasses.replace(TINY1, idx_lr=1e-2, idx_seq_len=256, idx_tail_blocks=2)
    lm = init_lm(jax.random.PRNGKey(0), tc.lm)
    # give the frozen LM a non-uniform attention to distil: sharpen the q/k maps
    lm["layers"] = [dict(lp, wqkv=lp["wqkv"] * 30.0) for lp in lm["layers"]]
    cfg = tc.indexers[0]
    init = {cfg.n_heads: (cfg, idx.init_indexers(jax.random.PRNGKey(5), tc.lm, cfg))}
    batch = T.sample_batch(99, 0, T.device_streams("train"), 2, tc.idx_seq_len)
    obj = jax.jit(lambda p: T.indexer_objective(p, lm, batch, tc)[1][str(cfg.n_heads)])
    start, _ = T.train_indexers(tc, str(tmp_path / "a"), lm, steps=40, stop_after=0, init=init)
    for a, b in zip(jax.tree_util.tree_leaves(start), jax.tree_util.tree_leaves(init)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trained, info = T.train_indexers(tc, str(tmp_path / "a"), lm, steps=40, init=init)
    assert info["steps"] == 40
    before = float(obj({str(cfg.n_heads): init[cfg.n_heads][1]}))
    after = float(obj({str(cfg.n_heads): trained[cfg.n_heads][1]}))
    assert after < 0.85 * before, (before, after)


def test_indexer_logits_are_the_library_scorer_and_weights_are_signed(rng):
    cfg = TINY.indexers[0]
    d = TINY.lm.d_model
    p = idx.init_indexer(jax.random.PRNGKey(2), d, cfg)
    x = jnp.asarray(rng.standard_normal((1, 40, d)), jnp.float32)
    pos = jnp.arange(40)
    k = idx.keys(p, x, pos, cfg, dt=jnp.float32)[0]
    q, w = idx.queries(p, x[:, -6:], pos[-6:], cfg, dt=jnp.float32)
    q, w = q[0], w[0]
    lg = idx.logits(q[None], w[None], k[None], dt=jnp.float32)[0]
    ref = score_gathered(q, w, jnp.broadcast_to(k[None], (6,) + k.shape))
    np.testing.assert_allclose(np.asarray(lg), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # the Hadamard rotation of the dumps leaves every score unchanged
    r = jnp.asarray(dump.hadamard(cfg.head_dim), jnp.float32)
    np.testing.assert_allclose(dump.hadamard(cfg.head_dim) @ dump.hadamard(cfg.head_dim).T,
                               np.eye(cfg.head_dim), atol=1e-12)
    rot = score_gathered(q @ r, w, jnp.broadcast_to((k @ r)[None], (6,) + k.shape))
    np.testing.assert_allclose(np.asarray(rot), np.asarray(ref), rtol=1e-4, atol=1e-5)
    # head weights: one signed value per (token, head), no sign constraint
    assert (np.asarray(w) < 0).any() and (np.asarray(w) > 0).any()
    assert not np.allclose(np.asarray(w[0]), np.asarray(w[1]))
    flipped = idx.queries(dict(p, ww=-p["ww"]), x[:, -6:], pos[-6:], cfg, dt=jnp.float32)[1][0]
    np.testing.assert_allclose(np.asarray(flipped), -np.asarray(w), rtol=1e-6)


def test_export_weights_roundtrip_int8(tmp_path):
    lm = init_lm(jax.random.PRNGKey(4), TINY.lm)
    ix = {c.n_heads: (c, idx.init_indexers(jax.random.PRNGKey(6), TINY.lm, c)) for c in TINY.indexers}
    path = str(tmp_path / "w.npz")
    checkpoint.export_weights(path, TINY.lm, lm, ix, {"note": "test"})
    lm_cfg, lm2, ix2, meta = checkpoint.load_weights(path)
    assert lm_cfg == TINY.lm and meta == {"note": "test"}
    assert {h: c for h, (c, _) in ix2.items()} == {h: c for h, (c, _) in ix.items()}
    for a, b in zip(jax.tree_util.tree_leaves((lm, {str(h): v[1] for h, v in ix.items()})),
                    jax.tree_util.tree_leaves((lm2, {str(h): v[1] for h, v in ix2.items()}))):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        if a.ndim == 2:  # int8 per column: error at most half a step
            step = np.abs(a).max(0) / 127.0
            assert np.all(np.abs(a - b) <= 0.5 * step[None, :] + 1e-7)
        else:
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(T.roundtrip_int8(lm)["embed"]), np.asarray(lm2["embed"]))


def test_committed_weights_describe_the_trained_model():
    lm_cfg, lm, ix, meta, digest = dump.load_default_weights()
    assert lm_cfg.vocab_size == 256 and lm_cfg.window == 4096
    assert sorted(ix) == [32, 64]
    for h, (cfg, layers) in ix.items():
        assert (cfg.n_heads, cfg.head_dim, cfg.rope_dim) == (h, 128, 64)
        assert len(layers) == lm_cfg.n_layers
        assert layers[0]["wq_b"].shape == (cfg.q_rank, h * 128)
    assert meta["lm_training"]["steps"] > 1000 and meta["indexer_training"]["steps"] > 100
    assert os.path.getsize(dump.WEIGHTS_PATH) < 10e6


def test_sparse_attention_reading_every_window_key_is_the_windowed_model():
    # K = window: each query's indexer selection is its whole attention window, so the
    # sparse forward computes the windowed model's logits (float32 TINY model, L = 2 windows)
    cfg, icfg = TINY.lm, TINY.indexers[0]
    lm = init_lm(jax.random.PRNGKey(7), cfg)
    layers = idx.init_indexers(jax.random.PRNGKey(8), cfg, icfg)
    toks = corpora.heldout_stream("prose")[:128].astype(np.int32)
    out = sparse_attention.forward_sparse(lm, layers, toks, cfg, icfg, top_k=cfg.window,
                                          selection="dense")
    ref = forward(lm, jnp.asarray(toks)[None], cfg)[0]
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref), rtol=1e-4, atol=1e-4)
    lo, hi = sparse_attention.visible_ranges(128, cfg.window)
    for sel in out.selections:
        got = np.sort(np.where(np.asarray(sel.indices) < 0, 10 ** 6, np.asarray(sel.indices)), -1)
        for t in (0, 63, 64, 127):  # the selection is exactly the visible window [lo, hi)
            n = int(hi[t] - lo[t])
            np.testing.assert_array_equal(got[t, :n], np.arange(int(lo[t]), int(hi[t])))
            assert (got[t, n:] == 10 ** 6).all()
    # with K below the window the model reads fewer keys and its logits change
    fewer = sparse_attention.forward_sparse(lm, layers, toks, cfg, icfg, top_k=8, selection="dense")
    assert not np.allclose(np.asarray(fewer.logits), np.asarray(ref), atol=1e-3)


def test_committed_lm_with_dosa_selected_keys_equals_dense_selection():
    """The committed LM with DSA attention: keys chosen by jax.jit(dosa_jax.topk) on each
    layer's indexer (q, k, w) are bitwise those of dosa_jax.dense_topk, so are the logits."""
    lm_cfg, lm, ix, _, _ = dump.load_default_weights()
    icfg, layers = ix[32]
    toks = corpora.heldout_stream("code")[:257].astype(np.int32)
    runs = {s: sparse_attention.forward_sparse(lm, layers, toks[:256], lm_cfg, icfg, top_k=32,
                                               selection=s) for s in ("dosa", "dense")}
    dosa, dense = runs["dosa"], runs["dense"]
    for a, b in zip(dosa.selections, dense.selections):
        np.testing.assert_array_equal(np.asarray(a.indices), np.asarray(b.indices))
        np.testing.assert_array_equal(np.asarray(a.scores), np.asarray(b.scores))
    np.testing.assert_array_equal(np.asarray(dosa.logits), np.asarray(dense.logits))
    # the selection is the Top-K of the indexer's own logits (Eq. 1), and DoSA pruned keys
    x = rms_norm(embed_sequence(lm, toks[:256]), lm["layers"][0]["attn_norm"])[None]
    pos = jnp.arange(256)
    q, w = idx.queries(layers[0], x, pos, icfg, dt=jnp.float32)
    lg = np.asarray(idx.logits(q, w, idx.keys(layers[0], x, pos, icfg, dt=jnp.float32),
                               dt=jnp.float32)[0])
    sel, t = np.asarray(dosa.selections[0].indices), 200
    kth = np.sort(lg[t, :t + 1])[-32]
    assert (lg[t, sel[t]] >= kth - 1e-4 * np.abs(lg[t]).max()).all()
    st = dosa.selections[-1].stats
    assert int(np.sum(st.survivors)) < int(np.sum(st.screened))
    loss = sparse_attention.next_token_loss_sparse(lm, layers, toks, lm_cfg, icfg, top_k=32)
    assert 0.3 < loss < math.log(256), loss
    with pytest.raises(ValueError, match="selection"):
        sparse_attention.forward_sparse(lm, layers, toks, lm_cfg, icfg, top_k=32, selection="lax")
