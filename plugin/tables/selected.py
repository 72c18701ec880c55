"""Selected-key tables of ``all_gather`` and ``dispatch``: which keys each rank's queries
see, where they live, and which of a rank's keys the others need.

The keys the queries of one run see form one span (``plan.runs``), so a rank's needed keys
are the union of its runs' spans per document (merged, non-overlapping, in position order),
and their owners come from cutting those spans by the partition of each document into the
ranks' runs. A rank learns what the others fetch from it the same way, for all of them in
one pass over their spans (no per-rank loop), which is what the backward (all_gather) and
the forward send lists (dispatch) need. ``staged`` cuts the same spans, as runs, into the
strategies' transfers and kernel calls; the per-key lists the tests compare them with
(``select_keys``, ``sent_keys``) live in tests/staged_reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.runs import STRIDE, Runs, pair_work
from .cache import host_table, table_key
from ..plan.spans import key_spans, merge_spans, span_pieces


# ---- spans and pieces -----------------------------------------------------------------------
# numpy end to end, from the plan's run table (``CPPlan.arrays.runs``): every function here
# returns int64 numpy arrays, which the other tables read as they are. The torch forms
# (``needed_spans``, ``fetch_counts``, ...) are views of them (``torch.from_numpy``, no
# copy) for the readers outside the tables: the report, the CLI, bench and the tests.
@dataclass(frozen=True)
class RunArrays:
    """A run list's fields as numpy int64 arrays (``spans``' functions work on these)."""

    holder: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row: np.ndarray
    length: np.ndarray

    def take(self, idx: np.ndarray) -> "RunArrays":
        return RunArrays(*(t[idx] for t in (self.holder, self.doc, self.start, self.stop,
                                             self.row, self.length)))

    def as_runs(self) -> Runs:
        """The torch form (views)."""
        return Runs(*(torch.from_numpy(t) for t in (self.holder, self.doc, self.start,
                                                      self.length, self.row)))


def run_arrays(plan: CPPlan, by_document: bool = False) -> RunArrays:
    """The plan's runs (holder = rank), sorted by (rank, doc, start), or with
    ``by_document`` by (doc, start): each document's partition into the ranks' runs
    (cached; numpy views of the plan's run table, sorted copies for ``by_document``)."""
    def build() -> RunArrays:
        r = plan.arrays.runs
        runs = RunArrays(r.rank, r.doc, r.start, r.start + r.length, r.row, r.length)
        if not by_document:
            return runs
        return runs.take(np.argsort(runs.doc * STRIDE + runs.start, kind="stable"))
    return host_table(plan, table_key("run_arrays", None, None, by_document), build)


def runs_by_document(plan: CPPlan) -> Runs:
    """Every rank's runs sorted by (doc, start), as tensors (views of
    ``run_arrays(plan, by_document=True)``)."""
    return host_table(plan, table_key("runs_by_document"),
                      lambda: run_arrays(plan, by_document=True).as_runs())


def _spans_of(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of the keys each run's queries see (numpy, ``spans.key_spans``)."""
    runs = run_arrays(plan)
    return key_spans(runs.start, runs.stop, plan.doc_length_array[runs.doc], mask)


def span_arrays(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, ...]:
    """(rank, doc, lo, hi) of every rank's merged key spans, sorted by (rank, doc, lo)
    (numpy int64, cached)."""
    def build() -> tuple[np.ndarray, ...]:
        runs = run_arrays(plan)
        lo, hi = _spans_of(plan, mask)
        return merge_spans(runs.holder, runs.doc, lo, hi)
    return host_table(plan, table_key("needed_spans", mask), build)


def needed_spans(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """:func:`span_arrays` as tensors (views)."""
    return tuple(torch.from_numpy(x) for x in span_arrays(plan, mask))


def piece_arrays(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, ...]:
    """Every rank's needed spans cut by the owners' runs: (span index, run index in
    ``run_arrays(plan, by_document=True)``, first position, length) of each piece (numpy
    int64, cached)."""
    def build() -> tuple[np.ndarray, ...]:
        _, doc, lo, hi = span_arrays(plan, mask)
        part = run_arrays(plan, by_document=True)
        return span_pieces(doc, lo, hi, part.doc, part.start, part.stop)
    return host_table(plan, table_key("needed_pieces", mask), build)


def needed_pieces(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """:func:`piece_arrays` as tensors (views)."""
    return tuple(torch.from_numpy(x) for x in piece_arrays(plan, mask))


def fetch_count_array(plan: CPPlan, mask: AttnMask) -> np.ndarray:
    """int64 [cp, cp]: how many keys rank s's queries need from rank o (o == s: its own)
    (numpy, cached)."""
    def build() -> np.ndarray:
        holder = span_arrays(plan, mask)[0]
        part = run_arrays(plan, by_document=True)
        span, run, _, length = piece_arrays(plan, mask)
        return _rank_matrix(plan.cp_size, holder[span], part.holder[run], length)
    return host_table(plan, table_key("fetch_counts", mask), build)


def fetch_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """:func:`fetch_count_array` as a tensor (a view)."""
    return torch.from_numpy(fetch_count_array(plan, mask))


def _rank_matrix(cp: int, s: np.ndarray, o: np.ndarray, values: np.ndarray) -> np.ndarray:
    """int64 [cp, cp]: ``values`` summed per (s, o). (A float64 bincount: exact, as every
    sum here stays far below 2^53: pairs of 128K tokens are < 2^34.)"""
    out = np.bincount(s * cp + o, weights=values, minlength=cp * cp)
    return out.astype(np.int64).reshape(cp, cp)


def pair_count_array(plan: CPPlan, mask: AttnMask) -> np.ndarray:
    """int64 [cp, cp]: visible pairs of rank s's queries with rank o's keys (exact, in
    closed form: each query run's key span is cut by the ranks' runs and every piece is
    counted with ``pair_work``; numpy, cached)."""
    def build() -> np.ndarray:
        runs, part = run_arrays(plan), run_arrays(plan, by_document=True)
        lo, hi = _spans_of(plan, mask)
        span, run, first, length = span_pieces(runs.doc, lo, hi, part.doc, part.start,
                                               part.stop)
        pairs = pair_work(runs.start[span], runs.stop[span], first, first + length, mask)
        return _rank_matrix(plan.cp_size, runs.holder[span], part.holder[run], pairs)
    return host_table(plan, table_key("pair_counts", mask), build)


def pair_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """:func:`pair_count_array` as a tensor (a view)."""
    return torch.from_numpy(pair_count_array(plan, mask))


def fetched_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: other ranks' K/V tokens its queries see (what dispatch fetches; the floor
    of any scheme that moves K/V to the queries)."""
    counts = fetch_count_array(plan, mask)
    return (counts.sum(1) - counts.diagonal()).tolist()


def selected_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: all the keys its queries see (own included): what it keeps for backward."""
    return fetch_count_array(plan, mask).sum(1).tolist()
