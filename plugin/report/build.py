"""The plan report: what a batch's plan gives each rank and what each layer type costs.

``plan_report(plan, layers, shape)`` computes, from the plan's closed forms only (run-level
tables the strategies build anyway; no tile schedule, no device copy; the coverage below
reads the step's tables):

- per rank: tokens (padding included) and, per layer type, visible pairs (the attention
  work, per query head), the K/V floor (other ranks' K/V bytes its queries see: what
  ``dispatch`` fetches in the forward, the least any K/V-moving strategy can) and the bytes
  the running strategy sends per layer (forward + backward, exactly what its collectives
  post: ``tables.traffic``), and the part of them that leaves the rank's node (nodes: the
  plan's ``topology``, which the integrations derive from the CP group, else the cost
  model's ``ranks_per_node``; none by default);
- per layer type: work imbalance (max / mean over ranks, ``plan.work_imbalance``), the
  strategy that runs (``auto`` resolved with the rule and cache of ``tables.auto``), the
  overlap stage count of staged strategies (``tables.staged.resolve_stages``, as the
  strategy resolves it), and optionally every candidate strategy's estimate
  (``tables.auto.estimates``: time per layer, forward + backward, slowest rank, and
  bytes) with the one ``auto`` picks; and, given the step's ``Backends``
  (``report.coverage``), the backend coverage of the running strategy on the reporting
  rank (``plan.cp_rank``): which FlashAttention-class backend its FA-form calls run on, the
  share of its visible pairs and of its kernel calls in FA's form (the rest on our
  kernels), the number of FA calls (``tables.coverage.flash_coverage``; at cp 1 the
  single-device op's one call);
- the token imbalance (``plan.token_imbalance``).

``auto``'s choice and the stage counts are read through the same cache keys the step's
``build_tables`` fills, so on a prepared plan they cost a dictionary lookup. Estimates for
every strategy are the expensive part (each staged candidate simulates its stages): the
training logs compute them only in the first block and when a choice changes. The
coverage reads the rank's host tables under the keys the step's prepare filled (same
route, tiles, stages), so in training it is cache lookups and a sum over a few calls;
offline (the CLI, or an unprepared plan) it builds those tables.

Limits: one head shape for every layer type; ``memory_budget_bytes`` of ``auto`` is not
modelled (the integrations do not set it); the rates are :class:`CostModel`'s defaults
(with the link rates of the plan's topology) unless one is passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..config import STAGED_STRATEGIES
from ..options import takes
from ..masks import AttnMask
from ..plan import CPPlan
from ..tables import catalogue
from ..tables.auto import CostModel, Estimate, choose_strategy, estimates, pick
from ..tables.cost_model import check_model
from ..tables.coverage import FlashCoverage
from ..tables.selected import fetch_count_array
from ..tables.staged import resolve_stages
from ..tables.traffic import split
from ..shape import AttnShape
from .coverage import Backends, layer_coverage

LOCAL = "local"  # the strategy name reported at cp 1, where every strategy is the local op


def mask_label(mask: AttnMask) -> str:
    """Short name of a mask for logs and metric names: "causal", "full", "chunk8192",
    "window4096" (causal, left window), "full+window(4,4)", "chunk8192+window(64,0)"."""
    parts = []
    if mask.chunk_size is not None:
        parts.append(f"chunk{mask.chunk_size}")
    left, right = mask.window_size
    if (left, right) != (-1, -1):
        parts.append(f"window{left}" if mask.causal and right == 0 and not parts
                     else f"window({left},{right})")
    if not parts:
        return "causal" if mask.causal else "full"
    return "+".join(parts) if mask.causal else "+".join(["full"] + parts)


@dataclass(frozen=True)
class LayerType:
    """Layers sharing one mask and one strategy: ``n_layers`` of them. ``strategy`` as
    configured ("auto" allowed); ``a2a_size`` for "a2a+p2p" (None: its default)."""

    mask: AttnMask
    n_layers: int
    strategy: str
    a2a_size: int | None = None

    @property
    def label(self) -> str:
        return mask_label(self.mask)


@dataclass(frozen=True)
class LayerReport:
    """One layer type on one plan; lists are per rank, bytes per layer (fwd + bwd)."""

    layer: LayerType
    strategy: str                     # what runs ("auto" resolved; "local" at cp 1)
    stages: int | None                # overlap stages (staged strategies), else None
    work: list[int]                   # visible pairs per rank (per query head)
    work_imbalance: float             # max / mean of ``work``
    kv_floor_bytes: list[int]         # other ranks' K/V this rank's queries see (forward)
    sent_bytes: list[int]             # what the running strategy sends, fwd + bwd
    cross_node_bytes: list[int]       # the part of ``sent_bytes`` that leaves the node
    estimates: dict[str, Estimate] | None = None   # every candidate, when asked for
    auto_pick: str | None = None      # what ``auto`` picks among ``estimates``
    coverage: FlashCoverage | None = None  # the reporting rank's calls on FA, when asked for
    flash_backend: str | None = None  # what its FA-form calls run on (None: no FA route)

    @property
    def label(self) -> str:
        return self.layer.label


@dataclass(frozen=True)
class PlanReport:
    """A plan's report (see the module docstring)."""

    cp: int
    layout: str
    n_docs: int
    total_tokens: int
    padded_tokens: int
    shape: AttnShape
    tokens: list[int]
    token_imbalance: float
    layers: list[LayerReport] = field(default_factory=list)
    backends: Backends | None = None  # the kernels' route, when the coverage was asked for

    def choices(self) -> tuple:
        """What the step runs: layout and, per layer type, strategy and stage count (a
        change of these starts a new block in the training logs)."""
        return (self.layout, self.cp, tuple((r.label, r.strategy, r.stages)
                                            for r in self.layers))

    def model_seconds(self, strategy: str | None = None) -> float | None:
        """Estimated attention time of the whole model per step (sum over layer types of
        layers x time per layer) with ``strategy`` everywhere (None: each layer type's
        running strategy); None when estimates were not computed or ``strategy`` is not
        a candidate of every layer type."""
        total = 0.0
        for r in self.layers:
            if r.estimates is None:
                return None
            name = r.strategy if strategy is None else strategy
            if name not in r.estimates:
                return None
            total += r.layer.n_layers * r.estimates[name].seconds
        return total


