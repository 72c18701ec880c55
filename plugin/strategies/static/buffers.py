"""The graph-safe mode's device buffers: every rank's rows' documents and positions,
allocated once per (device, cp, rank, capacity) and refreshed IN PLACE for each plan, so a
captured step reads the new batch from the storages it recorded."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...kernels.host_copy import to_device
from ...masks import AttnMask
from ...plan import CPPlan
from ...tables.static_rows import static_rows


class StaticRows:
    """Device buffers ``doc`` and ``pos`` (int32 [cp * capacity]) of every rank's rows,
    allocated once, refreshed in place for each plan (:meth:`refresh`)."""

    def __init__(self, device: torch.device, cp_size: int, capacity: int) -> None:
        self.capacity = capacity
        self.table = torch.full((2, cp_size * capacity), -1, dtype=torch.int32,
                                device=device)
        self.doc, self.pos = self.table[0], self.table[1]
        self._plan: Any = None

    def refresh(self, plan: CPPlan) -> None:
        """Write ``plan``'s rows into the buffers (once per plan): a non-blocking copy from
        a pinned staging buffer, then a copy into place, both on the current stream, so
        every later kernel on it reads the new rows; the storage never changes."""
        if self._plan is not None and self._plan() is plan:
            return
        host = torch.from_numpy(static_rows(plan, self.capacity))
        self.table.copy_(to_device([host], self.table.device)[0], non_blocking=True)
        self._plan = weakref.ref(plan)

    def rank_rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc, pos) views of ``rank``'s rows."""
        rows = slice(rank * self.capacity, (rank + 1) * self.capacity)
        return self.doc[rows], self.pos[rows]


_ROWS: dict[tuple, StaticRows] = {}


def static_buffers(plan: CPPlan, capacity: int, device: torch.device) -> StaticRows:
    """The buffers of ``plan``'s (device, cp, rank, capacity), refreshed for ``plan``."""
    key = (str(device), plan.cp_size, plan.cp_rank, capacity)
    rows = _ROWS.get(key)
    if rows is None:
        rows = _ROWS[key] = StaticRows(device, plan.cp_size, capacity)
    rows.refresh(plan)
    return rows





def mask_args(mask: AttnMask) -> tuple[bool, int, int, int]:
    causal, left, right, chunk = mask.params
    return causal, left, right, chunk


def _pair(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., :width], x[..., width:]


def pair(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` split at ``width`` along its last dim (two views)."""
    return x[..., :width], x[..., width:]
