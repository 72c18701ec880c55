"""Staged host tables of ``dispatch`` and ``all_gather``, and the cost model of staging.

A rank's attention is split by keys into stages. Stage 0 is the keys the rank holds, read
in place (local queries x local K/V, one call with the local tile schedule, no copy).
Stages 1..S are the remote keys its queries see, fetched in S collectives (``dispatch``:
one ``all_to_all_single`` each, of exactly the needed rows; ``all_gather``: one all-gather
each, of a slice of every rank's padded local K/V). Each stage's keys are listed per
document by position (segment i is document i), so each stage is one varlen call with
explicit positions and its own tile schedule; the partial (out, lse) fold by their LSE.

Which remote key travels in which stage:
- ``dispatch``: every rank lists the keys it fetches with the owners nearest first (ring
  distance, so a node's neighbours before the far ranks), each owner's keys in (document,
  position) order, and cuts that list into S parts of equal size (receiver-balanced). Stage
  s then takes from owner o a contiguous piece of what o sends, so the owner knows what to
  send in each stage from the [S, cp, cp] count table alone, with no metadata exchange.
- ``all_gather``: stage s gathers rows [lo_s, hi_s) of every rank's padded local K/V (equal
  slices of the padded length); a remote key is in the stage of its owner's row.
Stages empty on every rank are dropped (the same decision on every rank), so S is at most
the number of remote keys.

Cost of S stages (per layer, slowest rank per stage, since the collectives synchronize the
ranks): with c_s the compute of stage s (visible pairs x FLOPs per pair / flops_per_s, plus
a fixed ``stage_latency_s`` and the fold's memory traffic for s >= 1) and t_s its transfer
(max over ranks of the rows a rank sends or receives in it, x the K/V row / bytes_per_s;
t_0 = 0, the local keys need none), the forward posts t_{s+1} before computing stage s:

    forward  = t_0 + sum_{s=0..S} max(c_s, t_{s+1})          (t_{S+1} = 0)
    backward = b_1 + sum_{s=1..S} max(b_{next(s)}, r_s)       (order 1..S then local 0)

where the backward computes the fetched stages first, posting each one's dK/dV return r_s
while the next computes, and the local stage last, under the last return. The compute of a
stage is split from a rank's visible pairs with each owner's keys in proportion to that
owner's keys in the stage (exact for whole owners). ``default_stages`` picks the S in
1..``MAX_STAGES`` with the least estimated time (fewest stages among those within 1%):
enough to hide the transfer, no more, since each stage adds its latency and fold.

Limits: collective latency and fold traffic are modelled with two constants of the cost
model, not measured; compute per stage is proportional within an owner's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.runs import span_pieces
from .cost import Shape
from .holders import KernelCall, holder_from_counts, kernel_call, rank_holder, segment_ids
from .keys import host_table, table_key
from .ring import rank_visibility
from .selected import fetch_counts, needed_spans, runs_by_document, select_keys, sent_keys

STAGED = ("dispatch", "all_gather")
MAX_STAGES = 8          # the default search range; a user may ask for more
_BIG = 1 << 40          # group * _BIG + index: sort keys of (group, index) pairs


# ---- which remote keys travel in which stage -------------------------------------------------
def owner_order(cp: int) -> torch.Tensor:
    """int64 [cp, cp]: row d lists the owners nearest to rank d first (ring distance, then
    the next rank before the previous one); d itself first (it fetches nothing from
    itself)."""
    d = torch.arange(cp).unsqueeze(1)
    o = torch.arange(cp).unsqueeze(0)
    ahead, behind = (o - d) % cp, (d - o) % cp
    return torch.argsort(torch.minimum(ahead, behind) * cp + ahead, dim=1, stable=True)


def _drop_empty(counts: torch.Tensor) -> torch.Tensor:
    """Stages (dim 0) in which no rank fetches anything are dropped."""
    return counts[counts.flatten(1).sum(1) > 0]


def dispatch_stage_counts(plan: CPPlan, mask: AttnMask, stages: int) -> torch.Tensor:
    """int64 [S', cp, cp]: keys rank d fetches from rank o in stage s (S' <= ``stages``:
    stages empty everywhere dropped); summed over s it is ``fetch_counts`` off the
    diagonal (cached)."""
    def build() -> torch.Tensor:
        counts = fetch_counts(plan, mask).clone()
        counts.fill_diagonal_(0)
        cp = plan.cp_size
        order = owner_order(cp)
        c = counts.gather(1, order)                           # [d, owners nearest first]
        end = torch.cumsum(c, 1)
        start = end - c
        bounds = end[:, -1:] * torch.arange(stages + 1) // stages   # [d, S+1] equal cuts
        lo = torch.maximum(start.unsqueeze(1), bounds[:, :-1].unsqueeze(2))
        hi = torch.minimum(end.unsqueeze(1), bounds[:, 1:].unsqueeze(2))
        n = (hi - lo).clamp(min=0)                            # [d, S, owners nearest first]
        out = torch.zeros_like(n).scatter_(2, order.unsqueeze(1).expand_as(n), n)
        return _drop_empty(out.transpose(0, 1).contiguous())
    return host_table(plan, table_key("dispatch_stage_counts", mask, None, stages), build)


def gather_stage_rows(plan: CPPlan, stages: int) -> tuple[tuple[int, int], ...]:
    """(lo, hi) of each all_gather stage: equal slices of the padded local length (the
    largest local token count), empty slices dropped."""
    stride = max(plan.num_tokens_of(r) for r in range(plan.cp_size))
    cuts = [stride * s // stages for s in range(stages + 1)]
    return tuple((a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a)


def gather_stage_counts(plan: CPPlan, mask: AttnMask, stages: int) -> torch.Tensor:
    """int64 [S', cp, cp]: keys rank d picks from rank o's rows of all_gather stage s
    (exact, from the needed spans cut by the owners' runs; S' = the non-empty slices, so
    the stages line up with ``gather_stage_rows``) (cached)."""
    def build() -> torch.Tensor:
        cp = plan.cp_size
        rows = gather_stage_rows(plan, stages)
        holder, doc, lo, hi = needed_spans(plan, mask)
        part = runs_by_document(plan)
        span, run, first, length = span_pieces(doc, lo, hi, part)
        dest, owner = holder[span], part.holder[run]
        keep = dest != owner
        dest, owner = dest[keep], owner[keep]
        row0 = (part.row[run] + first - part.start[run])[keep]
        row1 = row0 + length[keep]
        out = torch.zeros(len(rows), cp * cp, dtype=torch.int64)
        for s, (a, b) in enumerate(rows):
            n = (torch.minimum(row1, torch.tensor(b)) - torch.maximum(row0, torch.tensor(a)))
            out[s].scatter_add_(0, dest * cp + owner, n.clamp(min=0))
        return out.view(len(rows), cp, cp)
    return host_table(plan, table_key("gather_stage_counts", mask, None, stages), build)


def stage_counts(name: str, plan: CPPlan, mask: AttnMask, stages: int) -> torch.Tensor:
    """[S', cp, cp] keys rank d takes from rank o in each stage of strategy ``name``."""
    if name == "dispatch":
        return dispatch_stage_counts(plan, mask, stages)
    return gather_stage_counts(plan, mask, stages)


# ---- one rank's tables ------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One remote stage of one rank (host tensors, or their device copies).

    Forward: ``dispatch`` sends its local rows ``in_rows`` (``in_splits`` to each rank) and
    receives ``back_splits`` rows from each; ``all_gather`` gathers rows [lo, hi) of every
    rank. ``gather`` picks the stage's keys from the receive buffer in the call's order.
    Backward: their dK/dV go to the owners in ``back_order`` (``back_splits`` each), and the
    rows others return to this rank land on local rows ``in_rows``."""

    call: KernelCall | None        # local queries x this stage's keys; None: no key here
    gather: torch.Tensor           # int64 [n]: receive-buffer row of each key, call order
    back_order: torch.Tensor       # int64 [n]: keys grouped by owner, as owners list them
    back_splits: tuple[int, ...]   # keys fetched from (dK/dV returned to) each rank
    in_rows: torch.Tensor          # int64 [m]: our rows the others take, grouped by rank
    in_splits: tuple[int, ...]     # rows each rank takes from us in this stage
    lo: int = 0                    # all_gather: slice of every rank's padded local K/V
    hi: int = 0

    @property
    def n_keys(self) -> int:
        return int(self.gather.numel())

    def to(self, device: torch.device) -> "Stage":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return replace(self, gather=mv(self.gather), back_order=mv(self.back_order),
                       in_rows=mv(self.in_rows),
                       call=None if self.call is None else self.call.to(device))


@dataclass(frozen=True)
class StagedTables:
    """Everything one rank's staged call needs: the local call (None: no local pair is
    visible), then the remote stages in order."""

    local: KernelCall | None
    stages: tuple[Stage, ...]

    def to(self, device: torch.device) -> "StagedTables":
        return StagedTables(None if self.local is None else self.local.to(device),
                            tuple(s.to(device) for s in self.stages))


def _rank_within(group: torch.Tensor) -> torch.Tensor:
    """int64: index of each element among the elements of its group, in list order."""
    order = torch.argsort(group, stable=True)
    ordered = group[order]
    out = torch.empty_like(group)
    out[order] = torch.arange(group.numel()) - torch.searchsorted(ordered, ordered)
    return out


def _stage_of(group: torch.Tensor, index: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Stage of the ``index``-th element of ``group``: ends [n_groups, S] are each group's
    cumulative stage ends (the first stage whose end exceeds the index)."""
    n_groups, n_stages = ends.shape
    flat = (torch.arange(n_groups).unsqueeze(1) * _BIG + ends).flatten()
    return torch.searchsorted(flat, group * _BIG + index, right=True) - group * n_stages


def _local_call(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int]
                ) -> KernelCall | None:
    holder = rank_holder(plan, rank)
    call = kernel_call(holder, holder, mask, block)
    return call if call.visited_pairs > 0 else None


