"""One rank's staged tables of ``dispatch`` and ``all_gather``, built from runs of keys.

What a rank's queries see is a few runs of keys per document (its needed spans cut by the
owners' runs), and what others take from it likewise. Every table here is one of those run
lists cut at the transfers' bounds (``routes.cut_runs``), sorted as runs where an order
is needed (by owner for the dK/dV returns), and only then laid out per key
(``plan.runs.run_rows``: a repeat and an add per key): no sort, search or gather over every
fetched key. At 128K tokens a rank may fetch ~100K keys while holding a few hundred runs;
one rank's tables for Llama 4's two masks (2 transfers) took 7.5-9.5 ms at cp 8 in torch,
against 12-34 ms for the per-key construction they replaced (1K documents; one 128K
document); in numpy (below) ~2.5-3 ms per mask at cp 8 on the long-document batches, about
half of it the tile schedules of its calls, computed together (``holders.set_calls``).

The tables (``Stage``) are those of that per-key construction (tests/staged_reference.py
keeps it; tests/tables/test_staged_tables.py compares the two on random batches), but for the
returns' rounds, now consecutive slices of the list (``rounds``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ...kernels.host_copy import to_device
from ...masks import AttnMask
from ...plan import CPPlan
from ...plan.runs import run_rows
from ..flash_form import FlashRoute
from ..holders import Holder, HolderSet, KernelCall, rank_holder, set_calls
from ..cache import host_table, table_key
from ..rounds import UniqueRounds
from ..selected import run_arrays, span_arrays
from ...plan.spans import span_pieces
from .routes import (cut_runs, dispatch_stage_array, gather_stage_array, gather_stage_rows,
                     index_in_group, transfers)

_BIG = 1 << 40          # owner * _BIG + slot: sort keys of (owner, slot) pairs


@dataclass(frozen=True)
class Stage:
    """One transfer and the call on its keys, for one rank (host tensors, or their device
    copies).

    Forward: ``dispatch`` sends its local rows ``in_rows`` (``in_splits`` to each rank) and
    receives ``back_splits`` rows from each; ``all_gather`` gathers rows [lo, hi) of every
    rank. ``gather`` picks the fetched keys from the receive buffer, in call order; with
    local keys in the call too (S = 1), the fetched ones go to call slots
    ``remote_slots`` and local rows ``local_rows`` to ``local_slots``. Backward: the
    fetched keys' dK/dV go to their owners in ``back_order`` (call slots, ``back_splits``
    to each), and the rows others return to this rank land on local rows ``in_rows``.

    A local row that several ranks fetched comes back once from each: ``in_rows`` has
    duplicates, and one ``index_add_`` over it would sum them with atomics on CUDA (bitwise
    run-to-run differences). The fold instead adds the returns in ``rounds``: round j holds
    the j-th return of every row (``rounds.rows`` unique within a round), the receive
    buffer's rows in round order (``rounds.perm``), so every row sums in one fixed order."""

    call: KernelCall | None        # local queries x this stage's keys; None: no key here
    n_keys: int
    gather: torch.Tensor           # int64 [n_fetched]: receive-buffer row of each fetched key
    back_order: torch.Tensor       # int64 [n_fetched]: call slots grouped by owner
    back_splits: tuple[int, ...]   # keys fetched from (dK/dV returned to) each rank
    in_rows: torch.Tensor          # int64 [m]: our rows the others take, grouped by rank
    in_splits: tuple[int, ...]     # rows each rank takes from us in this transfer
    lo: int = 0                    # all_gather: slice of every rank's padded local K/V
    hi: int = 0
    remote_slots: torch.Tensor | None = None   # S = 1: call slots of the fetched keys
    local_slots: torch.Tensor | None = None    # S = 1: call slots of the local keys
    local_rows: torch.Tensor | None = None     # S = 1: their local rows
    rounds: UniqueRounds | None = None         # the deterministic fold of the returns

    def to(self, device: torch.device) -> "Stage":
        names = ("gather", "back_order", "in_rows", "remote_slots", "local_slots",
                 "local_rows")
        moved = to_device([getattr(self, n) for n in names], device)
        return replace(self, **dict(zip(names, moved)),
                       rounds=None if self.rounds is None else self.rounds.to(device),
                       call=None if self.call is None else self.call.to(device))


