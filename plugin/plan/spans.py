"""Key spans of query runs, their union per holder and document, and their cut by runs.

``tables.selected`` and ``tables.staged`` cut every rank's key spans by the ranks' runs on
each plan and mask (``fetch_counts``, ``pair_counts``, the staged runs; the tests' per-key
``select_keys`` / ``sent_keys``), and ``plan.nodes`` on a layout's pieces before any table
exists (which ranks need whose keys, to place ranks on nodes):
a few thousand runs at cp 64, in numpy (torch's per-op cost, ~3-5 us on CPU against
numpy's ~0.5-1, made ``span_pieces`` alone ~3 ms of ``auto``'s ~30 ms at cp 64). Why a run's
keys are one span and a holder's spans merge into a few: ``plan/runs.py``'s docstring.
tests/tables/test_schedule_cache.py checks them against per-token references.
"""

from __future__ import annotations

import numpy as np

from ..masks import AttnMask
from .runs import STRIDE


def key_spans(start: np.ndarray, stop: np.ndarray, doc_len: np.ndarray, mask: AttnMask
              ) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive (lo, hi) of the keys the queries of each run [start, stop) see, clipped to
    its document (``doc_len``: the run's document's length)."""
    lo, _ = mask.key_interval(start)
    _, hi = mask.key_interval(stop - 1)
    return np.maximum(lo, 0), np.minimum(hi, doc_len - 1)


def merge_spans(holder: np.ndarray, doc: np.ndarray, lo: np.ndarray, hi: np.ndarray
                ) -> tuple[np.ndarray, ...]:
    """Union of spans per (holder, doc), input sorted by (holder, doc, run start): a span
    starts a new merged span iff it begins after the previous one's end + 1."""
    n = lo.size
    if n == 0:
        return holder, doc, lo, hi
    new = np.ones(n, dtype=bool)
    same = (holder[1:] == holder[:-1]) & (doc[1:] == doc[:-1])
    new[1:] = ~same | (lo[1:] > hi[:-1] + 1)
    last = np.ones(n, dtype=bool)
    last[:-1] = new[1:]
    return holder[new], doc[new], lo[new], hi[last]


def span_pieces(doc: np.ndarray, lo: np.ndarray, hi: np.ndarray, run_doc: np.ndarray,
                run_start: np.ndarray, run_stop: np.ndarray) -> tuple[np.ndarray, ...]:
    """Intersections of spans (doc, [lo, hi]) with runs (``run_*``, sorted by (doc, start),
    not overlapping): (span index, run index, first position, length) of every non-empty
    piece, in (span, position) order."""
    start_key = run_doc * STRIDE + run_start
    stop_key = run_doc * STRIDE + run_stop  # exclusive
    first = np.searchsorted(stop_key, doc * STRIDE + lo, side="right")   # runs ending > lo
    last = np.searchsorted(start_key, doc * STRIDE + hi, side="right")   # runs starting <= hi
    count = np.maximum(last - first, 0)
    span = np.repeat(np.arange(doc.size, dtype=np.int64), count)
    run = np.arange(span.size, dtype=np.int64) - (np.cumsum(count) - count)[span] + first[span]
    a = np.maximum(lo[span], run_start[run])
    b = np.minimum(hi[span] + 1, run_stop[run])
    return span, run, a, b - a
