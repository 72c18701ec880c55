"""Items: the stretches of positions that the layout orders and cuts. Each segment becomes
filler (short segments, and the short-like heads of long ones) or a body (the rest of a
long segment, which carries the excess); each item is walked in one of three orders.

Item kinds (how an item's tiles are ordered, see units.py):

- ``MIRRORED``: tiles 0, n-1, 1, n-2, ... of [start, end): every stretch of the order holds
  the item's work per token, so a cut anywhere keeps the balance (and costs the two ranks
  a fetch each);
- ``CHUNK_PAIRS``: a chunked + causal body folded by chunk pairs (units.py's chunk_fold):
  equal causal AND chunked work per unit;
- ``POSITION_ORDER``: the tiles in position order: a cut gives the earlier rank a prefix,
  which costs it nothing, and the later rank the rest, which costs it the prefix: one fetch
  where a mirrored cut costs two.
- ``REVERSED``: the tiles from the last to the first (``by_doc``'s early parts: walked
  back from the late part's start, so a rank's early and late stretches of a document
  sit around one point and the early stretches get sparser as the late ones get denser).

Body classes (``Items.block``) of the locality variants: a body split at p is a
``REMAINDER`` [start, p) and a ``TAIL_BLOCK`` [p, end) (``blocks``: whole rank shares of
excess; ``split``: the late part of a window body, dense in excess).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runs import prefix_pairs
from .body_split import density_split, group_split, tail_split
from .profile import Profile
from .segments import NEST_KEEP_EXCESS, doc_work, excess_of, segments_of
from .variants import Variant

# Window bodies: a late part with less excess than this share of a rank's stays with the
# early part (a rank would otherwise collect slivers of several documents' ends).
_MINLATE = 0.5

MIRRORED, CHUNK_PAIRS, POSITION_ORDER, REVERSED = 0, 1, 2, 3
TAIL_BLOCK, REMAINDER = 1, 2


@dataclass
class Items:
    """Items [I] (numpy, int64 unless noted): filler first, then bodies."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    kind: np.ndarray  # MIRRORED / CHUNK_PAIRS / POSITION_ORDER
    body: np.ndarray  # bool: carries excess work (phase 1) vs filler (phase 2)
    block: np.ndarray  # TAIL_BLOCK / REMAINDER for the bodies of "blocks" / "split", else 0
    # by_doc: 2 x the body's document group + 1 for the group's dense document (-1: filler)
    group: np.ndarray | None = None


def cut_items(lengths: np.ndarray, prof: Profile, cp: int, var: Variant,
              memo: dict | None = None) -> Items:
    """Cut the documents into filler items (short documents, heads) and bodies.

    ``var.body == "blocks"`` (chunked masks only): the head is the whole first chunk, the
    body [C, L) runs in position order and is split at p into a tail block [p, L) holding
    exactly n whole rank shares of the excess (n = floor of the body's shares; p off the
    tile grid) and a remainder [C, p): the tail block's ranks then hold ONE contiguous
    piece of one document each, and only the remainders (all starting at C, the cheapest
    place to start) share ranks.

    keep_small: long segments whose excess work is negligible (segments.py's
    ``_KEEP_EXCESS`` of a rank's mean work) stay whole filler items, split like any dense
    filler: spreading their body over every rank would fetch a whole window or chunk on
    each for nothing (one 4242-token document among 1000 short ones with a 4096 window at
    cp 16: SWA-layer efficiency 0.26 spread, 0.46 as filler)."""
    memo = {} if memo is None else memo
    doc, start, end, long = segments_of(lengths, prof, cp, var.keep_small, memo,
                                        NEST_KEEP_EXCESS if var.nest_long else None)
    blocks = var.body == "blocks" and prof.head == "chunk"
    h, tail, ends = _heads(prof, blocks, start, end, long)
    has_head = long & (h > 0)
    mid_end = np.where(ends, tail, end)
    # Filler: short segments and short-like heads; bodies (and the heads and tails of
    # "ends") carry the excess. With one mask (no excess) everything is filler.
    like = prof.head in ("chunk", "prefix")
    f_sel = [(~long, start, end)] + ([(has_head, start, start + h)] if like else [])
    b_sel = [(long, start + h, mid_end)] + ([] if like else [(has_head, start, start + h)])
    b_sel.append((ends, tail, end))
    f_doc = np.concatenate([doc[m] for m, _, _ in f_sel])
    f_start = np.concatenate([a[m] for m, a, _ in f_sel])
    f_end = np.concatenate([b[m] for m, _, b in f_sel])
    b_doc = np.concatenate([doc[m] for m, _, _ in b_sel])
    b_start = np.concatenate([a[m] for m, a, _ in b_sel])
    b_end = np.concatenate([b[m] for m, _, b in b_sel])
    n_f, n_long = f_doc.size, int(long.sum())
    b_doc, b_start, b_end, kind, block, *grp = _split_bodies(
        lengths, prof, cp, var, blocks, n_long, b_doc, b_start, b_end, memo)
    n_b = b_doc.size
    excess = prof.excess.shape[0] > 0
    out = (np.concatenate([f_doc, b_doc]), np.concatenate([f_start, b_start]),
           np.concatenate([f_end, b_end]),
           np.concatenate([_filler_kinds(lengths, prof, cp, var, f_doc, f_start, f_end, memo),
                           kind]),
           np.concatenate([np.zeros(n_f, dtype=bool), np.full(n_b, excess, dtype=bool)]),
           np.concatenate([np.zeros(n_f, dtype=np.int64), block]))
    if grp:
        return Items(*out, np.concatenate([np.full(n_f, -1, dtype=np.int64), grp[0]]))
    return Items(*out)


