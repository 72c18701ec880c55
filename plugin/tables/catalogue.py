"""The one list of CP strategies: name, how their transfers meet compute, when ``auto`` may
pick them, and their cost functions.

Everything that needs to know the strategies reads this list: the registry of runtime
implementations (``varlen_cp.strategies.STRATEGIES``, one per entry, in this order), the
choice of ``strategy="auto"`` (``tables.auto``), the options (``config.STRATEGY_CHOICES``,
``STAGED_STRATEGIES``), the plan report and the benchmarks. A new strategy is one entry
here, its traffic (``tables.traffic``: who sends what to whom; the bytes per rank are its
row sums), its other cost functions (``tables.cost``) and its runtime module.

``overlap``: "ring" (each ring step's transfer runs under the previous step's compute:
max(compute, comm) per pass), "stages" (``overlap_stages`` stages, the staged pipeline of
``tables.staged``; such a strategy is *staged*), "none" (it waits for its collectives:
compute + comm). ``tie_rank``: ``auto``'s order among near-equal estimates (simpler, less
memory first). ``graph_safe``: it has a static form (``varlen_cp.strategies.static``: the
same device work for every batch, ``AttnOptions(graph_safe=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..masks import AttnMask
from ..plan import CPPlan
from . import cost, traffic
from .hybrid import default_a2a_size, heads_fit
from ..shape import AttnShape

AUTO = "auto"   # not a strategy: the option that picks one per plan and mask


@dataclass(frozen=True)
class StrategyTraits:
    """One strategy's entry (module docstring). The cost functions take ``(plan, mask,
    shape, a2a_size)`` (``visited_pairs``: ``block`` before ``a2a_size``); ``options``
    gives the options ``auto`` runs it with for these heads at this cp, or None when the
    heads do not allow it."""

    name: str
    overlap: str
    tie_rank: int
    options: Callable[[AttnShape, int], dict[str, Any] | None]
    traffic: Callable[..., dict[str, Any]]
    visible_pairs: Callable[..., list[float]]
    visited_pairs: Callable[..., list[float]]
    saved_bytes: Callable[..., int]
    graph_safe: bool = False

    @property
    def staged(self) -> bool:
        """Takes ``overlap_stages``: its transfers overlap compute in stages."""
        return self.overlap == "stages"


def _any_heads(shape: AttnShape, cp: int) -> dict[str, Any]:
    return {}


def _a2a_heads(shape: AttnShape, cp: int) -> dict[str, Any] | None:
    return {} if heads_fit(shape.n_heads, shape.n_kv_heads, cp) else None


def _hybrid_heads(shape: AttnShape, cp: int) -> dict[str, Any] | None:
    size = default_a2a_size(shape.n_heads, shape.n_kv_heads, cp)
    return {"a2a_size": size} if 1 < size < cp else None


CATALOGUE: tuple[StrategyTraits, ...] = (
    StrategyTraits("p2p", "ring", 0, _any_heads, traffic.p2p_traffic, cost.rank_pairs,
                   cost.p2p_visited, cost.nothing_saved, True),
    StrategyTraits("all_gather", "stages", 4, _any_heads, traffic.all_gather_traffic,
                   cost.rank_pairs, cost.all_gather_visited, cost.selected_saved, True),
    StrategyTraits("a2a", "none", 1, _a2a_heads, traffic.a2a_traffic, cost.a2a_pairs,
                   cost.a2a_visited, cost.a2a_saved, True),
    StrategyTraits("a2a+p2p", "none", 3, _hybrid_heads, traffic.hybrid_traffic,
                   cost.hybrid_pairs, cost.hybrid_visited, cost.hybrid_saved, True),
    StrategyTraits("dispatch", "stages", 2, _any_heads, traffic.dispatch_traffic,
                   cost.rank_pairs, cost.dispatch_visited, cost.selected_saved, True),
)
BY_NAME: dict[str, StrategyTraits] = {t.name: t for t in CATALOGUE}
STRATEGY_NAMES: tuple[str, ...] = tuple(BY_NAME)
STAGED: tuple[str, ...] = tuple(t.name for t in CATALOGUE if t.staged)
GRAPH_SAFE: tuple[str, ...] = tuple(t.name for t in CATALOGUE if t.graph_safe)


def traits(name: Any) -> StrategyTraits:
    """The entry of strategy ``name``; ValueError naming the value for anything else."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise ValueError(f"strategy must be one of {(*STRATEGY_NAMES, AUTO)}, got {name!r}")
    return BY_NAME[name]


# ---- costs by name ---------------------------------------------------------------------------
def bytes_sent(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape,
               a2a_size: int | None = None) -> dict[str, list[int]]:
    """Bytes each rank sends per layer: {"fwd": [...], "bwd": [...]} (input dtype): the
    row sums of :func:`traffic_of`."""
    return {phase: m.sum(1).tolist()
            for phase, m in traits(name).traffic(plan, mask, shape, a2a_size).items()}


def traffic_of(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape,
               a2a_size: int | None = None) -> dict[str, Any]:
    """Who sends how many bytes to whom per layer: {"fwd": int64 [cp, cp], "bwd": ...}
    (row: sender, column: receiver; ``tables.traffic``); ``bytes_sent`` is its row sums."""
    return traits(name).traffic(plan, mask, shape, a2a_size)


def visible_pairs(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape,
                  a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: the visible pairs its kernels compute."""
    return traits(name).visible_pairs(plan, mask, shape, a2a_size)


def visited_pairs(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape,
                  block: tuple[int, int], a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: pairs the kernels' tiles cover (builds every
    rank's schedules: benchmarks and tests)."""
    return traits(name).visited_pairs(plan, mask, shape, block, a2a_size)


def saved_bytes(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape,
                a2a_size: int | None = None) -> int:
    """Max over ranks of what ``name`` keeps for the backward beyond q, k, v, out, lse."""
    return traits(name).saved_bytes(plan, mask, shape, a2a_size)