def _stage_call(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                doc: torch.Tensor, pos: torch.Tensor) -> KernelCall | None:
    if doc.numel() == 0:
        return None
    keys = holder_from_counts(doc, pos, plan.n_docs)
    return kernel_call(rank_holder(plan, rank), keys, mask, block)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(perm)
    out[perm] = torch.arange(perm.numel())
    return out


def dispatch_staged_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                           stages: int) -> StagedTables:
    """Host tables of ``rank``'s staged dispatch call with ``stages`` stages (cached)."""
    def build() -> StagedTables:
        counts = dispatch_stage_counts(plan, mask, stages)        # [S, d, o]
        ends = torch.cumsum(counts, 0)                            # inclusive, per (d, o)
        sel = select_keys(plan, mask, rank)
        doc = segment_ids(sel.holder.cu, sel.owner.numel())
        remote = torch.nonzero(sel.owner != rank).flatten()       # (doc, position) order
        owner = sel.owner[remote]
        index = _rank_within(owner)       # place in the owner's list (its send order)
        stage = _stage_of(owner, index, ends[:, rank, :].t())
        mine = counts[:, rank, :]                                 # [S, o]
        buf_start = torch.cumsum(mine, 1) - mine                  # owner's block in the buffer
        row = buf_start[stage, owner] + index - (ends - counts)[stage, rank, owner]
        dest, rows = sent_keys(plan, mask, rank)
        out = dest != rank
        dest, rows = dest[out], rows[out]
        out_stage = _stage_of(dest, _rank_within(dest), ends[:, :, rank].t())
        built = []
        for s in range(counts.shape[0]):
            here = stage == s
            slots, gather = remote[here], row[here]
            built.append(Stage(_stage_call(plan, mask, rank, block, doc[slots],
                                           sel.holder.pos[slots]),
                               gather, _inverse(gather), tuple(mine[s].tolist()),
                               rows[out_stage == s], tuple(counts[s, :, rank].tolist())))
        return StagedTables(_local_call(plan, mask, rank, block), tuple(built))
    return host_table(plan, table_key("dispatch_staged", mask, block, rank, stages), build)


