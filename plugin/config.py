"""CPConfig: every option of varlen-cp's context parallelism for the integrations.

The torchtitan ``[varlen_cp]`` section and megatron's ``VarlenCPOptions`` are this class plus
their framework's own extras. Its flat fields are the TOML keys; it composes the two objects
the spine takes and leaves their rules to them:

- :attr:`CPConfig.attn_options`: a ``varlen_cp.AttnOptions`` (strategy, backend, validate,
  a2a_size, overlap_stages) for the attention modules and ``build_tables``;
- :meth:`CPConfig.layout_spec`: the plan's layout spec (``varlen_cp.plan.layout_spec``:
  the layout and its own options, ``min_chunk_tokens`` / ``tile_tokens`` /
  ``pad_multiple``; an option of another layout is rejected) for ``CPPlan.build``.

Frozen and hashable (plans and strategies may cache per config); invalid fields raise
``ValueError`` naming the field and value in ``__post_init__``, where both objects are built
once (their checks are the config's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import check_bool, check_choice, check_int, check_positive
from .kernels.flash import FLASH_IMPLS
from .kernels.sink import SOFTMAX_TYPES
from .kernels.validation import BACKENDS
from .options import STAGED_STRATEGIES, STRATEGY_CHOICES, AttnOptions
from .plan.layout_spec import LAYOUTS, LayoutSpec, layout_spec
from .plan.nodes import Topology, launch_gpus_per_node, node_of_ranks
from .shape import AttnShape

__all__ = ["CPConfig", "AttnShape", "AttnOptions", "LAYOUTS", "STRATEGY_CHOICES",
           "STAGED_STRATEGIES", "BACKENDS", "SOFTMAX_TYPES"]


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """How a model's attention runs under context parallelism.

    The attention options (``varlen_cp.AttnOptions`` documents and checks them):

    strategy:  how K/V (or heads) move: "p2p" (ring), "all_gather", "a2a" (Ulysses),
               "a2a+p2p", "dispatch" (only the K/V each rank's queries see), or "auto"
               (chosen per plan and mask from closed-form costs).
    backend:   kernels: "auto" (on CUDA FlashAttention where a call is exact in its form,
               FA4 when installed, else torch's flash ops; Triton for the rest; the
               PyTorch twin on CPUs), "flash" (torch's flash ops where exact), "fa4"
               (flash-attn-4 where exact), "triton", "torch" (our kernels only).
    flash_impl: None, "FA3" or "FA4": switch torch's flash ops (backend "flash" / "auto")
               to FlashAttention 3 or 4 at start-up
               (``torch.nn.attention.activate_flash_attention_impl``); None keeps FA2.
    a2a_size:  "a2a+p2p" only: Ulysses group size (None: the largest divisor of cp that the
               head counts allow).
    overlap_stages: "dispatch" / "all_gather" (and "auto" when it picks one of them): S
               kernel stages, the remote K/V in S - 1 transfers each overlapping the
               previous stage (None: the cost model's choice per plan and mask).
    validate:  check once per plan, with one small all-reduce, that every rank built the
               same plan; False skips it.
    graph_safe: the same device work for every batch, for CUDA graphs (docs/graph-safe.md):
               plans at ``graph_capacity`` rows per rank, the batch sharded to them,
               every strategy but "auto", backends "auto" / "triton" / "torch".
    graph_capacity: graph_safe only: rows per rank (None: 1.02 x the mean tokens per rank,
               rounded up to 64).
    graph_send_capacity: graph_safe "dispatch" only: the most keys one rank sends another
               (None: graph_capacity).

    The layout (its spec, ``varlen_cp.plan.layout_spec``, checks its options):

    layout:    which tokens each rank holds: "balanced" (every layer type's work balanced),
               "dual_chunk", "te" (TransformerEngine's padded layout), "contiguous".
    min_chunk_tokens: "dual_chunk" only: documents shorter than 2*cp*this stay whole
               (None: 64).
    tile_tokens: "balanced" only: the tile grid documents are cut on (None: 64).
    pad_multiple: "te" only: pad each document to a multiple of it (None: 2*cp; 2*cp*tp
               with sequence parallelism).

    The machine (the plan's topology, ``varlen_cp.plan.Topology``):

    gpus_per_node: GPUs per node (None: the launch's ``LOCAL_WORLD_SIZE``, else 8); a CP
               rank's node is its global rank // this, so with TP inside a node a node
               holds fewer CP ranks. "balanced" places its ranks so that the K/V a rank
               fetches comes from its own node where it can, and ``auto`` and the overlap
               stages time in-node and cross-node bytes on their own links.
    node_bandwidth / cross_node_bandwidth: bytes per second one rank sends to a rank of
               its own node (default 1.5e11: NVLink) / of another node (default 4.5e10: a
               400 Gb/s NIC per GPU).

    The integrations:

    prefetch:  build the next batch's plan and all its tables in the background while the
               current step runs.
    report:    log the plan (layout, strategy per layer type, stage counts, balance, bytes,
               planner time) on the ``varlen_cp`` logger at the first step and when a
               choice changes, and its figures with the framework's metrics every logged
               step (``varlen_cp.report``); False: nothing.
    """

    strategy: str = "p2p"
    layout: str = "balanced"
    backend: str = "auto"
    flash_impl: str | None = None
    a2a_size: int | None = None
    overlap_stages: int | None = None
    validate: bool = True
    graph_safe: bool = False
    graph_capacity: int | None = None
    graph_send_capacity: int | None = None
    min_chunk_tokens: int | None = None
    tile_tokens: int | None = None
    pad_multiple: int | None = None
    gpus_per_node: int | None = None
    node_bandwidth: float = 1.5e11
    cross_node_bandwidth: float = 4.5e10
    prefetch: bool = True
    report: bool = True

    def __post_init__(self) -> None:
        self._check_attention()
        if self.flash_impl is not None:
            check_choice("flash_impl", self.flash_impl, FLASH_IMPLS)
        self.layout_spec()
        check_int("gpus_per_node", self.gpus_per_node, 1, optional=True)
        for name in ("node_bandwidth", "cross_node_bandwidth"):
            check_positive(name, getattr(self, name), " (bytes per second)")
        check_bool("prefetch", self.prefetch)
        check_bool("report", self.report)

    def _check_attention(self) -> None:
        """The attention options' rules (megatron's per-layer strategies: its own)."""
        self.attn_options  # noqa: B018  (built for its checks)

    @property
    def attn_options(self) -> AttnOptions:
        """The attention options of every layer (``varlen_cp.AttnOptions``)."""
        return AttnOptions(strategy=self.strategy, backend=self.backend,
                           validate=self.validate, a2a_size=self.a2a_size,
                           overlap_stages=self.overlap_stages, graph_safe=self.graph_safe,
                           graph_capacity=self.graph_capacity,
                           graph_send_capacity=self.graph_send_capacity)

    @property
    def plan_capacity(self) -> int | str | None:
        """``CPPlan.build``'s ``capacity``: ``graph_capacity`` ("auto" when unset) in the
        graph-safe mode, else None."""
        if not self.graph_safe:
            return None
        return "auto" if self.graph_capacity is None else self.graph_capacity

    def topology(self, global_ranks: Any) -> Topology:
        """The plan's topology for a CP group of ``global_ranks`` (its ranks in CP rank
        order): each rank's node, global rank // ``gpus_per_node`` (None: the launch's
        ``LOCAL_WORLD_SIZE``, else 8), and the two links' rates. The same on every rank of
        the group."""
        gpus = launch_gpus_per_node() if self.gpus_per_node is None else self.gpus_per_node
        return Topology(node_of_ranks(global_ranks, gpus), self.node_bandwidth,
                        self.cross_node_bandwidth, gpus)

    def layout_spec(self, masks: Any = None) -> LayoutSpec:
        """The plan's layout spec for ``CPPlan.build(..., layout=)``. ``masks``: the
        model's layer masks with their layer counts, e.g. ``[(AttnMask(chunk_size=8192),
        36), (AttnMask(), 12)]``; the ``balanced`` layout balances each of them (other
        layouts ignore them)."""
        options = {"min_chunk_tokens": self.min_chunk_tokens, "tile_tokens": self.tile_tokens,
                   "pad_multiple": self.pad_multiple}
        if self.layout == "balanced":
            options["masks"] = masks
        return layout_spec(self.layout, **options)
