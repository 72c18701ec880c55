"""CPConfig: every option of varlen-cp's context parallelism, declared and validated once.

The torchtitan ``[varlen_cp]`` section and megatron's ``VarlenCPOptions`` are this class plus
their framework's own extras; ``CPPlan.build`` takes its layout options through
:meth:`CPConfig.plan_kwargs`. The name lists (layouts, strategies, backends, softmax types)
live next to the code that implements them and are re-exported here, so a new layout or
strategy is one edit.

Frozen and hashable (plans and strategies may cache per config); invalid fields raise
``ValueError`` naming the field and value in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .checks import check_bool, check_choice, check_int
from .kernels import SOFTMAX_TYPES
from .kernels.validation import BACKENDS
from .plan.layouts import LAYOUTS
from .schedules import catalogue

# The strategies' names and traits live in one place, ``varlen_cp.schedules.catalogue``.
STRATEGY_NAMES: tuple[str, ...] = (*catalogue.STRATEGY_NAMES, catalogue.AUTO)

__all__ = ["CPConfig", "AttnShape", "LAYOUTS", "STRATEGY_NAMES", "BACKENDS", "SOFTMAX_TYPES"]

# Strategies that take ``overlap_stages`` ("auto" passes it on when it picks one of them).
STAGED_STRATEGIES: tuple[str, ...] = (*catalogue.STAGED, catalogue.AUTO)


def check_overlap_stages(value: Any, strategy: Any) -> Any:
    """``overlap_stages``: None or an int >= 1, with a strategy that stages its transfers."""
    check_int("overlap_stages", value, 1, optional=True)
    if value is not None and strategy not in STAGED_STRATEGIES:
        raise ValueError(f"overlap_stages applies to strategies {STAGED_STRATEGIES} only, "
                         f"got overlap_stages={value!r} with strategy={strategy!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """How a model's attention runs under context parallelism.

    strategy:  how K/V (or heads) move: "p2p" (ring), "all_gather", "a2a" (Ulysses),
               "a2a+p2p" (Ulysses in groups of ``a2a_size``, ring across), "dispatch" (only
               the K/V each rank's queries see), or "auto" (chosen per plan and mask from
               closed-form costs).
    layout:    which tokens each rank holds: "dual_chunk", "te" (TransformerEngine's padded
               layout), "contiguous", "balanced" (every layer type's work balanced).
    backend:   kernels: "auto" (Triton on CUDA, the PyTorch twin otherwise), "triton",
               "torch".
    a2a_size:  "a2a+p2p" only: Ulysses group size (None: the largest divisor of cp that the
               head counts allow).
    overlap_stages: "dispatch" / "all_gather" (and "auto" when it picks one of them): S
               kernel stages; S >= 2: the local keys first, the remote K/V in S - 1
               transfers, each in flight while the previous stage computes; 1: one
               transfer, then one call (no overlap). None: the cost model's choice per plan
               and mask (``varlen_cp.schedules.staged.default_stages``).
    validate:  check once per plan, with one small all-reduce, that every rank built the
               same plan (ranks that disagree would otherwise compute silently wrong
               results); False skips it.
    min_chunk_tokens: "dual_chunk" only: documents shorter than 2*cp*this stay whole.
    tile_tokens: "balanced" only: the tile grid documents are cut on (None: the layout's
               default).
    pad_multiple: "te" only: pad each document to a multiple of it (None: 2*cp; 2*cp*tp
               with sequence parallelism).
    prefetch:  integrations: build the next batch's plan and all its tables in the
               background while the current step runs.
    report:    integrations: log the plan (layout, strategy per layer type, stage counts,
               balance, bytes, planner time) on the ``varlen_cp`` logger at the first step
               and when a choice changes, and its figures with the framework's metrics
               every logged step (``varlen_cp.report``); False: nothing.
    """

    strategy: str = "p2p"
    layout: str = "balanced"
    backend: str = "auto"
    a2a_size: int | None = None
    overlap_stages: int | None = None
    validate: bool = True
    min_chunk_tokens: int = 64
    tile_tokens: int | None = None
    pad_multiple: int | None = None
    prefetch: bool = True
    report: bool = True

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, STRATEGY_NAMES)
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("backend", self.backend, BACKENDS)
        check_int("a2a_size", self.a2a_size, 1, optional=True)
        if self.a2a_size is not None and self.strategy != "a2a+p2p":
            raise ValueError(f"a2a_size applies to strategy 'a2a+p2p' only, got "
                             f"a2a_size={self.a2a_size!r} with strategy={self.strategy!r}")
        check_overlap_stages(self.overlap_stages, self.strategy)
        check_bool("validate", self.validate)
        check_int("min_chunk_tokens", self.min_chunk_tokens, 1)
        check_int("tile_tokens", self.tile_tokens, 1, optional=True)
        check_int("pad_multiple", self.pad_multiple, 1, optional=True)
        check_bool("prefetch", self.prefetch)
        check_bool("report", self.report)
        for name, layout in (("tile_tokens", "balanced"), ("pad_multiple", "te")):
            if getattr(self, name) is not None and self.layout != layout:
                raise ValueError(f"{name} applies to layout {layout!r} only, got "
                                 f"{name}={getattr(self, name)!r} with layout={self.layout!r}")

    def plan_kwargs(self, masks: Any = None) -> dict[str, Any]:
        """Keyword arguments of ``CPPlan.build`` for this layout. ``masks``: the model's
        layer masks with their layer counts, e.g. ``[(AttnMask(chunk_size=8192), 36),
        (AttnMask(), 12)]``; the ``balanced`` layout balances each of them (other layouts
        ignore them)."""
        kw: dict[str, Any] = {"layout": self.layout, "min_chunk_tokens": self.min_chunk_tokens}
        if self.layout == "balanced":
            kw["masks"] = masks
            if self.tile_tokens is not None:
                kw["tile_tokens"] = self.tile_tokens
        if self.layout == "te" and self.pad_multiple is not None:
            kw["pad_multiple"] = self.pad_multiple
        return kw


@dataclass(frozen=True, kw_only=True)
class AttnShape:
    """Head counts, head dims and dtype of a model's attention (what tile sizes and the
    ``auto`` cost model depend on)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            check_int(f"AttnShape.{name}", getattr(self, name), 1)
        check_int("AttnShape.head_dim_v", self.head_dim_v, 1, optional=True)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"AttnShape: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"AttnShape.dtype must be torch.float16, bfloat16 or float32, "
                             f"got {self.dtype!r}")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v
