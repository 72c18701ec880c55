"""Run-level geometry: what the strategies' host tables are computed from, without per-token
passes where runs suffice.

A *run* is a maximal stretch of consecutive real positions of one document held by one
*holder* (a CP rank, or a Ulysses group of ranks). A layout has few runs (a whole short
document is one run; a long one a few per rank), so pairing runs is cheap where pairing
tokens or rank pairs is not.

Three facts from docs/design.md's mask table make runs enough:
- every real query sees itself, and both ends of its key interval never decrease with its
  position, so the keys seen by the queries of a run form ONE contiguous span
  ``[lo(first), hi(last)]`` (:func:`key_spans`);
- the spans of one holder's runs in one document are ordered too, so their union is a few
  merged spans (:func:`merge_spans`);
- the number of visible pairs between a query run and a key range has a closed form
  (:func:`pair_work`), piecewise-quadratic in the ends, split at chunk edges.

Everything is int64 host math over arrays of runs (no Python loop over runs, documents or
rank pairs). Limits: positions must stay below 2^40 (mask_math's UNBOUNDED).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..masks import AttnMask

# Sort keys combine (document, position) as doc * STRIDE + position.
STRIDE = 1 << 42


@dataclass(frozen=True)
class Runs:
    """Runs sorted by (holder, doc, start), all int64 [R]; ``row`` is the run's first
    token's row among its holder's local tokens (its order there), ``length`` > 0."""

    holder: torch.Tensor
    doc: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor

    @property
    def stop(self) -> torch.Tensor:
        return self.start + self.length

    def select(self, keep: torch.Tensor) -> "Runs":
        return Runs(self.holder[keep], self.doc[keep], self.start[keep], self.length[keep],
                    self.row[keep])

    def by_document(self) -> "Runs":
        """The same runs sorted by (doc, start): for the runs of ALL holders this lists
        each document's real positions in order, as a partition."""
        order = torch.argsort(self.doc * STRIDE + self.start)
        return self.select(order)


