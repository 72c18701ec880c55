"""The entry point: :func:`balanced_runs` tries the attempts of variants.py in order on
items and units built once per (body, keep_small, fill, big, mirror_tail, by_doc,
nest_long), keeps the best, and turns its
cuts (and any nested pieces, relabelled) into maximal runs (rank, document, start, length).
The ``few`` variant is one attempt per holder count; of those that meet the targets, the
one whose most-fetching rank fetches least is taken (:func:`_fetch_max`, causal keys from
the runs). ``few``, ``nest``, ``nest_long``, ``mirror_tail`` and ``by_doc`` attempts are
taken where they meet the targets counted exactly on their runs (``few`` and ``nest`` never
as the best of failed attempts); ``nest_long``, ``mirror_tail`` and ``by_doc`` only where
they fetch 5% less (:func:`_fetch_cost`) than the layout the other attempts give, or where
that misses the targets (:func:`_guarded_or`); where every attempt misses them, the one
nearest them is taken, these three included.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import numpy as np

from ...masks import AttnMask
from .args import TOKEN_TOL, WORK_TOL, MaskWeights, runs_per_rank
from .items import Items, cut_items, mirror_tail_reachable
from .nested import long_nestable
from .phases import Layout, holder_counts, solve_attempt
from .profile import profile_of
from .segments import has_bodies, prefixes_dense_enough
from .units import Units, unit_runs, units_of
from .variants import choose_variants


def balanced_runs(lengths: Any, cp_size: int, masks: MaskWeights, tile_tokens: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, doc, start, length) int64 numpy runs of the balanced layout (see the package
    docstring) for documents of ``lengths`` (int64 numpy, or anything ``np.asarray``
    takes); inputs validated. Runs are maximal: one per (rank, document, stretch of
    consecutive positions), sorted by (rank, document, start)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp_size == 1 or int(lengths.sum()) == 0:
        d = np.flatnonzero(lengths > 0)
        return np.zeros_like(d), d, np.zeros_like(d), lengths[d]
    # Overflow to inf and divisions by zero are expected (and clipped or compared): no
    # warnings.
    with np.errstate(all="ignore"):
        return _solve(lengths, cp_size, _profile(masks, tile_tokens))


@functools.lru_cache(maxsize=32)
def _cached_profile(masks: MaskWeights, tile_tokens: int) -> Any:
    return profile_of(masks, tile_tokens)


def _profile(masks: MaskWeights, tile_tokens: int) -> Any:
    """The masks' profile, built once per (masks, tile) (~0.1 ms of set-up a batch;
    a model has one or two mask sets). Profiles are never modified."""
    try:
        return _cached_profile(masks, tile_tokens)
    except TypeError:  # unhashable masks (a list): not cached
        return profile_of(masks, tile_tokens)


def _solve(lengths: np.ndarray, cp_size: int, prof: Any) -> tuple[np.ndarray, ...]:
    """:func:`balanced_runs` for cp > 1 and a non-empty batch."""
    best, best_score = None, math.inf
    items_of: dict[tuple, tuple[Items, Units, dict]] = {}
    cut: dict[tuple, Items] = {}
    memo: dict = {}
    unreachable = set()
    bodies = has_bodies(lengths, prof, cp_size, memo)
    prefix_ok = bodies or prefixes_dense_enough(lengths, prof, cp_size, memo)

    def items_for(var: Any) -> Items:
        if _key(var) not in cut:
            cut[_key(var)] = cut_items(lengths, prof, cp_size, var, memo)
        return cut[_key(var)]

    def built(var: Any) -> tuple[Items, Units, dict]:
        if _key(var) not in items_of:
            items = items_for(var)
            items_of[_key(var)] = (items, units_of(items, lengths, prof), {})
        return items_of[_key(var)]

    variants = choose_variants(prof, bodies, prefix_ok)
    guarded = None  # the runs of a nest_long / mirror_tail / by_doc attempt that meets them
    for i, var in enumerate(variants):
        key = _key(var)
        if key in unreachable and var.solver != "vector":
            continue  # the same items and precheck: the other rank-by-rank solver fails too
        if var.few:
            # The counts from the plain split's items (the same bodies; cut for it
            # anyway), so that none are cut for this one where it has nothing to try.
            plain = next(v for v in variants[i + 1:] if not v.by_doc)
            counts = holder_counts(items_for(plain), lengths, prof, cp_size, memo)
            if not counts:
                continue
            items, units, cache = built(var)
            runs = _fewest_holders(units, prof, cp_size, var, items, lengths, cache, counts)
            if runs is not None:
                return _guarded_or(guarded, runs, lengths, prof, cp_size)
            continue
        if var.mirror_tail and not mirror_tail_reachable(lengths, prof, cp_size, memo):
            continue
        if var.nest_long and not long_nestable(lengths, prof, cp_size, memo):
            continue  # a body with more excess, or none to nest: the split attempts serve
        if var.by_doc and items_for(var).group is None:
            continue  # fewer than two document groups: the plain split serves
        items, units, cache = built(var)
        lay = solve_attempt(units, prof, cp_size, var, items, lengths, cache)
        if var.nest and not var.nest_long:  # taken where it meets the targets exactly
            runs = _exact_runs(units, lay, lengths, prof, cp_size)
            if runs is not None:
                return runs
            continue
        if var.mirror_tail or var.by_doc or var.nest_long:  # weighed against the others
            runs = _exact_runs(units, lay, lengths, prof, cp_size)
            if guarded is not None and runs is not None:  # two meet them: the one that
                # fetches less (the first where equal)
                runs = min((guarded, runs), key=lambda r: _fetch_cost(*r, lengths, prof,
                                                                      cp_size))
            guarded = guarded if runs is None else runs
            score = _score(lay.per_rank)
            if runs is None and score > 1.0 and (best is None or score < best_score) \
                    and _holds_all(units, lay, lengths):
                best, best_score = (lay, units), score  # the best of failed attempts
            continue
        if lay.unreachable:
            unreachable.add(key)
        score = _score(lay.per_rank)
        if best is None or score < best_score:
            best, best_score = (lay, units), score
        if best_score <= 1.0:
            break
    runs = _merge_runs(*_layout_runs(best[1], best[0]))
    if guarded is not None and best_score > 1.0:
        return guarded
    return _guarded_or(guarded, runs, lengths, prof, cp_size)


def _guarded_or(guarded: tuple | None, runs: tuple, lengths: np.ndarray, prof: Any,
                cp: int) -> tuple:
    """``guarded`` (the runs of a ``mirror_tail``, ``by_doc`` or ``nest_long`` attempt that
    meets the targets, or None) where it fetches ``_GUARD_GAIN`` less than ``runs``
    (which meet them too), else ``runs``."""
    if guarded is not None and _fetch_cost(*guarded, lengths, prof, cp) \
            < (1 - _GUARD_GAIN) * _fetch_cost(*runs, lengths, prof, cp):
        return guarded
    return runs


def _key(var: Any) -> tuple:
    """What a variant's items and units depend on (attempts with the same key share them)."""
    return (var.body, var.keep_small, var.fill, var.big, var.mirror_tail, var.by_doc,
            var.nest_long)


