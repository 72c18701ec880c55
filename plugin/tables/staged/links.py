"""The rows each transfer of a staged strategy moves, per hop, and the keys its calls use:
what the time model and the memory walk read (plain dispatch and all_gather: one hop;
dispatch relayed through nodes: two)."""

from __future__ import annotations

import numpy as np
import torch

from ...masks import AttnMask
from ...plan import CPPlan
from .relay import relay_active, relay_link_counts, relay_link_counts_of
from .routes import dispatch_stage_array, gather_stage_array, transfers


def stage_array(name: str, plan: CPPlan, mask: AttnMask, stages: int) -> np.ndarray:
    """int64 [P, cp, cp]: keys rank d takes from rank o in each transfer of ``name`` with
    ``stages`` stages (numpy); relayed dispatch: the keys its calls use."""
    return stage_links(name, plan, mask, stages)[-1]


def stage_links(name: str, plan: CPPlan, mask: AttnMask, stages: int
                ) -> tuple[np.ndarray, ...]:
    """The rows each hop of each transfer moves, int64 [P, receiver, sender] per hop, then
    (last) the keys rank d's calls use from rank o: for plain dispatch and all_gather one
    hop whose rows are those keys (``(counts, counts)``); for dispatch relayed through
    nodes (``relay``) (hop1, hop2, keys)."""
    if name == "dispatch":
        if relay_active(plan):
            return relay_link_counts(plan, mask, transfers(stages))
        counts = dispatch_stage_array(plan, mask, transfers(stages))
    else:
        counts = gather_stage_array(plan, mask, transfers(stages))
    return counts, counts


def stage_links_of(name: str, plan: CPPlan, mask: AttnMask, stage_list: tuple[int, ...]
                   ) -> list[tuple[np.ndarray, ...]]:
    """:func:`stage_links` of every S in ``stage_list`` (relayed dispatch: the counts of
    all S computed together, ``relay_link_counts_of``)."""
    if name == "dispatch" and relay_active(plan):
        relay_link_counts_of(plan, mask, tuple(transfers(s) for s in stage_list))
    return [stage_links(name, plan, mask, s) for s in stage_list]


def stage_counts(name: str, plan: CPPlan, mask: AttnMask, stages: int) -> torch.Tensor:
    """:func:`stage_array` as a tensor (a view)."""
    return torch.from_numpy(stage_array(name, plan, mask, stages))
