"""Host tables of the graph-safe mode: every rank's rows at a fixed capacity.

A captured step (CUDA graphs) replays the device work it recorded, with the shapes and
sizes of its first batch. So in the graph-safe mode (``AttnOptions(graph_safe=True)``)
every rank holds exactly ``capacity`` rows in every batch: its tokens of the plan first,
then unused slots (document and position -1: they see nothing and nothing sees them). What
differs between batches is data only: each row's document and position, which the static
strategies (``varlen_cp.strategies.static``) read from device buffers refreshed in place.

The capacity is the most tokens one rank may hold. Derived from the batch's token count
(fixed for a job: packed sequences of one length) and cp: ``TOKEN_SLACK`` x the mean,
rounded up to ``CAPACITY_MULTIPLE`` (the ``balanced`` layout keeps every rank within 2% of
the mean; the others within a token or their padding), unless given. A batch in which a
rank holds more is refused (:func:`check_capacity`) before anything is communicated; the
plan is the same on every rank, so every rank raises the same error.
"""

from __future__ import annotations

import math

import numpy as np

from ..plan import CPPlan
from .cache import host_table, table_key

TOKEN_SLACK = 1.02
"""The derived capacity's slack over a rank's mean token count (the ``balanced`` layout's
token target)."""

CAPACITY_MULTIPLE = 64
"""The derived capacity is rounded up to this (a kernel tile's rows)."""


def default_capacity(total_tokens: int, cp_size: int) -> int:
    """Rows per rank for ``total_tokens`` (padding included) split over ``cp_size`` ranks:
    ``TOKEN_SLACK`` x the mean, rounded up to ``CAPACITY_MULTIPLE`` (at least one)."""
    rows = math.ceil(TOKEN_SLACK * total_tokens / cp_size)
    return max(1, -(-rows // CAPACITY_MULTIPLE)) * CAPACITY_MULTIPLE


def capacity_of(plan: CPPlan, capacity: int | None) -> int:
    """``capacity``, or the plan's default (:func:`default_capacity` of its tokens)."""
    if capacity is not None:
        return capacity
    return default_capacity(plan.padded_total_tokens, plan.cp_size)


def check_capacity(plan: CPPlan, capacity: int) -> None:
    """ValueError when a rank of ``plan`` holds more than ``capacity`` tokens (every rank
    raises it: the plan is the same everywhere)."""
    counts = np.diff(plan.arrays.rank_offsets)
    worst = int(np.argmax(counts))
    if int(counts[worst]) > capacity:
        raise ValueError(
            f"graph_capacity={capacity} is below this batch's largest rank share: rank "
            f"{worst} holds {int(counts[worst])} of {plan.padded_total_tokens} tokens "
            f"(cp {plan.cp_size}, layout {plan.layout!r}); raise graph_capacity (the rows "
            f"every rank holds in the graph-safe mode)")


def static_rows(plan: CPPlan, capacity: int) -> np.ndarray:
    """int32 [2, cp * capacity]: the document (row 0) and position (row 1) of every rank's
    rows at ``capacity`` (rank r's rows at [r * capacity, (r + 1) * capacity): its tokens,
    then -1 for the unused slots), cached per capacity. Checks the capacity first."""
    def build() -> np.ndarray:
        check_capacity(plan, capacity)
        t = plan.arrays
        counts = np.diff(t.rank_offsets)
        rank = np.repeat(np.arange(plan.cp_size, dtype=np.int64), counts)
        slot = np.arange(t.position.size, dtype=np.int64) - t.rank_offsets[rank] \
            + rank * capacity
        out = np.full((2, plan.cp_size * capacity), -1, dtype=np.int32)
        real = t.position >= 0          # padding of the ``te`` layout sees nothing either
        out[0, slot[real]] = t.doc[real]
        out[1, slot[real]] = t.position[real]
        return out
    return host_table(plan, table_key("static_rows", None, None, capacity), build)
