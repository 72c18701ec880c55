"""FlashAttention's varlen form of one kernel call, wherever it is exact.

FlashAttention knows only row indices: in a segment of sq query rows and sk key rows, query
row i sees key row j iff ``i + d - left <= j <= i + d + right`` (d = sk - sq, -1 =
unbounded, causal = (-1, 0)), one (left, right) per call. Our calls see keys by position
(``AttnMask`` on each token's position in its document). A call's queries are cut into
*pieces*, runs of consecutive positions of one document (and one chunk), and each piece
gets the key rows its queries see, ``[kl, kh]`` (the keys of the union of their intervals).
Then, with a = the position of row kl and b that of kh, the piece is exact in FA's form iff

- (i) the keys that its queries lose at the left as the position grows, positions
  ``[a, lo(last query) - 1]``, are all present (no gap: each step drops exactly one row);
- (ii) the keys that they gain at the right, positions ``[hi(first query) + 1, b]``, are all
  present (each step adds exactly one row);

after trimming the queries at both ends that see nothing (those go to empty segments). Its
window is then ``left = sk - 1 - L`` (L = rows the last query no longer sees; -1 when 0)
and ``right = H - d`` (H = the last row the first query sees; -1 when it is kh): a run of
queries against a run of keys always qualifies; keys wholly before the queries qualify
(-1, -1) whatever gaps they have; gaps inside a sliding window do not.

Pieces then merge into segments where the merged segment is still exact: equal key rows and
no window (one document's pieces seeing the same keys: TransformerEngine's "second half"
step), or the causal case where the next piece's keys extend the previous piece's by its
own length (a rank's own pieces against its own keys, in position order). Segments are
grouped by window: each distinct window is one FlashAttention call (partials merged by
LSE), and a call whose pieces' key rows overlap (two pieces of one document needing shared
keys, e.g. both of a rank's dual-chunk pieces against a gathered prefix) either *gathers*
its keys into a buffer where they do not (``k_index``: an ``index_select``, whose backward
sums the duplicates in rounds of unique rows: deterministic) or *splits* into calls whose
key rows do not overlap, whichever moves fewer bytes (``FlashRoute``'s row sizes; the
gather costs ~3 passes over the duplicated K/V rows, each extra call an output, its merge
and its dQ/dK/dV). Every call covers every query and key row with a segment (empty ones
where nothing is seen), since FlashAttention never writes rows outside its segments.

A piece that is not exact because a window's edge runs through a gap of the call's keys is
cut where the edge enters or leaves a run of keys (:func:`cut_at_gaps`), and the call tried
again: each sub-piece is then exact, with a window of its own (one per document with such a
gap). Each FlashAttention call is handed only the rows its segments span (``q_span`` /
``k_span``), so these extra calls cost their documents' rows. A call with a piece still not
exact, or that would take more than ``MAX_CALLS`` FlashAttention calls, stays on the Triton
kernels.
All integer math is numpy over pieces (a few per document and call), never per token,
except the one pass over a holder's positions that finds its pieces (cached per holder).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..kernels.host_copy import to_device
from ..masks import AttnMask
from ..plan.runs import run_rows
from .rounds import UniqueRounds

MAX_CALLS = 8
"""Most FlashAttention calls one of our calls may become; beyond that, the Triton kernels
take the call whole. Each extra call writes, merges and back-propagates only the rows its
segments span (``FlashCall.q_span`` / ``k_span``), typically a few documents' worth: the
windows that differ per document (a sliding window over keys with a gap, keys wholly
before the queries) come one per such document, and Llama 4 mixes at cp 8 need up to 6."""


@dataclass(frozen=True)
class FlashRoute:
    """Which FlashAttention-class backend runs a layer's calls, and the row sizes (bytes)
    that decide between gathering and splitting: a query row's q + out, a key row's K + V."""

    backend: str
    q_row_bytes: int
    kv_row_bytes: int

    @classmethod
    def of(cls, backend: str, dtype: torch.dtype, n_heads: int, n_kv_heads: int,
           head_dim: int, head_dim_v: int) -> "FlashRoute":
        """The route of a layer of this head shape: q + out per query row, K + V per key."""
        width = (head_dim + head_dim_v) * dtype.itemsize
        return cls(backend, n_heads * width, n_kv_heads * width)


@dataclass(frozen=True)
class FlashCall:
    """One FlashAttention varlen call (host tensors, or their device copies).

    q_span / k_span: the rows [first, end) of the call's queries and of its key buffer
    that FlashAttention is handed (the rows its segments reach: a call of one window whose
    segments lie in a few documents reads and writes only those rows, so that extra calls
    cost their own rows, not the whole buffer's); cu_q / cu_k: int32 [S+1], relative to
    the spans, covering every row of both; window: (left, right); k_index: None (the
    call's K/V as they are) or int64 rows of them that make the key buffer (a gather with
    duplicates), ``k_rounds`` summing its gradient back; pairs: visible (query, key) pairs
    it computes."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int]
    pairs: int
    q_span: tuple[int, int]
    k_span: tuple[int, int]
    k_index: torch.Tensor | None = None
    k_rounds: UniqueRounds | None = None

    def to(self, device: torch.device) -> "FlashCall":
        cu_q, cu_k, k_index = to_device([self.cu_q, self.cu_k, self.k_index], device)
        return replace(self, cu_q=cu_q, cu_k=cu_k, k_index=k_index,
                       k_rounds=None if self.k_rounds is None else self.k_rounds.to(device))


@dataclass(frozen=True)
class FlashForm:
    """A kernel call as FlashAttention calls: their partials merge by LSE (one call: none)."""

    backend: str
    calls: tuple[FlashCall, ...]

    @property
    def pairs(self) -> int:
        return sum(c.pairs for c in self.calls)

    def to(self, device: torch.device) -> "FlashForm":
        return replace(self, calls=tuple(c.to(device) for c in self.calls))


# ------------------------------------------------------------------------------ pieces
def query_pieces(cu: np.ndarray, pos: np.ndarray, chunk: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(segment, first row, rows, first position) of every run of consecutive positions of
    one segment (and one chunk) among the real rows (position >= 0) of a holder with
    cu_seqlens ``cu`` and positions ``pos`` (int64 numpy)."""
    n = pos.size
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    seg = np.repeat(np.arange(cu.size - 1, dtype=np.int64), np.diff(cu))
    real = pos >= 0
    brk = np.ones(n + 1, dtype=bool)          # brk[r]: a piece cannot go on from r-1 to r
    brk[1:n] = (pos[1:] != pos[:-1] + 1) | (seg[1:] != seg[:-1])
    if chunk:
        brk[:n] |= pos % chunk == 0
    brk[:n] |= ~real
    starts = np.flatnonzero(brk[:n] & real)
    stops = np.flatnonzero(brk[1:] & real) + 1   # last real row of each piece, + 1
    return seg[starts], starts, stops - starts, pos[starts]


# ------------------------------------------------------------------------------- forms
def flash_forms(n_q: int, pieces, keys, k_ranges: list[tuple[int, int, int]],
                mask: AttnMask, route: FlashRoute, refined: bool = False
                ) -> list[FlashForm | None]:
    """The FlashAttention form of each call (the ``n_q`` query rows of one holder x the
    keys of holder ``k_ranges[i]`` = (holder index, first row, rows) of the HolderSet
    ``keys``, whose searches by position, ``first_at`` / ``last_at``, give the rows), or
    None where it is not exact. ``pieces``: :func:`query_pieces` of the query holder. A
    call with a piece that is not exact is tried once more with its pieces cut where the
    window's edges cross a gap between its keys (:func:`cut_at_gaps`; ``refined``: that
    second try)."""
    seg, row0, rows, qs = pieces
    n_calls, m = len(k_ranges), seg.size
    if n_calls == 0:
        return []
    holder = np.repeat(np.array([h for h, _, _ in k_ranges], dtype=np.int64), m)
    seg_n, row_n, rows_n, qs_n = (np.tile(x, n_calls) for x in (seg, row0, rows, qs))
    last = qs_n + rows_n - 1
    lo, _ = mask.key_interval(qs_n)
    _, hi = mask.key_interval(last)
    kl = keys.first_at(holder, seg_n, lo)
    kh = keys.last_at(holder, seg_n, hi)
    live = kl <= kh
    k_pos = keys._arrays[1]
    if not k_pos.size:            # no keys at all: every call sees nothing
        k_pos = np.zeros(1, dtype=np.int64)
    a = np.where(live, k_pos[np.minimum(kl, k_pos.size - 1)], 0)
    b = np.where(live, k_pos[np.clip(kh, 0, k_pos.size - 1)], -1)
    first, _ = mask.query_interval(a)          # the first query that sees key a
    _, final = mask.query_interval(b)          # the last query that sees key b
    t0, t1 = np.maximum(qs_n, first), np.minimum(last, final)
    live &= t0 <= t1
    x, _ = mask.key_interval(t1)               # the left end of the last query
    _, y = mask.key_interval(t0)               # the right end of the first query
    below_x = keys.first_at(holder, seg_n, x) - kl
    upto_y = keys.last_at(holder, seg_n, y)
    left_lost = np.where(x > a, below_x, 0)                       # L of the last query
    exact = (x <= a) | (below_x == x - a)                         # (i)
    exact &= (y >= b) | (kh - upto_y == b - y)                    # (ii)
    sk, sq = kh - kl + 1, t1 - t0 + 1
    first_hi = np.where(y >= b, sk - 1, upto_y - kl)              # H of the first query
    wl, wr = _windows(sk, sq, left_lost, first_hi, mask)
    pairs = _pairs(sq, sk, wl, wr)
    q0 = row_n + (t0 - qs_n)
    k_first = np.array([f for _, f, _ in k_ranges], dtype=np.int64)
    n_k = np.array([r for _, _, r in k_ranges], dtype=np.int64)
    call = np.repeat(np.arange(n_calls), m)
    inexact = np.bincount(call[live & ~exact], minlength=n_calls) > 0
    keep = live & ~inexact[call]
    out: list[FlashForm | None] = [None] * n_calls
    # the calls of one window without overlapping keys, all at once (most calls: a ring
    # at cp 64 makes ~100 per mask); the others one by one
    slow = _one_window_forms(out, call[keep], seg_n[keep], q0[keep], sq[keep],
                             (kl - k_first[call])[keep], sk[keep], wl[keep], wr[keep],
                             pairs[keep], n_q, n_k, route)
    for i in np.flatnonzero(inexact).tolist():
        h, first_row, k_rows = k_ranges[i]
        finer = None if refined else cut_at_gaps(pieces, keys, h, first_row, k_rows, mask)
        out[i] = None if finer is None else \
            flash_forms(n_q, finer, keys, [k_ranges[i]], mask, route, True)[0]
    for i in slow:
        s = keep & (call == i)
        out[i] = _call_form(seg_n[s], q0[s], sq[s], kl[s] - k_first[i], sk[s], wl[s], wr[s],
                            pairs[s], n_q, int(n_k[i]), route)
    return out


def _one_window_forms(out: list, call, seg, q0, sq, k0, sk, wl, wr, pairs, n_q: int,
                      n_k: np.ndarray, route: FlashRoute) -> list[int]:
    """Fill ``out[i]`` for every call ``i`` whose exact pieces (``call``: the call of each,
    in call order) make one FlashAttention call on every row: one window, key rows that do
    not overlap (the same call :func:`_call_form` makes for them, built for all such calls
    with one set of array operations). Calls without pieces get no FA call. Returns the
    calls left for :func:`_call_form`."""
    n_calls = len(out)
    for i in np.flatnonzero(np.bincount(call, minlength=n_calls) == 0).tolist():
        if out[i] is None:
            out[i] = FlashForm(route.backend, ())
    if not call.size:
        return []
    call, q0, sq, k0, sk, wl, wr, pairs = _merge(call, seg, q0, sq, k0, sk, wl, wr, pairs)
    head = np.flatnonzero(np.concatenate([[True], call[1:] != call[:-1]]))  # first segment
    first = np.repeat(head, np.diff(np.concatenate([head, [call.size]])))   # of each call
    k1 = k0 + sk
    big = np.int64(1) << 40            # a running max of the key ends that restarts per call
    reach = np.maximum.accumulate(call * big + k1) - call * big
    later = np.arange(call.size) != first
    clash = later & (k0 < np.concatenate([[0], reach[:-1]]))
    clash |= (wl != wl[first]) | (wr != wr[first])
    bad = np.bincount(call[clash], minlength=n_calls) > 0
    calls = np.unique(call)
    slow = calls[bad[calls]].tolist()
    ok = ~bad[call]
    if not ok.any():
        return slow
    call, q0, sq, k0, sk, wl, wr, pairs = (x[ok] for x in (call, q0, sq, k0, sk, wl, wr, pairs))
    head = np.flatnonzero(np.concatenate([[True], call[1:] != call[:-1]]))
    ids = call[head]
    n, c = call.size, ids.size
    # per segment (query gap, no keys), (no queries, key gap), (the segment); per call the
    # two tails: laid out call by call (3 entries a segment, 2 a call)
    at = 3 * np.arange(n) + 2 * np.cumsum(np.concatenate([[False], call[1:] != call[:-1]]))
    tail = np.concatenate([at[head[1:]] - 2, [3 * n + 2 * c - 2]])
    seq_q = np.zeros(3 * n + 2 * c, dtype=np.int64)
    seq_k = np.zeros(3 * n + 2 * c, dtype=np.int64)
    starts = np.concatenate([[True], call[1:] != call[:-1]])
    end_q, end_k = q0 + sq, k0 + sk
    seq_q[at] = q0 - np.where(starts, 0, np.concatenate([[0], end_q[:-1]]))
    seq_k[at + 1] = k0 - np.where(starts, 0, np.concatenate([[0], end_k[:-1]]))
    seq_q[at + 2], seq_k[at + 2] = sq, sk
    last = np.concatenate([head[1:], [n]]) - 1
    seq_q[tail] = n_q - end_q[last]
    seq_k[tail + 1] = n_k[ids] - end_k[last]
    owner = np.zeros(seq_q.size, dtype=np.int64)      # the call of every entry
    owner[np.concatenate([[0], tail[:-1] + 2])] = 1
    owner = np.cumsum(owner) - 1
    kept = (seq_q > 0) | (seq_k > 0)
    seq_q, seq_k, owner = seq_q[kept], seq_k[kept], owner[kept]
    bounds = np.searchsorted(owner, np.arange(c + 1))
    cum_q = np.concatenate([[0], np.cumsum(seq_q)])
    cum_k = np.concatenate([[0], np.cumsum(seq_k)])
    max_q = np.maximum.reduceat(seq_q, bounds[:-1])
    max_k = np.maximum.reduceat(seq_k, bounds[:-1])
    n_pairs = np.bincount(np.searchsorted(ids, call), weights=pairs, minlength=c)
    for j, i in enumerate(ids.tolist()):
        a, b = bounds[j], bounds[j + 1]
        cu_q = torch.from_numpy((cum_q[a:b + 1] - cum_q[a]).astype(np.int32))
        cu_k = torch.from_numpy((cum_k[a:b + 1] - cum_k[a]).astype(np.int32))
        w = (int(wl[head[j]]), int(wr[head[j]]))
        out[i] = FlashForm(route.backend, (FlashCall(
            cu_q, cu_k, max(int(max_q[j]), 2), int(max_k[j]), w, int(n_pairs[j]), (0, n_q),
            (0, int(n_k[i]))),))
    return slow


def cut_at_gaps(pieces, keys, h: int, k_first: int, k_rows: int, mask: AttnMask):
    """``pieces`` cut where the window's edges of their queries cross a gap between the
    keys of one call (key rows ``[k_first, k_first + k_rows)`` of holder ``h`` in the
    HolderSet ``keys``), or None when nothing would be cut.

    A piece fails the exactness rule when its queries' left edge runs through a gap of
    the keys (they lose no row while it crosses it, where FA's window drops one row per
    query) or their right edge does (likewise gaining). Cut at the queries where an edge
    enters or leaves a run of keys, each sub-piece sees its edges move through one run or
    one gap only: exact, with a window of its own (a balanced layout's two pieces of one
    document closer than the window give such gaps: issue 27's SWA coverage)."""
    _, k_pos, offsets = keys._arrays
    rows = slice(k_first, k_first + k_rows)
    pos, seg = k_pos[rows], keys._cells[rows] - h * keys.n_seg
    real = pos >= 0
    pos, seg = pos[real], seg[real]
    if pos.size < 2:
        return None
    brk = np.flatnonzero((pos[1:] != pos[:-1] + 1) | (seg[1:] != seg[:-1]))
    if not brk.size:
        return None
    starts = np.concatenate([[0], brk + 1])
    ends = np.concatenate([brk, [pos.size - 1]])
    run_seg, first_pos, last_pos = seg[starts], pos[starts], pos[ends]
    # queries where an edge reaches a run's first / past its last key, or a gap's
    _, last_first = mask.query_interval(first_pos - 1)    # the left edge reaches the run
    _, last_last = mask.query_interval(last_pos)          # the left edge leaves it
    first_first, _ = mask.query_interval(first_pos)       # the right edge reaches it
    first_after, _ = mask.query_interval(last_pos + 1)    # the right edge leaves it
    cut_seg = np.tile(run_seg, 4)
    cut_pos = np.concatenate([last_first + 1, last_last + 1, first_first, first_after])
    return _split_pieces(pieces, cut_seg, cut_pos)


def _split_pieces(pieces, cut_seg: np.ndarray, cut_pos: np.ndarray):
    """``pieces`` (segment, first row, rows, first position) split at the positions
    ``cut_pos`` of segments ``cut_seg`` that fall strictly inside them; None when none
    does. Rows and positions advance together inside a piece."""
    seg, row0, rows, qs = pieces
    big = np.int64(1) << 40
    cuts = np.unique(cut_seg * big + np.clip(cut_pos, -1, big - 1))
    lo = np.searchsorted(cuts, seg * big + qs, side="right")
    hi = np.searchsorted(cuts, seg * big + qs + rows, side="left")
    inner = hi - lo
    if not inner.any():
        return None
    owner = np.repeat(np.arange(seg.size), inner)           # the piece of each inner cut
    at = cuts[run_rows(lo, inner)] - seg[owner] * big        # its position
    piece = np.concatenate([np.arange(seg.size), owner])
    start = np.concatenate([qs, at])
    order = np.lexsort((start, piece))
    piece, start = piece[order], start[order]
    end = np.concatenate([start[1:], [0]])
    last = np.ones(piece.size, dtype=bool)
    last[:-1] = piece[1:] != piece[:-1]
    end[last] = qs[piece[last]] + rows[piece[last]]
    return (seg[piece], row0[piece] + (start - qs[piece]), end - start, start)


def _windows(sk, sq, left_lost, first_hi, mask: AttnMask) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's (left, right) window. A side that cuts nothing (the last query still
    sees key row 0; the first already sees the last row) admits any value from sk - 1
    (left) or sq - 1 (right) on, and -1: it takes the mask's own value when that is one of
    them, so that the pieces of a call share one window as far as possible (a chunk
    shorter than the window would otherwise make a call of its own)."""
    own_left = mask.window_size[0]
    own_right = 0 if mask.causal else mask.window_size[1]
    left_free, right_free = left_lost == 0, first_hi >= sk - 1
    wl = np.where(left_free, np.where((own_left < 0) | (own_left >= sk - 1), own_left, -1),
                  sk - 1 - left_lost)
    wr = np.where(right_free, np.where((own_right < 0) | (own_right >= sq - 1), own_right, -1),
                  first_hi - (sk - sq))
    return wl, wr


def _pairs(sq, sk, wl, wr) -> np.ndarray:
    """Visible pairs of FA segments (sq x sk, window (wl, wr)) whose every row sees a key
    (trimmed pieces): row i sees [max(0, i + d - wl), min(sk - 1, i + d + wr)], d = sk - sq,
    summed in closed form."""
    d = sk - sq
    c = d + wr
    rows = sq * c + sq * (sq - 1) // 2 - _relu_sum(c - (sk - 1), sq)
    his = np.where(wr < 0, sq * (sk - 1), rows)
    los = np.where(wl < 0, 0, _relu_sum(d - wl, sq))
    return (his - los + sq).astype(np.int64)


def _relu_sum(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """sum over i in [0, n) of max(0, i + c)."""
    i0 = np.maximum(0, 1 - c)
    cnt = np.maximum(0, n - i0)
    return np.where(cnt > 0, cnt * ((i0 + c) + (n - 1 + c)) // 2, 0)


def _call_form(seg, q0, sq, k0, sk, wl, wr, pairs, n_q: int, n_k: int, route: FlashRoute
               ) -> FlashForm | None:
    """Merge one call's exact pieces into segments, group them by window into
    FlashAttention calls (gathering or splitting overlapping key rows), or None when that
    takes more than ``MAX_CALLS`` calls."""
    n = seg.size
    if n == 0:
        return FlashForm(route.backend, ())
    if n > 1:
        _, q0, sq, k0, sk, wl, wr, pairs = _merge(np.zeros(n, dtype=np.int64), seg, q0, sq,
                                                  k0, sk, wl, wr, pairs)
    if (wl == wl[0]).all() and (wr == wr[0]).all():
        # one window (most calls): its segments on every row at once when they need one
        # call (no _widen after), else as below
        calls = _window_calls(q0, sq, k0, sk, pairs, (int(wl[0]), int(wr[0])), route,
                              (n_q, n_k))
    else:
        calls = []
        for w_left, w_right in np.unique(np.stack([wl, wr], axis=1), axis=0).tolist():
            sel = (wl == w_left) & (wr == w_right)
            calls += _window_calls(q0[sel], sq[sel], k0[sel], sk[sel], pairs[sel],
                                   (int(w_left), int(w_right)), route)
    if len(calls) > MAX_CALLS:
        return None
    # the call spanning the most query rows goes first and runs on every row: its output
    # starts the result (no merge, no zero-filled fp32 buffer); the others merge into the
    # rows they span
    if len(calls) > 1 or calls[0].q_span != (0, n_q):
        widest = max(range(len(calls)), key=lambda i: calls[i].q_span[1] - calls[i].q_span[0])
        calls.insert(0, _widen(calls.pop(widest), n_q, n_k))
    return FlashForm(route.backend, tuple(calls))


def _merge(call, seg, q0, sq, k0, sk, wl, wr, pairs):
    """Pieces merged into segments (see the module docstring): piece j joins piece j - 1
    (same call and segment, adjacent query rows, same first key row) when both see the same
    keys without a window, or both are causal and j's keys extend j - 1's by j's rows."""
    n = seg.size
    adj = np.zeros(n, dtype=bool)
    adj[1:] = ((call[1:] == call[:-1]) & (seg[1:] == seg[:-1]) & (q0[1:] == q0[:-1] + sq[:-1])
               & (k0[1:] == k0[:-1]))
    full = (wl == -1) & (wr == -1)
    causal = (wl == -1) & (wr == 0)
    join = np.zeros(n, dtype=bool)
    join[1:] = adj[1:] & (((sk[1:] == sk[:-1]) & full[1:] & full[:-1])            # same keys
                          | (causal[1:] & causal[:-1] & (sk[1:] - sk[:-1] == sq[1:])))
    head = np.flatnonzero(~join)
    group = np.cumsum(~join) - 1
    call, q0, k0 = call[head], q0[head], k0[head]
    sq = np.bincount(group, weights=sq).astype(np.int64)
    tail = np.concatenate([head[1:], [n]]) - 1
    sk, wl, wr = sk[tail], wl[tail], wr[tail]
    pairs = np.bincount(group, weights=pairs).astype(np.int64)
    return call, q0, sq, k0, sk, wl, wr, pairs


def _widen(call: FlashCall, n_q: int, n_k: int) -> FlashCall:
    """``call`` on every query row and every key row (a gathered buffer is already its
    own): empty segments over the rows before and after its spans."""
    (qa, qb), (ka, kb) = call.q_span, call.k_span
    if call.k_index is not None:
        ka, kb, n_k = 0, 0, 0
    seq_q = np.concatenate([[qa, 0], np.diff(call.cu_q.numpy()), [n_q - qb, 0]])
    seq_k = np.concatenate([[0, ka], np.diff(call.cu_k.numpy()), [0, n_k - kb]])
    keep = (seq_q > 0) | (seq_k > 0)
    seq_q, seq_k = seq_q[keep], seq_k[keep]
    cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_q)]).astype(np.int32))
    cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_k)]).astype(np.int32))
    return replace(call, cu_q=cu_q, cu_k=cu_k, max_q=max(call.max_q, int(seq_q.max())),
                   max_k=max(call.max_k, int(seq_k.max())), q_span=(0, n_q),
                   k_span=call.k_span if call.k_index is not None else (0, n_k))