def _heads(prof: Profile, blocks: bool, start: np.ndarray, end: np.ndarray,
           long: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(head length of each segment (0: none), the start of the "ends" tail item, which
    segments have one) of segments [start, end), ``long`` marking those with a body."""
    size = end - start
    if blocks:
        h = np.full_like(size, prof.chunk)
    elif prof.head == "chunk":
        r = size % prof.chunk
        t = prof.tile
        h = np.where(r == 0, 0, prof.chunk - (r + t - 1) // t * t)
    elif prof.head in ("prefix", "ends"):
        h = np.full_like(size, prof.prefix)
    else:
        h = np.zeros_like(size)
    t = prof.tile
    tail = (end - prof.suffix) // t * t  # "ends" only
    ends = long & (prof.head == "ends") & (start + h < tail) & (prof.suffix > 0)
    h = np.where(long & ((prof.head != "ends") | (start + h < tail)), h, 0)
    return h, tail, ends


def _split_bodies(lengths: np.ndarray, prof: Profile, cp: int, var: Variant,
                  blocks: bool, n_long: int, b_doc: np.ndarray, b_start: np.ndarray,
                  b_end: np.ndarray, memo: dict) -> tuple[np.ndarray, ...]:
    """The body items (the first ``n_long`` are the long segments' bodies) with their
    kinds and blocks: for ``blocks`` and ``split`` variants each long body cut at p into a
    remainder [start, p) and a tail block [p, end) (see :func:`cut_items`); else unchanged,
    mirrored (chunk-pair walked for chunked masks)."""
    n_b = b_doc.size
    kind = np.full(n_b, MIRRORED, dtype=np.int64)
    block = np.zeros(n_b, dtype=np.int64)
    if not ((blocks or var.body == "split") and n_long and prof.excess.shape[0]):
        if prof.head == "chunk":
            kind[:n_long] = CHUNK_PAIRS
        return b_doc, b_start, b_end, kind, block
    groups = None
    if blocks:
        p, n_sh = tail_split(lengths, prof, cp, b_doc[:n_long], b_start[:n_long],
                             b_end[:n_long], memo)
        tail = np.flatnonzero(n_sh >= 1)
    else:
        groups = group_split(lengths, prof, cp, b_doc[:n_long], b_start[:n_long],
                             b_end[:n_long], memo) if var.by_doc else None
        if groups is not None:
            p, grp, dense = groups
        else:
            p = density_split(lengths, prof, b_doc[:n_long], b_start[:n_long],
                              b_end[:n_long], memo)
        if _MINLATE > 0:
            excess, tot_e = excess_of(lengths, prof, memo)
            small = (excess(p, b_end[:n_long], lengths[b_doc[:n_long]])
                     < _MINLATE * tot_e / cp)
            p = np.where(small, b_end[:n_long], p)
        tail = np.flatnonzero(p < b_end[:n_long])
    rest = np.flatnonzero(p > b_start[:n_long])
    t_doc, t_start, t_end = b_doc[tail], p[tail], b_end[tail]
    t_kind = np.full(tail.size, POSITION_ORDER, dtype=np.int64)
    if blocks and var.mirror_tail:
        t_doc, t_start, t_end, t_kind = _mirrored_tails(lengths, prof, cp, t_doc, t_start,
                                                        t_end, memo)
    n_r, n_t = rest.size, t_doc.size
    b_doc = np.concatenate([b_doc[rest], t_doc, b_doc[n_long:]])
    b_start, b_end = (np.concatenate([b_start[rest], t_start, b_start[n_long:]]),
                      np.concatenate([p[rest], t_end, b_end[n_long:]]))
    n_b = b_doc.size
    block = np.concatenate([np.full(n_r, REMAINDER, dtype=np.int64),
                            np.full(n_t, TAIL_BLOCK, dtype=np.int64),
                            np.zeros(n_b - n_r - n_t, dtype=np.int64)])
    kind = np.concatenate([np.full(n_r, POSITION_ORDER, dtype=np.int64), t_kind,
                           np.full(n_b - n_r - n_t, POSITION_ORDER, dtype=np.int64)])
    if groups is None:
        return b_doc, b_start, b_end, kind, block
    # The dense documents' early parts walked back from p; each body's group key.
    kind[:n_r][dense[rest]] = REVERSED
    key = 2 * grp + dense
    return b_doc, b_start, b_end, kind, block, np.concatenate(
        [key[rest], key[tail], np.full(n_b - n_r - n_t, -1, dtype=np.int64)])


def _shares(lengths: np.ndarray, prof: Profile, cp: int, memo: dict) -> tuple[float, float]:
    """(excess, work under the mask with least work) a rank's share: the chunked mask's,
    for chunked + causal masks."""
    _, tot_e = excess_of(lengths, prof, memo)
    return tot_e / cp, float(doc_work(lengths, prof, memo).sum(0).min()) / cp


def mirror_tail_reachable(lengths: np.ndarray, prof: Profile, cp: int, memo: dict) -> bool:
    """Whether ``Variant.mirror_tail`` can reach its filler targets: mirrored, a whole
    share of excess in chunk 1 (share / C tokens) holds about half a chunk's work per
    token, share / 2 in all; where that exceeds a rank's mean work under the chunked
    mask (few documents at many tokens a rank: a few long among short at cp 8, 16K tokens
    a rank) its rank has no room for filler either, and the attempt is not built."""
    share_x, share_ch = _shares(lengths, prof, cp, memo)
    return share_x / 2 <= share_ch


def _mirrored_tails(lengths: np.ndarray, prof: Profile, cp: int, td: np.ndarray,
                    ta: np.ndarray, tb: np.ndarray, memo: dict) -> tuple[np.ndarray, ...]:
    """(doc, start, end, kind) of the ``blocks`` tail blocks [ta, tb) of documents ``td``
    cut at the chunk boundaries below chunk ``c_max + 1``, each such chunk's stretch walked
    mirrored (``Variant.mirror_tail``).

    A token of chunk c carries c x C of excess, so a whole rank share of excess there is
    share / (c C) tokens; at the end of chunk c, in position order, those tokens hold about
    share / c of chunked work, more than a rank's mean where c <= c_max = floor(share /
    chunked mean): that rank has no room left for filler (a few long among short at cp 64:
    chunk 1's last shares held 1.1-1.4x a rank's chunked work). Mirrored, a stretch holds
    the chunk's mean, about half. The stretches keep the tail block's order (one document's
    pieces in position order, then the next) and its whole shares (phases.py counts a
    document's tail items as one block)."""
    share_x, share_ch = _shares(lengths, prof, cp, memo)
    c_max = int(share_x // max(share_ch, 1e-300))
    # Per tail block: its pieces [max(a, c C), min(b, (c + 1) C)) for c <= c_max, then the
    # rest in position order.
    cuts = np.arange(1, c_max + 2, dtype=np.int64) * prof.chunk  # [c_max + 1]
    lo = np.concatenate([ta[:, None], np.maximum(ta[:, None], cuts[None, :])], 1)
    hi = np.concatenate([np.minimum(tb[:, None], cuts[None, :]), tb[:, None]], 1)
    lo = np.minimum(lo, hi)
    kinds = np.full(lo.shape, POSITION_ORDER, dtype=np.int64)
    kinds[:, :-1] = MIRRORED
    keep = hi > lo  # [tails, c_max + 2], row-major: each block's pieces in position order
    return np.repeat(td, keep.sum(1)), lo[keep], hi[keep], kinds[keep]


def _filler_kinds(lengths: np.ndarray, prof: Profile, cp: int, var: Variant,
                  f_doc: np.ndarray, f_start: np.ndarray, f_end: np.ndarray,
                  memo: dict) -> np.ndarray:
    """How each filler item is walked: in position order (``var.fill == "prefix"``),
    except items holding more than ``var.big`` ranks' work, which stay mirrored: in
    position order such an item's stretches would range from far too sparse (its start)
    to far too dense for the rank-by-rank solver."""
    n_f = f_doc.size
    if var.fill != "prefix":
        return np.full(n_f, MIRRORED, dtype=np.int64)
    f_kind = np.full(n_f, POSITION_ORDER, dtype=np.int64)
    if var.big < math.inf:
        m0 = prof.masks[0]
        fl = lengths[f_doc]
        w = (prefix_pairs(fl, f_end, m0) - prefix_pairs(fl, f_start, m0)
             ).astype(np.float64)
        share = float(doc_work(lengths, prof, memo)[:, 0].sum()) / cp
        f_kind[w > var.big * share] = MIRRORED
    return f_kind