def resolve_strategy(plan: CPPlan, layer: LayerType, shape: AttnShape) -> str:
    """The strategy the step runs for ``layer`` (``auto`` resolved as the op resolves it,
    cached in the plan; "p2p" at cp 1, where every strategy is the local op)."""
    if layer.strategy != "auto":
        return layer.strategy
    return choose_strategy(plan, layer.mask, shape)


def layer_report(plan: CPPlan, layer: LayerType, shape: AttnShape, *,
                 overlap_stages: int | None = None, with_estimates: bool = False,
                 model: CostModel | None = None, backends: Backends | None = None
                 ) -> LayerReport:
    """One layer type's report (module docstring); ``with_estimates``: every candidate
    strategy's estimate too (the expensive part); ``backends``: the backend coverage of
    the running strategy on ``plan.cp_rank`` with that route and tiles (None: not
    computed)."""
    mask = layer.mask
    name = resolve_strategy(plan, layer, shape) if plan.cp_size > 1 else LOCAL
    stages = None
    static = plan.capacity is not None   # graph-safe: no stages, the row kernels only
    if plan.cp_size > 1 and name in STAGED_STRATEGIES and not static:
        stages = resolve_stages(plan, mask, name, shape, overlap_stages)
    counts = fetch_count_array(plan, mask)
    floor = ((counts.sum(1) - counts.diagonal()) * shape.kv_row).tolist()
    model = check_model(model, plan.topology)
    if plan.cp_size == 1:
        sent, cross = [0], [0]
    else:
        a2a = layer.a2a_size if takes(name, "a2a_size") else None
        links = split(catalogue.traffic_of(name, plan, mask, shape, a2a),
                      model.nodes(plan.cp_size, plan.topology))
        sent = sum(links.values()).tolist()   # fwd + bwd, in the node and across
        cross = (links["fwd_cross"] + links["bwd_cross"]).tolist()
    table = auto_pick = None
    if with_estimates and plan.cp_size > 1:
        table = estimates(plan, mask, shape, model=model)
        auto_pick = pick(table, model)
    coverage = None if backends is None else \
        layer_coverage(plan, mask, name, backends, stages, layer.a2a_size, shape)
    return LayerReport(layer, name, stages, plan.work_per_rank(mask),
                       plan.work_imbalance(mask), floor, sent, cross, table, auto_pick,
                       coverage,
                       None if backends is None else backends.flash)


def plan_report(plan: CPPlan, layers: Sequence[LayerType], shape: AttnShape, *,
                overlap_stages: int | None = None, with_estimates: bool | str = False,
                model: CostModel | None = None, backends: Backends | None = None
                ) -> PlanReport:
    """The report of ``plan`` for a model whose attention layers are ``layers`` (each mask
    with its layer count and strategy) of ``shape``; ``overlap_stages`` as configured
    (None: the cost model's per layer type). ``with_estimates``: every candidate's
    estimate for every layer type (True), for the ``auto`` layer types only ("auto"), or
    none (False). ``backends`` (``Backends.step`` / ``Backends.planned``): the backend
    coverage of every layer type on ``plan.cp_rank`` (None: not computed). See the module
    docstring."""
    if with_estimates not in (True, False, "auto"):
        raise ValueError(f"with_estimates must be True, False or 'auto', got "
                         f"{with_estimates!r}")
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if not isinstance(shape, AttnShape):
        raise ValueError(f"shape must be a varlen_cp.config.AttnShape, got "
                         f"{type(shape).__name__}")
    if plan.capacity is not None:   # graph-safe: its row kernels, no backend to cover
        backends = None
    layers = list(layers)
    if not layers or not all(isinstance(t, LayerType) for t in layers):
        raise ValueError(f"layers must be a non-empty list of LayerType, got {layers!r}")
    if backends is not None and not isinstance(backends, Backends):
        raise ValueError(f"backends must be a varlen_cp.report.Backends or None, got "
                         f"{type(backends).__name__}")
    return PlanReport(
        cp=plan.cp_size, layout=plan.layout, n_docs=plan.n_docs,
        total_tokens=plan.total_tokens, padded_tokens=plan.padded_total_tokens, shape=shape,
        tokens=[plan.num_tokens_of(r) for r in range(plan.cp_size)],
        token_imbalance=plan.token_imbalance(),
        layers=[layer_report(plan, t, shape, overlap_stages=overlap_stages,
                             with_estimates=with_estimates is True or (
                                 with_estimates == "auto" and t.strategy == "auto"),
                             model=model, backends=backends) for t in layers],
        backends=backends)


def layer_types(layer_masks: Sequence[tuple[AttnMask, int]], strategy: str,
                a2a_size: int | None = None) -> list[LayerType]:
    """One ``LayerType`` per (mask, layer count) with the model's one strategy."""
    return [LayerType(mask, int(n), strategy, a2a_size if takes(strategy, "a2a_size") else None)
            for mask, n in layer_masks]