def _window_calls(q0, sq, k0, sk, pairs, window, route: FlashRoute,
                  whole: tuple[int, int] | None = None) -> list[FlashCall]:
    """The calls of one window's segments (query rows increasing): one call when their key
    rows do not overlap (on ``whole`` = (query rows, key rows) when given), else gathered
    or split (fewer bytes)."""
    k1 = k0 + sk
    if k0.size < 2 or (k0[1:] >= np.maximum.accumulate(k1)[:-1]).all():
        return [_call(q0, sq, k0, sk, pairs, window, whole)]
    # split: layer of a segment = how many earlier segments still hold its first key row
    # (exact for nested or chained ranges; checked, else only gathering is offered)
    layer = _layers(k0, k1)
    n_layers = int(layer.max()) + 1 if layer is not None else 0
    gathered = int(sk.sum())
    gather_bytes = 3 * gathered * route.kv_row_bytes
    split_bytes = 0      # each call past the first: its spans' output, merge and gradients
    for j in range(1, n_layers):
        sel = layer == j
        (qa, qb), (ka, kb) = _span(q0[sel], sq[sel]), _span(k0[sel], sk[sel])
        split_bytes += 2 * (qb - qa) * route.q_row_bytes + 2 * (kb - ka) * route.kv_row_bytes
    if layer is not None and split_bytes < gather_bytes:
        return [_call(q0[layer == j], sq[layer == j], k0[layer == j], sk[layer == j],
                      pairs[layer == j], window) for j in range(n_layers)]
    starts = np.cumsum(sk) - sk
    index = run_rows(k0, sk)
    call = _call(q0, sq, starts, sk, pairs, window)
    return [replace(call, k_index=torch.from_numpy(index),     # run_rows: int64 already
                    k_rounds=UniqueRounds.of_runs(k0, sk, index))]