def key_spans(runs: Runs, mask: AttnMask, doc_len: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive (lo, hi) of the keys the queries of each run see, clipped to the document
    (non-empty: every query sees itself)."""
    lo, _ = mask.key_interval(runs.start)
    _, hi = mask.key_interval(runs.stop - 1)
    return lo.clamp(min=0), torch.minimum(hi, doc_len[runs.doc] - 1)


def merge_spans(holder: torch.Tensor, doc: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
    """Union of spans per (holder, doc): (holder, doc, lo, hi) of the merged spans.

    Input sorted by (holder, doc, run start), so within a group both ends are
    non-decreasing and a span starts a new merged span iff it begins after the previous
    one's end + 1; a merged span ends at its last member's hi.
    """
    n = lo.numel()
    if n == 0:
        return holder, doc, lo, hi
    new = torch.ones(n, dtype=torch.bool)
    same = (holder[1:] == holder[:-1]) & (doc[1:] == doc[:-1])
    new[1:] = ~same | (lo[1:] > hi[:-1] + 1)
    last = torch.ones(n, dtype=torch.bool)
    last[:-1] = new[1:]
    return holder[new], doc[new], lo[new], hi[last]


def span_pieces(doc: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, runs: Runs
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intersections of spans (doc, [lo, hi]) with ``runs`` (sorted by (doc, start), not
    overlapping): (span index, run index, first position, length) of every non-empty
    piece, in (span, position) order."""
    start_key = runs.doc * STRIDE + runs.start
    stop_key = runs.doc * STRIDE + runs.stop  # exclusive
    first = torch.searchsorted(stop_key, doc * STRIDE + lo, right=True)   # runs ending > lo
    last = torch.searchsorted(start_key, doc * STRIDE + hi, right=True)   # runs starting <= hi
    count = (last - first).clamp(min=0)
    n = int(count.sum())
    span = torch.repeat_interleave(torch.arange(doc.numel()), count, output_size=n)
    run = torch.arange(n) - (torch.cumsum(count, 0) - count)[span] + first[span]
    a = torch.maximum(lo[span], runs.start[run])
    b = torch.minimum(hi[span] + 1, runs.stop[run])
    return span, run, a, b - a


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


def run_rows(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """int64: the runs ``[start[i], start[i] + length[i])`` (length >= 0) laid back to back,
    one entry per token: ``arange`` plus each run's start less its place in the list,
    repeated over the run. Two passes over the tokens (~1.8 us per 1K tokens on one CPU
    core at 100K tokens, vs ~3.2 for :func:`per_token`'s offset and value)."""
    first = torch.cumsum(length, 0) - length
    n = int(length.sum())
    out = torch.repeat_interleave(start - first, length, output_size=n)
    return out.add_(torch.arange(n))


# ---- exact visible-pair counts --------------------------------------------------------------
def _tri(x: torch.Tensor) -> torch.Tensor:
    """sum of q for q in [0, x)."""
    return x * (x - 1) // 2


def _ramp_sum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, e: torch.Tensor,
              left: int | None, right: int | None) -> torch.Tensor:
    """sum over q in [a, b) of |[max(c, q - left), min(e, q + right)]|, for ranges where
    every interval is non-empty (``None``: that side has no q-term)."""
    n = (b - a).clamp(min=0)
    if right is None:
        s_hi = e * n
    else:
        m = torch.minimum(torch.maximum(e - right, a), b)  # q < m: q + right is the min
        s_hi = _tri(m) - _tri(a) + right * (m - a) + e * (b - m)
    if left is None:
        s_lo = c * n
    else:
        m = torch.minimum(torch.maximum(c + left + 1, a), b)  # q >= m: q - left is the max
        s_lo = c * (m - a) + _tri(b) - _tri(m) - left * (b - m)
    return s_hi - s_lo + n


def _window(mask: AttnMask) -> tuple[int | None, int | None]:
    """(left, right) reach of a query inside its chunk (None = unbounded)."""
    causal, wl, wr, _ = mask.params
    rights = [x for x in ((0 if causal else None), (wr if wr >= 0 else None)) if x is not None]
    return (wl if wl >= 0 else None), (min(rights) if rights else None)


def _plain_pairs(a, b, c, e, left, right) -> torch.Tensor:
    """Visible pairs of queries [a, b) x keys [c, e) under a window without chunks."""
    lo_q = a if right is None else torch.maximum(a, c - right)
    hi_q = b if left is None else torch.minimum(b, e + left)
    ok = (lo_q < hi_q) & (c < e)
    lo_q, hi_q = torch.where(ok, lo_q, a), torch.where(ok, hi_q, a)
    return torch.where(ok, _ramp_sum(lo_q, hi_q, c, e - 1, left, right), 0)


def prefix_pairs(doc_len: torch.Tensor, stop: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens against all their keys (elementwise, 0 <= stop <= doc_len): the
    prefix case of :func:`pair_work`, ~3x faster for chunked masks (every whole chunk
    before ``stop`` holds the same count)."""
    left, right = _window(mask)
    doc_len, stop = doc_len.to(torch.int64), stop.to(torch.int64)
    chunk = mask.chunk_size
    if not chunk:
        zero = torch.zeros_like(stop)
        return _ramp_sum(zero, stop, zero, doc_len - 1, left, right)
    n_full = torch.div(stop, chunk, rounding_mode="floor")
    first = n_full * chunk
    one = torch.zeros(1, dtype=torch.int64)
    per_chunk = _ramp_sum(one, one + chunk, one, one + chunk - 1, left, right)
    last = torch.minimum(doc_len - 1, first + chunk - 1)
    return n_full * per_chunk + _ramp_sum(first, stop, first, last, left, right)


def _ramp_sum_np(a: np.ndarray, b: np.ndarray, c: np.ndarray, e: np.ndarray,
                 left: int | None, right: int | None) -> np.ndarray:
    """:func:`_ramp_sum` on int64 numpy arrays (the same integer steps)."""
    n = np.maximum(b - a, 0)
    if right is None:
        s_hi = e * n
    else:
        m = np.minimum(np.maximum(e - right, a), b)
        s_hi = _tri(m) - _tri(a) + right * (m - a) + e * (b - m)
    if left is None:
        s_lo = c * n
    else:
        m = np.minimum(np.maximum(c + left + 1, a), b)
        s_lo = c * (m - a) + _tri(b) - _tri(m) - left * (b - m)
    return s_hi - s_lo + n


@functools.lru_cache(maxsize=64)
def _chunk_pairs(chunk: int, left: int | None, right: int | None) -> int:
    """Visible pairs of one whole chunk (the same for every chunk)."""
    one = np.zeros(1, np.int64)
    return int(_ramp_sum_np(one, one + chunk, one, one + chunk - 1, left, right)[0])


def prefix_pairs_np(doc_len: np.ndarray, stop: np.ndarray, mask: AttnMask) -> np.ndarray:
    """:func:`prefix_pairs` on int64 numpy arrays, for the balanced layout's solver: on the
    few-element arrays it evaluates, a numpy op costs ~0.5 us where a torch op costs
    1.5-6 us (the same integer math, so the same values)."""
    left, right = _window(mask)
    chunk = mask.chunk_size
    if left is None and right == 0:
        # Causal without a left window (the usual masks): query q sees q + 1 keys (of its
        # chunk): triangle numbers, 4 ops where the general form takes ~20 (units_of on
        # 5000 documents: 0.7 -> ~0.2 ms a mask).
        if not chunk:
            return stop * (stop + 1) // 2
        r = stop % chunk
        return (stop - r) // chunk * (chunk * (chunk + 1) // 2) + r * (r + 1) // 2
    if not chunk:
        zero = np.zeros_like(stop)
        return _ramp_sum_np(zero, stop, zero, doc_len - 1, left, right)
    n_full = stop // chunk
    first = n_full * chunk
    per_chunk = _chunk_pairs(chunk, left, right)
    last = np.minimum(doc_len - 1, first + chunk - 1)
    return n_full * per_chunk + _ramp_sum_np(first, stop, first, last, left, right)


def pair_work(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, e: torch.Tensor,
              mask: AttnMask) -> torch.Tensor:
    """int64: visible pairs between queries at positions [a, b) and keys at positions
    [c, e) of one document (elementwise over the four tensors; empty ranges give 0).
    Checked against ``AttnMask.count_visible`` in the tests."""
    a, b, c, e = (t.to(torch.int64) for t in (a, b, c, e))
    left, right = _window(mask)
    chunk = mask.chunk_size
    if not chunk:
        return _plain_pairs(a, b, c, e, left, right)
    # Queries see keys of their own chunk only: chunks j0..j1 hold both sides; the inner
    # ones are whole on both sides, so each holds the same count.
    j0 = torch.maximum(torch.div(a, chunk, rounding_mode="floor"),
                       torch.div(c, chunk, rounding_mode="floor"))
    j1 = torch.minimum(torch.div(b - 1, chunk, rounding_mode="floor"),
                       torch.div(e - 1, chunk, rounding_mode="floor"))
    live = (j0 <= j1) & (a < b) & (c < e)

    def in_chunk(j: torch.Tensor) -> torch.Tensor:
        lo, hi = j * chunk, (j + 1) * chunk
        return _plain_pairs(torch.maximum(a, lo), torch.minimum(b, hi),
                            torch.maximum(c, lo), torch.minimum(e, hi), left, right)

    zero = torch.zeros(1, dtype=torch.int64)
    full = _plain_pairs(zero, zero + chunk, zero, zero + chunk, left, right)
    total = in_chunk(j0) + torch.where(j1 > j0, in_chunk(j1), 0) \
        + (j1 - j0 - 1).clamp(min=0) * full
    return torch.where(live, total, 0)


def _plain_pairs_np(a, b, c, e, left, right) -> np.ndarray:
    """:func:`_plain_pairs` on int64 numpy arrays."""
    lo_q = a if right is None else np.maximum(a, c - right)
    hi_q = b if left is None else np.minimum(b, e + left)
    ok = (lo_q < hi_q) & (c < e)
    lo_q, hi_q = np.where(ok, lo_q, a), np.where(ok, hi_q, a)
    return np.where(ok, _ramp_sum_np(lo_q, hi_q, c, e - 1, left, right), 0)


def pair_work_np(a: np.ndarray, b: np.ndarray, c: np.ndarray, e: np.ndarray,
                 mask: AttnMask) -> np.ndarray:
    """:func:`pair_work` on numpy arrays (int64 out; the same integer steps, so the same
    values): the schedules' pair counts call it on a few thousand spans per mask, where
    the torch form's ~40 ops cost ~0.4 ms."""
    a, b, c, e = (np.asarray(t, dtype=np.int64) for t in (a, b, c, e))
    left, right = _window(mask)
    chunk = mask.chunk_size
    if not chunk:
        return _plain_pairs_np(a, b, c, e, left, right)
    j0 = np.maximum(a // chunk, c // chunk)
    j1 = np.minimum((b - 1) // chunk, (e - 1) // chunk)
    live = (j0 <= j1) & (a < b) & (c < e)

    def in_chunk(j: np.ndarray) -> np.ndarray:
        lo, hi = j * chunk, (j + 1) * chunk
        return _plain_pairs_np(np.maximum(a, lo), np.minimum(b, hi), np.maximum(c, lo),
                               np.minimum(e, hi), left, right)

    total = in_chunk(j0) + np.where(j1 > j0, in_chunk(j1), 0) \
        + np.maximum(j1 - j0 - 1, 0) * _chunk_pairs(chunk, left, right)
    return np.where(live, total, 0)
