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

import numpy as np
import torch

from ..kernels import BlockSchedule
from ..kernels.host_copy import to_device
from ..kernels.schedule import work_lists
from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashForm, FlashRoute, flash_forms, query_pieces
from .cache import host_table, table_key


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

    @cached_property
    def as_set(self) -> "HolderSet":
        """This holder as a one-holder :class:`HolderSet` (made once)."""
        return HolderSet.of([self])


_POS_BITS = 32                        # sort keys: (holder * n_seg + seg) << 32 | position
_PAD_KEY = (1 << _POS_BITS) - 1       # padding sorts last in its segment
_MAX_POS = _PAD_KEY - 1


@dataclass(frozen=True)
class HolderSet:
    """H holders over the same documents, their tokens concatenated holder by holder: the
    unit the tile schedules are computed on, so a ring's calls (one query holder against
    many key holders) take a fixed number of vectorized ops, however many steps it has.

    numpy, in the plan's dtypes: cu: int32 [H, n_seg+1] each holder's cu_seqlens; pos:
    int32 [N] every holder's positions back to back; offsets: int64 [H+1] each holder's
    first row in ``pos``; max_len: each holder's longest segment. The schedules' integer
    math runs on numpy (an op on a small array costs ~0.5 us in numpy against ~3-5 us in
    torch; np.searchsorted on the 128K keys ~3x faster than torch's); tensors are made
    only for what a kernel reads (:meth:`holder`, the schedules' tables).
    """

    cu: np.ndarray
    pos: np.ndarray
    offsets: np.ndarray
    max_len: tuple[int, ...]

    @classmethod
    def of(cls, holders: list[Holder]) -> "HolderSet":
        """The holders' tables concatenated (read through numpy views of their tensors:
        no conversion)."""
        offsets = np.zeros(len(holders) + 1, dtype=np.int64)
        np.cumsum([h.n_tokens for h in holders], out=offsets[1:])
        return cls(np.stack([h.cu.numpy() for h in holders]),
                   np.concatenate([h.pos.numpy() for h in holders]), offsets,
                   tuple(h.max_len for h in holders))

    @property
    def n_seg(self) -> int:
        return self.cu.shape[1] - 1

    def holder(self, h: int) -> Holder:
        """Holder ``h`` (tensor views of the set's tables: what a kernel call takes)."""
        rows = slice(int(self.offsets[h]), int(self.offsets[h + 1]))
        return Holder(torch.from_numpy(self.cu[h]), torch.from_numpy(self.pos[rows]),
                      self.max_len[h])

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cu int64 [H, n_seg+1], pos int64 [N], offsets int64 [H+1]): the searches'
        operands in int64 (a sort key holds a position in its low 32 bits; the masks'
        intervals may reach past int32), made once per set."""
        return (self.cu.astype(np.int64), self.pos.astype(np.int64), self.offsets)

    @cached_property
    def _lengths(self) -> np.ndarray:
        """int64 [H * n_seg]: tokens of every (holder, segment) cell."""
        cu = self._arrays[0]
        return (cu[:, 1:] - cu[:, :-1]).ravel()

    @cached_property
    def _cells(self) -> np.ndarray:
        """int64 [N]: holder * n_seg + segment of every row."""
        lens = self._lengths
        return np.repeat(np.arange(lens.size, dtype=np.int64), lens)

    @cached_property
    def _padding(self) -> np.ndarray | None:
        """Rows with a position < 0 (None when there are none: most layouts)."""
        pad = np.flatnonzero(self._arrays[1] < 0)
        return pad if pad.size else None

    @cached_property
    def keys(self) -> np.ndarray:
        """int64 [N]: (holder * n_seg + segment) << 32 | position (padding: all ones):
        sorted, since positions increase inside a segment and padding comes last."""
        if len(self.max_len) * self.n_seg >= 1 << 30:
            raise ValueError(f"HolderSet: {len(self.max_len)} holders x {self.n_seg} "
                             f"documents is too many for the 64-bit sort keys")
        pos = self._arrays[1]
        # the cell ids shifted before they are repeated, the positions added in place: one
        # array of N made instead of three (0.73 vs 1.14 ms at 124K rows here)
        cells = np.arange(self._lengths.size, dtype=np.int64) << _POS_BITS
        keys = np.repeat(cells, self._lengths)
        keys += pos
        if self._padding is not None:
            keys[self._padding] += _PAD_KEY - pos[self._padding]
        return keys

    def pieces(self, h: int, chunk: int) -> tuple[np.ndarray, ...]:
        """Holder ``h``'s runs of consecutive positions, cut at chunk edges
        (``flash_form.query_pieces``; rows relative to the holder), cached per chunk."""
        cache = self.__dict__.setdefault("_pieces", {})
        if (h, chunk) not in cache:
            cu, pos, offsets = self._arrays
            cache[h, chunk] = query_pieces(cu[h], pos[offsets[h]:offsets[h + 1]], chunk)
        return cache[h, chunk]

    def first_at(self, holder: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Row in ``pos`` of the first token of (holder, segment) at a position >= ``pos``
        (past the cell's last real token when none is)."""
        base = (holder * self.n_seg + seg) << _POS_BITS
        return np.searchsorted(self.keys, base + np.clip(pos, 0, _MAX_POS))

    def last_at(self, holder: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Row in ``pos`` of the last token of (holder, segment) at a position <= ``pos``
        (before the cell's first token when none is)."""
        base = (holder * self.n_seg + seg) << _POS_BITS
        return np.searchsorted(self.keys, base + np.clip(pos, -1, _MAX_POS), side="right") - 1

    def first_row(self, holder: np.ndarray, seg: np.ndarray) -> np.ndarray:
        """Row in ``pos`` of the first token of (holder, segment)."""
        cu, _, offsets = self._arrays
        return offsets[holder] + cu[holder, seg]

    def block_ends(self, block: int) -> tuple[np.ndarray, ...]:
        """Every holder's non-empty blocks of ``block`` rows per segment, holder by holder:
        (holder, segment, block index, rows in the block, first real row, last real row)
        with rows absolute in ``pos``; a block without real rows has first > last.
        Cached per block size."""
        cache = self.__dict__.setdefault("_block_ends", {})
        if block not in cache:
            length = self._lengths                                      # [H * n_seg]
            real = length
            if self._padding is not None:  # padding trails each segment
                real = length - np.bincount(self._cells[self._padding],
                                            minlength=length.size)
            count = -(-length // block)
            cell = np.repeat(np.arange(length.size, dtype=np.int64), count)
            b = np.arange(cell.size, dtype=np.int64) - (np.cumsum(count) - count)[cell]
            lo = b * block
            holder = cell // self.n_seg
            seg = cell - holder * self.n_seg
            start = self.first_row(holder, seg)
            rows = np.minimum(lo + block, length[cell]) - lo
            last = np.minimum(lo + block, real[cell]) - 1
            per_holder = np.bincount(holder, minlength=len(self.max_len))
            bounds = np.concatenate([[0], np.cumsum(per_holder)]).astype(np.int64)
            cache[block] = (holder, seg, b, rows, start + lo, start + last, bounds)
        return cache[block]

    def blocks_of(self, block: int, holders: np.ndarray) -> tuple[np.ndarray, ...]:
        """The live blocks of the listed holders, concatenated in that order: (index in
        ``holders``, segment, block index, rows, first real row, last real row)."""
        h, seg, b, rows, first, last, bounds = self.block_ends(block)
        count = bounds[holders + 1] - bounds[holders]
        which = np.repeat(np.arange(holders.size, dtype=np.int64), count)
        idx = np.arange(which.size, dtype=np.int64) - (np.cumsum(count) - count)[which] \
            + bounds[holders][which]
        live = first[idx] <= last[idx]
        idx, which = idx[live], which[live]
        return which, seg[idx], b[idx], rows[idx], first[idx], last[idx]


def _search(src: HolderSet, seg: np.ndarray, first: np.ndarray, last: np.ndarray,
            dst: HolderSet, dst_holder: np.ndarray, interval) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) offsets, in its segment of holder ``dst_holder[i]`` of ``dst``, of the
    rows whose positions fall in the union of block i's row intervals (segment ``seg[i]``,
    rows ``first[i]``..``last[i]`` of ``src``): [lo(first real row), hi(last real row)],
    as both interval ends never decrease with the position."""
    pos = src._arrays[1]
    lo, _ = interval(pos[first])
    _, hi = interval(pos[last])
    at = dst.first_row(dst_holder, seg)
    start = dst.first_at(dst_holder, seg, lo) - at
    end = dst.last_at(dst_holder, seg, hi) + 1 - at
    end = np.maximum(end, start)
    empty = lo > hi
    return np.where(empty, 0, start), np.where(empty, 0, end)


def _put(table: np.ndarray, slot: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
    """``table[slot] = (start, end)``, one column at a time: ~2x faster than scattering a
    stacked [n, 2] copy (no int64 temporary; 83 vs 155 us at 15K entries)."""
    table[slot, 0] = start
    table[slot, 1] = end


def call_schedules(qset: HolderSet, q: int, kset: HolderSet, ks: list[int], mask: AttnMask,
                   block: tuple[int, int]) -> list[BlockSchedule]:
    """The tile schedules of the calls (holder ``q`` of ``qset``) x (holder ``k`` of
    ``kset``) for every k in ``ks``: what ``build_block_schedule`` computes from per-token
    tables, from per-block interval ends and sorted keys, all calls at once
    (O(blocks log tokens), a fixed number of ops for any number of calls)."""
    bm, bn = block
    n_seg, n = qset.n_seg, len(ks)
    kt = np.asarray(ks, dtype=np.int64)
    keys_of, queries_of = mask.key_interval, mask.query_interval   # numpy in, numpy out
    # kv_range: the query blocks are the same for every call.
    _, seg, b, rows, first, last = qset.blocks_of(bm, np.array([q], dtype=np.int64))
    nqb = -(-max(qset.max_len[q], 1) // bm)
    m = seg.size
    seg_n, first_n, last_n = np.tile(seg, n), np.tile(first, n), np.tile(last, n)
    dst = np.repeat(kt, m)
    start, end = _search(qset, seg_n, first_n, last_n, kset, dst, keys_of)
    kv = np.zeros((n, n_seg * nqb, 2), dtype=np.int32)
    slot = np.repeat(np.arange(n, dtype=np.int64), m) * (n_seg * nqb) + np.tile(seg * nqb + b, n)
    _put(kv.reshape(-1, 2), slot, start, end)
    # Full ranges: the keys that every real row sees, [lo(last row), hi(first row)] (the
    # same search with the rows swapped); the kernels run those tiles without a mask.
    fstart, fend = _search(qset, seg_n, last_n, first_n, kset, dst, keys_of)
    kv_full = np.zeros(kv.shape, dtype=np.int32)   # calloc: zeros_like writes every byte
    _put(kv_full.reshape(-1, 2), slot, fstart, fend)
    visited = (np.tile(rows, n) * (end - start)).reshape(n, -1).sum(1).tolist() if n else []
    # q_range: each call's key blocks, against the one query holder.
    which, kseg, kb, _, kfirst, klast = kset.blocks_of(bn, kt)
    mine = np.full(kseg.size, q, dtype=np.int64)
    qstart, qend = _search(kset, kseg, kfirst, klast, qset, mine, queries_of)
    nkb = np.array([-(-max(kset.max_len[k], 1) // bn) for k in ks], dtype=np.int64)
    size = n_seg * nkb
    at = np.cumsum(size) - size
    q_range = np.zeros((int(size.sum()), 2), dtype=np.int32)
    kslot = at[which] + kseg * nkb[which] + kb
    _put(q_range, kslot, qstart, qend)
    fstart, fend = _search(kset, kseg, klast, kfirst, qset, mine, queries_of)
    q_full = np.zeros(q_range.shape, dtype=np.int32)
    _put(q_full, kslot, fstart, fend)
    # Work lists from the live blocks listed above, not from a scan of every table entry
    # (the tables are n_seg x blocks: at 1K documents that scan cost ~2 ms per call).
    q_tiles = work_lists(np.repeat(np.arange(n, dtype=np.int64), m), np.tile(seg * nqb + b, n),
                         end - start, n)
    k_tiles = work_lists(which, kseg * nkb[which] + kb, qend - qstart, n)
    kv, kv_full = torch.from_numpy(kv), torch.from_numpy(kv_full)
    q_range, q_full = torch.from_numpy(q_range), torch.from_numpy(q_full)
    out = []
    for i in range(n):
        rows_i = slice(int(at[i]), int(at[i] + size[i]))
        shape = (n_seg, int(nkb[i]), 2)
        # Padding trails each segment and the searches stop before it: no visited range
        # holds padding, so the kernels bound their loads by the ranges alone.
        out.append(BlockSchedule(bm, bn, kv[i].view(n_seg, nqb, 2),
                                 q_range[rows_i].view(shape), int(visited[i]),
                                 kv_full=kv_full[i].view(n_seg, nqb, 2),
                                 q_full=q_full[rows_i].view(shape), q_tiles=q_tiles[i],
                                 k_tiles=k_tiles[i], padded=False))
    return out


def rank_holder(plan: CPPlan, rank: int) -> Holder:
    """Holder of ``rank``'s local tokens (views of the plan's tables)."""
    return Holder(plan.local_cu_seqlens_of(rank), plan.positions_of(rank),
                  plan.max_local_seqlen_of(rank))


def rank_set(plan: CPPlan) -> HolderSet:
    """Every rank's local tokens as one HolderSet (the plan's numpy tables as they are,
    cached)."""
    t = plan.arrays
    return host_table(plan, table_key("rank_set"),
                      lambda: HolderSet(t.local_cu, t.position, t.rank_offsets,
                                        plan.max_local_seqlens()))


def call_forms(qset: HolderSet, q: int, kset: HolderSet, ks: list[int], mask: AttnMask,
               route: FlashRoute) -> list[FlashForm | None]:
    """FlashAttention's form of each call (holder ``q`` of ``qset``) x (holder k of
    ``kset``), None where it is not exact (``flash_form``), all calls at once."""
    offsets, k_off = qset._arrays[2], kset._arrays[2]
    ranges = [(k, int(k_off[k]), int(k_off[k + 1] - k_off[k])) for k in ks]
    return flash_forms(int(offsets[q + 1] - offsets[q]), qset.pieces(q, mask.chunk_size or 0),
                       kset, ranges, mask, route)


def set_calls(qset: HolderSet, q: int, kset: HolderSet, ks: list[int], mask: AttnMask,
              block: tuple[int, int], route: FlashRoute | None = None) -> list[KernelCall]:
    """The calls (holder ``q`` of ``qset``) x (each holder of ``kset`` in ``ks``): with a
    ``route``, in FlashAttention's form wherever it is exact (:func:`call_forms`); the
    others' tile schedules computed together (:func:`call_schedules`)."""
    qh = qset.holder(q)
    forms = call_forms(qset, q, kset, ks, mask, route) if route else [None] * len(ks)
    rest = [k for k, form in zip(ks, forms) if form is None]
    schedules = iter(call_schedules(qset, q, kset, rest, mask, block) if rest else [])
    out = []
    for k, form in zip(ks, forms):
        kh = kset.holder(k)
        sched = next(schedules) if form is None else None
        out.append(KernelCall(qh.cu, kh.cu, qh.max_len, kh.max_len, qh.pos, kh.pos, sched,
                              form))
    return out


