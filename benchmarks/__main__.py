"""``python -m benchmarks <preset> [options]``: run one named preset, print and write its table.

    python -m benchmarks headline [--N all]             # XLA / dense / DoSA, T = 16K, N = 1M
    python -m benchmarks matrix [--N 1048576] [--cases code2_H32,prose1_H64]
    python -m benchmarks kernels                        # per-kernel device profile
    python -m benchmarks select                         # exact_topk vs lax.top_k
    python -m benchmarks decode [--cases H32]           # decode_topk per step, B = 1, 8, 64
    python -m benchmarks matrix --quick                 # tiny shapes, CPU smoke run
    python -m benchmarks matrix --N 1m --weights slack  # the slack-regularised indexers

Presets (shapes, cases, timing counts) are data in :mod:`benchmarks.shapes`; the
measurements are in :mod:`benchmarks.presets`. Each run writes ``<preset>.md`` and
``<preset>.json`` (``--tag`` adds a suffix) to ``--out`` (default ``$OUT``, else
``./bench_out``), rewritten after every row. ``--weights`` picks the trained indexers
(``dosa_jax.datasets.trained(..., weights=...)``): ``committed`` (the default), ``slack`` (the
slack-regularised fine-tune, ``dosa_jax/data/lm_weights_slack.npz``) or a weights file's path
(e.g. a slack fine-tune's ``weights_lambda_<λ>.npz``); the choice is in the table's meta and
notes, and other weights than the committed ones end the file names in their name (``slack``,
or the file's name: ``--tag``, default that name, gets ``_<name>`` appended unless it holds it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from benchmarks.report import log, run_meta
from benchmarks.shapes import PRESETS, QUICK


def parse_sizes(spec: str, preset):
    """``--N``: '' (the preset's), ``all`` (its options) or comma-separated ints (``1048576``,
    ``128k``, ``1m``)."""
    if not spec:
        return preset.Ns
    if spec == "all":
        return preset.N_options
    out = []
    for s in spec.split(","):
        s = s.strip().lower()
        mult = {"k": 1024, "m": 1 << 20}.get(s[-1:], 1)
        try:
            out.append(int(s[:-1] if mult > 1 else s) * mult)
        except ValueError:
            raise ValueError(f"--N: cannot read {s!r} (ints, 128k, 1m, or 'all')") from None
    return tuple(out)


def parse_cases(spec: str, preset):
    """``--cases``: '' (all the preset's) or comma-separated names (``code2_H32``) or head counts
    (``H64``: the preset's cases with H = 64)."""
    if not spec:
        return preset.cases
    by_name = {c.name: c for c in preset.cases}
    from benchmarks.shapes import Case
    out = []
    for name in spec.split(","):
        if name[:1] == "H" and name[1:].isdigit():
            sel = [c for c in preset.cases if c.H == int(name[1:])]
            if not sel:
                raise ValueError(f"--cases: the preset has no case with {name}")
            out += sel
            continue
        if name in by_name:
            out.append(by_name[name])
            continue
        try:   # any domain/layer/H the trained weights hold, e.g. prose2_H64
            dom_layer, h = name.split("_H")
            out.append(Case(dom_layer.rstrip("0123456789"), int(dom_layer[-1]), int(h)))
        except ValueError:
            raise ValueError(f"--cases: unknown case {name!r} (e.g. code2_H32; the preset has "
                             f"{sorted(by_name)})") from None
    return tuple(out)


#: ``--weights`` names (``dosa_jax.datasets.trained``'s ``weights``); anything else is a path.
WEIGHTS = ("committed", "slack")


def weights_name(weights: str) -> str:
    """A short name of ``--weights``: ``committed``, ``slack``, or a file's name without its
    folder and extension, in letters, digits, '.', '_' and '-' (``results/w_l3.npz``: ``w_l3``)."""
    if weights in WEIGHTS:
        return weights
    stem = os.path.splitext(os.path.basename(weights.rstrip("/")))[0]
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "weights"


def weights_tag(tag: str, weights: str) -> str:
    """The output suffix: ``tag`` itself for the committed weights; for any other weights a
    suffix naming them (:func:`weights_name`: ``slack`` alone, or ``<tag>_slack`` unless
    ``tag`` already says so)."""
    name = weights_name(weights)
    if weights == "committed" or name in tag:
        return tag
    return f"{tag}_{name}" if tag else name


def run(argv=None):
    """Run a preset; returns its :class:`benchmarks.report.Table`."""
    from benchmarks.presets import RUNNERS
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("preset", choices=sorted(RUNNERS))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--N", default="", help="context lengths: '', 'all' or e.g. 1m,128k")
    ap.add_argument("--cases", default="", help="e.g. code2_H32,prose1_H64 (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (median)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--weights", default="committed",
                    help="trained indexers: committed (default), slack (lm_weights_slack.npz) or "
                         "a weights file's path (dosa_jax.lm.checkpoint.export_weights, e.g. a "
                         "slack fine-tune's weights_lambda_<λ>.npz); other than committed, the "
                         "output names end in the weights' name")
    ap.add_argument("--anchor-stride", type=int, default=0,
                    help="matrix: also time DoSA with Config.anchor_stride=S (0: no variant)")
    ap.add_argument("--block-witnesses", type=int, default=None,
                    help="matrix: also time DoSA with Config.block_witnesses=W beside the "
                         "default (None: the backend's gate), W = 0 the plain seeds (omitted: "
                         "no variant)")
    ap.add_argument("--survivor-cost", type=float, default=0.0,
                    help="matrix: also time DoSA with Config.survivor_cost=κ (0: no variant)")
    ap.add_argument("--batches", default="",
                    help="decode: batch sizes, e.g. 1,8 (default: the preset's)")
    ap.add_argument("--check-steps", type=int, default=None,
                    help="decode: steps of the exactness run (0: none; default: the preset's)")
    ap.add_argument("--layouts", default="",
                    help="decode: key layouts, of contiguous,paged (default: both)")
    ap.add_argument("--graphs", action="store_true",
                    help="decode: also time every path compiled with "
                         "benchmarks.decode.GRAPH_COMPILER_OPTIONS (the loop in CUDA graphs)")
    a = ap.parse_args(argv)
    preset = (QUICK if a.quick else PRESETS)[a.preset]
    if a.layouts:
        layouts = tuple(x for x in a.layouts.split(",") if x)
        if a.preset != "decode" or not layouts or set(layouts) - {"contiguous", "paged"}:
            ap.error(f"--layouts: contiguous and/or paged, of the decode preset, got "
                     f"{a.layouts!r} for {a.preset}")
        preset = preset._replace(layouts=layouts)
    if a.graphs:
        if a.preset != "decode":
            ap.error(f"--graphs: an option of the decode preset, not of {a.preset}")
        preset = preset._replace(graphs=True)
    if a.check_steps is not None:
        if a.preset != "decode" or a.check_steps < 0:
            ap.error(f"--check-steps: a count >= 0 of the decode preset, got {a.check_steps} "
                     f"for {a.preset}")
        preset = preset._replace(check_steps=a.check_steps)
    if a.batches:
        try:
            batches = tuple(int(x) for x in a.batches.split(","))
        except ValueError:
            ap.error(f"--batches: comma-separated integers, got {a.batches!r}")
        if a.preset != "decode" or min(batches) < 1:
            ap.error(f"--batches: positive batch sizes of the decode preset, got {a.batches!r} "
                     f"for {a.preset}")
        preset = preset._replace(batches=batches)
    if a.anchor_stride < 0:
        ap.error(f"--anchor-stride must be >= 0, got {a.anchor_stride}")
    try:
        from dosa_jax import Config
        Config(block_witnesses=a.block_witnesses)
    except ValueError as e:
        ap.error(f"--block-witnesses: {e}")
    try:
        Config(survivor_cost=a.survivor_cost or None)
    except ValueError as e:
        ap.error(f"--survivor-cost: {e}")
    preset = preset._replace(anchor_stride=a.anchor_stride, block_witnesses=a.block_witnesses,
                             survivor_cost=a.survivor_cost)
    repeats = preset.repeats if a.repeats is None else a.repeats
    warmup = preset.warmup if a.warmup is None else a.warmup
    if repeats < 1 or warmup < 0:
        ap.error(f"--repeats must be >= 1 and --warmup >= 0, got {repeats}, {warmup}")
    try:
        Ns, cases = parse_sizes(a.N, preset), parse_cases(a.cases, preset)
    except ValueError as e:
        ap.error(str(e))
    from dosa_jax import datasets
    try:    # a missing slack weights file: one error naming the command that writes it
        weights_file = datasets.weights_file(a.weights)
    except FileNotFoundError as e:
        ap.error(f"--weights {a.weights}: {e}")
    meta = run_meta(preset)
    meta.update(Ns=list(Ns), cases=[c.name for c in cases], repeats=repeats, warmup=warmup,
                quick=a.quick, tag=weights_tag(a.tag, a.weights), anchor_stride=a.anchor_stride,
                block_witnesses=a.block_witnesses, survivor_cost=a.survivor_cost,
                weights=a.weights, weights_file=weights_file)
    log(f"[{a.preset}] N={list(Ns)} cases={[c.name for c in cases]} repeats={repeats} "
        f"warmup={warmup} weights={a.weights} out={a.out}")
    tab = RUNNERS[a.preset](preset, Ns, cases, a.out, meta, repeats, warmup)
    log(tab.markdown())
    return tab


def main(argv=None) -> int:
    tab = run(argv)
    return 1 if tab.errors else 0


if __name__ == "__main__":
    sys.exit(main())
