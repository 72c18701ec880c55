"""Where a long body is split when it is walked in position order (the locality variants):
chunked + causal bodies at the start of a tail block that holds whole rank shares of excess
(``blocks``), window + causal bodies where a token's excess reaches the bodies' mean
(``split``; with ``by_doc``, where a token's excess reaches its document group's mean).
Both are searches over positions on the closed forms, vectorized over bodies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runs import prefix_pairs
from .profile import Profile
from .segments import doc_work, excess_of

# Probes per round of a k-ary search (here and in vector_cut.py's pair cuts): 32 takes 2-3
# rounds over 128K tokens.
PROBES = 32


def _last_true(lo: np.ndarray, hi: np.ndarray, pred: Any) -> np.ndarray:
    """Per row, the largest p in [lo, hi] with pred(p) (pred true then false along p;
    lo is returned where pred(lo) is false): a k-ary search, PROBES probes a round. numpy
    (int64 in and out): each round is ~15 ops on a few hundred elements."""
    lo, hi = lo.copy(), hi.copy()
    rows = np.arange(lo.size)
    steps = np.arange(1, PROBES + 1)
    while bool((hi > lo).any()):
        probe = lo[:, None] + ((hi - lo)[:, None] * steps + PROBES - 1) // PROBES
        ok = pred(probe.reshape(-1), np.repeat(rows, PROBES)).reshape(-1, PROBES)
        last = ok.astype(np.int8).cumprod(1).sum(1) - 1  # ok is a prefix of the probes
        new_lo = np.where(last >= 0, probe[rows, np.maximum(last, 0)], lo)
        new_hi = np.where(last < PROBES - 1,
                          probe[rows, np.minimum(last + 1, PROBES - 1)] - 1, hi)
        lo, hi = new_lo, np.maximum(new_hi, new_lo)
    return lo


def tail_split(lengths: np.ndarray, prof: Profile, cp: int, doc: np.ndarray,
               start: np.ndarray, end: np.ndarray, memo: dict
               ) -> tuple[np.ndarray, np.ndarray]:
    """(p, n) per body [start, end): the excess of [p, end) is n whole rank shares (n =
    floor of the body's excess in shares), p the largest position with at least that much
    (p = end when n = 0)."""
    excess, total = excess_of(lengths, prof, memo)
    dl = lengths[doc]
    share = total / cp
    n = np.floor(excess(start, end, dl) / share * (1 + 1e-12)).astype(np.int64)
    want = n.astype(np.float64) * share
    p = _last_true(start, end, lambda x, r: excess(x, end[r], dl[r]) >= want[r])
    return p, n


def density_split(lengths: np.ndarray, prof: Profile, doc: np.ndarray,
                  start: np.ndarray, end: np.ndarray, memo: dict) -> np.ndarray:
    """Per body [start, end): the first position whose token carries at least the bodies'
    mean excess per token. With every mask looking left a token's work depends on its
    position only, and grows with it, so one search over positions serves all bodies."""
    excess, _ = excess_of(lengths, prof, memo)
    dl = lengths[doc]
    mean = float(excess(start, end, dl).sum()) / max(float((end - start).sum()), 1.0)
    top = int(lengths.max())
    # First position p with excess(p, p+1) >= mean: a coarse grid, then the bracket.
    step = max(1, -(-top // 1024))
    grid = np.arange(0, top, step, dtype=np.int64)
    ok = excess(grid, grid + 1, np.full_like(grid, top)) >= mean
    i = int(np.argmax(ok)) if bool(ok.any()) else grid.size
    fine = np.arange(max(0, (i - 1) * step), min(top, i * step + 1), dtype=np.int64)
    ok = excess(fine, fine + 1, np.full_like(fine, top)) >= mean
    q = int(fine[int(np.argmax(ok))]) if bool(ok.any()) else top
    q = (q + prof.tile - 1) // prof.tile * prof.tile  # on the tile grid: no extra cut
    return np.minimum(np.maximum(np.full_like(start, q), start), end)


# by_doc: a document whose body would bring a rank more than this share of its mean work
# in the filler column per share of excess (the rest comes from filler) is sparse: it joins
# the densest document's group.
GROUP_CAP = 0.85


def group_split(lengths: np.ndarray, prof: Profile, cp: int, doc: np.ndarray,
                start: np.ndarray, end: np.ndarray, memo: dict
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(p, group, dense) per body [start, end) (``Variant.by_doc``): the bodies' groups
    (each dense document one, densest in excess per token first; each sparse one joins a
    group with room, the shortest dense documents' groups first, by a first-fit on
    cumulative room and need: a body whose need spans two groups' room goes to the later,
    and where that overfills it there are no groups), whether the body is its group's
    dense document, and the first position whose token carries at least its group's mean
    excess per token (on the tile grid); None where there are fewer than two groups or a
    sparse body finds no room (the plain ``split`` then serves)."""
    excess, tot_e = excess_of(lengths, prof, memo)
    dl = lengths[doc]
    x = excess(start, end, dl)
    t = (end - start).astype(np.float64)
    dw = doc_work(lengths, prof, memo)
    col = int(np.argmin(dw.sum(0)))  # the filler column (as phases._setup picks it)
    mask = prof.masks[col]
    w = (prefix_pairs(dl, end, mask) - prefix_pairs(dl, start, mask)).astype(np.float64)
    share_x, share_w = tot_e / cp, float(dw[:, col].sum()) / cp
    ratio = w * share_x / np.maximum(x, 1e-300) / share_w
    dense = ratio <= GROUP_CAP
    order = np.argsort(ratio, kind="stable")
    group = np.zeros(doc.size, dtype=np.int64)
    dense_o = order[dense[order]]  # the dense bodies, densest first: groups 0, 1, ...
    group[dense_o] = np.arange(dense_o.size)
    # Each sparse body joins a group with room (in filler-column work over what its
    # excess brings at the cap), the groups of the shortest documents first (a rank's late
    # stretch of one then costs the fewest keys beside the sparse document's): a
    # first-fit on cumulative sums, checked after.
    c = GROUP_CAP * share_w / share_x
    fill_o = dense_o[np.argsort(dl[dense_o], kind="stable")]
    sparse_o = order[~dense[order]]
    slot = np.searchsorted(np.cumsum(c * x[fill_o] - w[fill_o]),
                           np.cumsum(w[sparse_o] - c * x[sparse_o]), side="left")
    if dense_o.size < 2 or bool((slot >= fill_o.size).any()):
        return None
    group[sparse_o] = group[fill_o[slot]]
    g_x = np.bincount(group, weights=x, minlength=dense_o.size)
    if bool((np.bincount(group, weights=w, minlength=dense_o.size)
             > c * g_x * (1 + 1e-9)).any()):
        return None
    mean = (g_x / np.maximum(np.bincount(group, weights=t, minlength=dense_o.size),
                             1.0))[group]
    # The last p with every token of [start, p) below the mean (a token's excess grows
    # with its position where every mask looks left).
    p = _last_true(start, end, lambda q, r: (q == start[r]) | (
        excess(np.maximum(q - 1, 0), q, dl[r]) < mean[r]))
    q = (p + prof.tile - 1) // prof.tile * prof.tile
    return np.minimum(np.maximum(q, start), end), group, dense