def rank_holders(plan: CPPlan) -> list[Holder]:
    """Every rank's holder, cached in the plan."""
    return host_table(plan, table_key("rank_holders"),
                      lambda: [rank_holder(plan, r) for r in range(plan.cp_size)])


def holder_from_counts(doc, pos, n_docs: int) -> Holder:
    """Holder of tokens listed in (doc, position) order (torch tensors or numpy arrays):
    cu from per-document counts."""
    doc, pos = np.asarray(doc), np.asarray(pos)
    counts = np.bincount(doc, minlength=n_docs)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    max_len = int(counts.max()) if counts.size else 0
    return Holder(torch.from_numpy(cu), torch.from_numpy(pos.astype(np.int32, copy=False)),
                  max_len)


@dataclass(frozen=True)
class KernelCall:
    """Everything but the tensors of one varlen kernel call (host or device copies): the
    call on positions (our kernels: cu_seqlens, positions and a tile schedule) or, where
    it is exact, the same call in FlashAttention's form (``flash``; then no schedule)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    schedule: BlockSchedule | None
    flash: FlashForm | None = None

    @property
    def visited_pairs(self) -> int:
        """Pairs the kernels compute: the tiles' (ours) or the visible ones (FA)."""
        return self.flash.pairs if self.flash is not None else self.schedule.visited_pairs

    def to(self, device: torch.device) -> "KernelCall":
        """Copy the tables (the schedule's or the FA form's) to ``device`` once, without a
        sync: one non_blocking copy from a pinned, reused staging buffer (``to_device``)."""
        if self.flash is not None:   # FlashAttention reads its own tables only
            return KernelCall(self.cu_q, self.cu_k, self.max_q, self.max_k, self.q_pos,
                              self.k_pos, None, self.flash.to(device))
        s = self.schedule
        cu_q, cu_k, q_pos, k_pos, *tables = to_device(
            [self.cu_q, self.cu_k, self.q_pos, self.k_pos, *s.tables()], device)
        return KernelCall(cu_q, cu_k, self.max_q, self.max_k, q_pos, k_pos,
                          s.with_tables(tables))


def block_schedule(q: Holder, k: Holder, mask: AttnMask, block: tuple[int, int]
                   ) -> BlockSchedule:
    """The tile schedule of the one call ``q`` x ``k`` (see :func:`call_schedules`)."""
    return call_schedules(q.as_set, 0, k.as_set, [0], mask, block)[0]


def kernel_call(q: Holder, k: Holder, mask: AttnMask, block: tuple[int, int],
                route: FlashRoute | None = None) -> KernelCall:
    """Host tables (FA form where exact with a ``route``, else the tile schedule) of the
    call ``q`` holder x ``k`` holder."""
    return set_calls(q.as_set, 0, k.as_set, [0], mask, block, route)[0]
