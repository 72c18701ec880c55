"""The rank-by-rank solver: cuts of several unit lists found one rank at a time, so that
each rank's (tokens, column) is exact and the cuts are monotone whatever the lists' local
densities. Items in position order are sparse at their start and dense at their end, where
the global search of vector_cut.py fails; the locality variants use this solver.

A Python loop over ranks on Python floats (~20 us a rank): each step reads single values of
piecewise linear curves, where array ops cost ~100x more.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from ..runs import prefix_pairs
from .items import POSITION_ORDER, Items
from .profile import Profile
from .segments import PREFIX_DENSITY
from .unit_list import UnitList

# A list pair must bracket a rank's target by this share of it before the pair is chosen
# by schedule rather than by margin (0.02-0.1 measured alike).
_MARGIN = 0.1
# ... and a pair's cost: the rest of the cut items the rank starts on (a fetch for it),
# weighed against the schedule (relative to the rank's tokens). 0.5-2 measured alike.
_OFFSET_W = 2.0
# Tolerance (of a rank's share): a rank's error goes to the next rank's target, so it does
# not add up; the snap budgets (phases.py) are 6x larger.
_SOLVE_TOL = 1e-3


class _Curves:
    """The lists' cumulative (tokens -> column) curves as Python lists: the rank-by-rank
    solver reads single values, where Python floats beat array ops by ~100x."""

    def __init__(self, lists: list[UnitList], col: Any) -> None:
        self.pts = [lst.pt.tolist() for lst in lists]
        self.cols = [lst.column(col).tolist() if lst.n else [0.0] for lst in lists]
        self.last = [len(p) - 1 for p in self.pts]
        self.starts = [lst.item_starts().tolist() for lst in lists]
        self.tot = [lst.total for lst in lists]

    def val(self, i: int, x: int) -> float:
        """Column value of list ``i``'s first ``x`` tokens (linear inside a unit)."""
        p, c = self.pts[i], self.cols[i]
        j = bisect.bisect_right(p, x) - 1
        if j >= self.last[i]:
            return c[-1]
        x0 = p[j]
        return c[j] + (c[j + 1] - c[j]) * (x - x0) / (p[j + 1] - x0)

    def offset(self, i: int, x: int) -> int:
        """Tokens of list ``i``'s item at ``x`` before ``x`` (what starting there cuts)."""
        s = self.starts[i]
        return x - s[bisect.bisect_right(s, x) - 1]


def _pick_pair(cv: _Curves, n_d: int, pos: list[int], cur: list[float], k: int, n_r: int,
               t_k: int, w_k: float) -> tuple | None:
    """(score, dense a, sparse b, lo, hi, g(lo), g(hi), base) of the pair of lists whose
    next ``t_k`` tokens can hold the rank's column target ``w_k`` (g = what the rank would
    hold minus its target, for lo..hi tokens from ``a``): feasible first; with several
    pairs, those with a margin of ``_MARGIN``, then the one furthest behind schedule and
    cheapest to start in; else the largest margin. None when no pair has room."""
    n_l = len(cv.tot)
    best = None
    for a in range(n_d):
        for b in range(n_d, n_l):
            lo, hi = max(0, t_k - (cv.tot[b] - pos[b])), min(t_k, cv.tot[a] - pos[a])
            if hi < lo:
                continue
            if hi == lo and n_l == 2:  # no choice: skip the evaluations
                best = ((True,), a, b, lo, hi, 0.0, 0.0, 0.0)
                continue
            base = cur[a] + cur[b] + w_k
            g_lo = cv.val(a, pos[a] + lo) + cv.val(b, pos[b] + t_k - lo) - base
            g_hi = cv.val(a, pos[a] + hi) + cv.val(b, pos[b] + t_k - hi) - base
            feasible = g_lo <= 0 <= g_hi
            score = (feasible,)
            if n_l > 2:
                margin = min(-g_lo, g_hi) / max(abs(w_k), 1.0)
                good = feasible and margin >= _MARGIN
                if good:
                    off = cv.offset(a, pos[a]) + cv.offset(b, pos[b])
                    lag = (2 * k / n_r - pos[a] / max(cv.tot[a], 1)
                           - pos[b] / max(cv.tot[b], 1) - _OFFSET_W * off / max(t_k, 1))
                score = (feasible, good, lag if good else margin)
            if best is None or score > best[0]:
                best = (score, a, b, lo, hi, g_lo, g_hi, base)
    return best


