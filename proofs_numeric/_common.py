"""Shared pieces of the numeric checks: float64 scope, instance families, results, CLI.

Every check builds *instances* (one query: head vectors ``q`` [H, D], signed
weights ``w`` [H], activation frequencies ``p`` [H], and a fixed number of keys
[n, D]) from named families — random ones and adversarial ones — and checks its
claim on every key of every instance. Instances are generated in NumPy float64
from a seed, so every run is reproducible.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from typing import Callable, Dict, Iterator, List, Sequence

import jax
import numpy as np

#: (H, D) shapes the float64 checks sweep (H ∈ {1, 2, 8, 32, 64}, D ∈ {1, 2, 32, 128}).
SHAPES_ALL = ((1, 1), (1, 128), (2, 2), (2, 32), (8, 1), (8, 32), (8, 128), (32, 2),
              (32, 32), (32, 128), (64, 32), (64, 128))
#: A smaller sweep that still covers every H and every D (used by the CPU tests).
SHAPES_SMALL = ((1, 1), (2, 2), (8, 32), (32, 128), (64, 1))

#: Instance families: random and adversarial (see :func:`make_query`).
FAMILIES = (
    "gaussian",          # i.i.d. heads, mixed-sign weights
    "correlated",        # heads share a direction (structured indexers)
    "zero_heads",        # some head vectors are exactly zero
    "all_positive",      # every weight > 0
    "all_negative",      # every weight < 0
    "all_zero",          # every weight == 0
    "zero_weights",      # mixed signs with some exact zeros
    "near_parallel",     # heads within 1e-7 of a common direction
    "exact_parallel",    # heads power-of-two multiples of one direction (d_h = 0)
    "antiparallel",      # pairs of heads whose residuals are u and −u
    "opposite_heads",    # q_h = −q_j pairs
    "huge",              # magnitudes ~2^60 (keys) and 2^30 (weights)
    "tiny",              # magnitudes ~2^-60 (keys) and 2^-30 (weights)
    "underflow",         # heads ~2^-68: their float32 squares are below the normal range
    "integer",           # small integers: exact arithmetic, exact ties
)


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Enable JAX float64 inside the block only; the previous setting is restored on exit
    (even on error), so x64 never leaks into other tests."""
    state = getattr(jax, "enable_x64", None)
    if state is not None and callable(state):
        with state(True):
            yield
        return
    old = jax.config.jax_enable_x64  # pragma: no cover - jax without the context manager
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


# ----------------------------------------------------------------------------- instances

def _unit(x, axis=-1):
    n = np.linalg.norm(x, axis=axis, keepdims=True)
    return np.where(n > 0, x / np.where(n > 0, n, 1.0), 0.0)


def _signed_weights(rng, H, lo=0.1, hi=1.0):
    return rng.uniform(lo, hi, H) * rng.choice([-1.0, 1.0], H)


