"""Deterministic accumulation of rows with duplicates: rounds of unique rows.

A key that several ranks fetched comes back to its owner once from each of them (dispatch
and all_gather's dK/dV returns), so the owner's list of rows to accumulate has duplicates.
One ``index_add_`` over such a list adds with atomics on CUDA and the duplicates of a row
sum in a run-dependent order: bitwise run-to-run differences in dK/dV. ``UniqueRounds``
cuts the list on the host into rounds where every row appears at most once (round j: each
row's j-th occurrence), and the device adds round after round: one fixed order per row, no
two updates of one row in one call. Rounds: at most the largest number of ranks that fetch
one key (1 when nothing repeats: one call, as before).

The staged tables hand the list over as runs of consecutive rows (one per destination and
piece of a document): :meth:`UniqueRounds.of_runs` cuts the runs at each other's ends and
ranks the pieces, not the rows, so no per-row sort is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.host_copy import to_device
from ..plan.runs import run_rows


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

    @classmethod
    def of_runs(cls, start: torch.Tensor, length: torch.Tensor,
                rows: torch.Tensor | None = None) -> "UniqueRounds":
        """:meth:`of` the list of runs ``[start[i], start[i] + length[i])`` laid back to
        back (``rows``: that list, when the caller has it), each run's rows distinct. The
        runs are cut at every run's ends into pieces that every run covers whole or not at
        all; a piece's round is the number of earlier runs covering it. Falls back to the
        per-row :meth:`of` when the pieces would outnumber the rows."""
        keep = length > 0
        start, length = start[keep], length[keep]
        if rows is None:
            rows = run_rows(start, length)
        n = rows.numel()
        if start.numel() <= 1:
            return cls(None, rows, (n,) if n else ())
        bounds = torch.unique(torch.cat([start, start + length]))      # sorted
        first = torch.searchsorted(bounds, start)
        count = torch.searchsorted(bounds, start + length) - first     # pieces per run
        n_pieces = int(count.sum())
        if n_pieces > n:
            return cls.of(rows)
        run = torch.repeat_interleave(torch.arange(start.numel()), count,
                                      output_size=n_pieces)
        piece = torch.arange(n_pieces) - (torch.cumsum(count, 0) - count)[run] + first[run]
        lo, size = bounds[piece], bounds[piece + 1] - bounds[piece]
        occurrence = rank_within(piece)     # earlier runs covering the same rows
        if int(occurrence.max()) == 0:      # no duplicates: one round, in list order
            return cls(None, rows, (n,))
        per_round = torch.zeros(int(occurrence.max()) + 1, dtype=torch.int64)
        per_round.scatter_add_(0, occurrence, size)
        at = (torch.cumsum(length, 0) - length)[run] + lo - start[run]   # place in the list
        order = torch.argsort(occurrence * (n + 1) + at)      # round by round, list order
        size = size[order]
        return cls(run_rows(at[order], size), run_rows(lo[order], size),
                   tuple(torch.cumsum(per_round, 0).tolist()))

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