def gather_staged_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                         stages: int) -> StagedTables:
    """Host tables of ``rank``'s staged all_gather call with ``stages`` stages (cached)."""
    def build() -> StagedTables:
        cp = plan.cp_size
        slices = gather_stage_rows(plan, stages)
        his = torch.tensor([hi for _, hi in slices], dtype=torch.int64)
        sel = select_keys(plan, mask, rank)
        doc = segment_ids(sel.holder.cu, sel.owner.numel())
        remote = torch.nonzero(sel.owner != rank).flatten()
        owner, row = sel.owner[remote], sel.row[remote]
        stage = torch.searchsorted(his, row, right=True)
        dest, rows = sent_keys(plan, mask, rank)
        out = dest != rank
        dest, rows = dest[out], rows[out]
        out_stage = torch.searchsorted(his, rows, right=True)
        built = []
        for s, (lo, hi) in enumerate(slices):
            here = stage == s
            slots, own = remote[here], owner[here]
            back = out_stage == s
            built.append(Stage(_stage_call(plan, mask, rank, block, doc[slots],
                                           sel.holder.pos[slots]),
                               own * (hi - lo) + row[here] - lo,
                               torch.argsort(own, stable=True),
                               tuple(torch.bincount(own, minlength=cp).tolist()),
                               rows[back], tuple(torch.bincount(dest[back], minlength=cp)
                                                 .tolist()), lo, hi))
        return StagedTables(_local_call(plan, mask, rank, block), tuple(built))
    return host_table(plan, table_key("all_gather_staged", mask, block, rank, stages), build)