def make_query(rng: np.random.Generator, H: int, D: int, family: str):
    """One query of a named family: (q [H, D], w [H]) in float64."""
    g = rng.standard_normal
    q = g((H, D)) / np.sqrt(D)
    w = _signed_weights(rng, H)
    if family == "gaussian":
        pass
    elif family == "correlated":
        shared = g(D) / np.sqrt(D)
        q = 0.8 * shared[None, :] + 0.45 * q
    elif family == "zero_heads":
        q[rng.uniform(size=H) < 0.4] = 0.0
        q[rng.integers(H)] = 0.0
    elif family == "all_positive":
        w = np.abs(w)
    elif family == "all_negative":
        w = -np.abs(w)
    elif family == "all_zero":
        w = np.zeros(H)
    elif family == "zero_weights":
        w[rng.uniform(size=H) < 0.4] = 0.0
    elif family == "near_parallel":
        base = _unit(g(D))
        q = (rng.uniform(0.5, 2.0, (H, 1)) * base[None, :]
             + 1e-7 * g((H, D)) * rng.choice([0.0, 1.0], (H, 1)))
    elif family == "exact_parallel":
        base = _unit(g(D))
        q = np.exp2(rng.integers(-3, 4, (H, 1))) * base[None, :]
        q[rng.uniform(size=H) < 0.2] *= -1.0
    elif family == "antiparallel":
        a = _unit(g(D))
        u = g(D) / np.sqrt(D)
        u = u - (u @ a) * a
        beta = rng.uniform(0.2, 2.0, H)
        sign = np.where(np.arange(H) % 2 == 0, 1.0, -1.0)
        q = beta[:, None] * a[None, :] + sign[:, None] * u[None, :]
        w = np.abs(w)
        w[1::2] = w[0::2][: len(w[1::2])]  # equal weights per pair: u_h = −u_l exactly
        w[rng.uniform(size=H) < 0.25] *= -1.0
    elif family == "opposite_heads":
        half = (H + 1) // 2
        q[half:] = -q[: H - half]
    elif family == "huge":
        q = q * 2.0 ** 40
        w = w * 2.0 ** 30
    elif family == "tiny":
        q = q * 2.0 ** -40
        w = w * 2.0 ** -30
    elif family == "underflow":
        q = q * 2.0 ** -68
    elif family == "integer":
        q = rng.integers(-2, 3, (H, D)).astype(np.float64)
        w = rng.integers(-3, 4, H).astype(np.float64)
    else:
        raise ValueError(f"unknown family {family!r}")
    return q.astype(np.float64), w.astype(np.float64)


def make_frequencies(rng: np.random.Generator, H: int, q, keys):
    """p_h: either measured on the keys (as the pipeline does on its seed sample) or
    adversarial values (exact 0, ½, 1 and random)."""
    mode = rng.integers(3)
    if mode == 0:
        return np.mean((keys @ q.T) > 0, axis=0) if len(keys) else np.full(H, 0.5)
    if mode == 1:
        return rng.choice([0.0, 0.5, 1.0], H)
    return rng.uniform(0.0, 1.0, H)


def residual_direction(qh, qj):
    """d = q_h − β* q_j with β* = relu(q_h·q_j)/‖q_j‖² (the Prop. 5 witness direction)."""
    n2 = qj @ qj
    beta = max(qh @ qj, 0.0) / n2 if n2 > 0 else 0.0
    return qh - beta * qj