def _span(first: np.ndarray, size: np.ndarray) -> tuple[int, int]:
    """Rows [first[0], last end) of segments in increasing order (their span)."""
    return (int(first[0]), int(first[-1] + size[-1])) if first.size else (0, 0)


def _layers(k0: np.ndarray, k1: np.ndarray) -> np.ndarray | None:
    """Layer per segment such that no two segments of a layer share key rows, or None when
    the simple rule fails: a segment's layer is the number of earlier segments that still
    hold its first key row. (Every j with k1[j] <= k0[i] is earlier than i, as the first
    rows never decrease and each range is non-empty: one search counts them.) Right for
    nested ranges (prefixes of one document) and chains; checked."""
    layer = np.arange(k0.size) - np.searchsorted(np.sort(k1), k0, side="right")
    for j in range(int(layer.max()) + 1):
        sel = layer == j
        a, b = k0[sel], k1[sel]
        if a.size > 1 and (a[1:] < np.maximum.accumulate(b)[:-1]).any():
            return None
    return layer


def _call(q0, sq, k0, sk, pairs, window, whole: tuple[int, int] | None = None
          ) -> FlashCall:
    """One call over segments (query rows [q0, q0 + sq) x key rows [k0, k0 + sk), rows
    increasing, key rows not overlapping), on the rows they span (``whole`` = (query rows,
    key rows): on all of them), with empty segments over the rows between them, so that
    every row of both spans is in a segment. (A gathered key buffer is the call's own: its
    span is all of it.)"""
    if whole is not None:
        q_span, k_span = (0, whole[0]), (0, whole[1])
    else:
        q_span, k_span = _span(q0, sq), _span(k0, sk)
    n, m = q0.size, 3 * q0.size
    # per segment: (query gap, no keys), (no queries, key gap), (the segment); then the
    # tails (filled in place: this runs once per call, ~100 calls per ring at cp 64)
    seq_q = np.zeros(m + 2, dtype=np.int64)
    seq_k = np.zeros(m + 2, dtype=np.int64)
    seq_q[0:m:3], seq_q[2:m:3] = q0, sq
    seq_k[1:m:3], seq_k[2:m:3] = k0, sk
    seq_q[3:m:3] -= q0[:-1] + sq[:-1]       # gaps: a segment's first row less the end of
    seq_k[4:m:3] -= k0[:-1] + sk[:-1]       # the one before (the first: from the span)
    seq_q[0] -= q_span[0]
    seq_k[1] -= k_span[0]
    seq_q[m] = q_span[1] - (q0[-1] + sq[-1] if n else q_span[0])
    seq_k[m + 1] = k_span[1] - (k0[-1] + sk[-1] if n else k_span[0])
    keep = (seq_q > 0) | (seq_k > 0)
    seq_q, seq_k = seq_q[keep], seq_k[keep]
    cu_q = np.zeros(seq_q.size + 1, dtype=np.int32)
    cu_k = np.zeros(seq_k.size + 1, dtype=np.int32)
    np.cumsum(seq_q, out=cu_q[1:])
    np.cumsum(seq_k, out=cu_k[1:])
    # max_q is a bound, and never 1: FA2 reads max_seqlen_q == 1 with GQA and no window as
    # "one query per segment" and reshapes q's heads into its rows (seqlenq_ngroups_swapped),
    # which segments of 0 queries would break
    return FlashCall(torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                     max(int(seq_q.max()) if seq_q.size else 0, 2),
                     int(seq_k.max()) if seq_k.size else 0, window, int(pairs.sum()),
                     q_span, k_span)
