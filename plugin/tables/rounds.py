"""Deterministic accumulation of rows with duplicates: consecutive rounds of unique rows.

A key that several ranks fetched comes back to its owner once from each of them (dispatch
and all_gather's dK/dV returns), so the owner's list of rows to accumulate has duplicates.
One ``index_add_`` over such a list adds with atomics on CUDA and the duplicates of a row
sum in a run-dependent order: bitwise run-to-run differences in dK/dV. ``UniqueRounds``
cuts the list on the host into rounds, consecutive slices of it in which no row repeats (a
round ends before the first entry whose row it already holds), and the device adds round
after round, one ``index_add_`` each: every row sums its values in list order, and no call
updates a row twice.

The rounds are slices of the list, so the values need no reordering. (Rounds made of each
row's j-th occurrence, as before, sum every row in the same order, so dK/dV are bitwise
unchanged, but needed a permuted copy of all the returns at every fold: an fp32 copy of
every returned row, 1.3 GiB at the peak of one 128K document at cp 64 with all_gather.)
Rounds: at least the largest number of ranks that fetch one key, 1 when nothing repeats
(one call); on the bench's batches at cp 64 up to ~2x that per transfer.

The staged tables hand the list over as runs of consecutive rows (one per destination and
piece of a document): :meth:`UniqueRounds.of_runs` finds where runs overlap by cutting
them at each other's ends, per run, not per row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..kernels.host_copy import to_device
from ..plan.runs import run_rows


def rank_within(group: torch.Tensor) -> torch.Tensor:
    """int64: index of each element among the elements of its group, in list order
    (torch: the tests' per-key reference, tests/staged_reference.py, is its reader)."""
    order = torch.argsort(group, stable=True)
    ordered = group[order]
    out = torch.empty_like(group)
    out[order] = torch.arange(group.numel()) - torch.searchsorted(ordered, ordered)
    return out


def _previous(key: np.ndarray) -> np.ndarray:
    """int64: index of the previous element with the same key (-1: none)."""
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    same = ordered[1:] == ordered[:-1]
    out = np.full(key.shape, -1, dtype=np.int64)
    out[order[1:][same]] = order[:-1][same]
    return out


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` by a sort and a comparison: numpy 2.4's ``unique`` took ~10x
    longer on this machine (0.53 vs 0.05 ms on 3000 int64; 17 vs 3 us on 300)."""
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if x.size else x


def _round_starts(last: torch.Tensor) -> list[int]:
    """Greedy cut of a list into rounds: element i starts a new round when ``last[i]``,
    the latest earlier element it clashes with (-1: none), lies in the current round. The
    round after one starting at s starts at the first i with last[i] >= s (last[i] < i):
    a suffix minimum over the values of ``last``, then one lookup per round."""
    n = last.size
    first = np.full(n + 1, n, dtype=np.int64)          # first i with last[i] == v
    where = np.flatnonzero(last >= 0)
    clash = last[where]                                 # (``np.unique`` with return_index
    order = np.argsort(clash, kind="stable")            # as a sort: ``_sorted_unique``)
    ordered = clash[order]
    head = order[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if where.size \
        else where
    first[clash[head]] = where[head]
    after = np.minimum.accumulate(first[::-1])[::-1]   # first i with last[i] >= s
    starts, s = [], 0
    while after[s] < n:
        s = int(after[s])
        starts.append(s)
    return starts


@dataclass(frozen=True)
class UniqueRounds:
    """A row list cut into rounds of unique rows: round j is entries [ends[j-1], ends[j])
    of ``rows``, the list itself. ``perm`` is None: the entries are added in list order
    (the field stays for readers of the tables that accept a reordering)."""

    perm: torch.Tensor | None
    rows: torch.Tensor
    ends: tuple[int, ...]

    @classmethod
    def of(cls, rows) -> "UniqueRounds":
        """Host tables of the list ``rows`` (int64, numpy array or host tensor): the
        rounds in numpy, ``rows`` handed out as a tensor (what ``index_add_`` reads; a view,
        no copy)."""
        rows = np.asarray(rows)
        if rows.size == 0:
            return cls(None, torch.from_numpy(rows), ())
        return cls(None, torch.from_numpy(rows), (*_round_starts(_previous(rows)), rows.size))

    @classmethod
    def of_runs(cls, start, length, rows=None) -> "UniqueRounds":
        """:meth:`of` the list of runs ``[start[i], start[i] + length[i])`` laid back to
        back (``rows``: that list, when the caller has it), each run's rows distinct; the
        rounds start at runs. The runs are cut at every run's ends into pieces that every
        run covers whole or not at all: a run clashes with the latest earlier run covering
        one of its pieces. Falls back to the per-row :meth:`of` when the pieces would
        outnumber the rows. Host tensors or numpy arrays in; numpy inside (a few hundred
        runs per transfer: torch's per-op cost made this ~0.5 ms per call)."""
        start, length = np.asarray(start), np.asarray(length)
        keep = length > 0
        start, length = start[keep], length[keep]
        rows = run_rows(start, length) if rows is None else np.asarray(rows)
        n = rows.size
        if start.size <= 1:
            return cls(None, torch.from_numpy(rows), (n,) if n else ())
        bounds = _sorted_unique(np.concatenate([start, start + length]))
        first = np.searchsorted(bounds, start)
        count = np.searchsorted(bounds, start + length) - first          # pieces per run
        n_pieces = int(count.sum())
        if n_pieces > n:
            return cls.of(rows)
        run = np.repeat(np.arange(start.size, dtype=np.int64), count)
        piece = np.arange(n_pieces, dtype=np.int64) - (np.cumsum(count) - count)[run] \
            + first[run]
        earlier = _previous(piece)                 # the previous run on the same rows
        clash = np.where(earlier >= 0, run[np.maximum(earlier, 0)], -1)
        last = np.full(start.size, -1, dtype=np.int64)
        np.maximum.at(last, run, clash)
        at = np.cumsum(length) - length            # each run's place in the list
        return cls(None, torch.from_numpy(rows), (*at[_round_starts(last)].tolist(), n))

    def to(self, device: torch.device) -> "UniqueRounds":
        perm, rows = to_device([self.perm, self.rows], device)
        return replace(self, perm=perm, rows=rows)

    def add_(self, acc: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``acc[rows[i]] += values[i]`` for every entry i of the list (``values`` in list
        order), round by round; returns ``acc``."""
        start = 0
        for end in self.ends:
            acc.index_add_(0, self.rows[start:end], values[start:end])
            start = end
        return acc
