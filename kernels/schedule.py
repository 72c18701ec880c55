"""Host-side block schedule: which key range each query block visits, and back.

Built from host tensors only (cu_seqlens and positions on the CPU), so it is the place where
"skip tiles with nothing visible" is decided without a device sync. Both backends read it:
the torch twin always builds one (its inputs live on the host), the Triton kernels use one
when the caller passes it (the CP plan does) and otherwise bound tiles on the device.

Ranges are offsets relative to the segment start, half-open ``[start, end)``. They are exact
when positions are non-decreasing inside each segment (padding tokens aside), which every
layout of the plan guarantees; otherwise the whole segment is visited and the per-element
mask inside the kernel keeps the result exact.

Besides the visited ranges the schedule holds, per block, the *full* range: the keys (or
queries) that every real row of the block sees, with no padding token among them. Tiles
inside it run without per-element masks (most tiles of a long document); the kernels mask
only the tiles at the range's ends. It also lists the non-empty blocks, longest first: the
Triton kernels launch one program per listed block and head (a work list, not a
max_seqlen x segments grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .host_copy import to_device
from .mask_math import UNBOUNDED, implicit_positions, key_interval, query_interval

# Segment keys are spread this far apart so one searchsorted serves every segment at once.
_SEGMENT_STRIDE = 1 << 42


def work_list(ranges: torch.Tensor) -> torch.Tensor:
    """int32 flat indices ``segment * n_blocks + block`` of the blocks whose range
    ``[start, end)`` is not empty, longest range first (ties in block order): the order the
    kernels' programs start in, so the longest tiles do not trail the launch."""
    span = (ranges[..., 1].to(torch.int64) - ranges[..., 0]).flatten()
    return work_lists(torch.zeros_like(span), torch.arange(span.numel()), span, 1)[0]


def work_lists(call, flat, span, n_calls: int) -> list[torch.Tensor]:
    """:func:`work_list` of several calls at once from their blocks' entries (call index,
    flat block index, range length; int64 host tensors or numpy arrays), e.g. only the live
    blocks a planner has listed: one sort for all calls, O(entries log entries) instead of
    a scan of every table. Numpy inside (a planner calls this per call set: ~5 small ops,
    each ~5x cheaper than torch's on CPU); int32 torch tensors out."""
    if n_calls == 0:
        return []
    call, flat, span = (np.asarray(x, dtype=np.int64) for x in (call, flat, span))
    live = span > 0
    call, flat, span = call[live], flat[live], span[live]
    order = np.argsort(call * (int(span.max()) + 1 if span.size else 1) - span, kind="stable")
    counts = np.bincount(call, minlength=n_calls)
    parts = np.split(flat[order].astype(np.int32), np.cumsum(counts)[:-1])
    return [torch.from_numpy(part) for part in parts]


@dataclass(frozen=True)
class BlockSchedule:
    """Per-block visit ranges for one (q, k) varlen call.

    kv_range: int32 [n_seg, cdiv(max_seqlen_q, block_m), 2] key offsets per query block.
    q_range:  int32 [n_seg, cdiv(max_seqlen_k, block_n), 2] query offsets per key block.
    visited_pairs: query-key pairs the ranges cover (computed area, for tile efficiency).
    kv_full / q_full: like kv_range / q_range, the sub-range that every real row of the
    block sees, free of padding (None: unknown, every tile is masked).
    q_tiles / k_tiles: int32 work lists of the non-empty query / key blocks
    (:func:`work_list`); made from the ranges when they are host tensors and not given.
    padded: whether a padding token (position < 0) may lie inside a visited range; the
    kernels then mask loads by position, not by range alone.
    """

    block_m: int
    block_n: int
    kv_range: torch.Tensor
    q_range: torch.Tensor
    visited_pairs: int
    kv_full: torch.Tensor | None = None
    q_full: torch.Tensor | None = None
    q_tiles: torch.Tensor | None = None
    k_tiles: torch.Tensor | None = None
    padded: bool = True

    def __post_init__(self):
        for name, ranges in (("q_tiles", self.kv_range), ("k_tiles", self.q_range)):
            if getattr(self, name) is None and ranges.device.type == "cpu":
                object.__setattr__(self, name, work_list(ranges))

    def to(self, device: torch.device | str) -> "BlockSchedule":
        """Copy the tables to ``device`` without waiting on the host: one non_blocking copy
        from a pinned, reused staging buffer (``host_copy.to_device``)."""
        return self.with_tables(to_device(self.tables(), device))

    def tables(self) -> list[torch.Tensor | None]:
        """The schedule's tensors, in the order :meth:`with_tables` takes them."""
        return [self.kv_range, self.q_range, self.kv_full, self.q_full, self.q_tiles,
                self.k_tiles]

    def with_tables(self, t: list[torch.Tensor | None]) -> "BlockSchedule":
        """This schedule with its tensors replaced (e.g. by their device copies)."""
        return BlockSchedule(self.block_m, self.block_n, t[0], t[1], self.visited_pairs,
                             t[2], t[3], t[4], t[5], self.padded)


def segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: segment of each row of a varlen batch with boundaries ``cu``."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=total)


def _block_bounds(lo, hi, seg, offset, n_blocks, block, n_seg, rows=None):
    """Per (segment, block) of rows: (min lo, max hi) over the rows with a non-empty
    interval (the union, what the block visits), or with ``rows`` (a mask of the real
    rows) (max lo, min hi) over them (the intersection, what every real row sees)."""
    slot = seg * n_blocks + torch.div(offset, block, rounding_mode="floor")
    blo = torch.full((n_seg * n_blocks,), UNBOUNDED, dtype=torch.int64)
    bhi = torch.full((n_seg * n_blocks,), -UNBOUNDED, dtype=torch.int64)
    if rows is None:
        live = lo <= hi  # rows with an empty interval (padding) do not widen the block
        blo.scatter_reduce_(0, slot[live], lo[live], "amin")
        bhi.scatter_reduce_(0, slot[live], hi[live], "amax")
    else:  # a real row that sees nothing empties the intersection; blocks without rows stay empty
        blo.scatter_reduce_(0, slot[rows], lo[rows], "amax", include_self=False)
        bhi.scatter_reduce_(0, slot[rows], hi[rows], "amin", include_self=False)
    return blo, bhi


def _ranges_in(pos, seg, cu, n_seg, blo, bhi, n_blocks):
    """Offsets [start, end) of the tokens (per segment) whose position lies in [blo, bhi]."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    starts = cu[:-1].to(torch.int64)
    block_seg = torch.arange(n_seg).repeat_interleave(n_blocks)
    empty = blo > bhi
    # Padding (< 0) takes the previous valid key so the per-segment keys stay sorted.
    key = torch.where(pos >= 0, pos, torch.full_like(pos, -1)) + seg * _SEGMENT_STRIDE
    key = torch.cummax(key, 0).values if key.numel() else key
    if _sorted(pos, seg):
        lo_key = torch.clamp(blo, min=-1) + block_seg * _SEGMENT_STRIDE
        hi_key = torch.clamp(bhi, max=UNBOUNDED) + block_seg * _SEGMENT_STRIDE
        start, end = _trim_padding(pos, torch.searchsorted(key, lo_key),
                                   torch.searchsorted(key, hi_key, right=True))
        start, end = start - starts[block_seg], end - starts[block_seg]
    else:  # unsorted positions: visit the whole segment, the kernel's mask stays exact
        start = torch.zeros_like(blo)
        end = lens[block_seg].clone()
    start = torch.clamp(start, min=0)
    end = torch.minimum(torch.maximum(end, start), lens[block_seg])
    start = torch.where(empty, 0, start)
    end = torch.where(empty, 0, end)
    return torch.stack([start, end], dim=-1).to(torch.int32).view(n_seg, n_blocks, 2)


def _trim_padding(pos, start, end):
    """Absolute ranges [start, end) shrunk to their first and last real token: padding at
    a range's ends is never visible, and a range that holds none lets the kernels bound
    their loads by the range alone (as the CP holders' ranges do)."""
    n = pos.numel()
    if n == 0:
        return start, end
    idx = torch.arange(n)
    last_real = torch.cummax(torch.where(pos >= 0, idx, -1), 0).values
    next_real = torch.flip(torch.cummin(torch.flip(torch.where(pos >= 0, idx, n), [0]), 0)
                           .values, [0])
    live = end > start
    new_end = last_real[(end - 1).clamp(0, n - 1)] + 1
    new_start = next_real[start.clamp(0, n - 1)]
    end = torch.where(live, new_end, end)
    start = torch.where(live, torch.minimum(new_start, end), start)
    return start, torch.maximum(end, start)


def _sorted(pos, seg) -> bool:
    """Whether the real positions (>= 0) never decrease inside a segment."""
    raw = (pos + seg * _SEGMENT_STRIDE)[pos >= 0]
    return bool((raw[1:] >= raw[:-1]).all()) if raw.numel() else True


def _padding_inside(ranges, cu, padding):
    """bool [n_seg, n_blocks]: whether a padding token lies inside each block's range."""
    if padding is None or not bool(padding.any()):
        return torch.zeros(ranges.shape[:2], dtype=torch.bool)
    count = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padding.long(), 0)])
    first = cu[:-1].to(torch.int64)[:, None]
    r = ranges.to(torch.int64)
    return (count[first + r[..., 1]] - count[first + r[..., 0]]) > 0