def _fewest_holders(units: Units, prof: Any, cp: int, var: Any, items: Items,
                    lengths: np.ndarray, cache: dict, counts: list[int]
                    ) -> tuple[np.ndarray, ...] | None:
    """The merged runs of the ``few`` variant: one attempt per holder count of
    ``counts`` (:func:`~.phases.holder_counts`); of those that meet the targets, counted
    exactly on their runs, the one whose rank with most keys to fetch fetches least (ties:
    the better balance). None where none meets them (the next variants are tried)."""
    best, best_key = None, None
    for n in counts:
        lay = solve_attempt(units, prof, cp, replace(var, holders=n), items, lengths, cache)
        runs = _exact_runs(units, lay, lengths, prof, cp)
        if runs is None:
            continue
        key = (_fetch_max(*runs, cp), _score(runs_per_rank(*runs, lengths, prof.masks, cp)))
        if best_key is None or key < best_key:
            best, best_key = runs, key
    return best


_CAUSAL = AttnMask()

# A nest_long, mirror_tail or by_doc layout is taken over the one the other attempts give
# (where that meets the targets) only where it fetches this share less (_fetch_cost): they
# trade balance margin or chunk-local order for locality, and on some batches fetch more
# (random searches: 12% of the mirror_tail layouts it took at cp 2-8 fetched more than the
# fold's; by_doc up to 2.7x the plain split's causal keys where that missed its targets;
# nest_long more than few on some batches where both met them).
_GUARD_GAIN = 0.05


