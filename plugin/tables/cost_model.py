"""The machine rates that turn visible pairs and bytes into seconds (a leaf: no package
imports but the argument checks).

``auto`` (which strategy) and ``staged.timing`` (how many overlap stages) both convert
with one :class:`CostModel`; it lives here, below both, so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checks import check_positive


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Machine rates the estimate converts pairs and bytes with (per rank).

    flops_per_s: attention kernel throughput (default 3e14: FA2-class bf16 on an H100).
    bytes_per_s: bytes one rank sends per second to a rank of its own node (default 1.5e11:
    NCCL all-to-all / P2P inside an NVLink node).
    cross_node_bytes_per_s: bytes one rank sends per second to ranks of other nodes
    (default 4.5e10: one 400 Gb/s InfiniBand / RoCE NIC per GPU; ~2.5e10 with 200 Gb/s).
    ranks_per_node: CP ranks that share a node, consecutive in CP rank order (GPUs per
    node / TP when TP is inside the node); None: every CP rank in one node (one link).
    A rank's bytes to its own node and to other nodes move on different links at the same
    time: its transfer time is the longer of the two (``tables.traffic`` splits them).
    tolerance: estimates within this fraction of the best count as equal (default 0.05).
    stage_latency_s: fixed cost of one overlap stage of dispatch / all_gather (a collective
    and a kernel launch; default 2e-5).
    memory_bytes_per_s: device memory bandwidth, for the per-stage fold of partial results
    (default 3e12: H100 HBM3).
    """

    flops_per_s: float = 3e14
    bytes_per_s: float = 1.5e11
    cross_node_bytes_per_s: float = 4.5e10
    ranks_per_node: int | None = None
    tolerance: float = 0.05
    stage_latency_s: float = 2e-5
    memory_bytes_per_s: float = 3e12

    def __post_init__(self) -> None:
        check_positive("CostModel.flops_per_s", self.flops_per_s)
        check_positive("CostModel.bytes_per_s", self.bytes_per_s)
        check_positive("CostModel.memory_bytes_per_s", self.memory_bytes_per_s)
        check_positive("CostModel.cross_node_bytes_per_s", self.cross_node_bytes_per_s)
        r = self.ranks_per_node
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"CostModel.ranks_per_node must be None or an int >= 1, got "
                             f"{r!r}")
        if isinstance(self.stage_latency_s, bool) \
                or not isinstance(self.stage_latency_s, (int, float)) \
                or not math.isfinite(self.stage_latency_s) or self.stage_latency_s < 0:
            raise ValueError(f"CostModel.stage_latency_s must be a finite number >= 0, got "
                             f"{self.stage_latency_s!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) \
                or not 0 <= self.tolerance < 1:
            raise ValueError(f"CostModel.tolerance must be in [0, 1), got {self.tolerance!r}")
        # a part of the cost tables' keys (hashed on each lookup): the fields' hash made once
        object.__setattr__(self, "_hash", hash((self.flops_per_s, self.bytes_per_s,
                                                self.cross_node_bytes_per_s,
                                                self.ranks_per_node, self.tolerance,
                                                self.stage_latency_s,
                                                self.memory_bytes_per_s)))

    def __hash__(self) -> int:
        return self._hash

    def nodes(self, cp_size: int, topology: Any = None) -> np.ndarray:
        """int64 [cp]: the node of each CP rank: a plan's ``topology`` (``plan.Topology``,
        what the CP group's ranks say) where it has one, else ``ranks_per_node`` (all 0
        without it)."""
        if topology is not None:
            return topology.node_array
        ranks = np.arange(cp_size, dtype=np.int64)
        return ranks // self.ranks_per_node if self.ranks_per_node else ranks * 0

    def link_seconds(self, inside: np.ndarray, cross: np.ndarray) -> np.ndarray:
        """Per rank: the time of ``inside`` bytes to its own node and ``cross`` bytes to
        others, on their own links at once (the longer of the two)."""
        return np.maximum(np.asarray(inside) / self.bytes_per_s,
                          np.asarray(cross) / self.cross_node_bytes_per_s)


def check_model(model: Any, topology: Any = None) -> CostModel:
    """``model``, or for None the default :class:`CostModel` with the link rates of a
    plan's ``topology`` (``plan.Topology``; the ``[varlen_cp]`` keys) where it has one;
    ValueError otherwise."""
    if model is None:
        model = CostModel() if topology is None else CostModel(
            bytes_per_s=topology.node_bytes_per_s,
            cross_node_bytes_per_s=topology.cross_node_bytes_per_s)
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel or None, got {type(model).__name__}")
    return model
