"""Hybrid (a2a+p2p) tables: Ulysses groups of ``a2a_size`` consecutive ranks, a ring across
the groups with each group's merged tokens as one ring holder."""

from __future__ import annotations

import numpy as np
import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..shape import AttnShape
from .flash_form import FlashRoute
from .holders import HolderSet
from .cache import cached_table, host_table, table_key
from .ring import RingTables, ring_tables
from .selected import fetch_count_array
from .ulysses import ulysses_tables


def heads_fit(n_heads: int, n_kv_heads: int, size: int) -> bool:
    """Whether an all-to-all over ``size`` ranks can split the heads (K/V heads split, or
    replicated when there are fewer than ``size``)."""
    return n_heads % size == 0 and (n_kv_heads % size == 0 or size % n_kv_heads == 0)


def default_a2a_size(n_heads: int, n_kv_heads: int, cp_size: int) -> int:
    """Largest divisor of cp whose all-to-all the head counts allow."""
    return max(a for a in range(1, cp_size + 1)
               if cp_size % a == 0 and heads_fit(n_heads, n_kv_heads, a))


def hybrid_size(plan: CPPlan, shape: AttnShape, a2a_size: int | None) -> int:
    """a2a+p2p's Ulysses group size: ``a2a_size``, or the largest the heads allow."""
    return default_a2a_size(shape.n_heads, shape.n_kv_heads, plan.cp_size) \
        if a2a_size is None else a2a_size


def group_members(rank: int, size: int) -> tuple[int, ...]:
    """CP ranks of ``rank``'s Ulysses group (consecutive ranks)."""
    first = rank // size * size
    return tuple(range(first, first + size))


def group_holders(plan: CPPlan, size: int) -> HolderSet:
    """The merged tokens of every group, as ring holders (cached)."""
    return host_table(plan, table_key("group_holders", None, None, size),
                      lambda: HolderSet.of([ulysses_tables(plan, group_members(g * size, size))
                                            .holder for g in range(plan.cp_size // size)]))


def group_visibility(plan: CPPlan, mask: AttnMask, size: int) -> np.ndarray:
    """int64 [G, G] (numpy): how many of group j's keys group s's queries see (cached)."""
    def build() -> np.ndarray:
        g = plan.cp_size // size
        return fetch_count_array(plan, mask).reshape(g, size, g, size).sum((1, 3))
    return host_table(plan, table_key("group_visibility", mask, None, size), build)


def hybrid_ring_tables(plan: CPPlan, mask: AttnMask, size: int, group_index: int,
                       block: tuple[int, int], device: torch.device | str | None = None,
                       route: FlashRoute | None = None) -> RingTables:
    """Ring tables of group ``group_index`` in the ring of groups, on the host or copied to
    ``device`` (cached); FA forms where exact with a ``route``."""
    return cached_table(plan, table_key("hybrid_ring", mask, block, size, group_index,
                                      route=route),
                        lambda: ring_tables(group_holders(plan, size),
                                            group_visibility(plan, mask, size), group_index,
                                            mask, block, route), device)
