"""Kernel tile and DoSA option specs as strings, for the tools that take them on a command line
(``benchmarks.kernel_sass --tiles``): :func:`parse_tiles` reads one, :func:`tiles_name` writes one.

This module imports the Pallas kernels' ``Tiles`` (the one benchmark module that does).
"""

from __future__ import annotations

from typing import NamedTuple

#: Seeds per query for the DoSA runs (Config.seed_size): 8·K at K = 2048.
BENCH_SEEDS = 16384


class DosaOptions(NamedTuple):
    """The DoSA Config fields a benchmark spec sets: seeds per query, anchor stride,
    retained-head budget (0: the default ``"auto"``)."""

    seeds: int = BENCH_SEEDS
    anchor: int = 0
    budget: int = 0
    survivor_cost: float = 0.0   # 0: the backend's default

    def config(self, K: int):
        from dosa_jax.config import Config
        return Config(top_k=K, backend="pallas", seed_size=self.seeds, anchor_stride=self.anchor,
                      retained_heads=self.budget or "auto",
                      survivor_cost=self.survivor_cost or None)

    def __str__(self):
        if self.survivor_cost:
            return f"{self.seeds}/{self.anchor}/{self.budget}/{self.survivor_cost:g}"
        if self.budget:
            return f"{self.seeds}/{self.anchor}/{self.budget}"
        return f"{self.seeds}/{self.anchor}" if self.anchor else str(self.seeds)


def parse_tiles(spec):
    """``layout:BK:warps:stages[:screen_layout:screen_bq:screen_warps[:screen_lane_sums[:screen_bk``
    ``[:widen_fp8[:refine_bk[:CH[:record_slots[:lane_sums]]]]]]]]``[/seeds[/anchor_stride[/budget``
    ``[/survivor_cost]]]]``
    -> (Tiles, DosaOptions). Or ``field=value+field=value...`` (any ``Tiles`` fields, on the
    defaults; booleans as 0/1) before the ``/``.

    E.g. ``kh:128:4:3:kh:8:4/8192``, ``/8192/64`` (default tiles, 8192 seeds, anchors every
    64 queries), ``/8192/0/6`` (retained-head budget r = 6 for every query); BQ is 4 (the
    refinement group); '' -> defaults.
    """
    from pallas_kernels import dense as dense_mod
    spec, _, opts = spec.partition("/")
    seeds, _, anchor = opts.partition("/")
    anchor, _, budget = anchor.partition("/")
    budget, _, kappa = budget.partition("/")
    seeds = DosaOptions(int(seeds) if seeds else BENCH_SEEDS, int(anchor) if anchor else 0,
                        int(budget) if budget else 0, float(kappa) if kappa else 0.0)
    if not spec:
        return dense_mod.Tiles(), seeds
    if "=" in spec:   # field=value+field=value... on the default tiles
        t = dense_mod.Tiles()
        for item in spec.split("+"):
            key, _, val = item.partition("=")
            if key not in t._fields:
                raise ValueError(f"tiles spec: unknown Tiles field {key!r} in {spec!r}")
            cur = getattr(t, key)
            t = t._replace(**{key: bool(int(val)) if isinstance(cur, bool) else
                              type(cur)(val)})
        return t, seeds
    f = spec.split(":")
    t = dense_mod.Tiles(BQ=4, BK=int(f[1]), num_warps=int(f[2]), num_stages=int(f[3]), layout=f[0],
                        refine_bk=dense_mod.Tiles().refine_bk if f[0] == "kc" else 0)
    if len(f) > 4:
        t = t._replace(screen_layout=f[4], screen_bq=int(f[5]), screen_warps=int(f[6]))
    if len(f) > 7:
        t = t._replace(screen_lane_sums=bool(int(f[7])))
    if len(f) > 8:
        t = t._replace(screen_bk=int(f[8]))
    if len(f) > 9:
        t = t._replace(widen_fp8=bool(int(f[9])))
    if len(f) > 10:
        t = t._replace(refine_bk=int(f[10]))
    if len(f) > 11:
        t = t._replace(CH=int(f[11]))
    if len(f) > 12:
        t = t._replace(record_slots=int(f[12]))
    if len(f) > 13:
        t = t._replace(lane_sums=bool(int(f[13])))
    return t, seeds


#: The Tiles fields of the positional spec, in order (BQ is always 4); the last three are
#: left out of a name while they hold their defaults.
POSITIONAL_FIELDS = ("layout", "BK", "num_warps", "num_stages", "screen_layout", "screen_bq",
                     "screen_warps", "screen_lane_sums", "screen_bk", "widen_fp8", "refine_bk",
                     "CH", "record_slots", "lane_sums")


def tiles_name(t, seeds=None):
    """The spec of :func:`parse_tiles` for tiles ``t`` (trailing default fields left out; the
    ``field=value`` form when a field past the positional spec is not its default)."""
    from pallas_kernels import dense as dense_mod
    d = dense_mod.Tiles()
    as_spec = lambda v: int(v) if isinstance(v, bool) else v
    if any(getattr(t, k) != getattr(d, k) for k in t._fields
           if k not in POSITIONAL_FIELDS + ("BQ",)):
        name = "+".join(f"{k}={as_spec(v)}" for k, v in t._asdict().items()
                        if v != getattr(d, k))
    else:
        f = [as_spec(getattr(t, k)) for k in POSITIONAL_FIELDS]
        while len(f) > 11 and f[-1] == as_spec(getattr(d, POSITIONAL_FIELDS[len(f) - 1])):
            f.pop()
        name = ":".join(str(x) for x in f)
    return name if seeds is None else f"{name}/{seeds}"
