"""Selected-key tables of ``all_gather`` and ``dispatch``: which keys each rank's queries
see, where they live, and which of a rank's keys the others need.

The keys the queries of one run see form one span (``plan.runs``), so a rank's needed keys
are the union of its runs' spans per document (merged, non-overlapping, in position order),
and their owners come from cutting those spans by the partition of each document into the
ranks' runs. A rank learns what the others fetch from it the same way, for all of them in
one pass over their spans (no per-rank loop), which is what the backward (all_gather) and
the forward send lists (dispatch) need. The kernel call of a rank pairs its queries with
its selected keys, listed per document by position: segment i is document i, as always.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.runs import Runs, key_spans, merge_spans, pair_work, per_token, span_pieces
from .holders import Holder, KernelCall, holder_from_counts, kernel_call, rank_holder
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


def fetch_counts(plan: CPPlan, mask: AttnMask) -> torch.Tensor:
    """int64 [cp, cp]: how many keys rank s's queries need from rank o (o == s: its own)."""
    def build() -> torch.Tensor:
        holder, doc, lo, hi = needed_spans(plan, mask)
        part = runs_by_document(plan)
        span, run, _, length = span_pieces(doc, lo, hi, part)
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


# ---- all_gather -----------------------------------------------------------------------------
@dataclass(frozen=True)
class GatherTables:
    """Everything one rank's all_gather call needs (host, or copied to the device)."""

    stride: int                    # rows per rank in the gathered buffer (max local count)
    index: torch.Tensor            # int64 [n_sel]: gathered rows this rank attends to
    call: KernelCall | None        # local queries x picked keys; None = nothing visible
    send_order: torch.Tensor       # int64 [n_sel]: picked rows grouped by owner
    send_splits: tuple[int, ...]   # dK/dV rows sent to each owner
    recv_index: torch.Tensor       # int64 [n_recv]: local row of each incoming dK/dV row
    recv_splits: tuple[int, ...]   # dK/dV rows received from each rank

    def to(self, device: torch.device) -> "GatherTables":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return replace(self, index=mv(self.index), send_order=mv(self.send_order),
                       recv_index=mv(self.recv_index),
                       call=None if self.call is None else self.call.to(device))


def gather_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int]
                  ) -> GatherTables:
    """Host tables of ``rank``'s all_gather call (cached)."""
    def build() -> GatherTables:
        cp = plan.cp_size
        stride = max(plan.num_tokens_of(r) for r in range(cp))
        sel = select_keys(plan, mask, rank)
        call = (kernel_call(rank_holder(plan, rank), sel.holder, mask, block)
                if sel.owner.numel() else None)
        dest, rows = sent_keys(plan, mask, rank)
        return GatherTables(stride, sel.owner * stride + sel.row, call,
                            torch.argsort(sel.owner, stable=True),
                            tuple(torch.bincount(sel.owner, minlength=cp).tolist()), rows,
                            tuple(torch.bincount(dest, minlength=cp).tolist()))
    return host_table(plan, table_key("all_gather", mask, block, rank), build)


# ---- dispatch -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DispatchTables:
    """Everything one rank's dispatch call needs (host, or copied to the device)."""

    send_rows: torch.Tensor        # int64 [n_send]: local K/V rows to send, by destination
    send_splits: tuple[int, ...]   # rows sent to each rank (0 to itself)
    recv_splits: tuple[int, ...]   # rows fetched from each rank (0 from itself)
    gather: torch.Tensor           # int64 [n_sel]: row of [local K/V; fetched] per key slot
    recv_order: torch.Tensor       # int64 [n_recv]: key slot of each fetched row
    local_slots: torch.Tensor      # int64 [n_loc]: key slots served by local rows
    local_rows: torch.Tensor       # int64 [n_loc]: their local rows
    call: KernelCall | None        # local queries x needed keys; None = nothing visible

    def to(self, device: torch.device) -> "DispatchTables":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return replace(self, send_rows=mv(self.send_rows), gather=mv(self.gather),
                       recv_order=mv(self.recv_order), local_slots=mv(self.local_slots),
                       local_rows=mv(self.local_rows),
                       call=None if self.call is None else self.call.to(device))


def dispatch_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int]
                    ) -> DispatchTables:
    """Host tables of ``rank``: its fetches, its sends (others' needs) and its local call
    (cached)."""
    def build() -> DispatchTables:
        cp = plan.cp_size
        sel = select_keys(plan, mask, rank)
        remote = sel.owner != rank
        # Fetched rows arrive grouped by owner, each owner's in (doc, position) order: the
        # order in which the owner lists them (sent_keys), as a stable sort keeps it.
        recv_order = torch.nonzero(remote).flatten()
        recv_order = recv_order[torch.argsort(sel.owner[recv_order], stable=True)]
        local_slots = torch.nonzero(~remote).flatten()
        gather = torch.empty(sel.owner.numel(), dtype=torch.int64)
        gather[local_slots] = sel.row[local_slots]
        gather[recv_order] = plan.num_tokens_of(rank) + torch.arange(recv_order.numel())
        dest, rows = sent_keys(plan, mask, rank)
        out = dest != rank
        call = (kernel_call(rank_holder(plan, rank), sel.holder, mask, block)
                if sel.owner.numel() else None)
        return DispatchTables(rows[out], tuple(torch.bincount(dest[out], minlength=cp).tolist()),
                              tuple(torch.bincount(sel.owner[remote], minlength=cp).tolist()),
                              gather, recv_order, local_slots, sel.row[local_slots], call)
    return host_table(plan, table_key("dispatch", mask, block, rank), build)
