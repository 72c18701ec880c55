"""The graph-safe strategies: the same device work for every batch, so that a captured step
(CUDA graphs) replays correctly with another batch's documents.

``AttnOptions(graph_safe=True)`` runs these instead of the dynamic strategies. Every rank
holds ``capacity`` rows (``varlen_cp.tables.static_rows``: its tokens, then unused slots);
each row's document and position live in device buffers allocated once per (device, cp,
rank, capacity) and refreshed IN PLACE for each plan (:class:`StaticRows`: a non-blocking
copy from a pinned staging buffer, on the current stream, before the call reads them). A
call then reads nothing of the batch on the host: its collectives have fixed sizes
(capacity rows per rank), its kernels the buffers' shapes (``kernels.rows``: grids and
host arguments from the capacity, visibility from (document, position)), and no Python branch looks
at the batch. What changes between batches is the buffers' contents only.

- ``p2p`` (ring): cp steps, each block of capacity rows posted to the next rank while the
  previous one computes; backward the blocks go round again with fp32 dK|dV
  accumulators that end at their owners.
- ``all_gather``: one ``all_gather_single`` of every rank's K|V rows (capacity each), one
  call of the local rows against all of them; backward: the dK|dV rows of every rank go
  back in one ``all_to_all_single`` of equal splits and are summed in fp32 in rank order
  (a reduce-scatter, deterministic).
- ``dispatch``: each rank sends each other rank the keys its queries see, padded to
  ``graph_send_capacity`` rows per pair (one equal-split all-to-all), and their dK|dV
  come back the same way.
- ``a2a+p2p``: Ulysses inside groups of ``a2a_size`` ranks (equal splits), the static ring
  across the groups.
- ``a2a`` (Ulysses): one ``all_to_all_single`` of q|k|v to heads (equal splits: capacity
  rows per rank), one call of every row against every row on this rank's heads, one back
  (out|lse); backward the same in reverse. K/V heads fewer than cp are repeated to cp
  (their gradients summed back), as the dynamic ``a2a`` does.

``auto`` (a choice per batch) is refused in this mode with an error naming the supported
strategies. Every call runs ``kernels.rows`` (``RowsKernel``, from the resolution's
backend): the Triton row kernels on GPUs (fixed grids over the buffers, the rows each block
visits searched on the device), the dense torch kernel on CPUs.
"""

from __future__ import annotations

import torch

from ...kernels.rows import RowsKernel
from ...masks import AttnMask
from ...options import GRAPH_SAFE_STRATEGIES
from ...plan import CPPlan
from ..base import CallSpec, Resolution, Strategy
from .a2a import _StaticUlysses
from .a2a_p2p import _StaticHybrid
from .all_gather import _StaticAllGather
from .buffers import (DispatchRows, StaticRows, dispatch_buffers, staged_dispatch,
                      staged_rows, static_buffers)
from .dispatch import _StaticDispatch
from .p2p import _StaticRing

__all__ = ["DispatchRows", "StaticRows", "StaticStrategy", "STATIC_STRATEGIES",
           "dispatch_buffers", "get_static_strategy", "static_buffers"]


class StaticStrategy(Strategy):
    """One graph-safe strategy (module docstring)."""

    def __init__(self, name: str, function: type[torch.autograd.Function]) -> None:
        self.name = name
        self._function = function

    @property
    def staged(self) -> bool:
        return False

    def check_heads(self, n_heads: int, n_kv_heads: int, cp_size: int,
                    a2a_size: int | None = None) -> None:
        if self._function not in (_StaticUlysses, _StaticHybrid):   # heads move
            return
        ulysses = self._function is _StaticUlysses
        a = cp_size if ulysses else a2a_size
        what = "cp" if ulysses else "a2a_size"
        if n_heads % a or not (n_kv_heads % a == 0 or a % n_kv_heads == 0) or cp_size % a:
            raise ValueError(f"graph_safe strategy {self.name!r} needs n_heads ({n_heads}) "
                             f"divisible by {what} ({a}), n_kv_heads ({n_kv_heads}) a "
                             f"multiple or a divisor of it, and it a divisor of cp "
                             f"({cp_size})")

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        """The plan's tables staged on ``device`` (the buffers are not touched: the
        planner thread runs this while the previous step reads them)."""
        staged_rows(plan, res.capacity, device)
        if res.send_capacity is not None:
            staged_dispatch(plan, mask, res.capacity, res.send_capacity, device)

    def refresh(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                device: torch.device) -> None:
        """The buffers rewritten in place for ``plan`` (before its step, on its stream)."""
        static_buffers(plan, res.capacity, device)
        if res.send_capacity is not None:
            dispatch_buffers(plan, mask, res.capacity, res.send_capacity, device)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        plan, res = spec.plan, spec.res
        rows = static_buffers(plan, res.capacity, q.device)
        kernel = RowsKernel(spec.attn.mask.params, res.backend)
        args = (rows, plan.cp_rank, plan.cp_size, spec.group, kernel, spec.attn.scale,
                spec.need_max)
        if res.send_capacity is not None:
            args += (dispatch_buffers(plan, spec.attn.mask, res.capacity,
                                      res.send_capacity, q.device),)
        if self._function is _StaticHybrid:   # its group size 1 or cp: plain p2p or a2a
            a = res.a2a_size
            if a in (1, plan.cp_size):
                return (_StaticRing if a == 1 else _StaticUlysses), args
            args += (a,)
        return self._function, args


STATIC_STRATEGIES: dict[str, StaticStrategy] = {
    f.strategy: StaticStrategy(f.strategy, f)
    for f in (_StaticRing, _StaticAllGather, _StaticUlysses, _StaticHybrid, _StaticDispatch)}
assert tuple(STATIC_STRATEGIES) == GRAPH_SAFE_STRATEGIES, "the catalogue's graph_safe traits"


def get_static_strategy(name: str) -> StaticStrategy:
    """The graph-safe form of strategy ``name`` (one of ``GRAPH_SAFE_STRATEGIES``: the
    options refuse the others)."""
    return STATIC_STRATEGIES[name]
