"""Plans at a fixed capacity: every rank holds exactly ``capacity`` rows in every batch, its
tokens first, then padding rows (no token, position -1), as the graph-safe mode needs
(docs/graph-safe.md: a captured step replays with the shapes it recorded).

``CPPlan.build(..., capacity=C)`` lays the batch out as usual, then appends each rank's
padding rows (:func:`pad_tables`); sharding, labels (``ignore_index``), RoPE positions, the
MoE layers' real rows and the token counts treat them as the ``te`` layout's padding. A
batch in which a rank holds more than the capacity is refused before anything is built
(:func:`check_capacity`); the plan is the same on every rank, so every rank raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..checks import is_int
from .tokens import TokenTables

TOKEN_SLACK = 1.02
"""The derived capacity's slack over a rank's mean token count (the ``balanced`` layout's
token target)."""

CAPACITY_MULTIPLE = 64
"""The derived capacity is rounded up to this (a kernel tile's rows)."""


@dataclass(frozen=True)
class GraphKey:
    """What a graph-safe step's device work depends on besides its buffers' contents: the
    rows per rank, cp and the rank (the buffers' sizes, the collectives' peers). Two
    batches with equal keys replay one captured step; the integrations hand it to the
    capturing framework in place of the plan (torchtitan's ``PackedBatch.graph_key``,
    megatron's packed params), which compares it by value."""

    capacity: int
    cp_size: int
    cp_rank: int

    @classmethod
    def of(cls, plan) -> "GraphKey":
        """The key of a plan built at a capacity (``CPPlan.build(..., capacity=...)``)."""
        return cls(plan.capacity, plan.cp_size, plan.cp_rank)


def default_capacity(total_tokens: int, cp_size: int) -> int:
    """Rows per rank for ``total_tokens`` (padding included) split over ``cp_size`` ranks:
    ``TOKEN_SLACK`` x the mean, rounded up to ``CAPACITY_MULTIPLE`` (at least one)."""
    rows = math.ceil(TOKEN_SLACK * total_tokens / cp_size)
    return max(1, -(-rows // CAPACITY_MULTIPLE)) * CAPACITY_MULTIPLE


def check_capacity_value(capacity: object) -> None:
    """None, "auto" or an int >= 1."""
    if capacity is None or capacity == "auto":
        return
    if not is_int(capacity) or capacity < 1:
        raise ValueError(f"capacity must be None, 'auto' or an int >= 1, got {capacity!r}")


def check_capacity(counts: np.ndarray, capacity: int, total: int, layout: str) -> None:
    """ValueError when a rank's token count (``counts`` [cp]) exceeds ``capacity``."""
    worst = int(np.argmax(counts))
    if int(counts[worst]) > capacity:
        raise ValueError(
            f"graph_capacity={capacity} is below this batch's largest rank share: rank "
            f"{worst} holds {int(counts[worst])} of {total} tokens (cp {counts.size}, "
            f"layout {layout!r}); raise graph_capacity (the rows every rank holds in the "
            f"graph-safe mode)")


def pad_tables(t: TokenTables, capacity: int) -> TokenTables:
    """``t`` with every rank's rows padded to ``capacity`` (after its tokens: no token,
    position -1, document -1); local cu_seqlens and runs unchanged (padding lies past every
    segment)."""
    counts = np.diff(t.rank_offsets)
    cp = counts.size
    rank = np.repeat(np.arange(cp, dtype=np.int64), counts)
    dest = np.arange(rank.size, dtype=np.int64) - t.rank_offsets[rank] + rank * capacity

    def spread(x: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(cp * capacity, fill, dtype=x.dtype)
        out[dest] = x
        return out
    token_index = spread(t.token_index, -1)
    padded_index = token_index if t.padded_index is t.token_index else \
        spread(t.padded_index, -1)
    # one padding piece after each rank's pieces (document -1)
    first = np.cumsum(t.piece_count) - t.piece_count
    p_rank = np.searchsorted(t.rank_offsets[1:], first, side="right")
    order = np.lexsort((np.r_[np.zeros(p_rank.size), np.ones(cp)],
                        np.r_[p_rank, np.arange(cp)]))
    piece_doc = np.r_[t.piece_doc, np.full(cp, -1, dtype=t.piece_doc.dtype)][order]
    piece_count = np.r_[t.piece_count, capacity - counts][order]
    keep = piece_count > 0
    return TokenTables(
        rank_offsets=np.arange(cp + 1, dtype=np.int64) * capacity,
        token_index=token_index, padded_index=padded_index,
        position=spread(t.position, -1), local_cu=t.local_cu, runs=t.runs,
        piece_doc=piece_doc[keep], piece_count=piece_count[keep].astype(t.piece_count.dtype))
