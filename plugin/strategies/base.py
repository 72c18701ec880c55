"""The Strategy protocol every CP strategy implements, and the per-call spec it receives.

A strategy is a stateless object (one instance each, in ``varlen_cp.strategies.STRATEGIES``)
with:
- ``check_heads(n_heads, n_kv_heads, cp_size, a2a_size)``: ValueError when the head counts
  (or the option) do not suit it; run by ``varlen_cp.attention`` at every cp, before any
  communication;
- ``prepare(plan, mask, block, device, shape, a2a_size, overlap_stages, route)``: build and
  cache in the plan every
  host table its ``attention`` will read, and their device copies (``varlen_cp.prepare``
  calls it ahead of the step); staged strategies (``staged``: the catalogue says so;
  dispatch, all_gather) also take ``overlap_stages`` there and read
  ``spec.options.overlap_stages``;
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
  same host tables it runs on (its cost functions in ``varlen_cp.schedules.catalogue``;
  benchmarks, tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..masks import AttnMask
from ..options import AttnOptions
from ..plan import CPPlan
from ..schedules import catalogue
from ..schedules.flash_form import FlashRoute
from ..schedules.shape import Shape, make_shape
from .calls import Attn, maybe_max


@dataclass(frozen=True)
class CallSpec:
    """Everything but the tensors of one ``cp_varlen_attn`` call, as a strategy sees it;
    ``options`` as the caller gave them (checked, and against the heads and cp)."""

    plan: CPPlan
    attn: Attn
    group: Any                       # the CP process group (None: the default group)
    block: tuple[int, int]           # tile sizes the schedules are built with
    need_lse: bool = True
    need_max: bool = False
    options: AttnOptions = AttnOptions()
    route: FlashRoute | None = None  # FlashAttention for the calls it can express exactly


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
    def prepare(self, plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device, shape: Shape, a2a_size: int | None = None,
                overlap_stages: int | None = None, route: FlashRoute | None = None) -> None:
        """Build and cache this rank's host tables and their ``device`` copies (calls in
        FlashAttention's form where exact, with a ``route``)."""

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
    def bytes_sent_per_rank(self, plan: CPPlan, mask: AttnMask, *, head_dim: int,
                            n_kv_heads: int, dtype_bytes: int, n_heads: int | None = None,
                            head_dim_v: int | None = None, a2a_size: int | None = None
                            ) -> dict[str, list[int]]:
        """Bytes each rank posts per layer: {"fwd": [...], "bwd": [...]}."""
        shape = make_shape(n_heads or n_kv_heads, n_kv_heads, head_dim, head_dim_v,
                           dtype_bytes)
        return catalogue.bytes_sent(self.name, plan, mask, shape, a2a_size)

    def compute_per_rank(self, plan: CPPlan, mask: AttnMask, *, block: tuple[int, int],
                         n_heads: int = 1, n_kv_heads: int = 1, a2a_size: int | None = None,
                         head_dim: int | None = None, head_dim_v: int | None = None,
                         dtype_bytes: int | None = None) -> dict[str, list[float]]:
        """Per rank, per query head of the model: pairs the kernels' tiles visit and the
        visible pairs among them (head dims and dtype do not change them)."""
        shape = make_shape(n_heads, n_kv_heads, 1, 1, 1)
        return {"visited": catalogue.visited_pairs(self.name, plan, mask, shape, tuple(block),
                                                   a2a_size),
                "visible": catalogue.visible_pairs(self.name, plan, mask, shape, a2a_size)}
