"""Train the language model, then distil its indexers; evaluate; export weights.

    python -m dosa_jax.lm.train --preset h200 --workdir W --stage all \\
        --lm-seconds 200 --indexer-seconds 150 --export W/lm_weights.npz

Stages (each resumes from ``W`` if a checkpoint is there):

1. ``lm``: next-byte prediction on crops of ``seq_len`` = 2·window tokens,
   half of every batch code and half prose, AdamW with warm-up and cosine
   decay. The number of steps is fixed when the stage first starts: given
   (``--lm-steps``) or fitted to ``--lm-seconds`` by timing a few steps.
2. ``indexer``: DeepSeek's dense warm-up. The LM is frozen *as committed*
   (int8 round trip, see ``checkpoint``); every layer's indexer, for each head
   count, minimises the KL to that layer's head-summed attention.
3. ``eval``: LM loss (train / held-out, per domain) and indexer Top-K coverage
   on held-out crops, trained against randomly initialised indexers, recency
   and the oracle (``indexer.coverage``).

``--slack LAMBDA`` adds LAMBDA · ``dosa_jax.slack.slack_loss`` of every indexer
(on a sample of each step's queries, at the crop length) to the distillation
KL, through ``optax.chain(dosa_jax.slack.regularizer(...), <optimizer>)``;
``--slack-layer-scale 4,1,1,1`` multiplies LAMBDA per LM layer (a layer whose
certificate needs a stronger push).

``--weights FILE`` starts from committed weights (skipping stage 1);
``--indexer-init`` then fine-tunes their indexers (preset ``h200-long``:
distillation on 32K-token crops).

Everything is jitted; data crops are sampled on the device from the whole
training stream, so a step depends only on (seed, step) and a resumed run
draws the same batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from functools import partial
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dosa_jax.lm import checkpoint, corpora, indexer as idx
from dosa_jax.lm.indexer import IndexerConfig
from dosa_jax.lm.model import LMConfig, forward, init_lm, next_token_loss, num_params


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that fixes a training run (frozen; stored in checkpoints)."""

    lm: LMConfig = LMConfig()
    indexers: Tuple[IndexerConfig, ...] = (IndexerConfig(n_heads=32), IndexerConfig(n_heads=64))
    seq_len: int = 8192
    lm_batch: int = 4  # even: half code, half prose
    lm_lr: float = 2e-3
    lm_min_lr_ratio: float = 0.1
    lm_warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    idx_batch: int = 2
    idx_seq_len: int = 0  # indexer crops (0: seq_len)
    idx_tail_blocks: int = 0  # distil on the last blocks of a crop only (0: its second half)
    idx_lr: float = 1e-3
    idx_warmup: int = 50
    eval_crops: int = 8  # per domain and split
    top_ks: Tuple[int, ...] = (64, 256, 2048)
    remat: bool = False
    seed: int = 0
    # slack regulariser (dosa_jax.slack) in the indexer step: KL + slack_weight · slack
    slack_weight: float = 0.0  # λ (0: the plain distillation step)
    slack_queries: int = 64  # queries sampled per step from one crop's distillation queries
    slack_top_k: int = 2048  # K of the certificate
    slack_seed_size: Optional[int] = 8192  # Config.seed_size of the planner
    slack_temperature: float = 0.1
    slack_margin: float = 0.0
    slack_layer_scale: Tuple[float, ...] = ()  # λ's factor per LM layer (): 1 on every layer