def staged_tables(name: str, plan: CPPlan, mask: AttnMask, rank: int,
                  block: tuple[int, int], stages: int) -> StagedTables:
    build = dispatch_staged_tables if name == "dispatch" else gather_staged_tables
    return build(plan, mask, rank, block, stages)


# ---- cost of staging --------------------------------------------------------------------------
@dataclass(frozen=True)
class StagedTime:
    """Estimated seconds of one layer with S stages (slowest rank per stage); the
    ``sequential_*`` fields are the same work without overlap (today's strategies: the
    whole exchange, then the whole compute; backward the reverse)."""

    stages: int                    # effective stages (empty ones dropped)
    forward_s: float
    backward_s: float
    compute_s: float               # forward + backward compute, slowest rank, no overheads
    comm_s: float                  # forward + backward transfer, summed over stages
    sequential_forward_s: float
    sequential_backward_s: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def sequential_s(self) -> float:
        return self.sequential_forward_s + self.sequential_backward_s


def _flops_per_pair(shape: Shape) -> tuple[float, float]:
    """(forward, backward) FLOPs per visible pair and query head (as ``auto``)."""
    d, dv = shape.head_dim, shape.head_dim_v
    return 2.0 * (d + dv) * shape.n_heads, (6.0 * d + 4.0 * dv) * shape.n_heads


