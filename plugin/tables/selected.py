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
from ..plan.runs import Runs, pair_work
from .cache import host_table, table_key
from .spans import key_spans, merge_spans, span_pieces


# ---- spans and pieces -----------------------------------------------------------------------
def runs_by_document(plan: CPPlan) -> Runs:
    """Every rank's runs sorted by (doc, start): each document's partition into ranks."""
    return host_table(plan, table_key("runs_by_document"), lambda: plan.runs.by_document())


@dataclass(frozen=True)
class RunArrays:
    """A run list's fields as numpy int64 views (``spans``' functions work on these)."""

    holder: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row: np.ndarray

    @classmethod
    def of(cls, runs: Runs) -> "RunArrays":
        return cls(*(t.numpy() for t in (runs.holder, runs.doc, runs.start, runs.stop,
                                         runs.row)))


def run_arrays(plan: CPPlan, by_document: bool = False) -> RunArrays:
    """``plan.runs`` (or :func:`runs_by_document`) as numpy arrays (cached)."""
    return host_table(plan, table_key("run_arrays", None, None, by_document),
                      lambda: RunArrays.of(runs_by_document(plan) if by_document
                                           else plan.runs))


def _spans_of(plan: CPPlan, mask: AttnMask) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of the keys each run's queries see (numpy, ``spans.key_spans``)."""
    runs = run_arrays(plan)
    return key_spans(runs.start, runs.stop, plan.doc_lengths.numpy()[runs.doc], mask)


def needed_spans(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """(rank, doc, lo, hi) of every rank's merged key spans, sorted by (rank, doc, lo)."""
    def build() -> tuple[torch.Tensor, ...]:
        runs = run_arrays(plan)
        lo, hi = _spans_of(plan, mask)
        return tuple(torch.from_numpy(x) for x in merge_spans(runs.holder, runs.doc, lo, hi))
    return host_table(plan, table_key("needed_spans", mask), build)


def needed_pieces(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """Every rank's needed spans cut by the owners' runs: (span index, run index in
    ``runs_by_document``, first position, length) of each piece (cached)."""
    def build() -> tuple[torch.Tensor, ...]:
        _, doc, lo, hi = (t.numpy() for t in needed_spans(plan, mask))
        part = run_arrays(plan, by_document=True)
        return tuple(torch.from_numpy(x) for x in
                     span_pieces(doc, lo, hi, part.doc, part.start, part.stop))
    return host_table(plan, table_key("needed_pieces", mask), build)


def fetch_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """int64 [cp, cp]: how many keys rank s's queries need from rank o (o == s: its own)."""
    def build() -> torch.Tensor:
        holder = needed_spans(plan, mask)[0].numpy()
        part = run_arrays(plan, by_document=True)
        span, run, _, length = (t.numpy() for t in needed_pieces(plan, mask))
        return _rank_matrix(plan.cp_size, holder[span], part.holder[run], length)
    return host_table(plan, table_key("fetch_counts", mask), build)


def _rank_matrix(cp: int, s: np.ndarray, o: np.ndarray, values: np.ndarray) -> torch.Tensor:
    """int64 [cp, cp]: ``values`` summed per (s, o). (A float64 bincount: exact, as every
    sum here stays far below 2^53: pairs of 128K tokens are < 2^34.)"""
    out = np.bincount(s * cp + o, weights=values, minlength=cp * cp)
    return torch.from_numpy(out.astype(np.int64).reshape(cp, cp))


def pair_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """int64 [cp, cp]: visible pairs of rank s's queries with rank o's keys (exact, in
    closed form: each query run's key span is cut by the ranks' runs and every piece is
    counted with ``pair_work``; cached)."""
    def build() -> torch.Tensor:
        runs, part = run_arrays(plan), run_arrays(plan, by_document=True)
        lo, hi = _spans_of(plan, mask)
        span, run, first, length = span_pieces(runs.doc, lo, hi, part.doc, part.start,
                                               part.stop)
        pairs = pair_work(runs.start[span], runs.stop[span], first, first + length, mask)
        return _rank_matrix(plan.cp_size, runs.holder[span], part.holder[run], pairs)
    return host_table(plan, table_key("pair_counts", mask), build)


def fetched_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: other ranks' K/V tokens its queries see (what dispatch fetches; the floor
    of any scheme that moves K/V to the queries)."""
    counts = fetch_counts(plan, mask)
    return (counts.sum(1) - counts.diagonal()).tolist()


def selected_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: all the keys its queries see (own included): what it keeps for backward."""
    return fetch_counts(plan, mask).sum(1).tolist()
