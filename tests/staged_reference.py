"""Test reference: the staged strategies' host side as the package computed it before
issue 22 (item 4) made it cheap; tests/tables/test_staged_tables.py checks that the package's
results equal these.

- Tables: the per-token construction of the staged tables of ``dispatch`` and
  ``all_gather``, replaced by the run-based tables (``varlen_cp.tables.staged.tables``).
  Every fetched key is listed one by one (``selected.select_keys`` / ``sent_keys``), its
  place in its owner's list found by a per-key sort and its transfer by a per-key search;
  the returns' rounds are each row's j-th occurrence, from a per-row sort, added through a
  permuted copy of the returns (the package's rounds are now consecutive slices of the
  list: each row sums in the same order, without the copy). Slow (sorts over up to
  cp x tokens keys) but direct.
- Time model and memory walk: torch ops on [cp] vectors, one stage count at a time
  (the package runs the same steps on numpy vectors, all candidates sharing their inputs).
  The walk is the one before tests/tables/test_staged_memory.py checked it against the engine's
  real allocations; the package's differs where this one was wrong: fp32 inputs (no fp32
  copies there) and head dims D != Dv (the K and V halves picked apart at S = 1). Since
  issue 30 the engine frees a transfer's send buffer once the transfer is in, before its
  keys are picked (the walk with it; this one too).

Not cached; not used by the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from varlen_cp.kernels.schedule import segment_ids
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.tables.cost_model import CostModel
from varlen_cp.tables.holders import (Holder, KernelCall, holder_from_counts, kernel_call,
                                         rank_holder)
from varlen_cp.tables.rounds import UniqueRounds, rank_within
from varlen_cp.tables.cache import host_table, table_key
from varlen_cp.tables.selected import (fetch_counts, needed_spans, pair_counts, run_arrays,
                                          runs_by_document)
from varlen_cp.plan.spans import span_pieces
from varlen_cp.shape import AttnShape
from varlen_cp.tables.staged import (CANDIDATE_STAGES, Stage, StagedMemory, StagedTables,
                                        StagedTime, dispatch_stage_counts, gather_stage_counts,
                                        gather_stage_rows, stage_counts, transfers)

_BIG = 1 << 40          # group * _BIG + index: sort keys of (group, index) pairs


# ---- per-key lists: every key a rank's queries see, one by one -------------------------
def per_token(length: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Pieces of ``length`` (>= 0) laid back to back, their tokens listed in order:
    (offset of each token in its piece, then each of ``values`` [pieces] repeated over its
    piece's tokens). A cumulative sum of steps at the pieces' first tokens: on CPU a few
    times faster than ``repeat_interleave`` plus gathers (advanced indexing is ~10x slower
    than a cumsum per element at 100K tokens)."""
    keep = length > 0
    if not bool(keep.all()):
        length = length[keep]
        values = tuple(v[keep] for v in values)
    n = int(length.sum())
    first = torch.cumsum(length, 0) - length

    def spread(v: torch.Tensor) -> torch.Tensor:
        steps = torch.zeros(n + 1, dtype=v.dtype)
        if v.numel():
            steps.index_add_(0, first, torch.cat([v[:1], v[1:] - v[:-1]]))
        return torch.cumsum(steps[:-1], 0)

    return (torch.arange(n) - spread(first), *(spread(v) for v in values))


@dataclass(frozen=True)
class Selection:
    """Keys one rank's queries see, in (document, position) order (host tensors)."""

    owner: torch.Tensor      # int64 [n]: rank holding the key
    row: torch.Tensor        # int64 [n]: its local row there
    holder: Holder           # cu / positions of the selected keys


def select_keys(plan: CPPlan, mask: AttnMask, rank: int) -> Selection:
    """The keys some query of ``rank`` sees, with their owners and rows (cached)."""
    def build() -> Selection:
        holder, doc, lo, hi = (t.numpy() for t in needed_spans(plan, mask))
        mine = holder == rank
        part, arrays = runs_by_document(plan), run_arrays(plan, by_document=True)
        _, run, first, length = (torch.from_numpy(x) for x in span_pieces(
            doc[mine], lo[mine], hi[mine], arrays.doc, arrays.start, arrays.stop))
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
        span, run, first, length = (torch.from_numpy(x) for x in span_pieces(
            doc.numpy(), lo.numpy(), hi.numpy(), mine.doc.numpy(), mine.start.numpy(),
            mine.stop.numpy()))
        offset, rows, dest = per_token(length, mine.row[run] + first - mine.start[run],
                                       holder[span])
        return dest, rows + offset
    return host_table(plan, table_key("sent_keys", mask, None, rank), build)


