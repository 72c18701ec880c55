"""AttnOptions: how one context-parallel attention call runs, declared and checked once.

The runtime options (strategy, backend, validate, a2a_size, overlap_stages, graph_safe,
graph_capacity, graph_send_capacity) travel as
ONE frozen object down the spine: ``CPConfig.attn_options`` (the integrations' TOML) ->
``ContextParallelVarlenAttention`` / ``cp_varlen_attn`` (and the compiled op) -> the
strategies' ``CallSpec``. Everything that can be said about them without the tensors is
checked here, in ``__post_init__``, so the layers below take the object as given; the
rules that need the head counts and cp (the Ulysses head split, an ``a2a_size`` that
divides cp) are the strategies' own (``Strategy.check_heads``, called through
``varlen_cp.resolve.check_heads``). Under torch.compile the options cross the custom op as
their ``key`` (an int; ``AttnOptions.of_key`` gives the object back), not taken apart.

Which strategy takes which option is :data:`TAKES`, read by :class:`AttnOptions` and by
megatron's per-layer strategy lists (:func:`check_taken`). The strategy names and which
strategies stage their transfers come from the one catalogue of strategies
(``varlen_cp.tables.catalogue``), the layer below, so that ``varlen_cp.strategies`` can
hold this object in its call spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .checks import check_bool, check_choice, check_int
from .kernels.flash import FLASH_IMPL_BACKENDS
from .kernels.validation import BACKENDS
from .tables import catalogue

STRATEGY_CHOICES: tuple[str, ...] = (*catalogue.STRATEGY_NAMES, catalogue.AUTO)
"""Every value of ``strategy``: the strategies, and "auto" (chosen per plan and mask)."""

STAGED_STRATEGIES: tuple[str, ...] = (*catalogue.STAGED, catalogue.AUTO)
"""Strategies that take ``overlap_stages`` ("auto" passes it on when it picks one)."""

GRAPH_SAFE_STRATEGIES: tuple[str, ...] = catalogue.GRAPH_SAFE
"""The strategies with a graph-safe form (``varlen_cp.strategies.static``)."""

GRAPH_SAFE_BACKENDS: tuple[str, ...] = tuple(b for b in BACKENDS
                                            if b not in FLASH_IMPL_BACKENDS)
"""The backends of the graph-safe mode ("auto", our Triton row kernels, the dense torch
kernel: ``varlen_cp.kernels.rows``); FlashAttention's calls are per batch."""

TAKES: dict[str, tuple[str, ...]] = {
    "a2a_size": ("a2a+p2p",),
    "overlap_stages": STAGED_STRATEGIES,
}
"""The strategy-bound options and the strategies that take them."""


def check_strategy(value: Any, name: str = "strategy") -> str:
    """``value`` if it is a strategy name (``STRATEGY_CHOICES``); ValueError naming ``name``."""
    return check_choice(name, value, STRATEGY_CHOICES)


def check_taken(option: str, value: Any, strategies: Sequence[str] | None) -> Any:
    """``value`` of the strategy-bound ``option`` (None, or an int >= 1) if one of
    ``strategies`` takes it (None: the strategies are not known yet, e.g. megatron's
    ``cp_comm_type``); ValueError naming the option, the value and the strategies."""
    check_int(option, value, 1, optional=True)
    if value is None or strategies is None:
        return value
    if not set(strategies) & set(TAKES[option]):
        takers = TAKES[option]
        which = f"strategy {takers[0]!r}" if len(takers) == 1 else f"strategies {takers}"
        got = strategies[0] if len(strategies) == 1 else tuple(strategies)
        raise ValueError(f"{option} applies to {which} only, got {option}={value!r} with "
                         f"strategy={got!r}")
    return value


def takes(strategy: str, option: str) -> bool:
    """Whether ``strategy`` takes the strategy-bound ``option``."""
    return strategy in TAKES[option]


