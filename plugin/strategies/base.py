"""The Strategy protocol every CP strategy implements, and the per-call spec it receives.

A strategy is a stateless object (one instance each, in ``varlen_cp.strategies.STRATEGIES``)
with:
- ``check_heads(n_heads, n_kv_heads, cp_size, a2a_size)``: ValueError when the head counts
  (or the option) do not suit it; run by ``varlen_cp.attention`` at every cp, before any
  communication;
- ``build_tables(plan, mask, res, device)``: build and cache in the plan every host table
  its ``attention`` will read for the call's :class:`Resolution` (tiles, FlashAttention
  route, stage count, Ulysses group size), and their device copies (``varlen_cp.prefetch``
  has it done ahead of the step);
- ``function(q, k, v, spec) -> (Function, args)``: its ``torch.autograd.Function`` and the
  arguments after q, k, v. ``attention(q, k, v, spec) -> (out, lse, max_part)`` applies it:
  differentiable in q, k, v through out AND lse (attention sinks compose on the merged
  lse); inputs already validated. ``varlen_cp.graph_op`` runs the same Function's
  ``forward`` / ``backward`` inside one custom op under torch.compile (a stand-in ctx), so
  a Function keeps its backward state in ctx attributes and ``save_for_backward`` only;
  ``max_part`` (``spec.need_max``; else None): fp32 [Hq], the max scaled visible score over
  the (query row, head) pairs this rank computed, -inf elsewhere; one MAX all-reduce over
  the CP group (the caller's) makes it global. ``lse`` may be an [Hq, 0] stand-in when not
  ``spec.need_lse`` (a2a);
- ``bytes_sent_per_rank`` / ``compute_per_rank``: its costs per layer and rank, from the
  same host tables it runs on (its cost functions in ``varlen_cp.tables.catalogue``;
  benchmarks, tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..tables import catalogue
from ..tables.flash_form import FlashRoute
from ..shape import AttnShape
from .calls import Attn, maybe_max


@dataclass(frozen=True)
class Resolution:
    """How the calls of one (plan, mask, options, head shape, device) run, resolved once
    by ``varlen_cp.resolve.resolve`` (cached in the plan): ahead of the step it says which
    tables to build, per call it is looked up. ``name``: the strategy the step runs
    ("auto" resolved; the configured name at cp 1, where ``strategy`` is the local op);
    ``backend``: our kernels ("triton" / "torch") for the calls FlashAttention does not
    take; ``block``: their tiles; ``route``: FlashAttention for the calls it expresses
    exactly (None: none); ``stages``: a staged strategy's stage count; ``a2a_size``: the
    Ulysses group size of "a2a+p2p" (the heads' default when not given); ``capacity``: the
    graph-safe mode's rows per rank (None: not graph-safe), ``send_capacity`` its
    ``dispatch``'s keys per pair of ranks."""

    name: str
    strategy: "Strategy"
    backend: str
    block: tuple[int, int]
    route: FlashRoute | None
    shape: AttnShape
    stages: int | None = None
    a2a_size: int | None = None
    capacity: int | None = None   # graph_safe: rows per rank (``tables.static_rows``)
    send_capacity: int | None = None   # graph_safe dispatch: keys per pair of ranks


@dataclass(frozen=True)
class CallSpec:
    """Everything but the tensors of one ``cp_varlen_attn`` call, as a strategy sees it."""

    plan: CPPlan
    attn: Attn
    group: Any                       # the CP process group (None: the default group)
    res: Resolution
    need_lse: bool = True
    need_max: bool = False

    def __post_init__(self) -> None:
        # the two the strategies read most, as plain attributes (read on every layer call)
        object.__setattr__(self, "block", self.res.block)   # tiles the tables are built with
        object.__setattr__(self, "route", self.res.route)   # FlashAttention (None: ours only)


class Strategy(ABC):
    """One CP strategy (see the module docstring)."""

    name: ClassVar[str]

    @property
    def staged(self) -> bool:
        """Overlaps its transfers in ``overlap_stages`` stages (the catalogue's trait;
        ``local`` is not in the catalogue: never)."""
        return self.name in catalogue.STAGED

    def check_heads(self, n_heads: int, n_kv_heads: int, cp_size: int,
                    a2a_size: int | None = None) -> None:
        """Any GQA head split works unless a strategy says otherwise."""

    @abstractmethod
    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        """Build and cache this rank's host tables for ``res`` and their ``device`` copies
        (calls in FlashAttention's form where exact, with ``res.route``)."""

    @abstractmethod
    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        """The autograd.Function of this call and its arguments after q, k, v; its forward
        returns (out, lse, max_part or the ``calls.no_max`` stand-in)."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Differentiable (out, lse, max_part) of the local queries over all keys."""
        fn, args = self.function(q, k, v, spec)
        out, lse, max_part = fn.apply(q, k, v, *args)
        return out, lse, maybe_max(max_part)

    # ---- costs (host only) -------------------------------------------------------------
    def bytes_sent_per_rank(self, plan: CPPlan, mask: AttnMask, shape: AttnShape, *,
                            a2a_size: int | None = None) -> dict[str, list[int]]:
        """Bytes each rank posts per layer for layers of ``shape``: {"fwd": [...],
        "bwd": [...]}."""
        return catalogue.bytes_sent(self.name, plan, mask, shape, a2a_size)

    def compute_per_rank(self, plan: CPPlan, mask: AttnMask, shape: AttnShape, *,
                         block: tuple[int, int], a2a_size: int | None = None
                         ) -> dict[str, list[float]]:
        """Per rank, per query head of the model: pairs the kernels' tiles visit and the
        visible pairs among them (head dims and dtype do not change them; the head counts
        do where heads move)."""
        return {"visited": catalogue.visited_pairs(self.name, plan, mask, shape, tuple(block),
                                                   a2a_size),
                "visible": catalogue.visible_pairs(self.name, plan, mask, shape, a2a_size)}
