"""The graph-safe mode's device buffers: every rank's rows' documents and positions (and
``dispatch``'s send lists and received keys, per layer type), allocated once per (device,
cp, rank, capacities) and refreshed IN PLACE for each plan, so a captured step reads the
new batch from the storages it recorded.

Two steps, so that the planner thread never writes a buffer the running step reads:
:func:`stage` (ahead of the step, on the planner thread: the host tables and their device
copies, made from pinned staging buffers with non-blocking copies, cached in the plan) and
``refresh`` (before the step, on the thread and stream that run it: one device copy into
each buffer; the first call on a new plan does it if nobody did)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...masks import AttnMask
from ...plan import CPPlan
from ...tables.cache import cached_table, table_key
from ...tables.static_rows import dispatch_rows, static_rows


def staged_rows(plan: CPPlan, capacity: int, device: torch.device) -> torch.Tensor:
    """``static_rows`` of ``plan`` on ``device`` (its own copy, cached in the plan)."""
    return cached_table(plan, table_key("static_rows_t", None, None, capacity),
                        lambda: torch.from_numpy(static_rows(plan, capacity)), device)


def staged_dispatch(plan: CPPlan, mask: AttnMask, capacity: int, send_capacity: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``dispatch_rows`` of ``plan`` on ``device`` (its own copies, cached in the plan)."""
    return cached_table(
        plan, table_key("static_dispatch_t", mask, None, plan.cp_rank, capacity,
                        send_capacity),
        lambda: tuple(torch.from_numpy(x) for x in dispatch_rows(
            plan, mask, plan.cp_rank, capacity, send_capacity)), device)


def check_not_capturing(device: torch.device) -> None:
    """A buffer rewritten inside a CUDA graph capture would be rewritten with the capture's
    plan at every replay (silently the wrong rows): the refresh belongs before the step
    (``varlen_cp.prefetch.refresh_buffers``, the integrations' sharding)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("varlen_cp: a graph-safe buffer would be rewritten for a new plan "
                           "inside a CUDA graph capture; refresh the buffers before the "
                           "step (varlen_cp.prefetch.refresh_buffers, or the integrations' "
                           "sharding), on the step's stream")


class Rows:
    """Every rank's rows' documents and positions (``table`` int32 [2, cp * capacity])."""

    def __init__(self, table: torch.Tensor, capacity: int) -> None:
        self.capacity = capacity
        self.table = table
        self.doc, self.pos = table[0], table[1]

    def rank_rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc, pos) views of ``rank``'s rows."""
        rows = slice(rank * self.capacity, (rank + 1) * self.capacity)
        return self.doc[rows], self.pos[rows]


class StaticRows(Rows):
    """Device buffers ``doc`` and ``pos`` (int32 [cp * capacity]) of every rank's rows,
    allocated once, refreshed in place for each plan (:meth:`refresh`)."""

    def __init__(self, device: torch.device, cp_size: int, capacity: int) -> None:
        super().__init__(torch.full((2, cp_size * capacity), -1, dtype=torch.int32,
                                    device=device), capacity)
        self._plan: Any = None

    def refresh(self, plan: CPPlan) -> None:
        """Write ``plan``'s rows into the buffers (once per plan): one copy from the plan's
        staged device copy, on the current stream, so every later kernel on it reads the
        new rows; the storage never changes."""
        if self._plan is not None and self._plan() is plan:
            return
        check_not_capturing(self.table.device)
        self.table.copy_(staged_rows(plan, self.capacity, self.table.device),
                         non_blocking=True)
        self._plan = weakref.ref(plan)


_ROWS: dict[tuple, StaticRows] = {}


def static_buffers(plan: CPPlan, capacity: int, device: torch.device) -> StaticRows:
    """The buffers of ``plan``'s (device, cp, rank, capacity), refreshed for ``plan``."""
    key = (str(device), plan.cp_size, plan.cp_rank, capacity)
    rows = _ROWS.get(key)
    if rows is None:
        rows = _ROWS[key] = StaticRows(device, plan.cp_size, capacity)
    rows.refresh(plan)
    return rows





class DispatchRows:
    """Graph-safe ``dispatch``'s device buffers for one layer type (mask): ``send`` (int64
    [cp, K]: the local rows this rank sends each rank, ``capacity`` = a zero row in the
    unused slots) and ``doc`` / ``pos`` (int32 [cp * K] of the keys it receives), allocated
    once, refreshed in place per plan (:meth:`refresh`, as :class:`StaticRows`)."""

    def __init__(self, device: torch.device, cp_size: int, capacity: int,
                 send_capacity: int) -> None:
        self.capacity, self.send_capacity = capacity, send_capacity
        self.send = torch.full((cp_size, send_capacity), capacity, dtype=torch.int64,
                               device=device)
        self.recv = torch.full((2, cp_size * send_capacity), -1, dtype=torch.int32,
                               device=device)
        self.doc, self.pos = self.recv[0], self.recv[1]
        self._plan: Any = None

    def refresh(self, plan: CPPlan, mask: AttnMask) -> None:
        if self._plan is not None and self._plan() is plan:
            return
        check_not_capturing(self.send.device)
        new_send, new_recv = staged_dispatch(plan, mask, self.capacity, self.send_capacity,
                                             self.send.device)
        self.send.copy_(new_send, non_blocking=True)
        self.recv.copy_(new_recv, non_blocking=True)
        self._plan = weakref.ref(plan)


_DISPATCH: dict[tuple, DispatchRows] = {}


def dispatch_buffers(plan: CPPlan, mask: AttnMask, capacity: int, send_capacity: int,
                     device: torch.device) -> DispatchRows:
    """The dispatch buffers of ``plan``'s (device, cp, rank, capacities) for ``mask``'s
    layers, refreshed for ``plan``."""
    key = (str(device), plan.cp_size, plan.cp_rank, capacity, send_capacity, mask)
    rows = _DISPATCH.get(key)
    if rows is None:
        rows = _DISPATCH[key] = DispatchRows(device, plan.cp_size, capacity, send_capacity)
    rows.refresh(plan, mask)
    return rows
