"""Which remote keys travel in which transfer, for every rank at once (counts), and the cut
of a rank's runs of keys at the transfers' bounds (what its tables are built from).

Of the P transfers (P = S - 1, or 1 when S = 1):
- ``dispatch``: what rank d fetches from rank o (listed in (document, position) order) is
  cut into P contiguous pieces of equal size, one per transfer, so every rank sends and
  receives 1/P of its rows in each (a collective lasts as long as its busiest rank; cutting
  each rank's own list instead, nearest owners first, made the sum of the per-transfer
  maxima up to 1.6x the total at cp 64). The owner knows what to send in each transfer
  from the [P, cp, cp] count table alone (no metadata exchange).
- ``all_gather``: transfer p gathers rows [lo_p, hi_p) of every rank's padded local K/V
  (equal slices of the padded length); a remote key travels with its owner's row.
Transfers empty on every rank are dropped (the same decision on every rank).
"""

from __future__ import annotations

import numpy as np
import torch

from ...masks import AttnMask
from ...plan import CPPlan
from ..cache import host_table, table_key
from ..selected import fetch_count_array, piece_arrays, run_arrays, span_arrays

_BIG = 1 << 40          # cell * _BIG + row: sort keys of (cell, row) pairs


def transfers(stages: int) -> int:
    """Transfers of S stages: the remote keys in S - 1 stages, or all keys in one."""
    return max(1, stages - 1)


# The counts are numpy int64 (``*_array``), what the staged tables, the time model and the
# memory walk read (the time model asks for six stage counts per mask, each a handful of
# operations on [cp, cp]); the tensor forms are views for the tests and tools.
def dispatch_stage_array(plan: CPPlan, mask: AttnMask, parts: int) -> np.ndarray:
    """int64 [P, cp, cp]: keys rank d fetches from rank o in transfer p: each (d, o) list
    cut into ``parts`` equal pieces, so every rank sends and receives 1/P of its rows in
    each (P <= ``parts``: transfers empty everywhere dropped); summed over p it is
    ``fetch_counts`` off the diagonal (numpy, cached)."""
    def build() -> np.ndarray:
        counts = fetch_count_array(plan, mask).copy()
        np.fill_diagonal(counts, 0)
        cuts = counts[None] * np.arange(parts + 1).reshape(-1, 1, 1) // parts
        steps = cuts[1:] - cuts[:-1]
        return steps[steps.reshape(parts, -1).sum(1) > 0]
    return host_table(plan, table_key("dispatch_stage_counts", mask, None, parts), build)


def dispatch_stage_counts(plan: CPPlan, mask: AttnMask, parts: int) -> torch.Tensor:
    """:func:`dispatch_stage_array` as a tensor (a view)."""
    return torch.from_numpy(dispatch_stage_array(plan, mask, parts))


