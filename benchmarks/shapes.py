"""Benchmark presets as data (DESIGN §14): shapes, cases and timing counts.

Every timed problem is a causal prefill chunk of the trained indexer
(``dosa_jax.datasets.trained``): the last T of the first N held-out tokens are
the queries, D = 128, FP8 e4m3 keys with per-key power-of-two scales, bf16
queries, K = 2048. A *case* names the indexer (domain, layer, heads H); a
*preset* names the cases, the context lengths N it runs them at, and how it
times them. ``QUICK`` holds the same presets at tiny shapes for a CPU smoke run
(N = 4096 reads the committed fixture where it holds the case).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple


class Case(NamedTuple):
    """One trained indexer: domain (``code``/``prose``), layer 0–3, heads H (32 or 64)."""

    domain: str
    layer: int
    H: int = 32

    @property
    def name(self) -> str:
        return f"{self.domain}{self.layer}_H{self.H}"


class Preset(NamedTuple):
    """What one ``python -m benchmarks <name>`` measures.

    T: queries; Ns: default context lengths; N_options: the lengths ``--N all``
    selects; cases: the indexers; K: top-k; seeds: ``Config.seed_size`` (None:
    the library default 2·K); repeats / warmup: timed and untimed calls per
    measurement; bound_queries: queries (strided over the T) on which the matrix
    evaluates the certificate per key (its floor and slack split); select_rows /
    select_cols: the score matrix of the selection preset.
    """

    name: str
    T: int
    Ns: Tuple[int, ...]
    N_options: Tuple[int, ...]
    cases: Tuple[Case, ...]
    K: int = 2048
    D: int = 128
    seeds: Optional[int] = None
    repeats: int = 10
    warmup: int = 2
    bound_queries: int = 0
    select_rows: int = 256
    select_cols: int = 1 << 20
    anchor_stride: int = 0
    block_witnesses: Optional[int] = None   # matrix: a DoSA variant with Config.block_witnesses
    survivor_cost: float = 0.0   # matrix: a DoSA variant with Config.survivor_cost (0: none)
    # decode: batch sizes B, consecutive steps per timed row, steps of the exactness run,
    # and the wall-clock budget after which the remaining rows are skipped (reported)
    batches: Tuple[int, ...] = ()
    steps: int = 0
    check_steps: int = 0
    budget_s: float = float("inf")
    # decode: key layouts timed, and whether each path is also timed compiled with
    # ``benchmarks.decode.GRAPH_COMPILER_OPTIONS`` (the loop in command buffers)
    layouts: Tuple[str, ...] = ("contiguous", "paged")
    graphs: bool = False


KiB = 1024
MiB = 1 << 20
LONG_NS = (MiB, 512 * KiB, 256 * KiB, 128 * KiB)
DOMAINS = ("code", "prose")
LAYERS = (0, 1, 2, 3)

#: code/prose × layers 0–3 at H = 32, then the same at H = 64 (one compile per (H, N)).
MATRIX_CASES = tuple(Case(d, l, h) for h in (32, 64) for d in DOMAINS for l in LAYERS)

PRESETS = {p.name: p for p in (
    Preset("headline", T=16 * KiB, Ns=(MiB,), N_options=LONG_NS, cases=(Case("code", 2),),
           seeds=8192, repeats=10, warmup=2),
    Preset("matrix", T=16 * KiB, Ns=(MiB, 128 * KiB), N_options=(MiB, 128 * KiB),
           cases=MATRIX_CASES, repeats=3, warmup=1, bound_queries=16),
    Preset("kernels", T=16 * KiB, Ns=(MiB,), N_options=LONG_NS, cases=(Case("code", 2),),
           seeds=8192, repeats=3, warmup=1),
    Preset("select", T=0, Ns=(), N_options=(), cases=(), repeats=30, warmup=5),
    Preset("decode", T=1, Ns=(MiB, 128 * KiB), N_options=LONG_NS,
           cases=(Case("code", 2, 32), Case("code", 2, 64)), batches=(1, 8, 64), steps=16,
           check_steps=1000, repeats=5, warmup=1, budget_s=330),
)}

#: The same presets at CPU smoke-test size (the fixture's N = 4096, cases it stores).
QUICK = {
    "headline": PRESETS["headline"]._replace(T=8, Ns=(4096,), N_options=(4096, 2048), K=64,
                                             seeds=128, cases=(Case("code", 0),),
                                             repeats=2, warmup=1),
    "matrix": PRESETS["matrix"]._replace(T=8, Ns=(4096,), N_options=(4096,), K=64, seeds=128,
                                         cases=(Case("code", 0), Case("prose", 3)),
                                         repeats=2, warmup=1, bound_queries=2),
    "kernels": PRESETS["kernels"]._replace(T=8, Ns=(4096,), N_options=(4096,), K=64, seeds=128,
                                           cases=(Case("code", 0),), repeats=2, warmup=1),
    "select": PRESETS["select"]._replace(repeats=2, warmup=1, select_rows=8, select_cols=4096,
                                         K=64),
    "decode": PRESETS["decode"]._replace(Ns=(4096,), N_options=(4096,), K=64,
                                         cases=(Case("code", 0),), batches=(1, 2), steps=4,
                                         check_steps=6, repeats=2, warmup=1, budget_s=600),
}