def make_keys(rng: np.random.Generator, q, n_keys: int, family: str):
    """``n_keys`` keys [n, D] for query ``q``: Gaussian keys plus adversarial directions —
    the zero key, ±q_h, ±(Prop. 5 witnesses q_h − β* q_j), sums of heads, keys
    orthogonal to a head; scaled per family. Exactly ``n_keys`` rows."""
    H, D = q.shape
    special: List[np.ndarray] = [np.zeros(D)]
    for h in rng.permutation(H)[:16]:
        special += [q[h], -q[h]]
    pairs = rng.integers(0, H, (24, 2))
    for h, j in pairs:
        d = residual_direction(q[h], q[j])
        special += [d, -d, d + 1e-3 * q[j]]
    special += [q.sum(0), -q.sum(0), q[::2].sum(0) - q[1::2].sum(0)]
    g = rng.standard_normal((4, D))
    h = rng.integers(H)
    qh = q[h]
    if qh @ qh > 0:
        special += list(g - np.outer(g @ qh, qh) / (qh @ qh))  # orthogonal to head h
    special = np.stack(special)[: n_keys // 2]
    special = special * np.exp2(rng.integers(-2, 3, (len(special), 1)))
    n_rand = n_keys - len(special)
    rand = rng.standard_normal((n_rand, D))
    if family == "integer":
        rand = rng.integers(-2, 3, (n_rand, D)).astype(np.float64)
        special = np.round(special)
    keys = np.concatenate([special, rand], axis=0)
    if family == "huge":
        keys = keys * 2.0 ** 60
    elif family == "tiny":
        keys = keys * 2.0 ** -60
    return keys.astype(np.float64)


def make_batch(rng: np.random.Generator, n: int, H: int, D: int, n_keys: int,
               families: Sequence[str] = FAMILIES):
    """``n`` instances cycling through ``families``: dict of float64 arrays
    q [n, H, D], w [n, H], p [n, H], keys [n, n_keys, D] and the family names."""
    qs, ws, ps, ks, names = [], [], [], [], []
    for i in range(n):
        fam = families[i % len(families)]
        q, w = make_query(rng, H, D, fam)
        keys = make_keys(rng, q, n_keys, fam)
        p = make_frequencies(rng, H, q, keys)
        qs.append(q), ws.append(w), ps.append(p), ks.append(keys), names.append(fam)
    return dict(q=np.stack(qs), w=np.stack(ws), p=np.stack(ps).astype(np.float64),
                keys=np.stack(ks), family=names)


def budgets(H: int) -> tuple:
    """Retained budgets r to sweep for H heads (1 ≤ r ≤ H−1, as Config.budgets clips)."""
    if H < 2:
        return (1,)
    return tuple(sorted({1, max(1, H // 4), max(1, H // 2), H - 1}))


# ----------------------------------------------------------------------------- results

def result(name: str, claim: str, **counts) -> Dict:
    """A check's result: its name, the claim, counts, and ``passed`` (no violation)."""
    out = dict(name=name, claim=claim)
    out.update(counts)
    out.setdefault("violations", 0)
    out["passed"] = int(out["violations"]) == 0
    return out


def add_by_family(acc: Dict, families: Sequence[str], counts) -> None:
    """Accumulate per-instance violation counts into ``acc[family]`` (non-zero only)."""
    for fam, c in zip(families, np.asarray(counts).reshape(len(families), -1).sum(-1)):
        if c:
            acc[fam] = acc.get(fam, 0) + int(c)


def timed(fn: Callable, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    out["seconds"] = round(time.perf_counter() - t, 2)
    return out


def format_table(rows: Sequence[Dict]) -> str:
    """Plain-text table: name, instances, keys/pairs, violations, max violation, time, status."""
    head = f"{'check':<28} {'instances':>10} {'keys/pairs':>14} {'violations':>11} " \
           f"{'max viol.':>11} {'time s':>8}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        n_keys = r.get("pairs", r.get("keys", 0))
        mv = r.get("max_violation", 0.0)
        lines.append(f"{r['name']:<28} {int(r.get('instances', 0)):>10} {int(n_keys):>14} "
                     f"{int(r['violations']):>11} {float(mv):>11.3g} "
                     f"{float(r.get('seconds', 0.0)):>8.1f}  {'ok' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


def format_result(r: Dict) -> str:
    keys = [k for k in r if k not in ("name", "claim")]
    width = max(len(k) for k in keys)
    lines = [f"{r['name']}: {r['claim']}"]
    for k in keys:
        lines.append(f"  {k:<{width}} {r[k]}")
    return "\n".join(lines)


def cli(check: Callable, description: str, argv=None, extra: Callable = None) -> int:
    """``python -m proofs_numeric.<name> [--instances N] [--seed S]``: run, print, exit 1 on failure."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--instances", type=int, default=None, help="number of instances")
    ap.add_argument("--seed", type=int, default=0)
    if extra is not None:
        extra(ap)
    args = vars(ap.parse_args(argv))
    kwargs = {k: v for k, v in args.items() if v is not None}
    if "instances" in kwargs:
        kwargs["n_instances"] = kwargs.pop("instances")
    r = timed(check, **kwargs)
    print(format_result(r))
    return 0 if r["passed"] else 1


@functools.lru_cache(maxsize=None)
def over_instances_variants_keys(one: Callable, groups: int):
    """jit(vmap) of a per-key check ``one(5 instance args, variant, key, groups=...)``
    over instances (axis 0 of the first five), variants (sixth) and keys (seventh)."""
    f = jax.vmap(functools.partial(one, groups=groups), in_axes=(None,) * 6 + (0,))
    f = jax.vmap(f, in_axes=(None,) * 5 + (0, None))
    return jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, 0, None, None)))