@dataclass(frozen=True)
class StagedTables:
    """Everything one rank's staged call needs: the local call (S >= 2; None: S = 1, or no
    local pair is visible), then the transfers and their calls in order."""

    local: KernelCall | None
    stages: tuple[Stage, ...]

    @property
    def n_calls(self) -> int:
        """Kernel calls this rank makes (more than one: fp32 accumulators)."""
        return (self.local is not None) + sum(s.call is not None for s in self.stages)

    def to(self, device: torch.device) -> "StagedTables":
        return StagedTables(None if self.local is None else self.local.to(device),
                            tuple(s.to(device) for s in self.stages))


# ---- runs of keys ------------------------------------------------------------------------------
# numpy from here on: a rank's tables are a few hundred runs per transfer, where torch's
# per-op cost (~3-5 us against numpy's ~0.5-1) was most of the time; the tables handed
# to the engine come back as torch tensors (``torch.from_numpy``, no copy).
@dataclass(frozen=True)
class KeyRuns:
    """Runs of consecutive keys (all numpy int64 [n]): document, first position, holding
    rank (``owner``), the owner's local row of the first key, place of the first key in the
    list the runs make (``slot``), length. ``peer``: the other rank of the list (the owner
    for a rank's selection, the destination for what a rank gives)."""

    doc: np.ndarray
    pos: np.ndarray
    row: np.ndarray
    slot: np.ndarray
    length: np.ndarray
    peer: np.ndarray

    def take(self, idx: np.ndarray, offset: np.ndarray | None = None,
             length: np.ndarray | None = None) -> "KeyRuns":
        """Runs ``idx``, each advanced by ``offset`` keys and cut to ``length``."""
        out = KeyRuns(*(t[idx] for t in (self.doc, self.pos, self.row, self.slot,
                                          self.length, self.peer)))
        if offset is None:
            return out
        return KeyRuns(out.doc, out.pos + offset, out.row + offset, out.slot + offset, length,
                       out.peer)


def selection_runs(plan: CPPlan, mask: AttnMask, rank: int) -> KeyRuns:
    """The keys ``rank``'s queries see, as runs in (document, position) order (the order
    of the tests' ``select_keys``); ``peer`` is the owner (cached)."""
    def build() -> KeyRuns:
        holder, doc, lo, hi = span_arrays(plan, mask)
        mine = holder == rank
        part = run_arrays(plan, by_document=True)
        _, run, first, length = span_pieces(doc[mine], lo[mine], hi[mine], part.doc,
                                            part.start, part.stop)
        return KeyRuns(part.doc[run], first, part.row[run] + first - part.start[run],
                       np.cumsum(length) - length, length, part.holder[run])
    return host_table(plan, table_key("selection_runs", mask, None, rank), build)


def given_runs(plan: CPPlan, mask: AttnMask, rank: int) -> KeyRuns:
    """``rank``'s keys that the OTHER ranks' queries see, as runs grouped by destination
    (``peer``), each destination's in its selection order (the order of
    the tests' ``sent_keys``); ``slot`` is the place in the destination's list of keys from
    ``rank`` (cached)."""
    def build() -> KeyRuns:
        holder, doc, lo, hi = span_arrays(plan, mask)
        runs = run_arrays(plan)
        ours = runs.holder == rank   # sorted by (doc, start) already
        m_doc, m_start, m_row = runs.doc[ours], runs.start[ours], runs.row[ours]
        span, run, first, length = span_pieces(doc, lo, hi, m_doc, m_start,
                                                runs.stop[ours])
        dest = holder[span]
        keep = dest != rank
        dest, run, first, length = dest[keep], run[keep], first[keep], length[keep]
        slot = index_in_group(dest, length, plan.cp_size)
        return KeyRuns(m_doc[run], first, m_row[run] + first - m_start[run], slot, length,
                       dest)
    return host_table(plan, table_key("given_runs", mask, None, rank), build)


