"""The main job: ``python -m dosa_jax`` runs DoSA and the dense baseline on built-in
data, checks that they select bitwise the same keys, and prints survival, the seed
threshold against τ*, the retained-head budgets and timings.

Data (``--data``):
  trained     the DSA indexer of the small LM in ``dosa_jax.lm`` on held-out text
              (``dosa_jax.datasets.trained``; the committed fixture at N=4096, T≤64,
              otherwise regenerated from the committed weights).
  structured  the ``structured`` synthetic generator (correlated heads, topic keys).
  gaussian    i.i.d. Gaussian q/k/w: the worst case, where almost nothing is pruned.

Queries are the last T positions of a causal prefill over N keys.
"""

from __future__ import annotations

import argparse
import sys
import time

DATA = ("trained", "structured", "gaussian")
DOMAINS = ("code", "prose")
LAYERS = (0, 1, 2, 3)
TRAINED_HEADS = (32, 64)
KEY_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")
SEED_STRATEGIES = ("union", "local", "sinks", "strided")  # dosa_jax.Config.seed_strategy
BACKENDS = ("auto", "reference", "pallas")  # dosa_jax.Config.backend
#: options that only one kind of data reads (refused with the other kinds)
TRAINED_ONLY = ("domain", "layer")
SYNTHETIC_ONLY = ("D", "seed")
#: survival above this (less than a fifth of the screened keys pruned) gets a warning
LOW_PRUNING_SURVIVAL = 0.8


def _int_at_least(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0)


def budget(text: str):
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer, got {text!r}") from None


def witness_count(text: str):
    if text == "auto":
        return None
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer, got {text!r}") from None
    if v < 0 or v % 64:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a multiple of 64 (the block size) "
                                         f">= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dosa_jax", description=__doc__, allow_abbrev=False,
        formatter_class=lambda prog: _Formatter(prog, max_help_position=32))
    p.add_argument("--data", choices=DATA, default="trained", help="which built-in data")
    p.add_argument("--domain", choices=DOMAINS, default="code",
                   help="trained data only: held-out CPython source (code) or Shakespeare (prose)")
    p.add_argument("--layer", type=int, choices=LAYERS, default=3,
                   help="trained data only: the LM layer whose indexer is used")
    p.add_argument("--T", type=positive_int, default=64,
                   help="queries (the last T positions); T <= N")
    p.add_argument("--N", type=positive_int, default=4096,
                   help="keys (context length); trained data other than the fixture's N=4096 "
                        "or T>64 is regenerated from the committed weights")
    p.add_argument("--H", type=positive_int, default=32,
                   help="indexer heads, >= 2 (trained data: 32 or 64)")
    p.add_argument("--D", type=positive_int, default=128,
                   help="synthetic data only: head dimension (trained data: 128)")
    p.add_argument("--K", type=positive_int, default=512,
                   help="top_k: keys selected per query; at most N - T + 1 (the keys the "
                        "first query sees)")
    p.add_argument("--key-dtype", choices=KEY_DTYPES, default="float8_e4m3fn",
                   help="key storage; float8_e4m3fn comes with a per-key float32 scale")
    p.add_argument("--retained", type=budget, default="auto",
                   help="retained-head budget r in [1, H-1], or 'auto' (per query, Eq. 18-21)")
    p.add_argument("--seed-strategy", choices=SEED_STRATEGIES, default="union",
                   help="which keys give the seed threshold τ (Eq. 2)")
    p.add_argument("--block-witnesses", type=witness_count, default="auto", metavar="W",
                   help="extra witnesses for τ per query: the keys of its W/64 best blocks of "
                        "64 keys, ranked by their mean key's score (a multiple of 64; 0: off; "
                        "auto: the backend decides per call, the kernels by their gate)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: Pallas kernels on a GPU, the pure-jnp reference elsewhere")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="synthetic data only: random seed of the generator")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls after the first (compiling) one; the median is reported")
    return p


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every option's help; the description keeps its layout."""


