"""The vector solvers: all rank boundaries of a list at once, then each cut snapped to the
cheapest nearby boundary within budgets (the fold variants). One body list cut by excess
(:func:`cut_excess`, an exact 1-D inverse), or a dense / sparse pair cut so that every
boundary gets its tokens and its target in one column (:func:`pair_cut`: a k-ary search
for the roots, cuts that go backwards made monotone and their error diffused, then the
snap; or, with ``seq``, rank_cut.py's exact rank-by-rank cuts).

Snap: a cut moves to an item boundary (cost 0), a unit boundary (1) or stays a finer cut
inside a unit (4) when the error this causes in every column stays within its budget;
cuts stay between the midpoints of their neighbours, so they stay in order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .body_split import PROBES
from .rank_cut import rank_cut
from .unit_list import UnitList, clip


def cut_excess(lst: UnitList, phi: np.ndarray, target: np.ndarray, budget: float
               ) -> np.ndarray:
    """Token offsets [K] of the body list where its cumulative excess ``phi`` (a [1+M]
    functional) reaches ``target`` [K], moved to a cheaper boundary within ``budget``."""
    if lst.n == 0:
        return np.zeros(target.shape, dtype=np.int64)
    tok = lst.inverse(phi, target)
    cands, cost = lst.snap_candidates(tok)
    err = np.abs(lst.at_col(cands, phi) - target[:, None])
    ok = (err <= budget) & _between(cands, tok)
    ok[:, 0] = True
    score = np.where(ok, cost, math.inf) + err / (budget + 1e-300) * 1e-3
    best = score.argmin(1)
    return np.maximum.accumulate(lst.even(cands[np.arange(cands.shape[0]), best]))


def _cut_fill(dense: UnitList, sparse: UnitList, n_tok: np.ndarray, target: np.ndarray,
              col: Any) -> np.ndarray:
    """x with f(x) = dense(x) + sparse(N - x) - target = 0 in column ``col``, per boundary
    (x in [max(0, N - |S|), min(|D|, N)]); f is non-decreasing while the dense units are
    denser than the sparse ones. A k-ary search brackets the root to 32 tokens (2-3 rounds
    for 128K tokens; regula falsi needs ~10 on these piecewise linear f), then f is taken
    as linear there (the snap evaluates its candidates exactly); ends clamp when the
    target is out of reach."""
    lo = np.maximum(n_tok - sparse.total, 0)
    hi = np.maximum(np.minimum(n_tok, dense.total), 0)
    lo = np.minimum(lo, hi)
    steps = np.arange(1, PROBES + 1)
    rows = np.arange(n_tok.size)

    def f(x: np.ndarray, n: np.ndarray, t: np.ndarray) -> np.ndarray:
        return dense.at_col(x, col) + sparse.at_col(n - x, col) - t

    while bool((hi - lo > 32).any()):
        probe = lo[:, None] + (hi - lo)[:, None] * steps // PROBES
        ok = f(probe, n_tok[:, None], target[:, None]) >= 0
        ok[:, -1] = True
        j = ok.argmax(1)
        new_hi = probe[rows, j]
        lo = np.where(j > 0, probe[rows, np.maximum(j - 1, 0)], lo)
        hi = new_hi
    f_lo, f_hi = f(np.stack([lo, hi]), n_tok, target)  # one evaluation for both ends
    with np.errstate(over="ignore"):  # a huge quotient clips to 1
        frac = clip(-f_lo / np.maximum(f_hi - f_lo, 1e-300), 0, 1)
    x = lo + (frac * (hi - lo).astype(np.float64)).round().astype(np.int64)
    return np.where(f_lo >= 0, lo, np.where(f_hi <= 0, hi, x))


def _snap_pair(dense: UnitList, sparse: UnitList, x: np.ndarray, n_tok: np.ndarray,
               col: Any, limits: list[tuple[Any, float, float]]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Move a dense / sparse cut pair (dense at x, sparse at N - x) to cheap boundaries.

    A candidate is acceptable when, for each (column or functional, budget, priority) of
    ``limits``, the change it causes there relative to the exact cuts is within the
    budget; the cheapest acceptable one wins, else the one with the smallest changes
    relative to the budgets, weighted by priority (layer counts: errors go to the masks of
    fewer layers first). The sparse candidates are taken near two anchors per dense
    candidate: the token-exact offset and the ``col``-exact one.
    """
    K = x.size
    s = n_tok - x
    dc, dcost = dense.snap_candidates(x)  # [K, C]
    cols = [c for c, _, _ in limits]
    # The values at the exact cuts and at the dense candidates, once for every limit;
    # ``col`` is one of the limits' columns (the same values as evaluating it alone).
    refs = [a + b for a, b in zip(dense.at_cols(x, cols), sparse.at_cols(s, cols))]
    d_vals = dense.at_cols(dc, cols)
    i_col = next((i for i, c in enumerate(cols) if c is col
                  or (isinstance(c, int) and isinstance(col, int) and c == col)), None)
    if i_col is None:
        d_col = dense.at_col(dc, col)
        ref_col = dense.at_col(x, col) + sparse.at_col(s, col)
    else:
        d_col, ref_col = d_vals[i_col], refs[i_col]
    s_col = sparse.inverse(col, ref_col[:, None] - d_col)
    anchors = np.concatenate([clip(n_tok[:, None] - dc, 0, sparse.total), s_col], 1)
    A = anchors.shape[1]
    sc, scost = sparse.snap_candidates(anchors.reshape(-1))  # [K*2C, C]
    n_c = scost.size
    sc = sc.reshape(K, A * n_c)
    scost = np.tile(scost, A)
    ok = _between(dc, x)[:, :, None] & _between(sc, s)[:, None, :]
    rel = np.zeros(ok.shape, dtype=np.float64)
    for ref, dv, sv, (_, budget, prio) in zip(refs, d_vals, sparse.at_cols(sc, cols),
                                              limits):
        err = np.abs(dv[:, :, None] + sv[:, None, :] - ref.reshape(K, 1, 1))
        ok &= err <= budget
        rel += err * (prio / max(budget, 1e-9))
    cost = dcost.reshape(1, -1, 1) + scost.reshape(1, 1, -1)
    score = np.where(ok, cost + 1e-3 * rel, 1e6 + rel).reshape(K, -1)
    best = score.argmin(1)
    bi, si = best // (A * n_c), best % (A * n_c)
    rows = np.arange(K)
    return dc[rows, bi], sc[rows, si]


