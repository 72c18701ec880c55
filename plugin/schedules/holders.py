"""Token holders and the host tables of one kernel call between two of them.

A *holder* is a set of tokens that one kernel call sees as its queries or keys: a CP rank's
local tokens (p2p, all_gather, dispatch), or the union of a Ulysses group's tokens (a2a,
a2a+p2p), or the keys a rank selected (all_gather, dispatch). Every holder keeps the plan's
invariant: segment i is document i, positions increase inside a segment, padding
(position < 0) last. So any two holders pair up as one varlen call with explicit positions,
and the host decides which tiles hold anything (the call's ``BlockSchedule``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..kernels import BlockSchedule
from ..kernels.mask_math import UNBOUNDED
from ..masks import AttnMask
from ..plan import CPPlan
from .keys import host_table, table_key

_STRIDE = 1 << 42  # sort keys: segment * _STRIDE + position


@dataclass(frozen=True)
class Holder:
    """Tokens one kernel call sees as queries or keys (host tensors).

    cu: int32 [n_docs+1]; pos: int32 [n]; max_len: longest segment.
    """

    cu: torch.Tensor
    pos: torch.Tensor
    max_len: int

    @property
    def n_tokens(self) -> int:
        return int(self.pos.numel())

    # ---- derived tables for tile schedules (computed once per holder) --------------------
    @cached_property
    def _segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(start int64 [n_seg], length, real rows) of each segment."""
        cu = self.cu.to(torch.int64)
        start, length = cu[:-1], cu[1:] - cu[:-1]
        real = torch.zeros(length.numel(), dtype=torch.int64)
        live = self.pos >= 0
        real.index_add_(0, segment_ids(cu, self.n_tokens)[live],
                        torch.ones(int(live.sum()), dtype=torch.int64))
        return start, length, real

    @cached_property
    def sort_keys(self) -> torch.Tensor:
        """int64 [n]: segment * STRIDE + position, padding at segment * STRIDE + STRIDE - 1
        (padding is last in its segment, so the keys are sorted)."""
        seg = segment_ids(self.cu, self.n_tokens)
        pos = self.pos.to(torch.int64)
        return seg * _STRIDE + torch.where(pos >= 0, pos, _STRIDE - 1)

    def block_ends(self, block: int) -> tuple[torch.Tensor, ...]:
        """The non-empty blocks of ``block`` rows of every segment: (dense index
        segment * cdiv(max_len, block) + block, rows in the block, first real row, last
        real row); rows are absolute, a block without real rows has first > last.
        Cached per block size."""
        cache = self.__dict__.setdefault("_block_ends", {})
        if block not in cache:
            start, length, real = self._segments
            nb = -(-max(self.max_len, 1) // block)
            count = -(-length // block)
            seg = torch.repeat_interleave(torch.arange(length.numel()), count)
            b = torch.arange(seg.numel()) - (torch.cumsum(count, 0) - count)[seg]
            lo = b * block
            rows = torch.minimum(lo + block, length[seg]) - lo
            last = torch.minimum(lo + block, real[seg]) - 1
            cache[block] = (seg * nb + b, seg, rows, start[seg] + lo, start[seg] + last)
        return cache[block]


def rank_holder(plan: CPPlan, rank: int) -> Holder:
    """Holder of ``rank``'s local tokens (views of the plan's tables)."""
    return Holder(plan.local_cu_seqlens_of(rank), plan.positions_of(rank),
                  plan.max_local_seqlen_of(rank))


def rank_holders(plan: CPPlan) -> list[Holder]:
    """Every rank's holder, cached in the plan."""
    return host_table(plan, table_key("rank_holders"),
                      lambda: [rank_holder(plan, r) for r in range(plan.cp_size)])


def holder_from_counts(doc: torch.Tensor, pos: torch.Tensor, n_docs: int) -> Holder:
    """Holder of tokens listed in (doc, position) order: cu from per-document counts."""
    counts = torch.bincount(doc, minlength=n_docs)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    max_len = int(counts.max()) if counts.numel() else 0
    return Holder(cu.to(torch.int32), pos.to(torch.int32), max_len)


def segment_ids(cu: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: segment of each row of a varlen batch with boundaries ``cu``."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=n)


@dataclass(frozen=True)
class KernelCall:
    """Everything but the tensors of one varlen kernel call (host or device copies)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    schedule: BlockSchedule

    @property
    def visited_pairs(self) -> int:
        return self.schedule.visited_pairs

    def to(self, device: torch.device) -> "KernelCall":
        """Copy the tables to ``device`` once, without a sync."""
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return KernelCall(mv(self.cu_q), mv(self.cu_k), self.max_q, self.max_k,
                          mv(self.q_pos), mv(self.k_pos), self.schedule.to(device))


def _ranges(src: Holder, block: int, dst: Holder, interval) -> tuple[torch.Tensor, int]:
    """For each block of ``src`` rows: the offsets [start, end) in its segment of ``dst``
    of the rows whose positions fall in the union of the block rows' intervals (the
    interval ends never decrease with the position, so the union is [lo(first real row),
    hi(last real row)]), as the dense [n_seg, cdiv(max_len, block), 2] table; and the
    pairs those ranges cover (rows x span, summed)."""
    n_seg, nb = src.cu.numel() - 1, -(-max(src.max_len, 1) // block)
    out = torch.zeros(n_seg * nb, 2, dtype=torch.int32)
    slot, seg, rows, first, last = src.block_ends(block)
    live = first <= last
    if not bool(live.any()):
        return out.view(n_seg, nb, 2), 0
    slot, seg, rows, first, last = slot[live], seg[live], rows[live], first[live], last[live]
    pos = src.pos.to(torch.int64)
    lo, _ = interval(pos[first])
    _, hi = interval(pos[last])
    base = seg * _STRIDE
    d_start = dst.cu.to(torch.int64)[seg]
    start = torch.searchsorted(dst.sort_keys, base + lo.clamp(min=0)) - d_start
    end = torch.searchsorted(dst.sort_keys, base + hi.clamp(max=UNBOUNDED), right=True) - d_start
    end = torch.maximum(end, start)
    empty = lo > hi
    start, end = torch.where(empty, 0, start), torch.where(empty, 0, end)
    out[slot] = torch.stack([start, end], -1).to(torch.int32)
    return out.view(n_seg, nb, 2), int((rows * (end - start)).sum())


def block_schedule(q: Holder, k: Holder, mask: AttnMask, block: tuple[int, int]
                   ) -> BlockSchedule:
    """The tile schedule of the call ``q`` x ``k`` (what ``build_block_schedule`` computes
    from per-token tables), from per-block ends and sorted keys: O(blocks log tokens) per
    call instead of several passes over every token."""
    kv_range, visited = _ranges(q, block[0], k, mask.key_interval)
    q_range, _ = _ranges(k, block[1], q, mask.query_interval)
    return BlockSchedule(block[0], block[1], kv_range, q_range, visited)


def kernel_call(q: Holder, k: Holder, mask: AttnMask, block: tuple[int, int]) -> KernelCall:
    """Host tables (and tile schedule) of the call ``q`` holder x ``k`` holder."""
    return KernelCall(q.cu, k.cu, q.max_len, k.max_len, q.pos, k.pos,
                      block_schedule(q, k, mask, block))