@dataclass(frozen=True, kw_only=True)
class AttnOptions:
    """How a context-parallel attention call runs (frozen, hashable).

    strategy:  how K/V (or heads) move: "p2p" (ring), "all_gather", "a2a" (Ulysses),
               "a2a+p2p" (Ulysses in groups of ``a2a_size``, ring across), "dispatch" (only
               the K/V each rank's queries see), or "auto" (chosen per plan and mask from
               closed-form costs, cached in the plan).
    backend:   kernels: "auto" (Triton on CUDA, the PyTorch twin otherwise), "triton",
               "torch".
    validate:  check once per plan, with one small all-reduce of host tensors, that every
               rank built the same plan (ranks that disagree would otherwise compute
               silently wrong results); False skips it.
    a2a_size:  "a2a+p2p" only: Ulysses group size, a divisor of cp whose all-to-all the
               head counts allow (None: the largest such divisor).
    overlap_stages: "dispatch" / "all_gather" (and "auto" when it picks one of them): S
               kernel stages; S >= 2: the local keys first, the remote K/V in S - 1
               transfers, each in flight while the previous stage computes; 1: one
               transfer, then one call (no overlap). None: the cost model's choice per plan
               and mask (``varlen_cp.tables.staged.default_stages``).
    graph_safe: the same device work for every batch, so that a captured step (CUDA
               graphs) replays right with other documents (``varlen_cp.strategies.static``;
               docs/graph-safe.md): every rank's q, k, v hold ``graph_capacity`` rows (its
               tokens, then unused slots), the rows' documents and positions are refreshed
               in place in device buffers, collectives have fixed sizes. Strategies
               ``GRAPH_SAFE_STRATEGIES`` (all but "auto"), backends
               ``GRAPH_SAFE_BACKENDS`` ("auto": the Triton row kernels on GPUs, the dense
               torch kernel on CPUs).
    graph_capacity: graph_safe only: rows per rank (None: 1.02 x the mean tokens per rank,
               rounded up to 64, ``plan.capacity.default_capacity``); a batch in which
               a rank holds more is refused before any communication.
    graph_send_capacity: graph_safe "dispatch" only: the most keys one rank sends another
               (None: ``graph_capacity``, which any batch fits); sends are padded to it.
    """

    strategy: str = "p2p"
    backend: str = "auto"
    validate: bool = True
    a2a_size: int | None = None
    overlap_stages: int | None = None
    graph_safe: bool = False
    graph_capacity: int | None = None
    graph_send_capacity: int | None = None

    def __post_init__(self) -> None:
        check_strategy(self.strategy)
        check_choice("backend", self.backend, BACKENDS)
        check_bool("validate", self.validate)
        for option in TAKES:
            check_taken(option, getattr(self, option), (self.strategy,))
        check_bool("graph_safe", self.graph_safe)
        check_int("graph_capacity", self.graph_capacity, 1, optional=True)
        check_int("graph_send_capacity", self.graph_send_capacity, 1, optional=True)
        for name in ("graph_capacity", "graph_send_capacity"):
            if getattr(self, name) is not None and not self.graph_safe:
                raise ValueError(f"{name} applies with graph_safe=True only, got "
                                 f"{name}={getattr(self, name)!r}")
        if self.graph_send_capacity is not None and self.strategy != "dispatch":
            raise ValueError(f"graph_send_capacity applies to strategy 'dispatch' only, got "
                             f"graph_send_capacity={self.graph_send_capacity!r} with "
                             f"strategy={self.strategy!r}")
        if self.graph_safe:
            if self.strategy not in GRAPH_SAFE_STRATEGIES:
                raise ValueError(f"graph_safe=True runs strategy {GRAPH_SAFE_STRATEGIES} "
                                 f"only ('auto' chooses per batch), got "
                                 f"strategy={self.strategy!r}")
            if self.backend not in GRAPH_SAFE_BACKENDS:
                raise ValueError(f"graph_safe=True runs backend {GRAPH_SAFE_BACKENDS} only "
                                 f"(FlashAttention's varlen calls take one window per call "
                                 f"over this batch's segments), got backend="
                                 f"{self.backend!r}")
            if self.overlap_stages is not None:
                raise ValueError(f"overlap_stages does not apply with graph_safe=True (one "
                                 f"transfer, no stages), got overlap_stages="
                                 f"{self.overlap_stages!r}")
        # The compiled op's handle on these options (a plain int the graph can carry):
        # equal options share one, and ``of_key`` gives the object back whole.
        key = _KEYS.setdefault(self, len(_KEYS))
        if key == len(_BY_KEY):
            _BY_KEY.append(self)
        object.__setattr__(self, "key", key)

    def __reduce__(self):
        # rebuilt through __init__ in another process, so it gets that process's key
        return (_rebuild, (self.strategy, self.backend, self.validate, self.a2a_size,
                           self.overlap_stages, self.graph_safe, self.graph_capacity,
                           self.graph_send_capacity))

    @staticmethod
    def of_key(key: int) -> "AttnOptions":
        """The options whose ``key`` is ``key`` (made in this process)."""
        return _BY_KEY[key]


_KEYS: dict[AttnOptions, int] = {}
_BY_KEY: list[AttnOptions] = []


def _rebuild(strategy: str, backend: str, validate: bool, a2a_size: int | None,
             overlap_stages: int | None, graph_safe: bool = False,
             graph_capacity: int | None = None,
             graph_send_capacity: int | None = None) -> AttnOptions:
    return AttnOptions(strategy=strategy, backend=backend, validate=validate,
                       a2a_size=a2a_size, overlap_stages=overlap_stages,
                       graph_safe=graph_safe, graph_capacity=graph_capacity,
                       graph_send_capacity=graph_send_capacity)
