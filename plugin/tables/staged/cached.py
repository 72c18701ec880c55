"""One rank's staged tables of a strategy, cached in the plan (and their device copy):
plain dispatch (``tables``), all_gather (``tables``) or dispatch relayed through nodes
(``relay_tables``) on a plan whose topology spans nodes."""

from __future__ import annotations

import torch

from ...masks import AttnMask
from ...plan import CPPlan
from ..cache import cached_table, table_key
from ..flash_form import FlashRoute
from .relay import relay_active
from .relay_tables import relay_tables
from .tables import StagedTables, dispatch_tables, gather_tables


def staged_tables(name: str, plan: CPPlan, mask: AttnMask, rank: int,
                  block: tuple[int, int], stages: int,
                  device: torch.device | str | None = None,
                  route: FlashRoute | None = None) -> StagedTables:
    """Host tables of ``rank``'s ``name`` call (``dispatch`` or ``all_gather``) with
    ``stages`` stages, or their copy on ``device`` (cached); FA forms where exact with a
    ``route``."""
    if name != "dispatch":
        build = gather_tables
    else:   # relayed through nodes on a plan across them
        build = relay_tables if relay_active(plan) else dispatch_tables
    return cached_table(plan, table_key(f"{name}_staged", mask, block, rank, stages,
                                          route=route),
                        lambda: build(plan, mask, rank, block, stages, route), device)