def _regula_falsi(g: Any, lo: int, hi: int, g_lo: float, g_hi: float, tol: float) -> int:
    """The integer x in [lo, hi] nearest g's zero (Illinois regula falsi; g increasing,
    g(lo) < 0 < g(hi)), stopping once within ``tol``."""
    side = 0
    while hi - lo > 1 and -g_lo > tol and g_hi > tol:
        m = min(max(int(lo + (hi - lo) * (-g_lo) / (g_hi - g_lo) + 0.5), lo + 1), hi - 1)
        g_m = g(m)
        if g_m >= 0:
            hi, g_hi = m, g_m
            g_lo = g_lo / 2 if side == 1 else g_lo
            side = 1
        else:
            lo, g_lo = m, g_m
            g_hi = g_hi / 2 if side == -1 else g_hi
            side = -1
    return lo if -g_lo <= g_hi else hi


def rank_cut(dense: list[UnitList], sparse: list[UnitList], n_tok: np.ndarray,
             target: np.ndarray, col: Any) -> list[np.ndarray]:
    """Cuts [cp+1] of every list, solved rank by rank (a Python loop over ranks, on
    Python floats: ~20 us a rank): rank k takes the next stretches of one dense and one
    sparse list, the pair whose stretches bracket its target density (tokens and column
    ``col`` exact up to _SOLVE_TOL of the rank's share, by regula falsi on the piecewise linear
    cumulative values), so the cuts are monotone whatever the lists' local densities
    (items in position order are sparse at their start and dense at their end). With
    several lists a side, among the pairs with a margin of at least ``_MARGIN`` the one
    furthest behind schedule, and least costly to start in (the rest of a cut item is a
    fetch for this rank), is taken. A rank whose target is out of reach takes the nearest
    end; targets are cumulative, so its error goes to the next rank. The last rank takes
    what is left."""
    lists = dense + sparse
    n_l, n_d = len(lists), len(dense)
    cv = _Curves(lists, col)
    nt, tg = n_tok.tolist(), target.tolist()
    n_r = len(nt) - 1
    pos = [0] * n_l
    cur = [0.0] * n_l  # cv.val(i, pos[i])
    out = [[0] * (n_r + 1) for _ in lists]
    done = 0.0
    for k in range(1, n_r):
        t_k, w_k = nt[k] - nt[k - 1], tg[k] - done
        best = _pick_pair(cv, n_d, pos, cur, k, n_r, t_k, w_k)
        if best is None:
            continue
        _, a, b, lo, hi, f_lo, f_hi, base = best
        if f_lo >= 0:
            dx = lo
        elif f_hi <= 0:
            dx = hi
        else:
            dx = _regula_falsi(
                lambda m: cv.val(a, pos[a] + m) + cv.val(b, pos[b] + t_k - m) - base,
                lo, hi, f_lo, f_hi, _SOLVE_TOL * abs(w_k))
        pos[a] += dx
        pos[b] += t_k - dx
        va, vb = cv.val(a, pos[a]), cv.val(b, pos[b])
        done += va - cur[a] + vb - cur[b]
        cur[a], cur[b] = va, vb
        for i in range(n_l):
            out[i][k] = pos[i]
    for i in range(n_l):
        out[i][n_r] = cv.tot[i]
    return [np.array(o, dtype=np.int64) for o in out]


def rank_reachable(items: Items, fill_items: np.ndarray, lengths: np.ndarray,
                   prof: Profile, col: int, f_tok: np.ndarray, f_target: np.ndarray
                   ) -> bool:
    """Cheap test before the rank-by-rank solver: every rank's filler share must be
    non-negative, and a filler item in position order that is longer than a rank's share
    must not be much sparser over its first share of tokens than the ranks' mean target
    (a rank starting on it could not reach its work: 128K tokens of the heavy tail at cp
    64, 2K tokens per rank, vs ~4K mean causal density)."""
    t = (f_tok[1:] - f_tok[:-1]).astype(np.float64)
    w = f_target[1:] - f_target[:-1]
    if bool((t < 0).any()) or bool((w < -1e-6 * float(np.abs(w).max())).any()):
        return False
    kind, start, end = items.kind, items.start, items.end
    share = int(np.sort(t)[(t.size - 1) // 2])  # the lower median
    long = np.flatnonzero(fill_items & (kind == POSITION_ORDER) & (end - start > share))
    if not long.size or share <= 0:
        return True
    mask = prof.masks[col - 1]
    dl, a = lengths[items.doc[long]], start[long]
    first = (prefix_pairs(dl, a + share, mask) - prefix_pairs(dl, a, mask)
             ).astype(np.float64)
    mean = float(w.sum()) / float(t.sum())
    return bool((first >= PREFIX_DENSITY * mean * share).all())