def gather_stage_rows(plan: CPPlan, parts: int) -> tuple[tuple[int, int], ...]:
    """(lo, hi) of each all_gather transfer: equal slices of the padded local length (the
    largest local token count), empty slices dropped (cached)."""
    def build() -> tuple[tuple[int, int], ...]:
        offsets = plan.arrays.rank_offsets
        stride = int((offsets[1:] - offsets[:-1]).max())
        cuts = [stride * s // parts for s in range(parts + 1)]
        return tuple((a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a)
    return host_table(plan, table_key("gather_stage_rows", None, None, parts), build)


def _picked_rows(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, ...]:
    """(destination, owner, first row, end row) of every piece of remote keys a rank picks
    from an owner's local rows (the needed spans cut by the owners' runs; cached)."""
    def build() -> tuple[np.ndarray, ...]:
        holder = span_arrays(plan, mask)[0]
        part = run_arrays(plan, by_document=True)
        span, run, first, length = piece_arrays(plan, mask)
        dest, owner = holder[span], part.holder[run]
        keep = dest != owner
        row0 = (part.row[run] + first - part.start[run])[keep]
        return dest[keep], owner[keep], row0, row0 + length[keep]
    return host_table(plan, table_key("picked_rows", mask), build)


def _picked_prefix(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, ...]:
    """The picked pieces sorted by (cell = destination * cp + owner, first row), as numpy:
    their sort keys, first and end rows, and the rows of all pieces before each (cached):
    what counts a cell's picked rows below any row with one search."""
    def build() -> tuple[np.ndarray, ...]:
        cp = plan.cp_size
        dest, owner, row0, row1 = _picked_rows(plan, mask)
        cell = dest * cp + owner
        order = np.argsort(cell * _BIG + row0, kind="stable")
        keys, lo, hi = (cell * _BIG + row0)[order], row0[order], row1[order]
        before = np.concatenate([[0], np.cumsum(hi - lo)])
        return keys, lo, hi, before
    return host_table(plan, table_key("picked_prefix", mask), build)


def gather_stage_array(plan: CPPlan, mask: AttnMask, parts: int) -> np.ndarray:
    """int64 [P, cp, cp]: keys rank d picks from rank o's rows of all_gather transfer p
    (exact, from the needed spans cut by the owners' runs; one per non-empty slice of
    ``gather_stage_rows``) (cached). A cell's picked rows below row x are one search in
    its sorted pieces (they never overlap: one destination's keys), so each count is a
    difference at the slice's two ends: cp^2 x (P + 1) searches, whatever the pieces.
    numpy."""
    def build() -> np.ndarray:
        cp = plan.cp_size
        rows = gather_stage_rows(plan, parts)
        keys, lo, hi, before = _picked_prefix(plan, mask)
        cuts = np.array([a for a, _ in rows] + [rows[-1][1]] if rows else [0], dtype=np.int64)
        cell = np.arange(cp * cp, dtype=np.int64).reshape(1, -1)
        x = cuts.reshape(-1, 1)
        first = np.searchsorted(keys, cell * _BIG)               # the cell's first piece
        j = np.searchsorted(keys, cell * _BIG + x)               # pieces starting below x
        last = np.maximum(j - 1, 0)
        over = np.where(j > first, np.maximum(hi[last] - x, 0), 0) if keys.size else 0
        below = before[j] - before[first] - over                 # [P + 1, cp^2]
        out = below[1:] - below[:-1]
        return np.ascontiguousarray(out).reshape(len(rows), cp, cp)
    return host_table(plan, table_key("gather_stage_counts", mask, None, parts), build)


def gather_stage_counts(plan: CPPlan, mask: AttnMask, parts: int) -> torch.Tensor:
    """:func:`gather_stage_array` as a tensor (a view)."""
    return torch.from_numpy(gather_stage_array(plan, mask, parts))


# ---- runs of keys cut at the transfers' bounds -----------------------------------------------
def index_in_group(group: np.ndarray, length: np.ndarray, n_groups: int) -> np.ndarray:
    """int64: where each run of ``length`` keys starts in its group's list, the group's runs
    laid back to back in list order (e.g. a run's place in the list of keys a rank fetches
    from one owner): a sort of the runs, not of their keys (numpy)."""
    order = np.argsort(group, kind="stable")
    ordered = length[order]
    totals = np.bincount(group, weights=length, minlength=n_groups).astype(np.int64)
    before = np.cumsum(totals) - totals
    out = np.empty_like(length)
    out[order] = np.cumsum(ordered) - ordered - before[group[order]]
    return out


def cut_runs(coord: np.ndarray, length: np.ndarray, begins: np.ndarray,
             ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs ``[coord, coord + length)`` cut at the transfers' bounds: transfer p holds
    ``[begins[i, p], ends[i, p])`` of run i's coordinate (the bounds non-decreasing in p,
    each transfer's range after the previous one's). (run index, transfer, offset in the
    run, length) of every non-empty cut, in (run, transfer) order (numpy int64)."""
    n = coord.size
    if n == 0 or ends.shape[1] == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    # per row, the first transfer ending after the run's first / last key (a row-wise
    # search: P is a handful, so a comparison count)
    first = (ends <= coord[:, None]).sum(1)
    last = (ends <= (coord + length - 1)[:, None]).sum(1)
    count = last - first + 1
    run = np.repeat(np.arange(n, dtype=np.int64), count)
    stage = np.arange(run.size, dtype=np.int64) - (np.cumsum(count) - count)[run] + first[run]
    lo = np.maximum(coord[run], begins[run, stage])
    hi = np.minimum(coord[run] + length[run], ends[run, stage])
    keep = hi > lo
    run, stage, lo, hi = run[keep], stage[keep], lo[keep], hi[keep]
    return run, stage, lo - coord[run], hi - lo
