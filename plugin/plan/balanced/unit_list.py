"""Unit lists: units in a fixed order (items by a key, each item's units in fold order) with
the cumulative (tokens, work per mask) at every unit boundary and break point. A cut is a
token offset into a list; the cuts [cp+1] of a list give rank k the units between cuts k
and k+1. Values between the points are linear, so the solvers (rank_cut.py, vector_cut.py)
evaluate and invert a list's columns in O(log n), and :meth:`UnitList.snap_candidates`
names the cheap boundaries near a cut.

Also here: the orders lists are built in (density spread evenly, density classes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .units import Units

# Cost of a cut, by where it falls: an item (document, head, body) boundary, a unit (tile
# pair) boundary inside a folded item, inside a unit (a "finer" cut, off the tile grid).
_COST = (0, 1, 4)
# Costs of :meth:`UnitList.snap_candidates`' five candidates.
_SNAP_COST = np.array([_COST[2], _COST[0], _COST[0], _COST[1], _COST[1]], dtype=np.float64)


def clip(x: Any, lo: Any, hi: Any) -> np.ndarray:
    """Clamp ``x`` to [lo, hi]: max, then min. ``np.clip`` costs ~3 us a call
    in its argument checks, ~5x these two ufuncs, and the solvers call it ~100 times."""
    return np.minimum(np.maximum(x, lo), hi)


class UnitList:
    """Units in a fixed order, with cumulative (tokens, work...) at every unit boundary and
    at every unit's break point (see :class:`Units`); values in between are interpolated
    linearly.

    numpy throughout (``order`` and every offset in and out are int64 arrays, values
    float64): the solvers evaluate these curves ~100 times an attempt on arrays of 1-300
    elements, where a numpy op costs ~0.5-1 us (a torch op 1.5-6 us)."""

    def __init__(self, units: Units, order: np.ndarray) -> None:
        self.order = order
        n = self.n = order.size
        vec, mid = units.vec[order], units.mid[order]
        r = vec.shape[1]
        cum = vec.cumsum(0)  # (methods, not np.* wrappers: ~2 us less a call)
        # Merged points: unit start, its break point, ..., the end.
        pv = np.zeros((2 * n + 1, r), dtype=np.float64)
        pv[2::2] = cum
        np.add(pv[:-1:2], mid, out=pv[1:-1:2])
        self.pv = pv
        self.pt = pv[:, 0].round().astype(np.int64)
        self.tok = self.pt[::2].copy()
        self._inner = self.pt[1:-1]  # see _locate
        self._tok_inner = self.tok[1:-1]  # see even
        self.total = int(self.pt[-1])
        # Tokens between merged points (at least 1), as floats: _locate divides by it.
        self._span = np.maximum(self.pt[1:] - self.pt[:-1], 1).astype(np.float64)
        # Boundary classes: 0 where an item starts (and at the end), 1 between units.
        cls = np.zeros(n + 1, dtype=np.int64)
        cls[:n] = units.ufold[order] != 0
        if n:
            cls[0] = 0
        self.cls = cls
        self._cols: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
        self._by_id: dict[int, tuple[Any, tuple[np.ndarray, np.ndarray]]] = {}
        self._bounds: list[np.ndarray] = []
        self.even_cuts = True

    def item_starts(self) -> np.ndarray:
        """Token offsets where an item starts in the list (0 first; [1] = 0 if empty)."""
        if self.n == 0:
            return np.zeros(1, dtype=np.int64)
        return self.tok[:-1][self.cls[:-1] == 0]

    def column(self, col: Any) -> np.ndarray:
        """Cumulative column ``col`` (an index, or a [1+M] functional, a float64 array)
        at the merged points; a functional is guarded to be non-decreasing (negative work
        in mixed mask sets counts as flat)."""
        return self._column(col)[0]

    def _column(self, col: Any) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`column` and its steps between merged points (c[j + 1] - c[j], the
        same subtraction the interpolation made per call)."""
        if isinstance(col, int):
            key = col
        else:  # a functional: the same array object is asked for again and again
            hit = self._by_id.get(id(col))
            if hit is not None and hit[0] is col:
                return hit[1]
            key = tuple(col.tolist())
        if key not in self._cols:
            if isinstance(col, int):
                c = self.pv[:, col].copy()
            else:
                c = np.maximum.accumulate(np.maximum(self.pv @ col, 0.0))
            self._cols[key] = (c, c[1:] - c[:-1])
        if not isinstance(col, int):
            self._by_id[id(col)] = (col, self._cols[key])  # holds col: its id stays unique
        return self._cols[key]

    def _locate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The merged point at or before x, in [0, 2n - 1]: searching the inner points
        # pt[1:-1] gives it directly (pt is non-decreasing), where searching all of pt
        # needs a -1 and a clamp (3 ops of ~1 us; ~40 calls a batch).
        j = self._inner.searchsorted(x, "right")
        frac = clip((x - self.pt[j]) / self._span[j], 0, 1)
        return j, frac

    def at(self, x: np.ndarray) -> np.ndarray:
        """Cumulative vectors at token offsets ``x`` (int64, any shape): [..., 1+M]."""
        if self.n == 0:
            return np.zeros((*x.shape, self.pv.shape[1]), dtype=np.float64)
        j, frac = self._locate(x)
        v0 = self.pv[j]
        return v0 + frac[..., None] * (self.pv[j + 1] - v0)

    def at_col(self, x: np.ndarray, col: Any) -> np.ndarray:
        """One column (or a functional, see :meth:`column`) of :meth:`at`."""
        if self.n == 0:
            return np.zeros(x.shape, dtype=np.float64)
        c, dc = self._column(col)
        j, frac = self._locate(x)
        return c[j] + frac * dc[j]

    def value_slope(self, x: np.ndarray, col: Any) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`at_col` and the column's increase per token there."""
        c, dc = self._column(col)
        j, frac = self._locate(x)
        dv = dc[j]
        return c[j] + frac * dv, dv / self._span[j]

    def at_cols(self, x: np.ndarray, cols: list) -> list[np.ndarray]:
        """:meth:`at_col` for several columns, locating ``x`` once."""
        if self.n == 0:
            return [np.zeros(x.shape, dtype=np.float64) for _ in cols]
        j, frac = self._locate(x)
        out = []
        for col in cols:
            c, dc = self._column(col)
            out.append(c[j] + frac * dc[j])
        return out

    def inverse(self, col: Any, value: np.ndarray) -> np.ndarray:
        """Smallest token offset where column ``col`` reaches ``value`` (any shape),
        interpolated, clamped to [0, total]."""
        if self.n == 0:
            return np.zeros(value.shape, dtype=np.int64)
        c = self.column(col)
        flat = value.reshape(-1)
        j = clip(c.searchsorted(flat), 1, 2 * self.n)
        i = j - 1
        with np.errstate(over="ignore"):  # a huge quotient clips to 1
            frac = clip((flat - c[i]) / np.maximum(c[j] - c[i], 1e-300), 0, 1)
        x = self.pt[i] + (frac * (self.pt[j] - self.pt[i]).astype(np.float64)
                              ).round().astype(np.int64)
        return np.where(flat <= 0, 0, x).reshape(value.shape)

    def even(self, x: np.ndarray) -> np.ndarray:
        """Cuts inside a unit moved down to an even offset in it (both stretches of a
        unit's order alternate two ends, and its first stretch is even, so only even
        offsets keep the work linear). Off for tiny batches (``even_cuts``), where one
        token is more than the token budget."""
        if self.n == 0 or not self.even_cuts:
            return x
        i = self._tok_inner.searchsorted(x, "right")  # in [0, n - 1], as in _locate
        odd = ((x - self.tok[i]) % 2 == 1) & (x < self.tok[i + 1])
        return np.where(odd, x - 1, x)

    def snap_candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Offsets near ``x`` [K] a cut may move to, [K, 5], and their costs [5]: x itself
        (a finer cut unless it is a boundary), the nearest item boundary below and above,
        the nearest unit boundary below and above."""
        cands = [x]
        if not self._bounds:
            self._bounds = [self.tok[self.cls <= c] for c in range(2)]
        for b in self._bounds:
            lo = np.maximum(b.searchsorted(x, "right") - 1, 0)
            hi = np.minimum(b.searchsorted(x), b.size - 1)
            cands += [b[lo], b[hi]]
        return np.stack(cands, 1), _SNAP_COST


def new_list(units: Units, order: np.ndarray, tok_budget: float) -> UnitList:
    """A list of ``units[order]``; cuts inside units kept even unless the token budget is
    under 2 tokens (see :meth:`UnitList.even`)."""
    lst = UnitList(units, order)
    lst.even_cuts = tok_budget >= 2
    return lst


def unit_order(units: Units, sel: np.ndarray, item_key: np.ndarray) -> np.ndarray:
    """Indices of the selected units ordered by (item_key of their item, fold). (The keys
    are unique, item_key being a permutation, so the sort's stability does not matter.)"""
    ufold = units.ufold
    idx = np.flatnonzero(sel)
    span = int(ufold.max()) + 1 if ufold.size else 1
    return idx[(item_key[units.item[idx]] * span + ufold[idx]).argsort(kind="stable")]


def spread_key(density: np.ndarray, tokens: np.ndarray, groups: int = 8) -> np.ndarray:
    """Item sort key spreading densities evenly by tokens: items sorted by density are
    cut into ``groups`` runs of equal tokens, then merged by phase (each item's middle
    token's share of its run), so every stretch of a list holds each density range in
    proportion to its tokens and per-rank targets near the mean stay reachable."""
    order = density.argsort(kind="stable")
    t = tokens[order]
    cum = t.cumsum()
    total = float(cum[-1]) if cum.size else 1.0
    mid = cum - t / 2
    g = np.minimum((mid * groups / max(total, 1.0)).astype(np.int64), groups - 1)
    g_start = np.full(groups, np.inf)
    np.minimum.at(g_start, g, cum - t)
    g_start[np.isinf(g_start)] = 0.0  # groups without items (never read)
    g_tok = np.bincount(g, weights=t, minlength=groups)
    phase = (mid - g_start[g]) / np.maximum(g_tok[g], 1)
    key = np.empty_like(order)
    key[order[phase.argsort(kind="stable")]] = np.arange(order.size)
    return key


def item_sums(units: Units, n_items: int, col: Any) -> np.ndarray:
    """[n_items] float64: column ``col`` (an index, or a [1+M] functional, a float64
    array) summed per item, in unit order (``bincount``: ~5 us where torch's index_add_
    took ~25 us)."""
    v = units.vec[:, col] if isinstance(col, int) else units.vec @ col
    return np.bincount(units.item, weights=v, minlength=n_items)


def density_classes(units: Units, sel: np.ndarray, item_d: np.ndarray,
                    item_t: np.ndarray, key: np.ndarray, n: int, tok_budget: float
                    ) -> list[UnitList]:
    """The selected units as ``n`` lists of equal tokens by item density (low first),
    each in ``key`` order."""
    u_item = units.item
    items = np.unique(u_item[sel])
    o = items[item_d[items].argsort(kind="stable")]
    cum = item_t[o].cumsum()
    total = float(cum[-1]) if cum.size else 1.0
    grp = np.minimum(((cum - item_t[o] / 2) * n / max(total, 1.0)).astype(np.int64), n - 1)
    g_of = np.full(item_t.size, -1, dtype=np.int64)
    g_of[o] = grp
    return [new_list(units, unit_order(units, sel & (g_of[u_item] == g), key), tok_budget)
            for g in range(n)]