def occurrence_rounds(rows: torch.Tensor) -> UniqueRounds:
    """The rounds as they were: round j holds each row's j-th occurrence; ``perm`` orders
    the list's entries round by round (None: one round)."""
    occurrence = rank_within(rows)
    counts = torch.bincount(occurrence) if rows.numel() else occurrence
    ends = tuple(torch.cumsum(counts, 0).tolist())
    if len(ends) <= 1:   # no duplicates: one round, in list order
        return UniqueRounds(None, rows, ends)
    perm = torch.argsort(occurrence, stable=True)
    return UniqueRounds(perm, rows[perm], ends)


def _stage_of(group: torch.Tensor, index: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Transfer of the ``index``-th element of ``group``: ends [n_groups, P] are each
    group's cumulative ends (the first transfer whose end exceeds the index)."""
    n_groups, n_parts = ends.shape
    flat = (torch.arange(n_groups).unsqueeze(1) * _BIG + ends).flatten()
    return torch.searchsorted(flat, group * _BIG + index, right=True) - group * n_parts


def _build(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int], stages: int,
           stage_of: torch.Tensor, buffer_row: torch.Tensor, back_key: torch.Tensor,
           out_stage: torch.Tensor, out_dest: torch.Tensor, out_rows: torch.Tensor,
           counts: torch.Tensor, slices: tuple[tuple[int, int], ...]) -> StagedTables:
    """Tables from the per-key facts both strategies share. Remote keys (in selection
    order): their transfer ``stage_of``, receive-buffer row ``buffer_row`` in it and the
    sort key ``back_key`` that groups them by owner in their owners' order; rows this rank
    gives (``out_*``, grouped by destination); ``counts`` [P, cp, cp]."""
    sel = select_keys(plan, mask, rank)
    doc = segment_ids(sel.holder.cu, sel.owner.numel())
    remote = torch.nonzero(sel.owner != rank).flatten()
    cp = plan.cp_size
    me = rank_holder(plan, rank)

    def call(slots: torch.Tensor) -> KernelCall | None:
        if slots.numel() == 0:
            return None
        return kernel_call(me, holder_from_counts(doc.index_select(0, slots),
                                                  sel.holder.pos.index_select(0, slots),
                                                  plan.n_docs), mask, block)

    built = []
    for p in range(counts.shape[0]):
        here = stage_of == p
        lo, hi = slices[p] if slices else (0, 0)
        give = out_stage == p
        common = dict(back_splits=tuple(counts[p, rank].tolist()), in_rows=out_rows[give],
                      in_splits=tuple(torch.bincount(out_dest[give], minlength=cp).tolist()),
                      lo=lo, hi=hi, rounds=occurrence_rounds(out_rows[give]))
        if stages == 1:   # one call over every key: local ones too, in their call slots
            local = torch.nonzero(sel.owner == rank).flatten()
            order = torch.argsort(back_key[here], stable=True)
            built.append(Stage(call(torch.arange(sel.owner.numel())), sel.owner.numel(),
                               buffer_row[here], remote[here][order], remote_slots=remote[here],
                               local_slots=local, local_rows=sel.row[local], **common))
        else:
            slots = remote[here]
            order = torch.argsort(back_key[here], stable=True)
            built.append(Stage(call(slots), int(slots.numel()), buffer_row[here], order,
                               **common))
    local_call = None
    if stages > 1 or not built:   # (with nothing to fetch anywhere, the local call is all)
        local_call = kernel_call(me, me, mask, block)
        local_call = local_call if local_call.visited_pairs > 0 else None
    return StagedTables(local_call, tuple(built))


