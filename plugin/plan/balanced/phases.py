"""One attempt (a :class:`~.variants.Variant`) solved in two phases on its units.

Phase 1 cuts the bodies so that every rank gets 1/cp of the excess work: one list spread
by excess per token and cut by excess alone, a dense / sparse pair cut to equal tokens and
excess, the ``blocks`` list (remainders, then tail blocks of whole rank shares), or the
``split`` pair (late and early parts) cut rank by rank (with ``Variant.holders``: onto the
first that many ranks only, :func:`holder_counts`; with ``Variant.by_doc``: by document
group, :func:`_group_targets`). With ``Variant.nest`` (no bodies),
nested.py's pieces of long documents go on ranks of their own first (with
``Variant.nest_long``, their ranks' filler targets less their excess,
:func:`_excess_shift`). Phase 2 cuts the
filler, as a dense
and a sparse list in the filler column (the mask with least work), to what phase 1 left of
every rank's targets (tokens and that column): by the vector solver, rank by rank, or rank
by rank over two density classes a side. Tokens and one work column then balance every mask
on the filler (profile.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runs import prefix_pairs
from .items import REMAINDER, TAIL_BLOCK, Items
from .nested import Nested, filler_keys, place_nested
from .profile import Profile, excess_functional
from .rank_cut import rank_cut, rank_reachable
from .segments import doc_work
from .unit_list import (UnitList, density_classes, item_sums, new_list, spread_key,
                        unit_order)
from .units import Units
from .variants import Variant
from .vector_cut import cut_excess, pair_cut, pair_reachable

# Snap budgets: the share of a target one rank boundary may use (a rank's error is the
# difference of its two boundaries' errors; targets in args.py).
_TOKEN_BUDGET = 0.009  # of T / cp
_EXCESS_BUDGET = 0.005  # of a mask's mean work per rank (phase 1, long bodies)
_FILL_BUDGET = 0.006  # of a mask's mean work per rank (phase 2, filler)


@dataclass
class Layout:
    """An attempt's lists and their cuts (rank k holds units [cuts[k], cuts[k+1]) of each
    list)."""

    lists: list[UnitList]
    cuts: list[np.ndarray]  # [cp+1] int64 token offsets per list
    per_rank: np.ndarray  # [cp, 1+M] float64 estimate (interpolated inside cut tiles)
    unreachable: bool = False  # the rank-by-rank solver's precheck failed (see solve_attempt)
    fixed: tuple | None = None  # (rank, doc, start, length) runs placed outside the lists
    labels: np.ndarray | None = None  # [cp] the rank label of each solver rank (None: same)


def rank_vectors(lists: list[UnitList], cuts: list[np.ndarray]) -> np.ndarray:
    """[cp, 1+M]: each rank's (tokens, work per mask) over all lists (interpolated inside
    cut units)."""
    out = 0
    for lst, c in zip(lists, cuts):
        v = lst.at(c)
        out = out + (v[1:] - v[:-1])
    return out


@dataclass(frozen=True)
class _Setup:
    """What both phases of :func:`solve_attempt` share (targets, budgets, the items' orders)."""

    n_items: int
    is_body: np.ndarray       # [units] bool
    total: np.ndarray         # [1+M] float64: tokens and each mask's work
    share: list[float]        # total / cp
    k: np.ndarray             # rank boundaries 0..cp (int64)
    n_tok: np.ndarray         # token targets: floor(k T / cp)
    tok_budget: float
    col: int                  # the filler column: the mask with least work
    first: np.ndarray         # [items] doc << 40 | first position
    doc_order: np.ndarray     # [items] rank of each item in document order
    item_t: np.ndarray        # [items] tokens (float64)
    u_item: np.ndarray        # [units] item of each unit
    phi: np.ndarray | None    # the excess functional (None without excess)
    item_phi: np.ndarray | None  # [items] its sum per item
    fail: "Layout"

    @property
    def n_masks(self) -> int:
        return self.total.size - 1


def _setup(units: Units, prof: Profile, cp: int) -> _Setup:
    """Targets and orders of ``units`` for ``cp`` ranks (the same for every attempt on
    these units: solve.py keeps one per units)."""
    u_item = units.item
    n_items = int(u_item.max()) + 1 if u_item.size else 0
    total = units.vec.sum(0)  # [1+M]
    T = float(total[0])
    k = np.arange(cp + 1, dtype=np.int64)
    # Items in document order (items are numbered filler first, bodies after; every item
    # has units, and its first position is unique).
    first = np.full(n_items, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, u_item, units.doc * (1 << 40) + units.a_start)
    doc_order = np.empty(n_items, dtype=np.int64)
    doc_order[first.argsort(kind="stable")] = np.arange(n_items)
    fail = Layout([], [], np.full((cp, total.size), math.inf, dtype=np.float64))
    # The filler column: the mask with least work (its relative errors are the largest).
    phi = excess_functional(prof, total) if prof.excess.shape[0] else None
    return _Setup(n_items, units.body & (prof.excess.shape[0] > 0), total,
                  (total / cp).tolist(), k, k * int(T) // cp, _TOKEN_BUDGET * T / cp,
                  1 + int(np.argmin(total[1:])), first, doc_order,
                  item_sums(units, n_items, 0), u_item, phi,
                  None if phi is None else item_sums(units, n_items, phi), fail)


def solve_attempt(units: Units, prof: Profile, cp: int, var: Variant, items: Items,
                  lengths: np.ndarray, cache: dict | None = None) -> Layout:
    """Phase 1 (bodies: the excess work) then phase 2 (filler: tokens and the rest).

    Bodies (``var``): one list spread by excess per token and cut by excess alone (a
    rank's bodies are then one or two documents; phase 2 absorbs the token differences);
    or a dense / sparse pair (in excess per token) cut to equal tokens and excess (more
    documents per rank, always feasible for phase 2); or the blocks of
    :func:`~.items.cut_items`.
    """
    cache = {} if cache is None else cache
    if "setup" not in cache:
        cache["setup"] = _setup(units, prof, cp)
    st = cache["setup"]
    lists, cuts = [], []
    b_val = np.zeros((cp + 1, st.total.size), dtype=np.float64)
    if prof.excess.shape[0] and bool(st.is_body.any()):
        lists, cuts, b_val = _cut_bodies(units, prof, cp, var, st, lengths, items)
    nested = None
    if var.nest:
        if "item_w" not in cache:  # the same for every attempt on these units
            cache["item_w"] = item_sums(units, st.n_items, st.col)
        nested = place_nested(items, lengths, prof, cp, cache["item_w"], st.item_t,
                              st.total, st.col, long_ok=var.nest_long)
        if nested is None:
            return st.fail
        b_val = b_val + nested.cum
        if var.nest_long:
            b_val[:, st.col] += _excess_shift(nested, st.col)
    return _cut_filler(units, prof, var, items, lengths, st, lists, cuts, b_val, cache,
                       nested)


def _excess_shift(nested: Nested, col: int) -> np.ndarray:
    """[cp+1] cumulative shift of phase 2's targets in the filler column for nested pieces
    of long segments (``nest_long``): every rank's target less its excess (its most work
    of any mask less its work in the filler column) and plus the mean excess, so that the
    mask with most work gets the same share on every rank (the filler is short documents,
    the same work under every mask) and the filler column only the mean excess apart."""
    per = np.diff(nested.cum, axis=0)
    excess = per[:, 1:].max(1) - per[:, col]
    return np.concatenate([[0.0], np.cumsum(excess - excess.mean())])


def _cut_bodies(units: Units, prof: Profile, cp: int, var: Variant, st: _Setup,
                lengths: np.ndarray, items: Items) -> tuple[list, list, np.ndarray]:
    """Phase 1: bodies, cut so that every rank gets 1/cp of the excess work (``split``
    with ``var.holders``: the first that many ranks get equal shares, the rest none):
    (lists, cuts, the cumulative vector [cp+1, 1+M] they give the rank boundaries)."""
    is_body, k, tok_budget = st.is_body, st.k, st.tok_budget
    phi = st.phi
    others = [m for m in range(st.n_masks) if 1 + m != st.col] or list(range(st.n_masks))
    budget = _EXCESS_BUDGET * min(st.share[1 + m] for m in others)
    item_phi = st.item_phi
    if var.body == "split":
        # Late parts (dense in excess) and early parts, in position order and document
        # order, cut rank by rank to equal tokens and excess.
        late = is_body & (units.block == TAIL_BLOCK)
        key = st.doc_order if items.group is None else _group_key(items, st)
        dense = new_list(units, unit_order(units, late, key), tok_budget)
        sparse = new_list(units, unit_order(units, is_body & ~late, key), tok_budget)
        t_b = dense.total + sparse.total
        n = var.holders or cp
        kk = np.minimum(k, n)
        p_b = float(dense.column(phi)[-1] + sparse.column(phi)[-1])
        if items.group is None:
            b_tok = kk * t_b // n
            b_phi = kk.astype(np.float64) * p_b / n
        else:  # each group's tokens in proportion to its excess
            b_tok, b_phi = _group_targets(items, st, t_b, p_b)
        xd, xs = rank_cut([dense], [sparse], b_tok, b_phi, phi)
        return [dense, sparse], [xd, xs], dense.at(xd) + sparse.at(xs)
    body_items = np.zeros(st.n_items, dtype=bool)
    body_items[st.u_item[is_body]] = True
    if var.pair:
        t_b = float(st.item_t[body_items].sum())
        p_b = float(item_phi[body_items].sum())
        hi = (item_phi * t_b > p_b * st.item_t)[st.u_item]
        dense = new_list(units, unit_order(units, is_body & hi, st.doc_order), tok_budget)
        sparse = new_list(units, unit_order(units, is_body & ~hi, st.doc_order), tok_budget)
        b_tok = k * int(t_b) // cp
        b_phi = k.astype(np.float64) * p_b / cp
        xd, xs = pair_cut(dense, sparse, b_tok, b_phi, phi,
                           [(0, 2 * tok_budget, 1.0), (phi, budget, 1.0)])
        return [dense, sparse], [xd, xs], dense.at(xd) + sparse.at(xs)
    if var.body == "blocks":
        key = _block_order(units, st, lengths)
    else:
        # Bodies spread by excess per token, so that the excess cut gives no rank
        # a stretch of only sparse bodies (too many tokens for the filler).
        key = spread_key(item_phi / np.maximum(st.item_t, 1), st.item_t * body_items)
    body = new_list(units, unit_order(units, is_body, key), tok_budget)
    if var.body == "blocks":
        target = _block_targets(units, body, phi, cp)
    else:
        target = k.astype(np.float64) * float(body.pv[-1] @ phi) / cp
    x = cut_excess(body, phi, target, budget)
    x[0], x[-1] = 0, body.total
    return [body], [x], body.at(x)


def _group_key(items: Items, st: _Setup) -> np.ndarray:
    """``by_doc``: items by (group, sparse documents before the group's dense one,
    document order)."""
    return (items.group * st.n_items + st.doc_order).argsort(kind="stable").argsort(
        kind="stable")


# by_doc: document groups start on a rank boundary where each group's ranks then hold
# within this share of a rank's share of excess.
_GROUP_ROUND = 0.01


def _group_targets(items: Items, st: _Setup, t_b: int, p_b: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``by_doc``'s (token, excess) targets [cp+1] of the bodies: within each document
    group, tokens in proportion to excess (with equal tokens a rank, the late and early
    lists would run through the documents at different rates, and a rank would take one
    document's late stretch with another's early one: both prefixes to fetch); each group
    on whole ranks where its ranks then hold within ``_GROUP_ROUND`` of a share of excess
    (else the rank at a boundary holds the end of one group and the start of the next)."""
    g = items.group >> 1
    sel = g >= 0
    n_g = int(g.max()) + 1
    g_x = np.bincount(g[sel], weights=st.item_phi[sel], minlength=n_g)
    g_t = np.bincount(g[sel], weights=st.item_t[sel], minlength=n_g)
    x_cum, t_cum = np.append(0.0, np.cumsum(g_x)), np.append(0.0, np.cumsum(g_t))
    cp = st.k.size - 1
    share = p_b / cp
    k_cum = np.round(x_cum / share).astype(np.int64)
    n_r = np.diff(k_cum)
    if bool((n_r >= 1).all()) and bool(
            (np.abs(g_x / np.maximum(n_r, 1) - share) <= _GROUP_ROUND * share).all()):
        gi = np.minimum(np.searchsorted(k_cum, st.k, side="right") - 1, n_g - 1)
        b_phi = x_cum[gi] + (st.k - k_cum[gi]) * g_x[gi] / n_r[gi]
    else:
        b_phi = st.k.astype(np.float64) * share
    b_phi[-1] = p_b
    b_tok = np.interp(b_phi, x_cum, t_cum).round().astype(np.int64)
    b_tok[-1] = t_b
    return np.maximum.accumulate(np.minimum(b_tok, t_b)), b_phi


# Of a mask's mean work per rank: what a rank holding window bodies may carry above the
# mean (the target is 3%; the filler's snap takes up to 0.6%, the solvers' tolerance less).
_FEW_SLACK = 0.015


def holder_counts(items: Items, lengths: np.ndarray, prof: Profile, cp: int,
                  memo: dict) -> list[int]:
    """Holder counts worth trying for the ``split`` bodies (``Variant.holders``): every
    rank holding 1/cp of a window body (a piece of a few tokens) fetches a whole window of
    keys for it, so where the bodies' excess is small (Gemma-style SWA 5:1 on documents
    little longer than the window), fewer ranks hold them, each a larger share: n0, the
    fewest for which every mask's work over the filler column's stays within
    ``_FEW_SLACK`` of its mean, and n0 + 1 (the filler cut then differs: which count
    fetches least is measured, not predicted). Empty where n0 is more than half the ranks
    (the pieces would stay small). From per-item sums, before any units are built: the
    bodies, and so the counts, are those of any ``split`` items (the filler's walk does
    not change them)."""
    b = np.flatnonzero(items.body)
    dl, a, e = lengths[items.doc[b]], items.start[b], items.end[b]
    body = np.array([float((prefix_pairs(dl, e, m) - prefix_pairs(dl, a, m)).sum())
                     for m in prof.masks])
    total = doc_work(lengths, prof, memo).sum(0)
    col = int(np.argmin(total))  # the filler column (as _setup picks it)
    extra = body - body[col]  # each mask's body work over the filler column's
    need = extra / np.maximum(_FEW_SLACK * total / cp + extra / cp, 1e-300)
    n0 = max(1, math.ceil(float(need.max())))
    return [n0, n0 + 1] if 2 * n0 <= cp else []


def _block_order(units: Units, st: _Setup, lengths: np.ndarray) -> np.ndarray:
    """Item key of the body blocks: remainders first, largest, smallest, second largest,
    ... (about two on a rank: each costs a chunk of causal keys to fetch), then the tail
    blocks, longest documents first, so that the last rank, which phase 2 gives what is
    left of every filler list, holds the shortest document's end."""
    i_blk = np.zeros(st.n_items, dtype=np.int64)
    i_blk[st.u_item] = units.block  # one block class per item
    ln = lengths[st.first >> 40]
    key = ((1 << 40) - ln) * (1 << 22) + (st.first >> 40)
    r_idx = np.flatnonzero(i_blk == REMAINDER)
    o = r_idx[np.argsort(-st.item_t[r_idx], kind="stable")]
    zz = np.empty(o.size, dtype=np.int64)
    zz[0::2] = np.arange((o.size + 1) // 2)
    zz[1::2] = o.size - 1 - np.arange(o.size // 2)
    key[o[zz]] = np.arange(o.size)
    # (Body items' keys are unique, but for the pieces of one tail block (mirror_tail),
    # which the stable sort keeps in item order: position order.)
    return key.argsort(kind="stable").argsort(kind="stable")


def _block_targets(units: Units, body: UnitList, phi: np.ndarray, cp: int) -> np.ndarray:
    """Excess targets [cp+1] of the "blocks" body list (remainders first, then tail
    blocks): the remainders in equal shares, then each tail block in equal shares of its
    own, so that the cuts fall on the blocks' boundaries (each block is a whole number of
    shares up to one token)."""
    it = units.item[body.order]
    tail_u = units.block[body.order] == TAIL_BLOCK
    doc_u = units.doc[body.order]
    new = np.ones(body.n, dtype=bool)
    # A block starts with each item, except a tail block's later pieces (mirror_tail:
    # the stretches of one document's tail block, consecutive in the list).
    new[1:] = (it[1:] != it[:-1]) & ~(tail_u[1:] & tail_u[:-1] & (doc_u[1:] == doc_u[:-1]))
    first = np.flatnonzero(new)
    cum = body.column(phi)
    c_s = cum[2 * first]
    c_e = np.append(c_s[1:], cum[-1])
    tail = units.block[body.order[first]] == TAIL_BLOCK
    total = float(cum[-1])
    n_sh = np.maximum(np.round((c_e - c_s)[tail] * cp / max(total, 1e-300)), 1).astype(np.int64)
    n_rest = cp - int(n_sh.sum())
    if not bool(tail.any()) or n_rest < 0 or (n_rest == 0 and not bool(tail[0])):
        return np.arange(cp + 1, dtype=np.float64) * total / cp
    s_t, e_t = c_s[tail], c_e[tail]
    rest_end = float(s_t[0])
    rep = np.repeat(np.arange(n_sh.size), n_sh)
    off = (np.arange(int(n_sh.sum())) - (np.cumsum(n_sh) - n_sh)[rep]).astype(np.float64)
    return np.concatenate([np.arange(n_rest, dtype=np.float64) * rest_end / max(n_rest, 1),
                           s_t[rep] + (e_t - s_t)[rep] * off / n_sh[rep].astype(np.float64),
                           [total]])


def _sums(units: Units, sel: np.ndarray, sel_items: np.ndarray, st: _Setup,
          item_w: np.ndarray) -> tuple[int, float, float]:
    """(units, tokens, filler column) of the units ``sel`` (the items ``sel_items``), the
    values the list of them would end on: the columns hold integers (token and pair
    counts, exact in float64), so summing per item gives the same values as the list's
    cumulative sum, without building it."""
    return (int(np.count_nonzero(sel)), float(st.item_t[sel_items].sum()),
            float(item_w[sel_items].sum()))


def _cut_filler(units: Units, prof: Profile, var: Variant, items: Items,
                lengths: np.ndarray, st: _Setup, lists: list, cuts: list,
                b_val: np.ndarray, cache: dict, nest: Nested | None = None
                ) -> Layout:
    """Phase 2: filler (short documents and heads), dense / sparse in the filler column,
    cut to what phase 1 (and the nested pieces, items ``placed``) left of every rank's
    targets."""
    col, k, tok_budget, total = st.col, st.k, st.tok_budget, st.total
    fill = ~st.is_body
    if nest is not None:
        fill = fill & ~nest.placed[st.u_item]
    f_tok = np.maximum.accumulate(np.maximum(
        st.n_tok - b_val[:, 0].round().astype(np.int64), 0))
    f_target = k.astype(np.float64) * st.share[col] - b_val[:, col]
    fill_items = np.zeros(st.n_items, dtype=bool)
    fill_items[st.u_item[fill]] = True
    if var.solver != "vector" and not rank_reachable(
            items, fill_items, lengths, prof, col, f_tok, f_target):
        return Layout([], [], st.fail.per_rank, unreachable=True)
    if "item_w" not in cache:  # the same for every attempt on these units
        cache["item_w"] = item_sums(units, st.n_items, col)
    item_w = cache["item_w"]
    f_w = float(total[col]) - float(b_val[-1, col])
    f_t = float(total[0]) - float(b_val[-1, 0])
    item_dense = item_w * f_t > f_w * st.item_t
    is_dense = item_dense[st.u_item]
    one_list = bool(lists) and not var.pair
    if one_list and var.solver == "vector" and not pair_reachable(
            _sums(units, fill & is_dense, fill_items & item_dense, st, item_w),
            _sums(units, fill & ~is_dense, fill_items & ~item_dense, st, item_w),
            st.n_tok - b_val[:, 0], f_target):
        return st.fail
    # Filler items in an order that spreads their densities evenly (any stretch of the
    # list holds about its mean density), so per-rank targets stay reachable.
    spread_id = ("spread", nest is not None)  # the same for every such attempt
    if spread_id not in cache:
        cache[spread_id] = spread_key(item_w / np.maximum(st.item_t, 1),
                                      st.item_t * fill_items)
    spread = cache[spread_id]
    if var.solver == "classes":
        dens = item_w / np.maximum(st.item_t, 1)
        dl = density_classes(units, fill & is_dense, dens, st.item_t, spread, 2, tok_budget)
        sl = density_classes(units, fill & ~is_dense, dens, st.item_t, spread, 2, tok_budget)
        f_tok[-1] = sum(lst.total for lst in dl + sl)
        lists = lists + dl + sl
        return _layout(lists, cuts + rank_cut(dl, sl, f_tok, f_target, col), nest)
    # The pair depends on what phase 1 left in all (not on how it was cut): the ``few``
    # attempts, one per holder count, share it.
    pair_key = ("filler pair", f_t, f_w)
    if pair_key not in cache:
        d_key = s_key = spread
        if nest is not None:  # its ranks, cut first, take the cheapest filler first
            d_key, s_key = filler_keys(spread, nest, fill_items, item_dense, st.item_t,
                                       float(total[0]) / (k.size - 1))
        cache[pair_key] = (
            new_list(units, unit_order(units, fill & is_dense, d_key), tok_budget),
            new_list(units, unit_order(units, fill & ~is_dense, s_key), tok_budget))
    dense, sparse = cache[pair_key]
    prio = [w / max(prof.weights) for w in prof.weights]
    limits = [(0, tok_budget, 1.0)] + [(1 + m, _FILL_BUDGET * st.share[1 + m],
                                        float(prio[m])) for m in range(st.n_masks)]
    cut = pair_cut(dense, sparse, f_tok, f_target, col, limits, give_up=one_list,
                    seq=var.solver == "seq")
    if cut is None:
        return st.fail
    return _layout(lists + [dense, sparse], cuts + list(cut), nest)


def _layout(lists: list, cuts: list, nest: Nested | None) -> Layout:
    """The Layout of cut lists, with the nested pieces (their runs, the ranks' labels,
    their tokens and work added to the estimate) where there are any."""
    per_rank = rank_vectors(lists, cuts)
    if nest is None:
        return Layout(lists, cuts, per_rank)
    return Layout(lists, cuts, per_rank + np.diff(nest.cum, axis=0), fixed=nest.runs,
                  labels=nest.labels)