PRESETS = {
    "h200": TrainConfig(),
    # a few seconds on a CPU: what the tests train
    "tiny": TrainConfig(
        lm=LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, window=64, block=16,
                    compute_dtype="float32"),
        indexers=(IndexerConfig(n_heads=4, head_dim=16, rope_dim=8, q_rank=8, compute_dtype="float32"),
                  IndexerConfig(n_heads=8, head_dim=16, rope_dim=8, q_rank=8, compute_dtype="float32")),
        seq_len=128, lm_batch=4, lm_lr=3e-3, lm_warmup=5, idx_batch=2, idx_lr=3e-3, idx_warmup=5,
        eval_crops=2, top_ks=(8, 32), slack_queries=8, slack_top_k=8, slack_seed_size=16),
}
# Long-crop indexer distillation: keys up to 32K positions back, loss on the
# last 1024 queries of each crop (the same scoring work per step as stage 2;
# XLA's CPU memory estimate for the step: 26 GB; 64K crops estimated 99 GB).
# Meant to continue from committed indexers (--indexer-init weights); the committed
# weights' indexers were fine-tuned with it (recipe in lm/README.md).
PRESETS["h200-long"] = dataclasses.replace(PRESETS["h200"], idx_seq_len=32768, idx_tail_blocks=2,
                                           idx_batch=2, idx_lr=3e-4, idx_warmup=20)


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- data

def device_streams(split: str):
    """(code, prose) token streams of a split as device uint8 arrays."""
    get = corpora.train_stream if split == "train" else corpora.heldout_stream
    return tuple(jnp.asarray(get(d)) for d in corpora.DOMAINS)


def sample_crops(key, stream, n: int, length: int):
    starts = jax.random.randint(key, (n,), 0, stream.shape[0] - length)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (length,)))(starts).astype(jnp.int32)


def sample_batch(seed: int, step, streams, batch: int, length: int):
    """``batch`` crops of ``length`` tokens, half from each domain, fixed by (seed, step)."""
    if batch % len(streams):
        raise ValueError(f"batch {batch} must be a multiple of the number of domains {len(streams)}")
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    keys = jax.random.split(key, len(streams))
    per = batch // len(streams)
    return jnp.concatenate([sample_crops(k, s, per, length) for k, s in zip(keys, streams)], axis=0)


def eval_crops(stream: np.ndarray, n: int, length: int) -> np.ndarray:
    """``n`` crops at evenly spaced offsets (deterministic)."""
    starts = np.linspace(0, len(stream) - length, n).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


# ----------------------------------------------------------------------------- optimisation

def lr_at(step, total, peak, warmup, min_ratio):
    """Linear warm-up then cosine decay to ``min_ratio · peak`` at ``total``."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total, jnp.float32), warmup + 1.0)
    warm = peak * (step + 1.0) / warmup
    frac = jnp.clip((step - warmup) / (total - warmup), 0.0, 1.0)
    cos = peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(step < warmup, warm, cos)


def make_optimizer(params, tc: TrainConfig):
    """Clip + Adam + decoupled weight decay on matrices; the learning rate is applied by the step."""
    mask = jax.tree_util.tree_map(lambda p: p.ndim == 2, params)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(tc.weight_decay, mask=mask))


def _apply(params, updates, lr):
    return jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)


@partial(jax.jit, static_argnames=("tc",), donate_argnums=(0, 1))
def lm_train_step(params, opt_state, step, total_steps, streams, tc: TrainConfig):
    tokens = sample_batch(tc.seed, step, streams, tc.lm_batch, tc.seq_len + 1)
    loss, grads = jax.value_and_grad(next_token_loss)(params, tokens, tc.lm, remat=tc.remat)
    opt = make_optimizer(params, tc)
    updates, opt_state = opt.update(grads, opt_state, params)
    lr = lr_at(step, total_steps, tc.lm_lr, tc.lm_warmup, tc.lm_min_lr_ratio)
    return _apply(params, updates, lr), opt_state, loss


def frozen_layers(lm_params, tokens, tc: TrainConfig):
    """Every layer's (normalised input x [B, L, d], head-averaged attention) of the frozen LM."""
    _, per_layer = forward(lm_params, tokens, tc.lm, collect=True)
    return jax.lax.stop_gradient(per_layer)


