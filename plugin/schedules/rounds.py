"""Deterministic accumulation of rows with duplicates: rounds of unique rows.

A key that several ranks fetched comes back to its owner once from each of them (dispatch
and all_gather's dK/dV returns), so the owner's list of rows to accumulate has duplicates.
One ``index_add_`` over such a list adds with atomics on CUDA and the duplicates of a row
sum in a run-dependent order: bitwise run-to-run differences in dK/dV. ``UniqueRounds``
cuts the list on the host into rounds where every row appears at most once (round j: each
row's j-th occurrence), and the device adds round after round: one fixed order per row, no
two updates of one row in one call. Rounds: at most the largest number of ranks that fetch
one key (1 when nothing repeats: one call, as before).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.host_copy import to_device


def rank_within(group: torch.Tensor) -> torch.Tensor:
    """int64: index of each element among the elements of its group, in list order."""
    order = torch.argsort(group, stable=True)
    ordered = group[order]
    out = torch.empty_like(group)
    out[order] = torch.arange(group.numel()) - torch.searchsorted(ordered, ordered)
    return out


@dataclass(frozen=True)
class UniqueRounds:
    """A row list cut into rounds of unique rows: ``perm`` (None: the identity) orders the
    list's entries round by round, ``rows`` are their rows in that order, round j is
    entries [ends[j-1], ends[j]) (each row's j-th occurrence, in list order)."""

    perm: torch.Tensor | None
    rows: torch.Tensor
    ends: tuple[int, ...]

    @classmethod
    def of(cls, rows: torch.Tensor) -> "UniqueRounds":
        """Host tables of the list ``rows`` (int64, host)."""
        occurrence = rank_within(rows)
        counts = torch.bincount(occurrence) if rows.numel() else occurrence
        ends = tuple(torch.cumsum(counts, 0).tolist())
        if len(ends) <= 1:   # no duplicates: one round, in list order
            return cls(None, rows, ends)
        perm = torch.argsort(occurrence, stable=True)
        return cls(perm, rows[perm], ends)

    def to(self, device: torch.device) -> "UniqueRounds":
        perm, rows = to_device([self.perm, self.rows], device)
        return replace(self, perm=perm, rows=rows)

    def add_(self, acc: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``acc[rows[i]] += values[i]`` for every entry i of the list (``values`` in list
        order), round by round; returns ``acc``."""
        if self.perm is not None:
            values = values.index_select(0, self.perm)
        start = 0
        for end in self.ends:
            acc.index_add_(0, self.rows[start:end], values[start:end])
            start = end
        return acc
