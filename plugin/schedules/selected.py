"""Selected-key tables of ``all_gather`` and ``dispatch``: which keys each rank's queries
see, where they live, and which of a rank's keys the others need.

The keys the queries of one run see form one span (``plan.runs``), so a rank's needed keys
are the union of its runs' spans per document (merged, non-overlapping, in position order),
and their owners come from cutting those spans by the partition of each document into the
ranks' runs. A rank learns what the others fetch from it the same way, for all of them in
one pass over their spans (no per-rank loop), which is what the backward (all_gather) and
the forward send lists (dispatch) need. ``staged`` cuts the same spans, as runs, into the
strategies' transfers and kernel calls; the per-key lists here (``select_keys``,
``sent_keys``) are for tests and the reference construction in tests/staged_reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.runs import Runs, key_spans, merge_spans, pair_work, per_token, span_pieces
from .holders import Holder, holder_from_counts
from .keys import host_table, table_key


# ---- spans and pieces -----------------------------------------------------------------------
def runs_by_document(plan: CPPlan) -> Runs:
    """Every rank's runs sorted by (doc, start): each document's partition into ranks."""
    return host_table(plan, table_key("runs_by_document"), lambda: plan.runs.by_document())


def needed_spans(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """(rank, doc, lo, hi) of every rank's merged key spans, sorted by (rank, doc, lo)."""
    def build() -> tuple[torch.Tensor, ...]:
        runs = plan.runs
        lo, hi = key_spans(runs, mask, plan.doc_lengths)
        return merge_spans(runs.holder, runs.doc, lo, hi)
    return host_table(plan, table_key("needed_spans", mask), build)


@dataclass(frozen=True)
class Selection:
    """Keys one rank's queries see, in (document, position) order (host tensors)."""

    owner: torch.Tensor      # int64 [n]: rank holding the key
    row: torch.Tensor        # int64 [n]: its local row there
    holder: Holder           # cu / positions of the selected keys


def select_keys(plan: CPPlan, mask: AttnMask, rank: int) -> Selection:
    """The keys some query of ``rank`` sees, with their owners and rows (cached)."""
    def build() -> Selection:
        holder, doc, lo, hi = needed_spans(plan, mask)
        mine = holder == rank
        part = runs_by_document(plan)
        _, run, first, length = span_pieces(doc[mine], lo[mine], hi[mine], part)
        offset, pos, row, owner, key_doc = per_token(
            length, first, part.row[run] + first - part.start[run], part.holder[run],
            part.doc[run])
        pos = pos + offset
        return Selection(owner, row + offset, holder_from_counts(key_doc, pos, plan.n_docs))
    return host_table(plan, table_key("select", mask, None, rank), build)


def sent_keys(plan: CPPlan, mask: AttnMask, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, local row) of ``rank``'s keys that each rank's queries see, grouped by
    destination rank (itself included) and, per destination, in the order that rank lists
    its selection (document, position) (cached)."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        holder, doc, lo, hi = needed_spans(plan, mask)
        runs = plan.runs
        mine = runs.select(runs.holder == rank)  # sorted by (doc, start) already
        span, run, first, length = span_pieces(doc, lo, hi, mine)
        offset, rows, dest = per_token(length, mine.row[run] + first - mine.start[run],
                                       holder[span])
        return dest, rows + offset
    return host_table(plan, table_key("sent_keys", mask, None, rank), build)


def needed_pieces(plan: CPPlan, mask: AttnMask) -> tuple[torch.Tensor, ...]:
    """Every rank's needed spans cut by the owners' runs: (span index, run index in
    ``runs_by_document``, first position, length) of each piece (cached)."""
    def build() -> tuple[torch.Tensor, ...]:
        _, doc, lo, hi = needed_spans(plan, mask)
        return span_pieces(doc, lo, hi, runs_by_document(plan))
    return host_table(plan, table_key("needed_pieces", mask), build)


def fetch_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """int64 [cp, cp]: how many keys rank s's queries need from rank o (o == s: its own)."""
    def build() -> torch.Tensor:
        holder = needed_spans(plan, mask)[0]
        part = runs_by_document(plan)
        span, run, _, length = needed_pieces(plan, mask)
        cp = plan.cp_size
        out = torch.zeros(cp * cp, dtype=torch.int64)
        return out.scatter_add_(0, holder[span] * cp + part.holder[run], length).view(cp, cp)
    return host_table(plan, table_key("fetch_counts", mask), build)


def pair_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """int64 [cp, cp]: visible pairs of rank s's queries with rank o's keys (exact, in
    closed form: each query run's key span is cut by the ranks' runs and every piece is
    counted with ``pair_work``; cached)."""
    def build() -> torch.Tensor:
        runs = plan.runs
        lo, hi = key_spans(runs, mask, plan.doc_lengths)
        part = runs_by_document(plan)
        span, run, first, length = span_pieces(runs.doc, lo, hi, part)
        pairs = pair_work(runs.start[span], runs.stop[span], first, first + length, mask)
        cp = plan.cp_size
        out = torch.zeros(cp * cp, dtype=torch.int64)
        return out.scatter_add_(0, runs.holder[span] * cp + part.holder[run], pairs).view(cp, cp)
    return host_table(plan, table_key("pair_counts", mask), build)


def fetched_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: other ranks' K/V tokens its queries see (what dispatch fetches; the floor
    of any scheme that moves K/V to the queries)."""
    counts = fetch_counts(plan, mask)
    return (counts.sum(1) - counts.diagonal()).tolist()


def selected_tokens(plan: CPPlan, mask: AttnMask) -> list[int]:
    """Per rank: all the keys its queries see (own included): what it keeps for backward."""
    return fetch_counts(plan, mask).sum(1).tolist()