def given_options(parser: argparse.ArgumentParser, argv) -> set:
    """Destinations of the options written on the command line (abbreviations are off)."""
    given = set()
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list
        for s in action.option_strings:
            if any(tok == s or tok.startswith(s + "=") for tok in argv):
                given.add(action.dest)
    return given


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and cross-checked arguments; bad combinations exit with status 2."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    given = given_options(parser, argv)

    def flag(dest):
        return "--" + dest.replace("_", "-")

    not_read = SYNTHETIC_ONLY if args.data == "trained" else TRAINED_ONLY
    refused = [flag(d) for d in not_read if d in given]
    if refused:
        reader = "synthetic (structured, gaussian)" if args.data == "trained" else "trained"
        parser.error(f"{', '.join(refused)} only applies to {reader} data, not --data {args.data}")
    if args.data == "trained" and args.H not in TRAINED_HEADS:
        parser.error(f"--H: the trained indexers have {TRAINED_HEADS[0]} or {TRAINED_HEADS[1]} "
                     f"heads, got {args.H}")
    if args.H < 2:
        parser.error(f"--H must be >= 2 (the retained-head budget lies in [1, H-1]), got {args.H}")
    if args.T > args.N:
        parser.error(f"--T {args.T} exceeds --N {args.N}: the queries are the last T of N positions")
    first_visible = args.N - args.T + 1
    if args.K > first_visible:
        parser.error(f"--K {args.K} exceeds the {first_visible} keys the first query sees "
                     f"(N - T + 1): every query needs at least K visible keys to select from")
    if args.retained != "auto" and not 1 <= args.retained <= args.H - 1:
        parser.error(f"--retained must be 'auto' or in [1, H-1] = [1, {args.H - 1}], "
                     f"got {args.retained}")
    return args


# ----------------------------------------------------------------------------- the run

def load_data(args, log):
    from dosa_jax import datasets

    if args.data == "trained":
        log.info("loading trained-indexer data (%s, layer %d, H=%d, N=%d, T=%d): the fixture "
                 "when it holds the case, else generated from the committed weights",
                 args.domain, args.layer, args.H, args.N, args.T)
        length = None if args.N == 4096 else args.N
        return datasets.trained(args.domain, args.layer, length=length,
                                         num_queries=args.T, heads=args.H,
                                         key_dtype=args.key_dtype)
    log.info("generating %s synthetic data (seed %d)", args.data, args.seed)
    return datasets.synthetic(args.data, T=args.T, N=args.N, H=args.H, D=args.D,
                                       seed=args.seed, key_dtype=args.key_dtype)


def timed(fn, repeats: int, name: str, log):
    """(result, seconds of the first call, median seconds of ``repeats`` later calls)."""
    import jax
    import numpy as np

    log.info("%s: compiling and running once ...", name)
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out.indices)
    first = time.perf_counter() - t0
    log.info("%s: first call (compile + run) %.1f s; timing %d more calls ...", name, first, repeats)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out.indices)
        times.append(time.perf_counter() - t0)
    log.info("%s: median %.1f ms", name, 1e3 * float(np.median(times)))
    return out, first, float(np.median(times))