def dispatch_staged_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                           stages: int) -> StagedTables:
    """Host tables of ``rank``'s dispatch call with ``stages`` stages."""
    counts = dispatch_stage_counts(plan, mask, transfers(stages))   # [P, d, o]
    ends = torch.cumsum(counts, 0)                  # inclusive, per (d, o)
    sel = select_keys(plan, mask, rank)
    remote = torch.nonzero(sel.owner != rank).flatten()
    owner = sel.owner[remote]
    index = rank_within(owner)       # place in the owner's list (its send order)
    stage = _stage_of(owner, index, ends[:, rank, :].t())
    mine = counts[:, rank, :]                                       # [P, o]
    buf_start = torch.cumsum(mine, 1) - mine        # owner's block in the buffer
    row = buf_start[stage, owner] + index - (ends - counts)[stage, rank, owner]
    dest, rows = sent_keys(plan, mask, rank)
    out = dest != rank
    dest, rows = dest[out], rows[out]
    out_stage = _stage_of(dest, rank_within(dest), ends[:, :, rank].t())
    # the buffer is grouped by owner in the owner's order: its row is the back key
    return _build(plan, mask, rank, block, stages, stage, row, row, out_stage, dest,
                  rows, counts, ())


def gather_staged_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                         stages: int) -> StagedTables:
    """Host tables of ``rank``'s all_gather call with ``stages`` stages."""
    slices = gather_stage_rows(plan, transfers(stages))
    his = torch.tensor([hi for _, hi in slices], dtype=torch.int64)
    los = torch.tensor([lo for lo, _ in slices], dtype=torch.int64)
    sel = select_keys(plan, mask, rank)
    remote = torch.nonzero(sel.owner != rank).flatten()
    owner, row = sel.owner[remote], sel.row[remote]
    stage = torch.searchsorted(his, row, right=True)
    buffer_row = owner * (his - los)[stage] + row - los[stage]
    dest, rows = sent_keys(plan, mask, rank)
    out = dest != rank
    dest, rows = dest[out], rows[out]
    counts = gather_stage_counts(plan, mask, transfers(stages))
    # owners list a destination's keys in its selection order: group by owner only
    return _build(plan, mask, rank, block, stages, stage, buffer_row, owner,
                  torch.searchsorted(his, rows, right=True), dest, rows, counts, slices)


def staged_tables(name: str, plan: CPPlan, mask: AttnMask, rank: int,
                  block: tuple[int, int], stages: int) -> StagedTables:
    """The per-token tables of ``rank``'s ``name`` call with ``stages`` stages."""
    build = dispatch_staged_tables if name == "dispatch" else gather_staged_tables
    return build(plan, mask, rank, block, stages)


# ---- the time model and memory walk as torch ops, one stage count at a time ---------------
def _flops_per_pair(shape: AttnShape) -> tuple[float, float]:
    """(forward, backward) FLOPs per visible pair, all query heads (as ``auto``)."""
    d, dv = shape.head_dim, shape.value_dim
    return 2.0 * (d + dv) * shape.n_heads, (6.0 * d + 4.0 * dv) * shape.n_heads


_FS = 1e15   # the pipeline simulation counts integer femtoseconds (exact int64 vectors)


def _fs(seconds: float) -> int:
    return round(seconds * _FS)


