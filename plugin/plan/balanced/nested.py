"""Nested pieces (variant ``nest``): a long causal-like document is cut so that each rank
holding a late stretch of it also holds an early one, and fetches less than its prefix.

Why: in position order, a document whose work spans several ranks gives some rank the
stretch that ends it, and that rank's queries see nearly the whole document: 1000
log-normal documents at cp 64 with 8K tokens a rank, the rank holding the last 61 tokens of
a 4713-token document fetches 4652 keys where its compute covers ~3800 at NVLink speed.

How: a rank's fetch (causal) is the positions before its last one that it does not hold,
so a rank holding the tail stretch [x, e) and the head stretch [g, g + h) fetches x - h.
Walking the document from its end, each piece takes the next tail stretch below the last
one and the next head stretch, h = x - F for a fetch F common to the pieces, and work
W + rho * (its tokens) (rho: the density of the filler its rank gets besides, so that
every piece leaves its rank the same filler density). A piece then holds e - F tokens, and
its work in the continuous approximation

    (e^2 - x^2) / 2 + ((g + x - F)^2 - g^2) / 2 = W + rho (e - F)

is LINEAR in x (the x^2 terms cancel): one closed-form step a piece. Once x would fall
below F, the rest [g, e) goes in position order (each stretch fetches its start, < F).
F is the least for which the heads never reach the tails, of 128 candidates a document,
all documents and candidates in one walk (its step loop runs over the pieces, not over
documents or candidates).

Which documents, and where (:func:`place_nested`): whole short segments (causal-like under
every mask; with ``nest_long``, also whole long ones whose excess is small, weighed by
their most work under any mask) of at least ``NEST_SHARES`` ranks' work; each piece is a rank of its own, a
whole number of pieces per segment (W a little under the share, rather than one light last
piece whose rank would take much of the dense filler), at most half the ranks in all.
Their ranks take the sparsest filler first (:func:`filler_keys`: phase 2's sparse list
starts with it, its dense list with its smallest items, which cost a rank little to cut),
and a segment's pieces get consecutive labels packed into aligned blocks of 8
(:func:`group_labels`: every piece fetches from the others, and the node placement starts
from blocks of consecutive labels). Numpy; positions float64, rounded to integers at the
end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runs import prefix_pairs
from .args import runs_per_rank
from .items import POSITION_ORDER, Items
from .profile import Profile
from .segments import NEST_KEEP_EXCESS, doc_work, segments_of

# Whole short segments of at least this many ranks' work are nested.
NEST_SHARES = 2.0
# The least share of work a piece may carry (less: the filler is too dense to fill its
# rank, and the segment would spread over too many ranks).
_NEST_MIN = 0.25
# The sparsest filler given first to the pieces' ranks, over what they need (their mean
# density then holds as the solver cuts the list).
_NEST_SLACK = 1.1
# Of the pieces' ranks' tokens: how much of the dense list starts with its smallest items
# (those ranks took 0-5% of their tokens from it on 1000 log-normal documents).
_NEST_LEAD = 0.1
# F to 1/128 of each segment (37 keys on a 4713-token document).
_F_GRID = 128
# Labels are packed in aligned blocks of this many ranks (GPUs per node, the common case).
_BLOCK = 8


@dataclass
class Nested:
    """The nested pieces of one attempt."""

    runs: tuple  # (rank, doc, start, length) int64, solver ranks
    cum: np.ndarray  # [cp+1, 1+M] their cumulative (tokens, work per mask) at rank bounds
    placed: np.ndarray  # [items] bool: the items nested (not filler)
    lead: np.ndarray  # [items] bool: the sparse items the pieces' ranks take first
    n_ranks: int  # the pieces' ranks: 0..n_ranks-1
    labels: np.ndarray  # [cp] the rank label of each solver rank


def _walk(length: np.ndarray, work: np.ndarray, rho: float, fetch: np.ndarray,
          record: bool = False) -> tuple[np.ndarray, list]:
    """One walk per segment and fetch (arrays broadcast: [n] or [n, K] candidates of F):
    whether the heads stay below the tails, and (``record``) the pieces as (live, head
    start, head end, tail start, tail end) per step."""
    e = np.broadcast_to(length, np.broadcast_shapes(length.shape, fetch.shape)
                        ).astype(np.float64)
    g = np.zeros_like(e)
    ok = np.ones(e.shape, dtype=bool)
    steps = []
    for _ in range(2 * int(np.ceil(float((e * e / (2 * work)).max()))) + 8):
        # Live while the rounded ends differ (pieces are rounded end by end: a remainder
        # under a token can still hold one); an infeasible walk stops (F is too small).
        live = (np.rint(e) > np.rint(g)) & ok
        if not bool(live.any()):
            break
        w = work + rho * np.maximum(e - fetch, 0.0)
        d = np.maximum(fetch - g, 1e-9)
        x_head = (e * e / 2 + (g - fetch) ** 2 / 2 - g * g / 2 - w) / d
        with_head = live & (x_head >= fetch)
        # Without a head: (e^2 - x^2) / 2 = work + rho (e - x), a quadratic in x.
        # (All of [g, e) where its work is no more: the walk ends.)
        x_plain = rho + np.sqrt(np.maximum((e - rho) ** 2 - 2 * work, 0.0))
        rest_fits = (e * e - g * g) / 2 <= work + rho * (e - g)
        x_plain = np.where(rest_fits, g, np.maximum(np.minimum(x_plain, e), g))
        x = np.where(with_head, np.minimum(x_head, e), x_plain)
        h = np.where(with_head, x - fetch, 0.0)
        # Infeasible at this F: the head alone outweighs the piece (x past e), or the
        # heads run into the tails.
        ok &= ~(with_head & ((x_head > e) | (g + h > x)))
        x = np.where(live, x, e)
        h = np.where(live, h, 0.0)
        if record:
            steps.append((live.copy(), g.copy(), g + h, x.copy(), e.copy()))
        g = g + h
        e = x
    return ok, steps


def nested_pieces(length: np.ndarray, work: np.ndarray, rho: float = 0.0
                  ) -> tuple[np.ndarray, ...]:
    """Pieces of segments of ``length`` tokens (int64 [n]), each piece's causal work about
    ``work + rho * its tokens`` (``work``: a float or float64 [n], per segment; a
    segment's last piece may carry less): (segment, piece index, head start, head length,
    tail start, tail length), int64 arrays, segment-relative positions. Pieces partition
    each segment; piece i of a segment is meant for one rank."""
    if length.size == 0:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(6))
    work = np.broadcast_to(np.asarray(work, dtype=np.float64), length.shape)
    # F by one walk over a grid of ``_F_GRID`` candidates a segment (a walk costs about
    # the same on [n, K] arrays as on [n]): the least feasible; the largest, F = L (no
    # heads: position order), always is.
    grid = length[:, None] * (np.arange(1, _F_GRID + 1, dtype=np.float64) / _F_GRID)
    ok, steps = _walk(length[:, None], work[:, None], rho, grid, record=True)
    n = np.arange(length.size)
    j = np.argmax(ok, axis=1)
    cols: list[list[np.ndarray]] = [[], [], [], [], [], []]
    for i, step in enumerate(steps):
        live, g0, g1, x, e = (v[n, j] for v in step)
        s = np.flatnonzero(live)
        # Each step's ends are the next step's starts (the same floats): rounded alike,
        # the pieces still partition the segment.
        a, b = np.rint(g0[s]).astype(np.int64), np.rint(g1[s]).astype(np.int64)
        c, f = np.rint(x[s]).astype(np.int64), np.rint(e[s]).astype(np.int64)
        for col, v in zip(cols, (s, np.full(s.size, i, dtype=np.int64), a,
                                 np.maximum(np.minimum(b, c) - a, 0), c, f - c)):
            col.append(v)
    return tuple(np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols)


def long_nestable(lengths: np.ndarray, prof: Profile, cp: int, memo: dict) -> bool:
    """Whether the ``nest_long`` attempt may nest anything, before its items are built:
    no segment carries more than ``NEST_KEEP_EXCESS`` of a rank's mean work in excess, and
    some long one (a body under the default threshold) holds at least ``NEST_SHARES``
    shares of the filler column under some mask (:func:`place_nested`'s test; its
    document's work: an upper bound where chunks are the segments), and cp >= 4."""
    if cp < 4 or segments_of(lengths, prof, cp, True, memo, NEST_KEEP_EXCESS)[3].any():
        return False  # (cp < 4: two pieces on at most half the ranks cannot be placed)
    doc, _, _, long = segments_of(lengths, prof, cp, True, memo)
    work = doc_work(lengths, prof, memo)
    share = float(work.sum(0).min()) / cp
    return bool((work[doc[long]].max(1) >= NEST_SHARES * share).any())


def place_nested(items: Items, lengths: np.ndarray, prof: Profile, cp: int,
                 item_w: np.ndarray, item_t: np.ndarray, total: np.ndarray, col: int,
                 long_ok: bool = False) -> Nested | None:
    """The nested pieces of the filler items in position order that are whole short
    segments of at least ``NEST_SHARES`` ranks' work (``item_w``: each item's work in the
    filler column ``col`` of ``total``), longest first, each piece on a rank of its own
    (0, 1, ...). A piece of t tokens gets W + rho t of work, rho the density of the
    sparsest filler its rank can be given (as many of the sparse items, sparsest first,
    as the pieces' ranks need), W a share less rho times a rank's tokens, a little less
    to make whole pieces. None where no item qualifies, W is under ``_NEST_MIN`` of a
    share, or the pieces would hold more than half the ranks (the next variants run).
    ``long_ok`` (variant ``nest_long``): whole long segments that stayed filler (their
    excess under ``segments.NEST_KEEP_EXCESS``) qualify too, weighed by their most work
    under any mask (the walk sizes pieces by causal work; the exact counts decide)."""
    share = float(total[col]) / cp
    t_rank = float(total[0]) / cp
    size = items.end - items.start
    seg_len = prof.split or 1 << 62  # a segment: a document, or a chunk of split
    whole = (items.start % seg_len == 0) & (
        items.end == np.minimum(items.start + seg_len, lengths[items.doc]))
    # ``long_ok`` (variant ``nest_long``): whole long segments kept as filler too, weighed
    # by their most work under any mask (their excess is what phases._excess_shift moves).
    long = size > prof.theta
    w_all = item_w
    if long_ok and bool(long.any()):
        w_all = item_w.astype(np.float64, copy=True)
        dl, a, b = lengths[items.doc[long]], items.start[long], items.end[long]
        w_all[long] = np.max([prefix_pairs(dl, b, m) - prefix_pairs(dl, a, m)
                              for m in prof.masks], axis=0)
    placed = (~items.body & (items.kind == POSITION_ORDER) & whole & (~long | long_ok)
              & (w_all >= NEST_SHARES * share))
    if not bool(placed.any()):
        return None
    fill = ~placed & ~items.body
    f_w, f_t = float(item_w[fill].sum()), float(item_t[fill].sum())
    sparse = np.flatnonzero(fill & (item_w * f_t < f_w * item_t))
    sparse = sparse[np.argsort(item_w[sparse] / np.maximum(item_t[sparse], 1), kind="stable")]
    c_t, c_w = np.cumsum(item_t[sparse]), np.cumsum(item_w[sparse])
    it = np.flatnonzero(placed)
    it = it[np.argsort(-size[it], kind="stable")]
    size = size[it]
    need = 0.0  # sparse tokens the pieces' ranks take (first: the whole list's density)
    for _ in range(2):  # the density of what they need, then the pieces that leaves
        j = int(np.searchsorted(c_t, need)) if need else c_t.size - 1
        j = min(j, c_t.size - 1)
        rho = float(c_w[j]) / max(float(c_t[j]), 1.0) if c_t.size else 0.0
        work = share - rho * t_rank
        if work < _NEST_MIN * share:
            return None
        rest = w_all[it] - rho * size
        n = np.ceil(rest / work)
        need = _NEST_SLACK * float(n.sum() * t_rank - size.sum())
    if 2 * int(n.sum()) > cp:  # the other ranks could not take the rest of the filler
        return None
    lead = np.zeros(placed.size, dtype=bool)
    lead[sparse[:int(np.searchsorted(c_t, need)) + 1]] = True
    seg, idx, hs, hl, ts, tl = nested_pieces(size, rest / n, rho)
    first = np.zeros(it.size + 1, dtype=np.int64)
    np.add.at(first, seg + 1, 1)
    first = np.cumsum(first)
    if 2 * int(first[-1]) > cp:  # (the walk may end with one more piece than estimated)
        return None
    rank = first[seg] + idx  # a segment's pieces on consecutive ranks
    base = items.start[it[seg]]
    rank, doc = np.concatenate([rank, rank]), np.tile(items.doc[it[seg]], 2)
    start, length = np.concatenate([base + hs, base + ts]), np.concatenate([hl, tl])
    keep = length > 0
    rank, doc, start, length = rank[keep], doc[keep], start[keep], length[keep]
    cum = np.zeros((cp + 1, 1 + len(prof.masks)), dtype=np.float64)
    cum[1:] = runs_per_rank(rank, doc, start, length, lengths, prof.masks, cp).cumsum(0)
    return Nested((rank, doc, start, length), cum, placed, lead, int(first[-1]),
                  group_labels(first, cp))


def group_labels(first: np.ndarray, cp: int, block: int = _BLOCK) -> np.ndarray:
    """[cp] labels of the solver's ranks: segment s's pieces (ranks first[s] ..
    first[s+1] - 1) on consecutive labels in the first aligned block of ``block`` labels
    with room (first fit; a segment of more pieces than a block, or one that fits no
    block: the lowest free labels, not always consecutive), the other ranks on the free
    labels in order. (A loop over the nested segments: at most
    cp / 4, each has two or more pieces on at most half the ranks.)"""
    n_blocks = -(-cp // block)
    cap = np.minimum(block, cp - block * np.arange(n_blocks))
    taken = np.zeros(n_blocks, dtype=np.int64)  # a prefix of each block (see below)
    label = np.full(cp, -1, dtype=np.int64)
    used = np.zeros(cp, dtype=bool)
    for a, b in zip(first[:-1].tolist(), first[1:].tolist()):
        fit = np.flatnonzero(cap - taken >= b - a) if b - a <= block else []
        if len(fit):
            at = int(fit[0]) * block + int(taken[fit[0]])
            slots = np.arange(at, at + b - a)
        else:  # the lowest free labels: the rest of a block before the next one
            slots = np.flatnonzero(~used)[:b - a]
        label[a:b] = slots
        used[slots] = True
        taken += np.bincount(slots // block, minlength=n_blocks)
    rest = np.flatnonzero(label < 0)
    label[rest] = np.flatnonzero(~used)[:rest.size]
    return label


def filler_keys(spread: np.ndarray, nested: Nested, fill_items: np.ndarray,
                dense_items: np.ndarray, item_t: np.ndarray, t_rank: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Item keys of phase 2's dense and sparse lists (else ``spread``) for an attempt
    with ``nested`` pieces, whose ranks the rank-by-rank solver cuts first: the dense
    list starts with its smallest items (``_NEST_LEAD`` of those ranks' tokens; a rank
    whose dense stretch starts inside an item in position order fetches its prefix), the
    sparse list with ``nested.lead`` (the sparsest, as many as those ranks need)."""
    dense = np.flatnonzero(fill_items & dense_items)
    by_size = dense[np.argsort(item_t[dense], kind="stable")]
    lead = _NEST_LEAD * nested.n_ranks * t_rank
    small = np.zeros(item_t.size, dtype=bool)
    small[by_size[:int(np.searchsorted(np.cumsum(item_t[by_size]), lead, side="right"))]] = True
    return _first(spread, small, item_t), _first(spread, nested.lead, None)


def _first(key: np.ndarray, sel: np.ndarray, size: np.ndarray | None) -> np.ndarray:
    """Item key ``key`` with the items ``sel`` first: by ``size`` (smallest first), else
    in their order by ``key``; keys stay unique."""
    idx = np.flatnonzero(sel)
    out = key + idx.size
    order = np.argsort(size[idx] if size is not None else key[idx], kind="stable")
    out[idx[order]] = np.arange(idx.size)
    return out