def _spread(runs: KeyRuns, *starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per key of ``runs``, each of ``starts`` (one value per run) plus the key's offset
    in its run (``plan.runs.run_rows``)."""
    return tuple(run_rows(v, runs.length) for v in starts)


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))


def _holder(runs: KeyRuns, n_docs: int) -> Holder:
    """The keys of ``runs`` (in (document, position) order) as a kernel call's holder."""
    counts = np.bincount(runs.doc, weights=runs.length, minlength=n_docs).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    (pos,) = _spread(runs, runs.pos)
    return Holder(torch.from_numpy(cu), torch.from_numpy(pos.astype(np.int32)),
                  int(counts.max()) if counts.size else 0)


def _by_owner(runs: KeyRuns, slot: np.ndarray) -> np.ndarray:
    """Call slots of the keys of ``runs`` (first slots ``slot``) grouped by owner, each
    owner's in call order: the order the dK/dV returns are packed in."""
    order = np.argsort(runs.peer * _BIG + slot, kind="stable")
    return _spread(runs.take(order), slot[order])[0]


# ---- the tables ----------------------------------------------------------------------------------
def _assemble(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int], stages: int,
              counts: np.ndarray, fetched: KeyRuns, stage: np.ndarray,
              buffer: np.ndarray, given: KeyRuns, given_stage: np.ndarray,
              slices: tuple[tuple[int, int], ...], route: FlashRoute | None) -> StagedTables:
    """Tables from the runs both strategies share: the fetched runs (``fetched``, in
    selection order, each within one transfer ``stage``, its first key at receive-buffer
    row ``buffer``) and the given runs (``given``, grouped by destination, in transfer
    ``given_stage``); ``counts`` [P, cp, cp]. The tile schedules of all the rank's calls
    are computed together (``set_calls``)."""
    cp = plan.cp_size
    parts, keys = [], []      # per transfer: Stage fields but the call; its keys' holder
    for p in range(counts.shape[0]):
        here = stage == p
        mine, buf = fetched.take(here), buffer[here]
        lo, hi = slices[p] if slices else (0, 0)
        out = given.take(given_stage == p)
        (in_rows,) = _spread(out, out.row)
        splits = np.bincount(out.peer, weights=out.length, minlength=cp).astype(np.int64)
        fields = dict(back_splits=tuple(counts[p, rank].tolist()), in_rows=_tensor(in_rows),
                      in_splits=tuple(splits.tolist()), lo=lo, hi=hi,
                      rounds=UniqueRounds.of_runs(out.row, out.length, in_rows))
        fields["gather"] = _tensor(_spread(mine, buf)[0])
        if stages == 1:   # one call over every key: local ones too, in their call slots
            sel = selection_runs(plan, mask, rank)
            local = sel.take(sel.peer == rank)
            fields["remote_slots"] = _tensor(_spread(mine, mine.slot)[0])
            fields["local_slots"], fields["local_rows"] = (
                _tensor(x) for x in _spread(local, local.slot, local.row))
            fields["back_order"] = _tensor(_by_owner(mine, mine.slot))
            mine = sel
        else:
            fields["back_order"] = _tensor(_by_owner(mine, np.cumsum(mine.length)
                                                     - mine.length))
        fields["n_keys"] = int(mine.length.sum())
        parts.append(fields)
        keys.append(_holder(mine, plan.n_docs) if mine.length.size else None)
    return with_calls(plan, mask, rank, block, stages, route, keys, parts, Stage)