def staged_time(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, model: Any,
                stages: int) -> StagedTime:
    """Estimate of ``name`` with ``stages`` stages (module docstring); ``model``: a
    ``varlen_cp.tables.auto.CostModel``. Integer tables; the per-rank pipeline in
    int64 femtoseconds, every rank at once (no floating tensor is read: the hot path may
    call this)."""
    cp = plan.cp_size
    counts = stage_counts(name, plan, mask, stages)                 # [P, d, o]
    n_parts = counts.shape[0]
    vis = pair_counts(plan, mask)                                   # [d, o] visible pairs
    fetch = fetch_counts(plan, mask)
    pairs = ((counts * vis) // fetch.clamp(min=1)).sum(2)           # [P, d], proportional
    local = vis.diagonal()
    rows = torch.maximum(counts.sum(2), counts.sum(1))              # [P, r] sent or received
    f_fwd, f_bwd = _flops_per_pair(shape)
    rate, bw, mem = model.flops_per_s, model.bytes_per_s, model.memory_bytes_per_s
    row, b, lat = shape.kv_row, shape.dtype_bytes, model.stage_latency_s
    back = [x * row / bw for x in rows.amax(1).tolist()] if n_parts else []  # dK/dV returns
    if name == "dispatch":
        send = back
    else:   # every rank sends (cp - 1) copies of its slice
        send = [(cp - 1) * (hi - lo) * row / bw
                for lo, hi in gather_stage_rows(plan, transfers(stages))]
    work = int((local + pairs.sum(0)).max())
    compute = work * (f_fwd + f_bwd) / rate
    comm = sum(send) + sum(back)
    bound = max(work * f_fwd / rate, sum(send)) + max(work * f_bwd / rate, sum(back))
    if stages == 1 or n_parts == 0:   # one exchange, one call: nothing overlaps
        fwd = sum(send) + work * f_fwd / rate
        bwd = work * f_bwd / rate + sum(back)
        return StagedTime(1, fwd, bwd, compute, comm, bound)
    offsets = plan.rank_offsets()
    tokens = offsets[1:] - offsets[:-1]
    elems_o = tokens * (shape.n_heads * shape.value_dim)
    elems_q = tokens * (shape.n_heads * shape.head_dim)
    up = (b + 4) if b != 4 else 0          # a conversion to fp32 and back, per element
    folds = (pairs > 0).any(0)             # 2+ partials on this rank
    live = pairs > 0
    # forward: the local call (+ out to fp32 and back), then each fetched stage (+ fold:
    # acc *= w, acc += o * w_i: 16 + b bytes per element)
    c0 = local * _fs(f_fwd / rate) + torch.where(folds, elems_o * _fs(2 * up / mem), 0)
    c = torch.where(live, pairs * _fs(f_fwd / rate) + elems_o * _fs((16 + b) / mem)
                    + _fs(lat), 0)
    ends = c0                              # end of the last computed stage, per rank
    last, posted = 0, 0                    # the previous transfer's end; this one's post
    for p in range(n_parts):
        last = max(last, posted) + _fs(send[p])      # a collective ends for all at once
        posted = int(ends.max())                     # the next one goes out after this call
        ends = torch.clamp(ends, min=last) + c[p]
    fwd = int(ends.max()) / _FS
    # backward: fetched stages (dq += dq_s: 8 + b bytes per element; dq to fp32 and back
    # counted with the local call), posting each return; the returns of stage p folded
    # before stage p + 2 computes; the local call last
    b0 = local * _fs(f_bwd / rate) + torch.where(folds, elems_q * _fs(2 * up / mem), 0)
    bb = torch.where(live, pairs * _fs(f_bwd / rate) + elems_q * _fs((8 + b) / mem)
                     + _fs(lat), 0)
    ends, returned = torch.zeros(cp, dtype=torch.int64), [0]   # returned[p]: return p-1 landed
    for p in range(n_parts):
        ends = torch.clamp(ends, min=returned[p - 1] if p >= 1 else 0) + bb[p]
        returned.append(max(returned[-1], int(ends.max())) + _fs(back[p]))
    start = torch.clamp(ends, min=returned[n_parts - 1] if n_parts >= 2 else 0)
    bwd = max(int((start + b0).max()), returned[-1]) / _FS
    return StagedTime(n_parts + 1, fwd, bwd, compute, comm, bound)


def default_stages(plan: CPPlan, mask: AttnMask, name: str, shape: AttnShape,
                   model: Any = None) -> int:
    """The S in CANDIDATE_STAGES with the least ``staged_time`` (the fewest among those
    within 1% of it) among those whose peak memory (``staged_memory``, max over ranks) is
    no more than S = 1's, the call without overlap (not cached)."""
    model = CostModel() if model is None else model

    def choose() -> int:
        times = {s: staged_time(name, plan, mask, shape, model, s).seconds
                 for s in CANDIDATE_STAGES}
        limit = max(staged_memory(name, plan, mask, shape, 1).peak)

        seen: dict[int, bool] = {1: True}

        def fits(s: int) -> bool:   # memory walks only for the candidates that matter
            if s not in seen:
                seen[s] = max(staged_memory(name, plan, mask, shape, s).peak) <= limit
            return seen[s]
        best = next(times[s] for s in sorted(times, key=times.get) if fits(s))
        return next(s for s in sorted(times) if times[s] <= best * 1.01 and fits(s))
    return choose()


class _Live:
    """Bytes alive on every rank (int64 [cp]), and their peak, as a walk allocates and
    frees; ``where`` limits a step to some ranks (the walk's branches, as masks)."""

    def __init__(self, base: torch.Tensor) -> None:
        self.now = base.clone()
        self.peak = base.clone()

    def alloc(self, n: torch.Tensor | int, where: torch.Tensor | None = None) -> None:
        self.now = self.now + (n if where is None else torch.where(where, n, 0))
        self.peak = torch.maximum(self.peak, self.now)

    def free(self, n: torch.Tensor | int, where: torch.Tensor | None = None) -> None:
        self.now = self.now - (n if where is None else torch.where(where, n, 0))


@dataclass(frozen=True)
class _Walk:
    """What the engine's allocations depend on, every rank at once (int64 [r] or [P, r])."""

    name: str
    cp: int
    t: torch.Tensor           # local tokens
    fetched: torch.Tensor     # [P, r] keys a rank takes in each transfer
    given: torch.Tensor       # [P, r] keys others take from a rank in each transfer
    own: torch.Tensor         # local keys the queries see
    keys: torch.Tensor        # [P, r] keys of each transfer's call
    local: torch.Tensor       # bool: a separate local call (S >= 2)
    one: bool                 # S = 1: one call over local and fetched keys
    slices: tuple             # all_gather's row slices per transfer
    b: int                    # dtype bytes
    kv: int                   # bytes of a K|V row, and in fp32
    kv4: int
    o: int                    # bytes of an output row, and in fp32
    o4: int
    g: int                    # bytes of a dQ row, and in fp32
    g4: int

    @property
    def n_parts(self) -> int:
        return self.fetched.shape[0]

    @property
    def zero(self) -> torch.Tensor:
        return torch.zeros(self.cp, dtype=torch.int64)

    def post(self, live: _Live, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A transfer posted: its (send, receive) buffers (returned), built with their
        temporaries."""
        if self.name == "dispatch":   # two halves, cat into the send buffer; the receive
            live.alloc(self.given[p] * self.kv)
            live.alloc(self.given[p] * self.kv)
            live.free(self.given[p] * self.kv)
            live.alloc(self.fetched[p] * self.kv)
            return self.given[p] * self.kv, self.fetched[p] * self.kv
        lo, hi = self.slices[p]        # the zero-padded slice; the gathered slices
        live.alloc((1 + self.cp) * (hi - lo) * self.kv)
        return self.zero + (hi - lo) * self.kv, self.zero + self.cp * (hi - lo) * self.kv


def _forward_walk(w: _Walk) -> tuple[torch.Tensor, torch.Tensor]:
    """(peak beyond q, k, v; bytes kept for the backward) of the forward."""
    t, kv, o = w.t, w.kv, w.o
    live, have = _Live(w.zero), w.zero
    none = (w.zero, w.zero)
    xchg = w.post(live, 0) if w.n_parts else none
    acc = torch.where(w.local, t * o, 0)
    live.alloc(t * o, w.local)                               # the local call's output
    for p in range(w.n_parts):
        nxt = w.post(live, p + 1) if p + 1 < w.n_parts else none
        live.free(xchg[0])    # the send buffer, once its transfer is in (issue 30)
        if w.one:   # every key: fetched ones picked, local ones copied, per K and V half
            for _ in range(2):
                live.alloc(w.keys[p] * kv // 2)
                live.alloc(w.fetched[p] * kv // 2)
                live.free(w.fetched[p] * kv // 2)
                live.alloc(w.own * kv // 2)
                live.free(w.own * kv // 2)
        else:
            live.alloc(w.keys[p] * kv)
        have = have + w.keys[p] * kv
        live.free(xchg[1])
        xchg = nxt
        k = w.keys[p] > 0
        live.alloc(t * o, k)                                 # the call's output
        first, later = k & (acc == 0), k & (acc != 0)
        to_fp32 = later & (acc == t * o) & (w.b != 4)        # the first fold: fp32
        live.alloc(t * w.o4, to_fp32)
        live.free(acc, to_fp32)
        acc = torch.where(first, t * o, torch.where(to_fp32, t * w.o4, acc))
        live.free(t * o, later)
    live.alloc(t * o, (acc != t * o) & (acc != 0))           # out in q.dtype
    return live.peak, have + torch.where(w.local, t * kv, 0)  # k, v kept for the local call


def _backward_walk(w: _Walk, have: torch.Tensor) -> torch.Tensor:
    """Peak of the backward beyond q and dout (what the forward kept included)."""
    t, kv, kv4, g, g4 = w.t, w.kv, w.kv4, w.g, w.g4
    live = _Live(have)
    calls = w.local.to(torch.int64) + (w.keys > 0).sum(0)
    acc_kv, dq, prev = w.zero, w.zero, w.zero

    def call_out(where: torch.Tensor) -> None:
        nonlocal dq
        fp32 = where & (dq == 0) & (calls > 1) & (w.b != 4)  # dq made fp32 at once
        live.alloc(t * g4, fp32)
        live.free(t * g, fp32)
        live.free(t * g, where & (dq != 0))
        dq = torch.where(fp32, t * g4, torch.where(where & (dq == 0), t * g, dq))

    def accumulator(where: torch.Tensor | None = None) -> None:
        nonlocal acc_kv
        new = acc_kv == 0 if where is None else where & (acc_kv == 0)
        live.alloc(t * kv4, new)
        acc_kv = torch.where(new, t * kv4, acc_kv)

    for p in range(w.n_parts):
        keys, k = w.keys[p], w.keys[p] > 0
        live.alloc(t * g + keys * kv, k)                    # dq, dk, dv of the call
        call_out(k)
        live.alloc(keys * kv, k)                            # packed dK|dV
        live.free(keys * kv, k)
        live.alloc(keys * kv, ~k)
        if w.one:
            accumulator()
            live.alloc(w.own * (kv + kv4))                  # local rows picked, in fp32
            live.free(w.own * (kv + kv4))
        live.alloc((w.fetched[p] + w.given[p]) * kv)        # send (picked), receive
        live.free(keys * kv)
        if p:                                               # the previous returns land
            accumulator()
            live.alloc(w.given[p - 1] * kv4)
            live.free(w.given[p - 1] * kv4 + prev)
        prev = (w.fetched[p] + w.given[p]) * kv
    live.alloc(t * g + t * kv, w.local)                     # the local call
    call_out(w.local)
    accumulator(w.local)
    live.free(t * kv, w.local)
    if w.n_parts:
        accumulator()
        live.alloc(w.given[-1] * kv4)
        live.free(w.given[-1] * kv4 + prev)
    back = (dq == t * g4) & (w.b != 4)                      # dq in q.dtype
    live.alloc(t * g, back)
    live.free(t * g4, back)
    live.alloc(t * kv)                                      # dk, dv
    return live.peak


def staged_memory(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, stages: int
                  ) -> StagedMemory:
    """Host count of the buffers ``selected_keys``' engine allocates, walked in its program
    order (its allocations and frees, mirrored one by one), every rank at once (int64
    vectors; the engine's per-rank branches are masks): exchange buffers (the transfer in
    flight and the next), picked K/V, the output and its fp32 accumulator, dQ (fp32 when
    the rank makes several calls), the fp32 dK|dV accumulator, one call's gradients, the
    returns in flight. Not counted: the kernels' own workspaces, [H, T] tensors (LSE, fold
    weights), index tables."""
    b = shape.dtype_bytes
    counts = stage_counts(name, plan, mask, stages)
    one = stages == 1 and counts.shape[0] > 0      # one call over local and fetched keys
    own = fetch_counts(plan, mask).diagonal()
    offsets = plan.rank_offsets()
    o, g = shape.n_heads * shape.value_dim, shape.n_heads * shape.head_dim
    w = _Walk(name, plan.cp_size, offsets[1:] - offsets[:-1], counts.sum(2), counts.sum(1),
              own, counts.sum(2) + (own if one else 0),
              (pair_counts(plan, mask).diagonal() > 0) & (not one), one,
              gather_stage_rows(plan, transfers(stages)) if name == "all_gather" else (),
              b, shape.kv_row, shape.kv_row * 4 // b, o * b, o * 4, g * b, g * 4)
    fwd, have = _forward_walk(w)
    return StagedMemory(fwd.tolist(), _backward_walk(w, have).tolist(), have.tolist())
