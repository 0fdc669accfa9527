"""``Config``: every knob of the pipeline, frozen, hashable and static.

``Config`` is registered as a pytree with *no* array leaves, so the design's
usage line works with a plain ``jax.jit``::

    jax.jit(dosa_jax.topk)(q, k, w, config=dosa_jax.Config(top_k=2048))

(DESIGN §12). Every field is a Python scalar, string or tuple.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax

from dosa_jax.backend import BACKENDS
from dosa_jax.bounds.heads import RANKINGS
from dosa_jax.bounds.negative import SUPPORTS
from dosa_jax.bounds.positive import RESIDUALS

SEED_STRATEGIES = ("union", "local", "sinks", "strided")
CERTIFICATE_FORMS = ("basic", "absolute")
CONTEXT_MERGES = ("gather", "tree")


@dataclasses.dataclass(frozen=True)
class Config:
    """DoSA configuration (DESIGN §3–§10, §12).

    Attributes:
      top_k: K, the number of keys to select.
      retained_heads: budget r (1 ≤ r ≤ H − 1; ``topk`` raises otherwise) or ``"auto"`` (per query, from the
        cost model Eq. 18–21 on the seed sample, among ``budget_candidates``).
      budget_candidates: candidate budgets for ``"auto"`` (each in [1, H−1]);
        empty means ``(H/8, 2H/8, …, 6H/8)`` clipped to [1, H−1] (trained indexers can have more than
        half of their heads positive; omitted positive heads cost a residual).
      seed_strategy: ``union`` (sinks + local window + strided), ``local``,
        ``sinks`` or ``strided`` (DESIGN §3).
      seed_size: number of seed keys S (≥ top_k); None → 2·top_k.
      sink_size: sinks in the ``union`` strategy.
      local_fraction: share of the ``union`` seeds taken from the local window
        (0.75: with S = 2K the local window alone holds ≥ K keys).
      survivor_cost: κ, the weight of the survival fraction in the ``"auto"`` budget's
        cost (r + d_a)/H + κ·m (Eq. 21 has κ = 1: dot products counted); None → the
        backend's value (reference 1; pallas
        ``pallas_kernels.pipeline.SURVIVOR_COST``, whose budget is also shared by each
        screening program's queries).
      budget_sample: strided keys per query scored for the ``"auto"`` budget's
        survival estimate and the activation frequencies p_h (seeds are biased).
      guided_witnesses: if > 0, that many extra witnesses for τ: the keys with the
        largest certificate U^num among a strided sample of ``guided_sample`` keys,
        scored in full (helps where the local window is not where the winners are).
      anchor_stride: if > 0 (and T ≥ 4·anchor_stride), every ``anchor_stride``-th
        query (an *anchor*: queries 0, s, 2s, …) is answered first by a dense scan,
        and its exact Top-K ids join the witnesses for τ of the following
        ``anchor_stride`` queries (DESIGN §3: a neighbouring query's selection,
        rescored for the current query). Neighbouring queries share most winners,
        so τ rises towards τ*; any ids are safe (distinct visible keys only count).
      block_witnesses: if > 0 (a multiple of ``witness_block``), that many extra witnesses
        per query for τ: every key of the ``block_witnesses / witness_block`` key blocks
        (``witness_block`` consecutive keys each, visible to the query) whose mean key
        scores highest for the query, ranked by the backend's dense path over the
        N / ``witness_block`` block means (:func:`dosa_jax.witnesses.block_witnesses`).
        The winners of a query cluster in few blocks, so τ rises towards τ* where the
        local window does not hold them; any ids are safe (the answer never changes).
        0: none. None (the default): the backend decides per call: the pallas backend
        adds ``pallas_kernels.pipeline.AUTO_BLOCK_WITNESSES`` when its planner's sample
        says that many keys score between the seed τ and τ* (``block_witness_gate``),
        the reference backend adds none.
      witness_block: keys per block of ``block_witnesses``.
      block_witness_gate: the gate of ``block_witnesses=None`` on the pallas backend, in
        keys per witness: W block witnesses join a call when its τ gap (the mean share of a
        query's keys scoring at or above its seed τ beyond its K, estimated on the planner's
        sample: ``pallas_kernels.pipeline.sampled_tau_gap``) times its mean key range
        exceeds gate · W. None: the backend's default
        (``pallas_kernels.pipeline.BLOCK_WITNESS_GATE`` on a GPU; kernels in interpret mode
        add none); 0: whenever the gap is positive; ``inf``: never.
      positive_residual: ``triangle`` (Eq. 6), ``joint`` (Eq. 7), ``grouped``
        (App. A.1) or ``best`` (the minimum of them).
      residual_groups: coordinate groups for ``grouped``/``best``.
      positive_projection: False is the "no positive projection" ablation.
      negative_support: ``majority`` (p_h ≥ ½), ``all`` or ``none`` (ablations).
      negative_ranking: ``uncertainty`` or ``strength`` (ablation).
      certificate_form: ``basic`` (Eq. 9) or ``absolute`` (Eq. 24–25, used for
        queries whose positive heads are all retained).
      capacity: candidate buffer per query (keys); None → automatic. A full
        buffer is flushed by exact merging — never truncated.
      key_block: keys per block of the scan and of the canonical scorer.
      query_tile: queries processed together.
      scorer_unit_roundoff / screen_unit_roundoff: unit roundoff of the
        accumulation in the scorer's / the screening's dot products, for the
        numerical enclosure (2^-24: float32).
      raise_threshold: after each merge of exact scores, raise τ to the current
        K-th best (a valid lower bound on τ*; prunes more in later rounds).
      backend: ``reference`` (pure jnp), ``pallas`` or ``auto`` (the default: pallas on a
        GPU, the reference elsewhere; :mod:`dosa_jax.backend`).
      dense_switch: on the pallas backend, a call whose predicted ratio of DoSA's time
        to the dense scan's exceeds this is answered by the dense scan from θ₀ = τ
        (exact either way; ``Stats.dense``, ``Stats.predicted_cost``). None: the
        backend's default (``pallas_kernels.pipeline.DENSE_SWITCH`` on a GPU; kernels in
        interpret mode always screen); ``inf``: always screen. The reference backend always
        screens.
      context_axis: name of a ``shard_map`` mesh axis over which the keys are sharded
        contiguously (context parallel, :mod:`dosa_jax.context_parallel`): ``topk`` and
        ``dense_topk`` then take this device's key slice with global ``lo``/``hi`` and
        return the global Top-K (global ids) on every device. None: keys are local.
      context_merge: how per-device candidates are merged under ``context_axis``:
        ``gather`` (one all-gather of K records per device, one exact selection) or
        ``tree`` (log2 P rounds of pairwise exchange and merge; P a power of two, else
        ``gather``).
    """

    top_k: int = 2048
    retained_heads: Union[int, str] = "auto"
    budget_candidates: tuple = ()
    seed_strategy: str = "union"
    seed_size: Optional[int] = None
    sink_size: int = 64
    local_fraction: float = 0.75
    budget_sample: int = 256
    survivor_cost: Optional[float] = None
    guided_witnesses: int = 0
    guided_sample: int = 8192
    anchor_stride: int = 0
    block_witnesses: Optional[int] = None
    witness_block: int = 64
    block_witness_gate: Optional[float] = None
    positive_residual: str = "best"
    residual_groups: int = 4
    positive_projection: bool = True
    negative_support: str = "majority"
    negative_ranking: str = "uncertainty"
    certificate_form: str = "basic"
    capacity: Optional[int] = None
    key_block: int = 256
    query_tile: int = 32
    scorer_unit_roundoff: float = 2.0 ** -24
    screen_unit_roundoff: float = 2.0 ** -24
    raise_threshold: bool = True
    backend: str = "auto"
    dense_switch: Optional[float] = None
    context_axis: Optional[str] = None
    context_merge: str = "gather"

    def anchors(self, T: int) -> int:
        """Anchor stride in effect for T queries (0: no anchors)."""
        s = self.anchor_stride
        return s if s and T >= 4 * s else 0

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"Config.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            bad("top_k", "must be an int >= 1")
        r = self.retained_heads
        if not (r == "auto" or (isinstance(r, int) and not isinstance(r, bool) and r >= 1)):
            bad("retained_heads", "must be an int >= 1 or 'auto'")
        if not isinstance(self.budget_candidates, tuple) or not all(
                isinstance(c, int) and c >= 1 for c in self.budget_candidates):
            bad("budget_candidates", "must be a tuple of ints >= 1")
        if self.seed_strategy not in SEED_STRATEGIES:
            bad("seed_strategy", f"must be one of {SEED_STRATEGIES}")
        if self.seed_size is not None and (not isinstance(self.seed_size, int) or self.seed_size < 1):
            bad("seed_size", "must be None or an int >= 1")
        if not isinstance(self.budget_sample, int) or self.budget_sample < 1:
            bad("budget_sample", "must be an int >= 1")
        sc = self.survivor_cost
        if sc is not None and (isinstance(sc, bool) or not isinstance(sc, (int, float))
                               or not sc > 0 or sc == float("inf")):
            bad("survivor_cost", "must be None or a finite number > 0")
        for name in ("guided_witnesses", "guided_sample", "anchor_stride", "block_witnesses",
                     "witness_block"):
            v = getattr(self, name)
            if name == "block_witnesses" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (
                    name in ("guided_sample", "witness_block") and v < 1):
                bad(name, "must be a non-negative int (guided_sample, witness_block >= 1; "
                          "block_witnesses may be None)")
        if self.block_witnesses is not None and self.block_witnesses % self.witness_block:
            bad("block_witnesses", f"must be a multiple of witness_block ({self.witness_block})")
        if not isinstance(self.sink_size, int) or self.sink_size < 0:
            bad("sink_size", "must be an int >= 0")
        if not 0.0 <= self.local_fraction <= 1.0:
            bad("local_fraction", "must be in [0, 1]")
        if self.positive_residual not in RESIDUALS:
            bad("positive_residual", f"must be one of {RESIDUALS}")
        if not isinstance(self.residual_groups, int) or self.residual_groups < 1:
            bad("residual_groups", "must be an int >= 1")
        if self.negative_support not in SUPPORTS:
            bad("negative_support", f"must be one of {SUPPORTS}")
        if self.negative_ranking not in RANKINGS:
            bad("negative_ranking", f"must be one of {RANKINGS}")
        if self.certificate_form not in CERTIFICATE_FORMS:
            bad("certificate_form", f"must be one of {CERTIFICATE_FORMS}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            bad("capacity", "must be None or an int >= 1")
        for name in ("key_block", "query_tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(name, "must be an int >= 1")
        for name in ("scorer_unit_roundoff", "screen_unit_roundoff"):
            v = getattr(self, name)
            if not (isinstance(v, float) and 0.0 < v < 2.0 ** -6):
                bad(name, "must be a float in (0, 2^-6)")
        bg = self.block_witness_gate
        if bg is not None and (isinstance(bg, bool) or not isinstance(bg, (int, float))
                               or not bg >= 0):
            bad("block_witness_gate", "must be None or a number >= 0 (inf: never)")
        ds = self.dense_switch
        if ds is not None and (isinstance(ds, bool) or not isinstance(ds, (int, float))
                               or not ds > 0):
            bad("dense_switch", "must be None or a number > 0 (inf: always screen)")
        if self.backend not in BACKENDS:
            bad("backend", f"must be one of {BACKENDS}")
        if self.context_axis is not None and (not isinstance(self.context_axis, str)
                                              or not self.context_axis):
            bad("context_axis", "must be None or a mesh axis name (non-empty str)")
        if self.context_merge not in CONTEXT_MERGES:
            bad("context_merge", f"must be one of {CONTEXT_MERGES}")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    # ---- derived static sizes -------------------------------------------------
    def seeds(self) -> int:
        """S = max(top_k, seed_size or 2·top_k)."""
        return max(self.top_k, self.seed_size if self.seed_size is not None else 2 * self.top_k)

    def budgets(self, H: int) -> tuple:
        """Candidate budgets for H heads (static), each in [1, H−1].

        An explicit ``retained_heads`` or ``budget_candidates`` entry outside [1, H−1]
        raises ValueError (it cannot be met: a budget of H or more omits no head). With
        H = 1 no head can be omitted: the only budget is r = 1, every head retained, so
        the certificate is the score's own numerical enclosure (Eq. 26 with E = 0) —
        exact, but screening then costs as many dot products as scoring (Eq. 21).
        """
        top = max(H - 1, 1)
        r = self.retained_heads
        if isinstance(r, int):
            if not 1 <= r <= top:
                raise ValueError(
                    f"Config.retained_heads={r} is outside [1, H-1] = [1, {H - 1}] for H={H} "
                    "heads" + (" (with H=1 the only budget is 1)" if H == 1 else ""))
            return (r,)
        if self.budget_candidates:
            bad = [c for c in self.budget_candidates if not 1 <= c <= top]
            if bad:
                raise ValueError(
                    f"Config.budget_candidates {bad} outside [1, H-1] = [1, {H - 1}] for H={H} "
                    "heads" + (" (with H=1 the only budget is 1)" if H == 1 else ""))
            return tuple(sorted(set(self.budget_candidates)))
        if H < 2:
            return (1,)
        return tuple(sorted({min(max((i * H) // 8, 1), H - 1) for i in range(1, 7)}))


jax.tree_util.register_pytree_node(Config, lambda c: ((), c), lambda c, _: c)