def _full_ranges(pos, seg, cu, n_seg, flo, fhi, n_blocks, padding):
    """The full ranges: from the first to the last real token whose position lies in
    [flo, fhi] (what every real row of the block sees), empty when a padding token lies
    between them or positions are unsorted (then nothing is known to be fully visible)."""
    real = torch.nonzero(pos >= 0).flatten()
    empty_out = torch.zeros(n_seg, n_blocks, 2, dtype=torch.int32)
    if real.numel() == 0 or not _sorted(pos, seg):
        return empty_out
    key = pos[real] + seg[real] * _SEGMENT_STRIDE
    block_seg = torch.arange(n_seg).repeat_interleave(n_blocks)
    a = torch.searchsorted(key, torch.clamp(flo, min=0) + block_seg * _SEGMENT_STRIDE)
    b = torch.searchsorted(key, torch.clamp(fhi, max=UNBOUNDED) + block_seg * _SEGMENT_STRIDE,
                           right=True)
    first = cu[:-1].to(torch.int64)[block_seg]
    start = real[a.clamp(max=real.numel() - 1)] - first
    end = real[(b - 1).clamp(min=0)] + 1 - first
    empty = (flo > fhi) | (b <= a)
    full = torch.stack([torch.where(empty, 0, start), torch.where(empty, 0, end)], dim=-1)
    full = full.to(torch.int32).view(n_seg, n_blocks, 2)
    return torch.where(_padding_inside(full, cu, padding)[..., None], 0, full)


def build_block_schedule(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, *, causal: bool, window_left: int, window_right: int,
    chunk_size: int, q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64,
) -> BlockSchedule:
    """Build the schedule on the host. All tensor arguments must be CPU tensors.

    The tables are sized by ``max_seqlen_q/k`` as given (their shapes are checked against
    the call's values): pass the longest segments, not a loose bound. 10**9 for 14 tokens
    means ~2 GB of empty blocks; the api and the twin pass the exact lengths themselves.
    """
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("q_positions", q_positions), ("k_positions", k_positions)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"build_block_schedule: {name} must be a host (CPU) tensor, "
                             f"got device {t.device}")
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    n_seg = cu_q.numel() - 1
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    implicit_q, implicit_k = implicit_positions(cu_q, cu_k, total_q, total_k)
    q_pos = implicit_q if q_positions is None else q_positions.to(torch.int64)
    k_pos = implicit_k if k_positions is None else k_positions.to(torch.int64)
    q_pad = None if q_positions is None else q_pos < 0
    k_pad = None if k_positions is None else k_pos < 0
    mask = (causal, window_left, window_right, chunk_size)
    seg_q, seg_k = segment_ids(cu_q, total_q), segment_ids(cu_k, total_k)
    off_q = torch.arange(total_q) - cu_q[seg_q]
    off_k = torch.arange(total_k) - cu_k[seg_k]
    nqb = -(-max(max_seqlen_q, 1) // block_m)
    nkb = -(-max(max_seqlen_k, 1) // block_n)

    lo, hi = key_interval(q_pos, *mask, negative_is_padding=q_positions is not None)
    blo, bhi = _block_bounds(lo, hi, seg_q, off_q, nqb, block_m, n_seg)
    kv_range = _ranges_in(k_pos, seg_k, cu_k, n_seg, blo, bhi, nqb)
    real_q = torch.ones(total_q, dtype=torch.bool) if q_pad is None else ~q_pad
    flo, fhi = _block_bounds(lo, hi, seg_q, off_q, nqb, block_m, n_seg, rows=real_q)
    kv_full = _full_ranges(k_pos, seg_k, cu_k, n_seg, flo, fhi, nqb, k_pad)

    qlo, qhi = query_interval(k_pos, *mask)
    if q_positions is not None:  # padding queries (< 0) are never in range
        qlo = torch.where(k_pos >= 0, torch.clamp(qlo, min=0), qlo)
    blo, bhi = _block_bounds(qlo, qhi, seg_k, off_k, nkb, block_n, n_seg)
    # Implicit query positions can be negative (Lq > Lk) without being padding: shift them
    # and their bounds together so the padding rule (< 0) does not drop them.
    shift = max(0, -int(q_pos.min())) if q_positions is None and total_q else 0
    q_range = _ranges_in(q_pos + shift, seg_q, cu_q, n_seg, blo + shift, bhi + shift, nkb)
    real_k = torch.ones(total_k, dtype=torch.bool) if k_pad is None else ~k_pad
    flo, fhi = _block_bounds(qlo, qhi, seg_k, off_k, nkb, block_n, n_seg, rows=real_k)
    q_full = _full_ranges(q_pos + shift, seg_q, cu_q, n_seg, flo + shift, fhi + shift, nkb,
                          q_pad)

    padded = bool(_padding_inside(kv_range, cu_k, k_pad).any()
                  or _padding_inside(q_range, cu_q, q_pad).any())
    rows = torch.bincount(seg_q * nqb + torch.div(off_q, block_m, rounding_mode="floor"),
                          minlength=n_seg * nqb)
    spans = (kv_range[..., 1] - kv_range[..., 0]).to(torch.int64).flatten()
    return BlockSchedule(block_m, block_n, kv_range, q_range, int((rows * spans).sum()),
                         kv_full=kv_full, q_full=q_full, padded=padded)