def _fetch_cost(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray,
                lengths: np.ndarray, prof: Any, cp: int) -> float:
    """Over the masks (all looking left), weighted by layer count, the most keys any rank
    fetches (:func:`_fetch_per_rank`)."""
    return sum(w * float(_fetch_per_rank(rank, doc, start, start + length, m, cp).max())
               for m, w in zip(prof.masks, prof.weights))


def _fetch_per_rank(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray,
                    mask: Any, cp: int) -> np.ndarray:
    """[cp] int64: the keys each rank fetches under a mask that looks left (a query at p
    sees [max(p - w, its chunk's start), p]): per (rank, document, chunk), the keys its
    runs' windows reach that it does not hold. Merged runs (sorted by rank, document,
    start); vectorized: runs are split at chunk boundaries, and a run's window is clipped
    at the previous run's end in its group."""
    _, wl, _, chunk = mask.params
    c = chunk if chunk else int(end.max(initial=0)) + 1
    n = (end - 1) // c - start // c + 1
    idx = np.repeat(np.arange(start.size), n)
    ch = (start // c)[idx] + np.arange(idx.size) - np.repeat(np.cumsum(n) - n, n)
    s, e = np.maximum(start[idx], ch * c), np.minimum(end[idx], (ch + 1) * c)
    lo = np.maximum(s - wl, ch * c) if wl >= 0 else ch * c
    r, d = rank[idx], doc[idx]
    same = np.zeros(idx.size, dtype=bool)
    same[1:] = (r[1:] == r[:-1]) & (d[1:] == d[:-1]) & (ch[1:] == ch[:-1])
    prev = np.where(same, np.concatenate([[0], e[:-1]]), lo)
    got = np.maximum(s - np.maximum(lo, prev), 0)
    return np.bincount(r, weights=got, minlength=cp).astype(np.int64)


def _exact_runs(units: Units, lay: Layout, lengths: np.ndarray, prof: Any, cp: int
                ) -> tuple[np.ndarray, ...] | None:
    """The merged runs of an attempt that holds every token and meets the targets
    counted exactly on its runs (not only on its estimate, interpolated inside cut tiles,
    ~4e-4 off: the ``few`` layouts sit nearer the targets than the others), else None."""
    if _score(lay.per_rank) > 1.0:
        return None
    runs = _whole_runs(units, lay, lengths)
    if runs is None:  # (pieces rounded apart: never taken)
        return None
    return runs if _score(runs_per_rank(*runs, lengths, prof.masks, cp)) <= 1.0 else None


def _whole_runs(units: Units, lay: Layout, lengths: np.ndarray
                ) -> tuple[np.ndarray, ...] | None:
    """The merged runs of an attempt where they hold exactly the batch's tokens, else None
    (nested pieces are rounded end by end: a layout that loses one is never taken)."""
    runs = _merge_runs(*_layout_runs(units, lay))
    return runs if int(runs[3].sum()) == int(lengths.sum()) else None


def _holds_all(units: Units, lay: Layout, lengths: np.ndarray) -> bool:
    """Whether a failed attempt may be the best of failed ones: its runs hold every token
    (only nested pieces, ``lay.fixed``, can lose one)."""
    return lay.fixed is None or _whole_runs(units, lay, lengths) is not None


def _fetch_max(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray,
               cp: int) -> int:
    """The most keys any rank fetches under a causal mask (the widest reach of the masks
    the ``few`` variant serves); runs merged and sorted by (rank, document, start)."""
    return int(_fetch_per_rank(rank, doc, start, start + length, _CAUSAL, cp).max())


def _score(per_rank: np.ndarray) -> float:
    """Worst of max/mean - 1 over tokens and masks, relative to their tolerances (inf for
    a variant given up early)."""
    if not bool(np.isfinite(per_rank).all()):
        return math.inf
    mean = np.maximum(per_rank.mean(0), 1e-300)
    imb = per_rank.max(0) / mean - 1
    tol = np.full_like(imb, WORK_TOL)
    tol[0] = TOKEN_TOL
    return float((imb / tol).max())


def _layout_runs(units: Units, lay: Layout) -> tuple[np.ndarray, ...]:
    """(rank, doc, start, length) of every run (not merged: the token tables sort them)."""
    u_doc, a_start, a_len = units.doc, units.a_start, units.a_len
    b_start, b_len = units.b_start, units.b_len
    parts = []
    for lst, cut in zip(lay.lists, lay.cuts):
        if lst.n == 0:
            continue
        # Units no cut falls inside go whole to one rank: tiles a and b as they are.
        rank_u = np.searchsorted(cut, lst.tok[:-1], side="right") - 1
        inner = cut[(cut > 0) & (cut < lst.total)]
        hit = np.searchsorted(lst.tok, inner, side="right") - 1
        split_u = np.zeros(lst.n, dtype=bool)
        split_u[hit[lst.tok[hit] != inner]] = True
        whole = lst.order[~split_u]
        r = rank_u[~split_u]
        d = u_doc[whole]
        parts.append((np.concatenate([r, r]), np.concatenate([d, d]),
                      np.concatenate([a_start[whole], b_start[whole]]),
                      np.concatenate([a_len[whole], b_len[whole]])))
        if not bool(split_u.any()):
            continue
        # Units that cuts fall inside: one segment per (unit, rank), four runs each.
        su = np.flatnonzero(split_u)
        points = np.unique(np.concatenate([lst.tok[su], lst.tok[su + 1], inner]))
        first, stop = points[:-1], points[1:]
        ui = np.searchsorted(lst.tok, first, side="right") - 1
        keep = split_u[np.minimum(ui, lst.n - 1)] & (ui < lst.n)
        first, stop, ui = first[keep], stop[keep], ui[keep]
        rank = np.searchsorted(cut, first, side="right") - 1
        u = lst.order[ui]
        runs = unit_runs(units, u, first - lst.tok[ui], stop - lst.tok[ui])
        d = u_doc[u]
        parts.append((np.tile(rank, 4), np.tile(d, 4), np.concatenate([x for x, _ in runs]),
                      np.concatenate([n for _, n in runs])))
    if lay.fixed is not None:
        parts.append(lay.fixed)
    rank, doc, start, length = (np.concatenate(x) for x in zip(*parts))
    if lay.labels is not None:  # a relabelling: every rank's share unchanged
        rank = lay.labels[rank]
    keep = length > 0
    return rank[keep], doc[keep], start[keep], length[keep]


def _merge_runs(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray
                ) -> tuple[np.ndarray, ...]:
    """Runs sorted by (rank, doc, start) with touching runs of one rank and document
    merged (the layout cuts on a tile grid: ~one run per tile before merging)."""
    n_docs = int(doc.max()) + 1 if doc.size else 1
    span = int((start + length).max()) + 1 if doc.size else 1
    n_ranks = int(rank.max()) + 1 if doc.size else 1
    # Keys are unique (runs hold distinct tokens), so any sort gives the same order.
    if n_ranks * n_docs * span < 1 << 62:
        o = ((rank * n_docs + doc) * span + start).argsort(kind="stable")
    else:  # stable sorts, least significant key first
        o = np.argsort(start, kind="stable")
        o = o[np.argsort(doc[o], kind="stable")]
        o = o[np.argsort(rank[o], kind="stable")]
    rank, doc, start, length = rank[o], doc[o], start[o], length[o]
    new = np.ones(rank.size, dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (
        start[1:] != start[:-1] + length[:-1])
    head = np.flatnonzero(new)
    stop = np.append(head[1:], rank.size)
    end = (start + length)[stop - 1]
    return rank[head], doc[head], start[head], end - start[head]