def threshold_lines(tau, tau_star):
    """Report lines for the seed threshold τ against the K-th score τ* (τ ≤ τ*, Eq. 2).

    τ/τ* reads as "how close" only where τ* > 0; elsewhere the gap τ* − τ is reported."""
    import numpy as np

    pruning = np.isfinite(tau)
    lines = []
    pos = pruning & (tau_star > 0)
    if pos.any():
        ratio = tau[pos] / tau_star[pos]
        lines.append(f"tau/tau*: median {np.median(ratio):.3f}  [p10 {np.percentile(ratio, 10):.3f}, "
                     f"p90 {np.percentile(ratio, 90):.3f}]  ({int(pos.sum())} queries with tau* > 0)")
    rest = pruning & ~(tau_star > 0)
    if rest.any():
        gap = tau_star[rest] - tau[rest]
        lines.append(f"tau* - tau (threshold gap): median {np.median(gap):.4g}  "
                     f"[max {np.max(gap):.4g}]  ({int(rest.sum())} queries with tau* <= 0, "
                     f"where a ratio means nothing)")
    if (~pruning).any():
        lines.append(f"{int((~pruning).sum())} queries without a seed threshold (no pruning)")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)

    from absl import flags
    from absl import logging as log

    if not flags.FLAGS.is_parsed():  # absl's handler without absl.app: no flags of its own
        flags.FLAGS.mark_as_parsed()
    log.use_absl_handler()
    log.set_verbosity(log.INFO)

    import jax
    import numpy as np

    import dosa_jax

    log.info("jax %s on %s; backend %s", jax.__version__, jax.default_backend(), args.backend)
    if args.backend == "pallas" and jax.default_backend() == "cpu":
        log.warning("--backend pallas on a CPU runs the kernels in interpret mode (slow)")
    try:
        inp = load_data(args, log)
    except (OSError, ValueError) as e:
        log.error("could not load --data %s: %s", args.data, e)
        return 1
    T, H, D = inp.q.shape
    N = inp.k.shape[0]
    cfg = dosa_jax.Config(top_k=args.K, retained_heads=args.retained,
                          seed_strategy=args.seed_strategy, backend=args.backend,
                          block_witnesses=args.block_witnesses)
    log.info("data: %s (%s)  T=%d N=%d H=%d D=%d K=%d keys=%s%s", inp.meta.get("kind", args.data),
             inp.meta.get("source", "generated"), T, N, H, D, args.K, inp.k.dtype,
             " +scale" if inp.k_scale is not None else "")
    kw = inp.as_kwargs()
    dosa = jax.jit(dosa_jax.topk)
    dense = jax.jit(dosa_jax.dense_topk)
    r, first_dosa, t_dosa = timed(lambda: dosa(**kw, config=cfg), args.repeats, "DoSA", log)
    d, first_dense, t_dense = timed(lambda: dense(**kw, config=cfg), args.repeats, "dense", log)

    same_idx = bool(np.array_equal(np.asarray(r.indices), np.asarray(d.indices)))
    same_sc = bool(np.array_equal(np.asarray(r.scores), np.asarray(d.scores)))
    st = jax.tree_util.tree_map(np.asarray, r.stats)
    screened, surv = int(np.sum(st.screened)), int(np.sum(st.survivors))
    survival = surv / max(screened, 1)
    budgets = np.bincount(st.budget, minlength=H)

    print()
    print(f"  DoSA == dense (indices, bitwise): {same_idx}   (scores: {same_sc})")
    print(f"  survival rate: {surv}/{screened} = {survival:.4f}  "
          f"(pruned {1 - survival:.2%} of screened keys)")
    for line in threshold_lines(st.tau_seed.astype(np.float64), st.tau_final.astype(np.float64)):
        print("  " + line)
    print("  retained heads r: " + ", ".join(f"r={i}: {c}" for i, c in enumerate(budgets) if c))
    print(f"  rounds/query: mean {np.mean(st.rounds):.2f}; overflows {int(np.sum(st.overflows))}; "
          f"recoveries {int(np.sum(st.recoveries))}")
    print(f"  time (median of {args.repeats}, after compile): DoSA {t_dosa * 1e3:.1f} ms, "
          f"dense {t_dense * 1e3:.1f} ms, ratio dense/DoSA {t_dense / t_dosa:.2f}x  "
          f"(first calls with compile: {first_dosa:.1f} s, {first_dense:.1f} s)")
    print(flush=True)
    if survival > LOW_PRUNING_SURVIVAL:
        why = ("random Gaussian keys have no geometry the certificate can use: the omitted "
               "heads' bounds (Eq. 4-8) are loose for unrelated heads and the seeds' K-th score "
               "is far below tau*" if args.data == "gaussian" else
               "the certificate's bounds are loose for these inputs or the seeds' K-th score is "
               "far below tau*; try a larger --retained budget or another --seed-strategy")
        log.warning("DoSA pruned only %.1f%% of the screened keys: %s. "
                    "The answer is still exact; trained data shows the pruning DoSA is for.",
                    100 * (1 - survival), why)
    if not (same_idx and same_sc):
        log.error("DoSA and the dense baseline disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