def _between(cands: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Candidates [K, C] of boundary k lying between the midpoints of the exact cuts [K]
    of boundaries k-1, k and k, k+1, so that moving every cut keeps them in order."""
    prev = np.concatenate([exact[:1], exact[:-1]])
    nxt = np.concatenate([exact[1:], exact[-1:]])
    lo = (prev + exact + 1) // 2
    hi = (exact + nxt) // 2
    return (cands >= lo[:, None]) & (cands <= hi[:, None])


def _untangle(dense: UnitList, sparse: UnitList, y: np.ndarray, n_tok: np.ndarray,
              target: np.ndarray, col: Any, rounds: int = 16) -> np.ndarray:
    """Exact dense cuts ``y`` that go backwards (in the dense or the sparse list) made
    monotone, and the errors that leaves diffused to the neighbouring ranks.

    The exact cuts only go backwards where a stretch of a list is locally denser or
    sparser than the rank targets allow (a unit of an item holding its partial last tile
    is sparser than the item, the others denser): clamping then leaves one rank over and
    its neighbour under. Each round moves every boundary (dense forward, sparse back by as
    many tokens) half way to the error of its two neighbours, within its neighbours' cuts:
    a few rounds spread the error over a few ranks (at cp 128 on 128K tokens: max/mean
    1.049 -> measured below 1.03)."""
    s = n_tok - y
    if bool((y[1:] >= y[:-1]).all()) and bool((s[1:] >= s[:-1]).all()):
        return y
    for _ in range(3):
        y = np.maximum.accumulate(y)
        y = n_tok - np.maximum.accumulate(n_tok - y)
    y = np.minimum(np.maximum.accumulate(y), n_tok)
    y[0], y[-1] = 0, dense.total
    if dense.n == 0 or sparse.n == 0:
        return y
    for _ in range(rounds):
        s = n_tok - y
        vd, dd = dense.value_slope(y, col)
        vs, ds = sparse.value_slope(s, col)
        err = vd + vs - target
        want = (err[:-2] + err[2:]) / 2 - err[1:-1]
        yi = y[1:-1]
        step = (0.5 * want / np.maximum(dd[1:-1] - ds[1:-1], 1e-9)).round().astype(np.int64)
        lo = np.maximum(y[:-2], n_tok[1:-1] - s[2:])
        hi = np.minimum(y[2:], n_tok[1:-1] - s[:-2])
        new = np.minimum(np.maximum(yi + step, lo), hi)
        y = np.concatenate([y[:1], np.where(lo <= hi, new, yi), y[-1:]])
    return y


def pair_cut(dense: UnitList, sparse: UnitList, n_tok: np.ndarray, target: np.ndarray,
             col: Any, limits: list[tuple[Any, float, float]], give_up: bool = False,
             seq: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """Cuts [cp+1] of a dense / sparse list pair giving boundary k ``n_tok[k]`` tokens and
    ``target[k]`` in column ``col`` (exact, then snapped within the budgets of ``limits``,
    relative to what the exact cuts reach, see :func:`_snap_pair`). give_up: None
    instead of untangling exact cuts that go backwards (a sign of targets out of reach).
    seq: exact cuts rank by rank (:func:`rank_cut`), not snapped."""
    n_tok = clip(n_tok, 0, dense.total + sparse.total)
    n_tok[-1] = dense.total + sparse.total
    if seq:
        # Exact rank by rank and not snapped: the snap saved no fetch here (a cut in an
        # item in position order costs its offset either way) and took a third of the time.
        y = rank_cut([dense], [sparse], n_tok, target, col)[0]
        return y, n_tok - y
    else:
        y = _cut_fill(dense, sparse, n_tok, target, col)
        if give_up and not (bool((y[1:] >= y[:-1]).all())
                            and bool((n_tok[1:] - y[1:] >= n_tok[:-1] - y[:-1]).all())):
            return None
        y = _untangle(dense, sparse, y, n_tok, target, col)
    yd, ys = _snap_pair(dense, sparse, y, n_tok, col, limits)
    yd = np.maximum.accumulate(dense.even(yd))
    ys = np.maximum.accumulate(sparse.even(ys))
    yd[0], ys[0] = 0, 0
    yd[-1], ys[-1] = dense.total, sparse.total
    return yd, ys


def pair_reachable(dense: tuple[int, float, float], sparse: tuple[int, float, float],
                   f_tok: np.ndarray, f_target: np.ndarray) -> bool:
    """Whether every rank's filler share (tokens, column) lies between the sparse and the
    dense list's mean densities: with the lists' densities spread evenly that is about
    what a dense / sparse cut can reach. ``dense`` / ``sparse``: (units, tokens, column
    total) of each list. Checked before the filler lists are built, so that a variant
    that cannot balance costs little (lognormal_long, Llama 4, cp 64: 8.5 -> ~1 ms)."""
    if dense[0] == 0 or sparse[0] == 0:  # nothing to mix: the bodies must do it alone
        return True
    t = (f_tok[1:] - f_tok[:-1]).astype(np.float64)
    w = f_target[1:] - f_target[:-1]
    lo = sparse[2] / max(sparse[1], 1)
    hi = dense[2] / max(dense[1], 1)
    return bool((t >= 0).all()) and bool(((w >= lo * t) & (w <= hi * t)).all())
