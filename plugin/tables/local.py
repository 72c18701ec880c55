"""The table of cp == 1 (and of any rank's own keys): one call, local queries x local keys."""

from __future__ import annotations

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashRoute
from .holders import KernelCall, kernel_call, rank_holder
from .cache import cached_table, table_key


def local_call(plan: CPPlan, mask: AttnMask, block: tuple[int, int],
               device: torch.device | str | None = None,
               route: FlashRoute | None = None) -> KernelCall:
    """The call of this rank's queries against its own keys, on the host or copied to
    ``device`` (cached); in FlashAttention's form where exact with a ``route``."""
    def build() -> KernelCall:
        holder = rank_holder(plan, plan.cp_rank)
        return kernel_call(holder, holder, mask, block, route)
    return cached_table(plan, table_key("local", mask, block, route=route), build, device)