def indexer_objective(idx_params: dict, lm_params, tokens, tc: TrainConfig, per_layer=None):
    """Σ over head counts of the layer-mean distillation KL; also per head count.

    ``per_layer``: the frozen LM's layers (:func:`frozen_layers`) when already computed.
    """
    if per_layer is None:
        _, per_layer = forward(lm_params, tokens, tc.lm, collect=True)
    per_layer = jax.lax.stop_gradient(per_layer)
    losses = {}
    for cfg in tc.indexers:
        layers = idx_params[str(cfg.n_heads)]
        kl = [idx.distillation_loss(p, x, probs, cfg, tc.lm, tc.idx_tail_blocks)
              for p, (x, probs) in zip(layers, per_layer)]
        losses[str(cfg.n_heads)] = sum(kl) / len(kl)
    return sum(losses.values()), losses


# ----------------------------------------------------------------------------- slack regulariser

def slack_config(tc: TrainConfig):
    """The ``dosa_jax.Config`` whose plan the slack loss differentiates (K, seeds)."""
    import dosa_jax
    return dosa_jax.Config(top_k=tc.slack_top_k, seed_size=tc.slack_seed_size)


def slack_inputs(p: dict, x, positions, cfg: IndexerConfig, tc: TrainConfig) -> dict:
    """``slack_loss`` keyword arguments of one layer's indexer on one crop.

    Args:
      p: the layer's indexer parameters (differentiated).
      x: [L, d] the frozen LM's normalised layer input of the crop.
      positions: [S] int32 query positions (each sees the keys [0, position]).

    q [S, H, D], k [L, D], w [S, H] in float32 and Hadamard-rotated as the dumps are
    (``dump._indexer_rows``: the grouped residual allowance is not rotation invariant).
    """
    from dosa_jax.lm.dump import hadamard
    L = x.shape[0]
    k = idx.keys(p, x[None], jnp.arange(L), cfg, dt=jnp.float32)[0]
    q, w = idx.queries(p, x[positions][None], positions, cfg, dt=jnp.float32)
    r = jnp.asarray(hadamard(cfg.head_dim), jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    q = jnp.einsum("thd,de->the", q[0], r, precision=hp)
    k = jnp.einsum("nd,de->ne", k, r, precision=hp)
    positions = positions.astype(jnp.int32)
    return dict(q=q, k=k, w=w[0], lo=jnp.zeros_like(positions), hi=positions + 1,
                config=slack_config(tc), temperature=tc.slack_temperature,
                margin=tc.slack_margin)


def slack_batch(per_layer, seed: int, step, tc: TrainConfig) -> dict:
    """The regulariser's ``batch``: one crop of the step's batch (crop ``step mod B``) and
    ``tc.slack_queries`` of its distillation query positions, both fixed by (seed, step).

    Returns ``{"x": [n_layers, L, d], "positions": [S] int32}``.
    """
    xs = jnp.stack([x for x, _ in per_layer])               # [n_layers, B, L, d]
    B, L = xs.shape[1], xs.shape[2]
    crop = jnp.asarray(step, jnp.int32) % B
    x = jax.lax.dynamic_index_in_dim(xs, crop, axis=1, keepdims=False)
    idx.query_blocks(tc.lm, L, tc.idx_tail_blocks)          # validates L
    C, W = tc.lm.block, tc.lm.window
    tail = tc.idx_tail_blocks
    first = (W // C if tail <= 0 else max(W // C, L // C - tail)) * C
    n = L - first
    S = min(tc.slack_queries, n)
    key = jax.random.fold_in(jax.random.PRNGKey(seed + 2), step)
    pos = first + jax.random.choice(key, n, (S,), replace=False)
    return dict(x=x, positions=jnp.sort(pos).astype(jnp.int32))


def slack_layer_scales(tc: TrainConfig) -> Tuple[float, ...]:
    """λ's factor on each LM layer's slack term: ``tc.slack_layer_scale``, or 1 on every layer
    when it is empty.

    Raises:
      ValueError: not one finite factor ≥ 0 per layer (naming ``slack_layer_scale``).
    """
    n = tc.lm.n_layers
    scale = tuple(float(x) for x in tc.slack_layer_scale) or (1.0,) * n
    if len(scale) != n or not all(np.isfinite(x) and x >= 0 for x in scale):
        raise ValueError(f"slack_layer_scale must hold one finite factor >= 0 per layer "
                         f"({n}), got {tc.slack_layer_scale!r}")
    return scale


def with_slack_layer_scale(tc: TrainConfig, spec: str) -> TrainConfig:
    """``tc`` with ``slack_layer_scale`` parsed from comma-separated factors ("4,1,1,1").

    Raises:
      ValueError: not a number per layer, or a factor that is negative or not finite.
    """
    try:
        scale = tuple(float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"comma-separated numbers expected, got {spec!r}") from None
    out = dataclasses.replace(tc, slack_layer_scale=scale)
    slack_layer_scales(out)
    return out


def slack_objective(idx_params: dict, batch: dict, tc: TrainConfig):
    """Σ over head counts of the layer mean of scale_l · slack loss_l (the regularised term
    per head count; scale_l from :func:`slack_layer_scales`, 1 by default)."""
    from dosa_jax.slack import slack_loss
    scale = slack_layer_scales(tc)
    out = {}
    for cfg in tc.indexers:
        layers = idx_params[str(cfg.n_heads)]
        vals = [scale[li] * slack_loss(**slack_inputs(p, batch["x"][li], batch["positions"],
                                                      cfg, tc))
                for li, p in enumerate(layers)]
        out[str(cfg.n_heads)] = sum(vals) / len(vals)
    return sum(out.values()), out


def slack_enabled(tc: TrainConfig, slack_weight=None) -> bool:
    return slack_weight is not None or tc.slack_weight != 0


def slack_regularizers(tc: TrainConfig, slack_weight=None) -> list:
    """One ``dosa_jax.slack.regularizer`` per (head count, layer), weight λ · scale_l /
    n_layers (the layer mean, like the KL; scale_l from :func:`slack_layer_scales`, 1 by
    default): chained, they add λ · ∇ :func:`slack_objective` to the updates.

    λ is ``slack_weight`` when given (an array: one compilation serves every λ, and λ = 0
    leaves the updates bitwise unchanged), else ``tc.slack_weight`` (a static number). Their
    ``update`` needs ``batch=`` (:func:`slack_batch`).
    """
    from dosa_jax.slack import regularizer
    n = tc.lm.n_layers
    scale = slack_layer_scales(tc)

    def layer_weight(li):
        if slack_weight is None:
            return tc.slack_weight * scale[li] / n
        return lambda count: jnp.asarray(slack_weight, jnp.float32) * scale[li] / n

    regs = []
    for cfg in tc.indexers:
        for li in range(n):
            def fn(p, batch, cfg=cfg, li=li):
                return slack_inputs(p[str(cfg.n_heads)][li], batch["x"][li], batch["positions"],
                                    cfg, tc)
            regs.append(regularizer(fn, layer_weight(li)))
    return regs


def make_indexer_optimizer(params, tc: TrainConfig, slack_weight=None):
    """The indexer optimizer: with the slack term enabled (``slack_weight`` given or
    ``tc.slack_weight`` ≠ 0), ``optax.chain`` of :func:`slack_regularizers` then
    :func:`make_optimizer`; else :func:`make_optimizer` alone."""
    base = make_optimizer(params, tc)
    if not slack_enabled(tc, slack_weight):
        return base
    return optax.chain(*slack_regularizers(tc, slack_weight), base)


@partial(jax.jit, static_argnames=("tc",), donate_argnums=(0, 1))
def indexer_train_step(idx_params, opt_state, lm_params, step, total_steps, streams, tc: TrainConfig,
                       slack_weight=None):
    """One indexer step (LM frozen): KL distillation, plus λ · slack through the optimizer
    chain when enabled (``slack_weight`` or ``tc.slack_weight``; see
    :func:`make_indexer_optimizer`)."""
    tokens = sample_batch(tc.seed + 1, step, streams, tc.idx_batch, tc.idx_seq_len or tc.seq_len)
    slack = slack_enabled(tc, slack_weight)
    per_layer = frozen_layers(lm_params, tokens, tc) if slack else None
    (loss, parts), grads = jax.value_and_grad(indexer_objective, has_aux=True)(
        idx_params, lm_params, tokens, tc, per_layer)
    opt = make_indexer_optimizer(idx_params, tc, slack_weight)
    extra = dict(batch=slack_batch(per_layer, tc.seed, step, tc)) if slack else {}
    updates, opt_state = opt.update(grads, opt_state, idx_params, **extra)
    lr = lr_at(step, total_steps, tc.idx_lr, tc.idx_warmup, 0.1)
    return _apply(idx_params, updates, lr), opt_state, parts


# ----------------------------------------------------------------------------- the loop

def run_loop(name, step_fn, state, start_step, total_steps, *, steps, seconds, save, log_every=50,
             stop_after=None):
    """Run ``step_fn(state, step, total) -> (state, metrics)`` with time-fitted length.

    If ``total_steps`` is None (fresh run), it becomes ``steps`` or, with
    ``seconds``, the number of steps that fit once a few have been timed.
    ``save(state, step, total)`` is called every ~60 s and at the end;
    ``stop_after`` ends this run early (a later run resumes) after that many steps.
    """
    step, t0, last_save = start_step, time.time(), time.time()
    timing_steps = 5
    provisional = total_steps or steps or 10**9
    t_compile = None
    while True:
        total = total_steps or provisional
        if step >= total or (stop_after is not None and step - start_step >= stop_after):
            break
        ts = time.time()
        state, metrics = step_fn(state, step, total)
        if step == start_step:
            jax.block_until_ready(metrics)
            t_compile = time.time() - ts
            t_timing = time.time()
        step += 1
        if total_steps is None and step == start_step + 1 + timing_steps:
            jax.block_until_ready(metrics)
            per = (time.time() - t_timing) / timing_steps
            if steps:
                total_steps = steps
            else:
                total_steps = max(step, int((seconds - (time.time() - t0)) / per) + step)
            log(f"[{name}] first step (compile) {t_compile:.1f}s, {per * 1e3:.1f} ms/step -> "
                f"{total_steps} steps")
        if step % log_every == 0 or step == (total_steps or provisional):
            m = jax.tree_util.tree_map(lambda v: float(v), metrics)
            log(f"[{name}] step {step}/{total_steps or provisional} {m} elapsed {time.time() - t0:.1f}s")
        if time.time() - last_save > 60:
            save(state, step, total_steps or provisional)
            last_save = time.time()
    save(state, step, total_steps or provisional)
    return state, step, total_steps or provisional, time.time() - t0, t_compile


def train_lm(tc: TrainConfig, workdir: str, *, steps=None, seconds=None, stop_after=None):
    """Stage 1. Returns (params, info)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "lm_ckpt.npz")
    params = init_lm(jax.random.PRNGKey(tc.seed), tc.lm)
    opt_state = make_optimizer(params, tc).init(params)
    start, total, prior = 0, None, {}
    if os.path.exists(path):
        (params, opt_state), prior = checkpoint.load_tree(path, (params, opt_state))
        start, total = prior["step"], prior["total_steps"]
        log(f"[lm] resumed at step {start}/{total}")
    streams = device_streams("train")
    log(f"[lm] {num_params(params) / 1e6:.2f}M parameters; train tokens "
        f"{[int(s.shape[0]) for s in streams]}; {tc.lm_batch}x{tc.seq_len} tokens/step")

    def step_fn(state, step, total):
        p, o = state
        p, o, loss = lm_train_step(p, o, jnp.int32(step), jnp.int32(total), streams, tc)
        return (p, o), {"loss": loss}

    def save(state, step, total):
        checkpoint.save_tree(path, state, step=step, total_steps=total,
                             wall_s=prior.get("wall_s", 0.0) + time.time() - t_start)

    t_start = time.time()
    (params, opt_state), step, total, wall, t_compile = run_loop(
        "lm", step_fn, (params, opt_state), start, total, steps=steps, seconds=seconds, save=save,
        stop_after=stop_after)
    info = dict(steps=step, total_steps=total, tokens=step * tc.lm_batch * tc.seq_len,
                wall_s_this_run=wall, first_step_s=t_compile,
                wall_s_total=prior.get("wall_s", 0.0) + time.time() - t_start)
    return params, info


def train_indexers(tc: TrainConfig, workdir: str, lm_params, *, steps=None, seconds=None,
                   stop_after=None, init: Optional[Dict[int, tuple]] = None):
    """Stage 2 (LM frozen). Returns ({n_heads: (cfg, params)}, info).

    ``init``: start from these indexers ({n_heads: (cfg, layers)}) instead of
    a random initialisation (a checkpoint in ``workdir`` still takes precedence).
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "indexer_ckpt.npz")
    keys = jax.random.split(jax.random.PRNGKey(tc.seed + 7), len(tc.indexers))
    params = {str(c.n_heads): idx.init_indexers(k, tc.lm, c) for k, c in zip(keys, tc.indexers)}
    if init is not None:
        for c in tc.indexers:
            if init[c.n_heads][0] != c:
                raise ValueError(f"init indexer H={c.n_heads} has config {init[c.n_heads][0]}, "
                                 f"expected {c}")
        params = {str(c.n_heads): init[c.n_heads][1] for c in tc.indexers}
    opt_state = make_indexer_optimizer(params, tc).init(params)
    start, total, prior = 0, None, {}
    if os.path.exists(path):
        (params, opt_state), prior = checkpoint.load_tree(path, (params, opt_state))
        start, total = prior["step"], prior["total_steps"]
        log(f"[indexer] resumed at step {start}/{total}")
    streams = device_streams("train")
    log(f"[indexer] {num_params(params) / 1e6:.2f}M parameters "
        f"({', '.join(f'H={h}: {num_params(p) / 1e6:.2f}M' for h, p in params.items())}); "
        f"{tc.idx_batch}x{tc.idx_seq_len or tc.seq_len} tokens/step, "
        f"{'last %d query blocks' % tc.idx_tail_blocks if tc.idx_tail_blocks else 'second-half queries'}"
        + (f"; slack regulariser λ={tc.slack_weight}, {tc.slack_queries} queries/step, "
           f"K={tc.slack_top_k}, per-layer factors {slack_layer_scales(tc)}"
           if slack_enabled(tc) else ""))

    def step_fn(state, step, total):
        p, o = state
        p, o, parts = indexer_train_step(p, o, lm_params, jnp.int32(step), jnp.int32(total),
                                         streams, tc)
        return (p, o), {f"kl_H{h}": v for h, v in parts.items()}

    def save(state, step, total):
        checkpoint.save_tree(path, state, step=step, total_steps=total,
                             wall_s=prior.get("wall_s", 0.0) + time.time() - t_start)

    t_start = time.time()
    (params, opt_state), step, total, wall, t_compile = run_loop(
        "indexer", step_fn, (params, opt_state), start, total, steps=steps, seconds=seconds,
        save=save, log_every=25, stop_after=stop_after)
    info = dict(steps=step, total_steps=total, wall_s_this_run=wall, first_step_s=t_compile,
                wall_s_total=prior.get("wall_s", 0.0) + time.time() - t_start)
    return {c.n_heads: (c, params[str(c.n_heads)]) for c in tc.indexers}, info


def roundtrip_int8(tree):
    """What ``export_weights`` + ``load_weights`` turn the parameters into."""
    def rt(a):
        if a.ndim != 2:
            return a
        q, s = checkpoint.quantize_int8(np.asarray(a))
        return jnp.asarray(q.astype(np.float32) * s[None, :])
    return jax.tree_util.tree_map(rt, tree)


# ----------------------------------------------------------------------------- evaluation

@partial(jax.jit, static_argnames=("cfg",))
def _lm_loss(params, tokens, cfg):
    return next_token_loss(params, tokens, cfg)


@partial(jax.jit, static_argnames=("cfg",))
def _collect(params, tokens, cfg):
    return forward(params, tokens, cfg, collect=True)[1]


@partial(jax.jit, static_argnames=("cfg", "lm_cfg", "top_ks"))
def _coverage(p, x, probs, cfg, lm_cfg, top_ks):
    return idx.coverage(p, x, probs, cfg, lm_cfg, top_ks)


def evaluate(tc: TrainConfig, lm_params, indexers: Optional[Dict[int, tuple]] = None, *,
             crops: Optional[int] = None, batch: int = 2, random_baseline: bool = True) -> dict:
    """LM loss per domain and split; indexer coverage per domain, layer, head count."""
    n = crops or tc.eval_crops
    out = {"lm_loss_nats_per_byte": {}, "coverage": {}}
    for d in corpora.DOMAINS:
        for split, get in (("train", corpora.train_stream), ("heldout", corpora.heldout_stream)):
            c = eval_crops(get(d), n, tc.seq_len + 1)
            losses = [float(_lm_loss(lm_params, jnp.asarray(c[i:i + batch]), tc.lm))
                      for i in range(0, n, batch)]
            out["lm_loss_nats_per_byte"][f"{d}/{split}"] = float(np.mean(losses))
    if not indexers:
        return out
    rand = {}
    if random_baseline:
        for h, (cfg, _) in indexers.items():
            rand[h] = idx.init_indexers(jax.random.PRNGKey(tc.seed + 1234), tc.lm, cfg)
    for d in corpora.DOMAINS:
        c = eval_crops(corpora.heldout_stream(d), n, tc.seq_len)
        acc: Dict[str, list] = {}
        for i in range(0, n, batch):
            per_layer = _collect(lm_params, jnp.asarray(c[i:i + batch]), tc.lm)
            for li, (x, probs) in enumerate(per_layer):
                for h, (cfg, layers) in indexers.items():
                    variants = [("trained", layers[li])]
                    if random_baseline:
                        variants.append(("random", rand[h][li]))
                    for kind, p in variants:
                        r = _coverage(p, x, probs, cfg, tc.lm, tuple(tc.top_ks))
                        acc.setdefault(f"{d}/layer{li}/H{h}/{kind}", []).append(
                            {k: float(v) for k, v in r.items()})
        for key, rows in acc.items():
            out["coverage"][key] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return out


def format_coverage(res: dict, K: int) -> str:
    """A text table: layer x head count, trained / random / recent / oracle at K."""
    lines = [f"{'domain/layer/H':24s} {'trained':>8s} {'random':>8s} {'recent':>8s} {'oracle':>8s} "
             f"{'KL':>7s}"]
    for key, v in res["coverage"].items():
        if not key.endswith("/trained"):
            continue
        base = key[:-len("/trained")]
        r = res["coverage"].get(base + "/random", {})
        lines.append(f"{base:24s} {v[f'indexer@{K}']:8.4f} {r.get(f'indexer@{K}', float('nan')):8.4f} "
                     f"{v[f'recent@{K}']:8.4f} {v[f'oracle@{K}']:8.4f} {v['kl']:7.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the LM and its DSA indexers (see module doc).")
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--workdir", required=True, help="checkpoints go here (resumed if present)")
    ap.add_argument("--stage", default="all", choices=["lm", "indexer", "eval", "all"])
    ap.add_argument("--lm-steps", type=int, default=None)
    ap.add_argument("--lm-seconds", type=float, default=200.0)
    ap.add_argument("--indexer-steps", type=int, default=None)
    ap.add_argument("--indexer-seconds", type=float, default=150.0)
    ap.add_argument("--export", default=None, help="write the int8 weights file here")
    ap.add_argument("--weights", default=None, help="evaluate/continue from this weights file")
    ap.add_argument("--indexer-init", action="store_true",
                    help="indexer stage: start from the indexers in --weights (fine-tuning)")
    ap.add_argument("--metrics", default=None, help="write the evaluation JSON here")
    ap.add_argument("--eval-crops", type=int, default=None)
    ap.add_argument("--slack", type=float, default=None, metavar="LAMBDA",
                    help="indexer stage: add LAMBDA · slack loss (dosa_jax.slack) to the KL")
    ap.add_argument("--slack-layer-scale", default="", metavar="F0,F1,...",
                    help="LAMBDA's factor per LM layer, e.g. 4,1,1,1 (default: 1 on every layer)")
    a = ap.parse_args(argv)
    tc = PRESETS[a.preset]
    if a.slack is not None:
        if not (a.slack >= 0 and np.isfinite(a.slack)):
            ap.error(f"--slack must be a finite number >= 0, got {a.slack}")
        tc = dataclasses.replace(tc, slack_weight=float(a.slack))
    if a.slack_layer_scale:
        try:
            tc = with_slack_layer_scale(tc, a.slack_layer_scale)
        except ValueError as e:
            ap.error(f"--slack-layer-scale: {e}")
    log(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
        f"preset {a.preset}")
    t_all = time.time()
    run_info = {"preset": a.preset, "stage": a.stage, "train_config": repr(tc),
                "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    meta = dict(run_info)
    lm_params = indexers = None
    if a.weights:  # keep the provenance of the weights, record this run after it
        lm_cfg, lm_params, indexers, meta_w = checkpoint.load_weights(a.weights)
        if lm_cfg != tc.lm:
            raise SystemExit(f"--weights LM config {lm_cfg} differs from preset {a.preset}")
        meta = dict(meta_w)
        meta["later_runs"] = list(meta_w.get("later_runs", [])) + [run_info]
    if a.stage in ("lm", "all") and lm_params is None:
        params, info = train_lm(tc, a.workdir, steps=a.lm_steps, seconds=a.lm_seconds)
        meta["lm_training"] = info
        meta["lm_float_eval"] = evaluate(tc, params, None, crops=a.eval_crops)["lm_loss_nats_per_byte"]
        log(f"[lm] float weights: {meta['lm_float_eval']}")
        lm_params = roundtrip_int8(params)
        if a.export:  # export early: a later stage killed by a time limit loses nothing
            checkpoint.export_weights(a.export, tc.lm, lm_params, {}, meta)
    if a.stage in ("indexer", "all"):
        if lm_params is None:
            raise SystemExit("indexer stage needs --weights or a finished lm stage")
        init = indexers if a.indexer_init else None
        if a.indexer_init and not init:
            raise SystemExit("--indexer-init needs --weights holding indexers")
        indexers, info = train_indexers(tc, a.workdir, lm_params, steps=a.indexer_steps,
                                        seconds=a.indexer_seconds, init=init)
        meta["indexer_fine_tuning" if init else "indexer_training"] = info
        indexers = {h: (c, roundtrip_int8(p)) for h, (c, p) in indexers.items()}
        if a.export:
            checkpoint.export_weights(a.export, tc.lm, lm_params, indexers, meta)
            log(f"exported {a.export} ({os.path.getsize(a.export) / 1e6:.2f} MB)")
    if a.stage in ("eval", "all") and lm_params is not None:
        t0 = time.time()
        res = evaluate(tc, lm_params, indexers, crops=a.eval_crops)
        res["eval_wall_s"] = time.time() - t0
        res["meta"] = meta
        log(json.dumps(res["lm_loss_nats_per_byte"], indent=1))
        if indexers:
            for K in tc.top_ks:
                log(f"Top-{K} attention-mass coverage (held-out, second-half queries)\n"
                    + format_coverage(res, K))
        if a.metrics:
            with open(a.metrics, "w") as f:
                json.dump(res, f, indent=1)
    log(f"total wall {time.time() - t_all:.1f}s")


if __name__ == "__main__":
    main()