def with_calls(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int], stages: int,
               route: FlashRoute | None, keys: list[Holder | None], parts: list[dict],
               stage_type: type) -> StagedTables:
    """The tables of a rank whose transfers' fields are ``parts`` and their calls' keys
    ``keys`` (None: no call): the tile schedules of all its calls, the local one too,
    computed together (``set_calls``)."""
    me = host_table(plan, table_key("rank_holder", None, None, rank),   # (its schedules'
                    lambda: rank_holder(plan, rank))                    # blocks cached)
    with_local = stages > 1 or not parts  # (with nothing to fetch anywhere, it is all)
    holders = [h for h in keys if h is not None] + ([me] if with_local else [])
    calls = iter(set_calls(me.as_set, 0, HolderSet.of(holders), list(range(len(holders))),
                           mask, block, route) if holders else [])
    built = tuple(stage_type(call=None if h is None else next(calls), **fields)
                  for h, fields in zip(keys, parts))
    local_call = next(calls) if with_local else None
    if local_call is not None and local_call.visited_pairs == 0:
        local_call = None
    return StagedTables(local_call, built)


def dispatch_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                     stages: int, route: FlashRoute | None) -> StagedTables:
    """Dispatch: each (d, o) list of keys cut into equal transfers (``transfers``)."""
    cp = plan.cp_size
    counts = dispatch_stage_array(plan, mask, transfers(stages))   # [P, d, o]
    ends = np.cumsum(counts, 0)                                      # inclusive, per (d, o)
    begins = ends - counts
    sel = selection_runs(plan, mask, rank)
    remote = sel.take(sel.peer != rank)
    index = index_in_group(remote.peer, remote.length, cp)   # place in the owner's list
    owner_begins, owner_ends = begins[:, rank, :].T, ends[:, rank, :].T   # [o, P]
    run, stage, offset, length = cut_runs(index, remote.length, owner_begins[remote.peer],
                                          owner_ends[remote.peer])
    fetched = remote.take(run, offset, length)
    owner = fetched.peer
    mine = counts[:, rank, :]                                        # [P, o]
    buf_start = np.cumsum(mine, 1) - mine                            # owner's block in buffer
    buffer = buf_start[stage, owner] + index[run] + offset - begins[stage, rank, owner]
    given = given_runs(plan, mask, rank)
    dest_begins, dest_ends = begins[:, :, rank].T, ends[:, :, rank].T        # [d, P]
    grun, gstage, goffset, glength = cut_runs(given.slot, given.length,
                                              dest_begins[given.peer], dest_ends[given.peer])
    return _assemble(plan, mask, rank, block, stages, counts, fetched, stage, buffer,
                     given.take(grun, goffset, glength), gstage, (), route)


def gather_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                   stages: int, route: FlashRoute | None) -> StagedTables:
    """all_gather: the runs cut at the slices of the owners' padded rows."""
    slices = gather_stage_rows(plan, transfers(stages))
    los = np.array([lo for lo, _ in slices], dtype=np.int64)
    his = np.array([hi for _, hi in slices], dtype=np.int64)
    sel = selection_runs(plan, mask, rank)
    remote = sel.take(sel.peer != rank)
    n = remote.length.size
    run, stage, offset, length = cut_runs(remote.row, remote.length,
                                          np.broadcast_to(los, (n, los.size)),
                                          np.broadcast_to(his, (n, his.size)))
    fetched = remote.take(run, offset, length)
    buffer = fetched.peer * (his - los)[stage] + fetched.row - los[stage]
    given = given_runs(plan, mask, rank)
    m = given.length.size
    grun, gstage, goffset, glength = cut_runs(given.row, given.length,
                                              np.broadcast_to(los, (m, los.size)),
                                              np.broadcast_to(his, (m, his.size)))
    counts = gather_stage_array(plan, mask, transfers(stages))
    return _assemble(plan, mask, rank, block, stages, counts, fetched, stage, buffer,
                     given.take(grun, goffset, glength), gstage, slices, route)
