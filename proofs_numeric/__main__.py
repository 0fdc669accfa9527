"""Run every numeric check and print a table: ``python -m proofs_numeric [--quick]``.

Exit status 1 when any check reports a violation. ``--quick`` uses the sizes of
the CPU test suite; ``--only NAME ...`` selects checks; ``--pairs`` sets the
enclosure check's pair count.
"""

from __future__ import annotations

import argparse
import importlib
import json

from proofs_numeric import CHECKS
from proofs_numeric import _common as cm

#: Sizes of the CPU test suite (tests/test_proofs_numeric.py, tests/test_enclosure.py).
QUICK = {
    "certificate": dict(n_instances=15, shapes=cm.SHAPES_SMALL),
    "joint_allowance": dict(n_instances=15, shapes=((2, 2), (8, 32), (64, 1))),
    "single_anchor_optimality": dict(n_instances=300),
    "slack_decomposition": dict(n_instances=15, shapes=((1, 1), (8, 32), (64, 128))),
    "margin_equivalence": dict(n_instances=15, shapes=((2, 2), (32, 32))),
    "exact_selection": dict(n_instances=12, variants=("r1_triangle_cap1block", "auto_best_fp8",
                                                      "grouped_nosupport_strength_bf16")),
    "enclosure": dict(pairs=10_000_000, cases="CASES_CPU"),
}


def _kwargs(name: str, quick: bool, pairs, seed: int) -> dict:
    kw = dict(QUICK[name]) if quick else {}
    if name == "enclosure":
        from proofs_numeric import enclosure
        if isinstance(kw.get("cases"), str):
            kw["cases"] = getattr(enclosure, kw["cases"])
        if pairs is not None:
            kw["pairs"] = pairs
    kw["seed"] = seed
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CPU test suite's sizes")
    ap.add_argument("--only", nargs="*", default=None, choices=CHECKS)
    ap.add_argument("--pairs", type=int, default=None, help="enclosure check: pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    rows = []
    for name in args.only or CHECKS:
        mod = importlib.import_module(f"proofs_numeric.{name}")
        r = cm.timed(mod.check, **_kwargs(name, args.quick, args.pairs, args.seed))
        print(cm.format_result(r), flush=True)
        rows.append(r)
    print()
    print(cm.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
