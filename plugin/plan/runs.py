"""Run-level geometry: what the strategies' host tables are computed from, without per-token
passes where runs suffice.

A *run* is a maximal stretch of consecutive real positions of one document held by one
*holder* (a CP rank, or a Ulysses group of ranks). A layout has few runs (a whole short
document is one run; a long one a few per rank), so pairing runs is cheap where pairing
tokens or rank pairs is not.

Three facts from docs/design.md's mask table make runs enough:
- every real query sees itself, and both ends of its key interval never decrease with its
  position, so the keys seen by the queries of a run form ONE contiguous span
  ``[lo(first), hi(last)]`` (``plan.spans.key_spans``);
- the spans of one holder's runs in one document are ordered too, so their union is a few
  merged spans (``plan.spans.merge_spans``);
- the number of visible pairs between a query run and a key range has a closed form
  (:func:`pair_work`), piecewise-quadratic in the ends, split at chunk edges.

Everything is int64 host math over arrays of runs (no Python loop over runs, documents or
rank pairs). The plan keeps its runs as numpy (``tokens.RunTable``), which the host tables
read as they are (``CPPlan.arrays.runs``, ``varlen_cp.tables.selected.run_arrays``);
:class:`Runs` is the tensor form ``CPPlan.runs`` hands out (bench, tests). Limits: positions must stay below 2^40
(mask_math's UNBOUNDED).
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
    """Runs sorted by (holder, doc, start), all int64 tensors [R]; ``row`` is the run's
    first token's row among its holder's local tokens (its order there), ``length`` > 0."""

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


def run_rows(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """int64: the runs ``[start[i], start[i] + length[i])`` (length >= 0) laid back to back,
    one entry per token: each run's start less its place in the list, repeated over the
    run, plus ``arange`` (in place: one array of N, not two)."""
    first = np.cumsum(length) - length
    rows = np.repeat((start - first).astype(np.int64, copy=False), length)
    rows += np.arange(rows.size, dtype=np.int64)
    return rows


# ---- exact visible-pair counts --------------------------------------------------------------
# numpy on int64 arrays: the solver and the schedules evaluate these on a few to a few
# thousand elements, where a numpy op costs ~0.3-1 us and a torch op ~1.5-6 us.
def _tri(x: np.ndarray) -> np.ndarray:
    """sum of q for q in [0, x)."""
    return x * (x - 1) // 2


def _window(mask: AttnMask) -> tuple[int | None, int | None]:
    """(left, right) reach of a query inside its chunk (None = unbounded)."""
    causal, wl, wr, _ = mask.params
    rights = [x for x in ((0 if causal else None), (wr if wr >= 0 else None)) if x is not None]
    return (wl if wl >= 0 else None), (min(rights) if rights else None)


def _ramp_sum(a: np.ndarray, b: np.ndarray, c: np.ndarray, e: np.ndarray,
              left: int | None, right: int | None) -> np.ndarray:
    """sum over q in [a, b) of |[max(c, q - left), min(e, q + right)]|, for ranges where
    every interval is non-empty (``None``: that side has no q-term)."""
    n = np.maximum(b - a, 0)
    if right is None:
        s_hi = e * n
    else:
        m = np.minimum(np.maximum(e - right, a), b)  # q < m: q + right is the min
        s_hi = _tri(m) - _tri(a) + right * (m - a) + e * (b - m)
    if left is None:
        s_lo = c * n
    else:
        m = np.minimum(np.maximum(c + left + 1, a), b)  # q >= m: q - left is the max
        s_lo = c * (m - a) + _tri(b) - _tri(m) - left * (b - m)
    return s_hi - s_lo + n


@functools.lru_cache(maxsize=64)
def _chunk_pairs(chunk: int, left: int | None, right: int | None) -> int:
    """Visible pairs of one whole chunk (the same for every chunk)."""
    one = np.zeros(1, np.int64)
    return int(_ramp_sum(one, one + chunk, one, one + chunk - 1, left, right)[0])


def prefix_pairs(doc_len: np.ndarray, stop: np.ndarray, mask: AttnMask) -> np.ndarray:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens against all their keys (elementwise, 0 <= stop <= doc_len): the
    prefix case of :func:`pair_work`, ~3x faster for chunked masks (every whole chunk
    before ``stop`` holds the same count)."""
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
        return _ramp_sum(zero, stop, zero, doc_len - 1, left, right)
    n_full = stop // chunk
    first = n_full * chunk
    per_chunk = _chunk_pairs(chunk, left, right)
    last = np.minimum(doc_len - 1, first + chunk - 1)
    return n_full * per_chunk + _ramp_sum(first, stop, first, last, left, right)


def _plain_pairs(a, b, c, e, left, right) -> np.ndarray:
    """Visible pairs of queries [a, b) x keys [c, e) under a window without chunks."""
    lo_q = a if right is None else np.maximum(a, c - right)
    hi_q = b if left is None else np.minimum(b, e + left)
    ok = (lo_q < hi_q) & (c < e)
    lo_q, hi_q = np.where(ok, lo_q, a), np.where(ok, hi_q, a)
    return np.where(ok, _ramp_sum(lo_q, hi_q, c, e - 1, left, right), 0)


def pair_work(a: np.ndarray, b: np.ndarray, c: np.ndarray, e: np.ndarray,
              mask: AttnMask) -> np.ndarray:
    """int64: visible pairs between queries at positions [a, b) and keys at positions
    [c, e) of one document (elementwise over the four arrays; empty ranges give 0).
    Checked against ``AttnMask.count_visible`` in the tests."""
    a, b, c, e = (np.asarray(t, dtype=np.int64) for t in (a, b, c, e))
    left, right = _window(mask)
    chunk = mask.chunk_size
    if not chunk:
        return _plain_pairs(a, b, c, e, left, right)
    j0 = np.maximum(a // chunk, c // chunk)
    j1 = np.minimum((b - 1) // chunk, (e - 1) // chunk)
    # Queries see keys of their own chunk only: chunks j0..j1 hold both sides; the inner
    # ones are whole on both sides, so each holds the same count.
    live = (j0 <= j1) & (a < b) & (c < e)

    def in_chunk(j: np.ndarray) -> np.ndarray:
        lo, hi = j * chunk, (j + 1) * chunk
        return _plain_pairs(np.maximum(a, lo), np.minimum(b, hi), np.maximum(c, lo),
                            np.minimum(e, hi), left, right)

    total = in_chunk(j0) + np.where(j1 > j0, in_chunk(j1), 0) \
        + np.maximum(j1 - j0 - 1, 0) * _chunk_pairs(chunk, left, right)
    return np.where(live, total, 0)