def staged_time(name: str, plan: CPPlan, mask: AttnMask, shape: Shape, model: Any,
                stages: int) -> StagedTime:
    """Estimate of ``name`` with ``stages`` stages (module docstring); ``model``: a
    ``varlen_cp.schedules.auto.CostModel``. Integer tables, then Python floats per rank
    (no floating tensor is read back: the hot path may call this)."""
    cp = plan.cp_size
    counts = stage_counts(name, plan, mask, stages)                 # [S, d, o]
    n_stages = counts.shape[0]
    vis = rank_visibility(plan, mask)                               # [d, o] visible pairs
    fetch = fetch_counts(plan, mask)
    # a stage's pairs: each owner's pairs in proportion to its keys in the stage
    pairs = ((counts * vis) // fetch.clamp(min=1)).sum(2).tolist()  # [S][d]
    local = vis.diagonal().tolist()
    rows = torch.maximum(counts.sum(2), counts.sum(1)).tolist()     # [S][r] sent or received
    f_fwd, f_bwd = _flops_per_pair(shape)
    rate, bw, mem = model.flops_per_s, model.bytes_per_s, model.memory_bytes_per_s
    row, b, lat = shape.kv_row, shape.dtype_bytes, model.stage_latency_s
    tokens = [plan.num_tokens_of(r) for r in range(cp)]
    fold_f = [t * shape.n_heads * shape.head_dim_v * (16 + b) / mem for t in tokens]
    fold_b = [t * shape.n_heads * shape.head_dim * (8 + b) / mem for t in tokens]
    returns = [max(x) * row / bw for x in rows]                     # backward, per stage
    if name == "dispatch":
        sends = returns
    else:  # every rank sends (cp - 1) copies of its slice
        sends = [(cp - 1) * (hi - lo) * row / bw for lo, hi in gather_stage_rows(plan, stages)]
    c = [max(p * f_fwd / rate + f for p, f in zip(pairs[s], fold_f)) + lat
         for s in range(n_stages)]
    bb = [max(p * f_bwd / rate + f for p, f in zip(pairs[s], fold_b)) + lat
          for s in range(n_stages)]
    c0, b0 = max(local) * f_fwd / rate, max(local) * f_bwd / rate
    fwd = sum(max(cs, ts) for cs, ts in zip([c0] + c, sends + [0.0]))
    order = bb + [b0]                        # backward: fetched stages, then the local one
    bwd = order[0] + sum(max(order[s + 1], returns[s]) for s in range(n_stages))
    work = [lo + sum(pairs[s][r] for s in range(n_stages)) for r, lo in enumerate(local)]
    per_rank = [[rows[s][r] for s in range(n_stages)] for r in range(cp)]
    seq_x = (max(sum(x) for x in per_rank) * row / bw) if n_stages else 0.0
    seq_f = max(work) * f_fwd / rate + (sum(sends) if name == "all_gather" else seq_x)
    seq_b = max(work) * f_bwd / rate + seq_x
    return StagedTime(n_stages, fwd, bwd, max(work) * (f_fwd + f_bwd) / rate,
                      sum(sends) + sum(returns), seq_f, seq_b)


def default_stages(plan: CPPlan, mask: AttnMask, name: str, shape: Shape,
                   model: Any = None) -> int:
    """The S in 1..MAX_STAGES with the least ``staged_time`` (the fewest among those
    within 1% of it); cached in the plan per (mask, strategy, shape, model)."""
    if model is None:
        from .auto import CostModel  # auto imports this module
        model = CostModel()

    def choose() -> int:
        times = [staged_time(name, plan, mask, shape, model, s).seconds
                 for s in range(1, MAX_STAGES + 1)]
        best = min(times)
        return next(s for s, t in enumerate(times, 1) if t <= best * 1.01)
    return host_table(plan, table_key("overlap_stages", mask, None, name, shape, model),
                      choose)


def resolve_stages(plan: CPPlan, mask: AttnMask, name: str, shape: Shape,
                   stages: int | None) -> int:
    """``stages`` when given, else the cost model's default."""
    return default_stages(plan, mask, name, shape) if stages is None else stages


# ---- memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagedMemory:
    """Per rank, bytes the staged call holds at its peak beyond its inputs (q, k, v, dout):
    ``forward`` and ``backward`` peaks (backward: ``kept`` included) and ``kept``, what the
    forward keeps for the backward (the fetched K/V)."""

    forward: list[int]
    backward: list[int]
    kept: list[int]

    @property
    def peak(self) -> list[int]:
        return [max(f, b) for f, b in zip(self.forward, self.backward)]


def staged_memory(name: str, plan: CPPlan, mask: AttnMask, shape: Shape, stages: int
                  ) -> StagedMemory:
    """Host count of the buffers ``selected_keys``' engine allocates, walked in program
    order per rank: exchange buffers of the stage in flight and the next one, fetched K/V,
    the fp32 out / dQ / dK|dV accumulators, one kernel call's outputs. Not counted: the
    kernels' own workspaces, [H, T] tensors (LSE, weights), index tables."""
    cp, b = plan.cp_size, shape.dtype_bytes
    counts = stage_counts(name, plan, mask, stages)
    n_stages = counts.shape[0]
    fetch = counts.sum(2).tolist()                        # [S][r] keys r fetches
    given = counts.sum(1).tolist()                        # [S][r] rows others take from r
    kv, kv4 = shape.kv_row, shape.kv_row * 4 // b         # one K|V row, in fp32
    out, out4 = shape.n_heads * shape.head_dim_v * b, shape.n_heads * shape.head_dim_v * 4
    dq, dq4 = shape.n_heads * shape.head_dim * b, shape.n_heads * shape.head_dim * 4
    slices = gather_stage_rows(plan, stages) if name == "all_gather" else ()
    fwd, bwd, kept = [], [], []
    for r in range(cp):
        t = plan.num_tokens_of(r)
        n = [fetch[s][r] for s in range(n_stages)]
        m = [given[s][r] for s in range(n_stages)]
        if name == "dispatch":     # send (with its two halves while it is built) + receive
            xchg = [(2 * m[s] + n[s]) * kv for s in range(n_stages)]
        else:                      # the zero-padded slice + the gathered slices
            xchg = [(1 + cp) * (hi - lo) * kv for lo, hi in slices]
        xchg += [0]
        acc = t * (out4 if b != 4 else out)
        conv = t * out if b != 4 else 0          # the local call's output being converted
        peaks = [xchg[0] + t * out + conv if n_stages else t * out + conv]
        have = 0
        for s in range(n_stages):
            peaks.append(acc + have + xchg[s] + xchg[s + 1] + n[s] * kv)   # picking keys
            have += n[s] * kv
            peaks.append(acc + have + xchg[s + 1] + t * out)               # stage s call
        peaks.append(acc + have + (t * out if b != 4 else 0))              # out in q.dtype
        fwd.append(max(peaks))
        kept.append(have)
        # backward: fetched stages, then the local call; returns in flight one stage
        grads, dq_acc = t * kv4, t * (dq4 if b != 4 else dq)
        peaks, prev = [], 0
        for s in range(n_stages):
            first = dq_acc if s else 0           # dq accumulator exists from stage 2
            call = have + grads + first + t * dq + n[s] * kv + prev
            peaks.append(call + (dq_acc if s == 0 and b != 4 else 0) + n[s] * kv)
            posted = (n[s] + m[s]) * kv
            peaks.append(have + grads + dq_acc + prev + posted
                         + (m[s - 1] * kv4 if s else 0))
            prev = posted
        peaks.append(have + grads + (dq_acc if n_stages else 0) + t * dq + t * kv + prev)
        peaks.append(have + grads + dq_acc + t * dq)                       # dq to q.dtype
        peaks.append(have + grads + t * dq + t * kv)                       # dk, dv
        bwd.append(max(peaks))
    return StagedMemory(fwd, bwd, kept)
