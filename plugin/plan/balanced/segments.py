"""Segments and their excess: the documents (or their chunks, when every mask is chunked
with one size) that the layout cuts, which of them are long (carry excess work), each
document's work per mask, the excess functional over any stretch of positions, and the
cheap prechecks that decide which attempts are worth building.

``memo`` is a per-call cache (one dict per :func:`~.solve.balanced_runs` call): segments,
document work and the excess function are shared by every attempt of the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runs import prefix_pairs
from .profile import Profile, excess_functional

# Long segments with less excess work than this share of a rank's mean work (the mask with
# least work) stay filler: spread over every rank they would cost a window or chunk of
# fetched keys on each for nothing (see items.py).
_KEEP_EXCESS = 0.0075
# The ``nest_long`` attempt of a batch with window bodies (variants.py) keeps long segments with
# up to this share of a rank's mean work in excess whole, to nest them: their pieces'
# ranks take that much less filler in the filler column (phases.py's ``_excess_shift``).
NEST_KEEP_EXCESS = 0.25
# An item in position order longer than a rank's filler share is only tried when its first
# share of tokens holds at least this share of the mean target density (rank_cut.py's
# rank_reachable, and prefixes_dense_enough below).
PREFIX_DENSITY = 0.75


def segments_of(lengths: np.ndarray, prof: Profile, cp: int, keep_small: bool,
                memo: dict | None = None, keep: float | None = None
                ) -> tuple[np.ndarray, ...]:
    """(doc, start, end, long) of the non-empty segments: documents, or their chunks when
    every mask is chunked with one size; long: longer than theta and, with keep_small,
    carrying more than ``keep`` (default ``_KEEP_EXCESS``) of a rank's mean work in excess
    (see :func:`~.items.cut_items`). ``memo``: per-call cache."""
    keep = _KEEP_EXCESS if keep is None else keep
    if memo is not None and ("seg", keep_small, keep) in memo:
        return memo[("seg", keep_small, keep)]
    out = _find_segments(lengths, prof, cp, keep_small, keep)
    if memo is not None:
        memo[("seg", keep_small, keep)] = out
    return out


def _find_segments(lengths_np: np.ndarray, prof: Profile, cp: int, keep_small: bool,
                   keep: float) -> tuple[np.ndarray, ...]:
    n_docs = lengths_np.size
    doc, start, end = np.arange(n_docs), np.zeros_like(lengths_np), lengths_np.copy()
    if prof.split:  # independent chunks: each is a segment of its own
        n = (lengths_np + prof.split - 1) // prof.split
        doc = np.repeat(doc, n)
        first = np.cumsum(n) - n
        start = (np.arange(doc.size) - first[doc]) * prof.split
        end = np.minimum(start + prof.split, lengths_np[doc])
    live = end > start
    doc, start, end = doc[live], start[live], end[live]
    size = end - start
    long = size > prof.theta
    if keep_small and prof.excess.shape[0] and bool(long.any()):
        vec = np.empty((size.size, 1 + len(prof.masks)), dtype=np.float64)
        vec[:, 0] = size
        ends, lens = np.concatenate([end, start]), np.tile(lengths_np[doc], 2)
        for k, mask in enumerate(prof.masks):
            w = prefix_pairs(lens, ends, mask).reshape(2, -1)
            vec[:, 1 + k] = w[0] - w[1]
        total = vec.sum(0)
        phi = excess_functional(prof, total)
        tau = keep * float(total[1:].min()) / cp
        long &= np.abs(vec @ phi) > tau
    return doc, start, end, long


def excess_of(lengths: np.ndarray, prof: Profile, memo: dict) -> tuple[Any, float]:
    """(excess(a, b, doc_len): the excess functional over positions [a, b) of documents of
    doc_len tokens, its total over all documents)."""
    if "excess" not in memo:
        memo["excess"] = _excess_fn(lengths, prof, memo)
    return memo["excess"]


def doc_work(lengths: np.ndarray, prof: Profile, memo: dict) -> np.ndarray:
    """[n_docs, M] float64: each document's work under each mask (memoized per call)."""
    if "docw" not in memo:
        memo["docw"] = np.stack([prefix_pairs(lengths, lengths, m).astype(np.float64)
                                 for m in prof.masks], 1)
    return memo["docw"]


def _excess_fn(lengths: np.ndarray, prof: Profile, memo: dict) -> tuple[Any, float]:
    """The pair :func:`excess_of` memoizes. The function takes and returns numpy arrays
    (the searches of body_split.py call it ~20 times a batch on a few hundred elements)."""
    vec = np.empty((lengths.size, 1 + len(prof.masks)), dtype=np.float64)
    vec[:, 0] = lengths
    vec[:, 1:] = doc_work(lengths, prof, memo)
    total = vec.sum(0)
    phi_np = excess_functional(prof, total)

    def excess_np(a: np.ndarray, b: np.ndarray, dl: np.ndarray) -> np.ndarray:
        out = phi_np[0] * (b - a).astype(np.float64)
        for k, mask in enumerate(prof.masks):
            out = out + phi_np[1 + k] * (prefix_pairs(dl, b, mask)
                                         - prefix_pairs(dl, a, mask)).astype(np.float64)
        return out

    return excess_np, float(phi_np @ total)


def has_bodies(lengths: np.ndarray, prof: Profile, cp: int, memo: dict) -> bool:
    """Whether any segment carries excess work (a long document with more than the
    negligible excess of ``keep_small``)."""
    if not prof.excess.shape[0]:
        return False
    return bool(segments_of(lengths, prof, cp, True, memo)[3].any())


def prefixes_dense_enough(lengths: np.ndarray, prof: Profile, cp: int, memo: dict) -> bool:
    """:func:`~.rank_cut.rank_reachable`'s density test when everything is filler, before
    any item is built: no segment longer than a rank's share may be much sparser over its
    first share than the mean (the single 128K document, 24-32K documents at 8-16K tokens per
    rank, the heavy tail at 2-4K tokens per rank fail it)."""
    doc, start, end, _ = segments_of(lengths, prof, cp, True, memo)
    share = int(lengths.sum()) // cp
    long = end - start > share
    if not bool(long.any()) or share <= 0:
        return True
    w = doc_work(lengths, prof, memo).sum(0)
    m = int(np.argmin(w))
    mask = prof.masks[m]
    mean = float(w[m]) / max(int(lengths.sum()), 1)
    dl, a = lengths[doc[long]], start[long]
    first = (prefix_pairs(dl, a + share, mask) - prefix_pairs(dl, a, mask)
             ).astype(np.float64)
    return bool((first >= PREFIX_DENSITY * mean * share).all())
