"""Attention between rows described by (document, position): the graph-safe mode's kernel
calls, on either backend.

The graph-safe strategies (``varlen_cp.strategies.static``) hand every call whole buffers
(capacity rows per rank) and each row's document and position as device tensors; a row with
a negative document or position (padding, an unused slot) sees nothing and is seen by
nothing. What a call does
on the device must not depend on the batch, so both backends take only these tables:

- "torch" (``kernels.dense``): every query row against every key row, quadratic in the
  capacity. The CPU kernel (and the reference the tests compare with).
- "triton" (``kernels.triton_rows``): one program per block of the buffer and head; each
  block visits the key rows its queries can see, found on the device in the key side
  sorted by (document, position). A side whose rows are already in that order (every
  rank's rows of a plan are: its documents in order, each document's positions rising)
  is used as it is; a side made of several ranks' rows (gathered keys, Ulysses' rows, the
  dispatch's received keys) is sorted on the device (one ``argsort`` of a fixed length per
  call). The ranges are ``searchsorted`` over those keys. Everything has the buffers'
  shapes: the same launches and sizes for every batch.

A :class:`RowsKernel` (mask, backend, block sizes) is fixed per layer; :meth:`RowsKernel.call`
builds one call's geometry (:class:`RowsCall`), which both the forward and the backward use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dense import dense_bwd, dense_fwd, dense_visible
from .mask_math import key_interval, query_interval

ROWS_BACKENDS = ("torch", "triton")
"""The kernels of graph-safe calls: "torch" (dense, any device), "triton" (CUDA, or the
interpreter)."""

_LOW = 32            # a sort key: document << 32 | position (positions are < 2**30)
_LAST = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class RowsKernel:
    """How one layer's graph-safe calls compute: ``mask_args`` = (causal, window_left,
    window_right, chunk_size) (``AttnMask.params``), ``backend`` one of
    :data:`ROWS_BACKENDS`, ``block_sizes`` the Triton tiles (None: the default for the
    dtype, head dims and GPU)."""

    mask_args: tuple
    backend: str
    block_sizes: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.backend not in ROWS_BACKENDS:
            raise ValueError(f"backend must be one of {ROWS_BACKENDS}, got {self.backend!r}")

    def side(self, rows: "tuple | RowsSide", *, in_order: bool) -> "RowsSide":
        """``rows`` (documents, positions) prepared as one side of calls: a layer whose
        calls share a side (a ring's queries) prepares it once."""
        return rows if isinstance(rows, RowsSide) else RowsSide(rows, in_order)

    def call(self, q: torch.Tensor, v: torch.Tensor, q_rows: "tuple | RowsSide",
             k_rows: "tuple | RowsSide", *, q_sorted: bool, k_sorted: bool) -> "RowsCall":
        """The geometry of one call of ``q``'s rows (documents and positions ``q_rows``, or
        a prepared :meth:`side`) against keys ``k_rows``; ``*_sorted``: that side's rows are
        in (document, position) order already (padding rows anywhere), else it is sorted on
        the device. The same rows for both sides (Ulysses) are prepared once."""
        q_side = self.side(q_rows, in_order=q_sorted)
        k_side = q_side if k_rows is q_rows and k_sorted == q_sorted else \
            self.side(k_rows, in_order=k_sorted)
        return RowsCall(self, q, v, q_side, k_side)


class RowsSide:
    """One side of calls (its rows' documents and positions, padding marked by
    :func:`real_rows`), with what the Triton calls derive from it made once and kept: the
    rows in (document, position) order, their search keys, and per (mask, block, role) the
    blocks' key bounds. Only the search against the other side is per call."""

    def __init__(self, rows: tuple, in_order: bool) -> None:
        self.rows = real_rows(*rows)
        self.in_order = in_order
        self._sorted: tuple | None = None
        self._keys: torch.Tensor | None = None
        self._bounds: dict = {}

    @property
    def sorted(self) -> tuple:
        """int32 (doc, pos, idx) in (document, position) order (:func:`sorted_side`)."""
        if self._sorted is None:
            self._sorted = sorted_side(*self.rows, self.in_order)
        return self._sorted

    @property
    def search_keys(self) -> torch.Tensor:
        """Non-decreasing int64 keys of the sorted rows (:func:`_searchable`)."""
        if self._keys is None:
            self._keys = _searchable(self.sorted)
        return self._keys

    def bounds(self, mask_args: tuple, block: int, queries: bool) -> tuple:
        """(lo_key, hi_key, empty) per block of the sorted rows (:func:`_block_bounds`)."""
        key = (mask_args, block, queries)
        if key not in self._bounds:
            self._bounds[key] = _block_bounds(self.sorted, mask_args, block, queries)
        return self._bounds[key]


class RowsCall:
    """One call's tables: the visibility matrix ("torch", made at the first use and kept
    for the backward), or the two sides and the per-block ranges ("triton", the key
    blocks' ranges made at the first backward)."""

    def __init__(self, kernel: RowsKernel, q: torch.Tensor, v: torch.Tensor,
                 q_side: RowsSide, k_side: RowsSide) -> None:
        self.kernel = kernel
        self.sides = (q_side, k_side)
        self._seen: torch.Tensor | None = None
        if kernel.backend == "torch":
            return
        from .triton_rows import rows_blocks
        self.blocks = rows_blocks(q.dtype, q.shape[2], v.shape[2], q.device,
                                  kernel.block_sizes)
        self.q_side, self.k_side = q_side.sorted, k_side.sorted
        self.q_ranges = block_ranges(q_side, k_side, kernel.mask_args, self.blocks[0],
                                     queries=True)
        self._k_ranges: tuple | None = None

    @property
    def seen(self) -> torch.Tensor:
        """bool [Tq, Tk] ("torch"): which pairs are visible."""
        if self._seen is None:
            (q_doc, q_pos), (k_doc, k_pos) = self.sides[0].rows, self.sides[1].rows
            self._seen = dense_visible(q_doc, q_pos, k_doc, k_pos, *self.kernel.mask_args)
        return self._seen

    @property
    def k_ranges(self) -> tuple:
        if self._k_ranges is None:
            self._k_ranges = block_ranges(self.sides[1], self.sides[0],
                                          self.kernel.mask_args, self.blocks[1],
                                          queries=False)
        return self._k_ranges

    def fwd(self, q, k, v, scale: float, need_max: bool):
        """(out fp32 [Tq, Hq, Dv], lse fp32 [Hq, Tq], row max or None)."""
        if self.kernel.backend == "torch":
            return dense_fwd(q, k, v, self.seen, scale, need_max)
        from .triton_rows import rows_fwd
        return rows_fwd(q, k, v, self.q_side, self.k_side, self.q_ranges,
                        self.kernel.mask_args, scale, self.blocks, return_max=need_max)

    def bwd(self, dout, q, k, v, out, lse, dlse, scale: float):
        """fp32 (dq, dk, dv) given the FINAL out and lse of the query rows."""
        if self.kernel.backend == "torch":
            return dense_bwd(dout, q, k, v, out, lse, dlse, self.seen, scale)
        from .triton_rows import rows_bwd
        return rows_bwd(dout, q, k, v, out, lse, dlse, self.q_side, self.k_side,
                        self.q_ranges, self.k_ranges, self.kernel.mask_args, scale,
                        self.blocks)


def _keys(doc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """int64 (document, position) sort keys; -1 on padding rows."""
    key = (doc.to(torch.int64) << _LOW) | pos.to(torch.int64).clamp(min=0)
    return torch.where(doc >= 0, key, -1)


def real_rows(doc: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc, pos) with every row of a negative document or position marked padding
    (document -1), so that both backends agree on which rows are real; both are new
    tensors, so a call (kept for its backward) never reads buffers refreshed in place."""
    return torch.where(pos >= 0, doc, -1).to(torch.int32), pos.to(torch.int32, copy=True)


def sorted_side(doc: torch.Tensor, pos: torch.Tensor, in_order: bool) -> tuple:
    """int32 (doc, pos, idx) of a side's rows in (document, position) order: ``idx[j]`` is
    the buffer row of sorted row j. ``in_order``: the rows are sorted already (padding rows
    may lie anywhere; they stay where they are), else a stable ``argsort`` puts them in
    order, padding last. ``doc``, ``pos``: tensors of the call's own (:func:`real_rows`)."""
    if in_order:
        idx = torch.arange(doc.numel(), dtype=torch.int32, device=doc.device)
        return doc.to(torch.int32), pos.to(torch.int32), idx
    key = _keys(doc, pos)
    order = torch.argsort(torch.where(key >= 0, key, _LAST), stable=True)
    return doc[order].to(torch.int32), pos[order].to(torch.int32), order.to(torch.int32)


def _searchable(side: tuple) -> torch.Tensor:
    """The side's sort keys made non-decreasing: a padding row takes the key before it,
    rows after the last real one sort last."""
    key = _keys(side[0], side[1])
    key = torch.cummax(key, 0).values
    at = torch.arange(key.numel(), device=key.device)
    last = torch.where(side[0] >= 0, at, -1).amax() if key.numel() else at.new_tensor(-1)
    return torch.where(at > last, _LAST, key)


def _block_bounds(side: tuple, mask_args: tuple, block: int, queries: bool) -> tuple:
    """(lo_key, hi_key, empty) per block of the sorted ``side``: the (document, position)
    keys from the block's first real row's low end to its last one's high end (both ends
    never decrease along a document, ``mask_math``); ``empty``: no real row."""
    doc, pos = side[0], side[1]
    n = doc.numel()
    nb = -(-n // block)
    pad = nb * block - n
    d = torch.nn.functional.pad(doc.to(torch.int64), (0, pad), value=-1).view(nb, block)
    p = torch.nn.functional.pad(pos.to(torch.int64), (0, pad), value=-1).view(nb, block)
    real = d >= 0
    key = (d << _LOW) | p.clamp(min=0)
    first = torch.where(real, key, _LAST).amin(1)
    last = torch.where(real, key, -1).amax(1)
    low = (1 << _LOW) - 1
    interval = key_interval if queries else query_interval
    lo_pos = interval(first & low, *mask_args)[0].clamp(0, low)
    hi_pos = interval(last & low, *mask_args)[1].clamp(0, low)
    lo_key = ((first >> _LOW) << _LOW) | lo_pos
    hi_key = ((last >> _LOW) << _LOW) | hi_pos
    return lo_key, hi_key, ~real.any(1)


def block_ranges(side: RowsSide, other: RowsSide, mask_args: tuple, block: int, *,
                 queries: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (lo, hi) [cdiv(rows, block)]: the rows of ``other`` (in its sorted order) that
    the rows of each block of ``side`` can meet. ``queries``: ``side`` holds the queries
    (``other`` the keys), else the keys. From the block's first real row's low end to its
    last one's high end in (document, position) order: every document in between lies
    wholly inside. A block without a real row gets (0, 0)."""
    lo_key, hi_key, empty = side.bounds(mask_args, block, queries)
    keys = other.search_keys
    lo = torch.searchsorted(keys, lo_key)
    hi = torch.maximum(torch.searchsorted(keys, hi_key, right=True), lo)
    lo = torch.where(empty, 0, lo)
    hi = torch.where(empty, 0, hi)
    return lo.to(torch.int32), hi.to(torch.int32)
