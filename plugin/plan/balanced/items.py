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

Body classes (``Items.block``) of the locality variants: a body split at p is a
``REMAINDER`` [start, p) and a ``TAIL_BLOCK`` [p, end) (``blocks``: whole rank shares of
excess; ``split``: the late part of a window body, dense in excess).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .args import prefix_work
from .body_split import density_split, tail_split
from .profile import Profile
from .segments import doc_work, excess_of, segments_of
from .variants import Variant

# Window bodies: a late part with less excess than this share of a rank's stays with the
# early part (a rank would otherwise collect slivers of several documents' ends).
_MINLATE = 0.5

MIRRORED, CHUNK_PAIRS, POSITION_ORDER = 0, 1, 2
TAIL_BLOCK, REMAINDER = 1, 2


@dataclass
class Items:
    """Items [I] (int64 unless noted): filler first, then bodies."""

    doc: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    kind: torch.Tensor  # MIRRORED / CHUNK_PAIRS / POSITION_ORDER
    body: torch.Tensor  # bool: carries excess work (phase 1) vs filler (phase 2)
    block: torch.Tensor  # TAIL_BLOCK / REMAINDER for the bodies of "blocks" / "split", else 0


def cut_items(lengths: torch.Tensor, prof: Profile, cp: int, var: Variant,
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
    doc, start, end, long = segments_of(lengths, prof, cp, var.keep_small, memo)
    blocks = var.body == "blocks" and prof.head == "chunk"
    h, tail, ends = _heads(prof, blocks, start, end, long)
    has_head = long & (h > 0)
    mid_end = torch.where(ends, tail, end)
    # Filler: short segments and short-like heads; bodies (and the heads and tails of
    # "ends") carry the excess. With one mask (no excess) everything is filler.
    like = prof.head in ("chunk", "prefix")
    f_sel = [(~long, start, end)] + ([(has_head, start, start + h)] if like else [])
    b_sel = [(long, start + h, mid_end)] + ([] if like else [(has_head, start, start + h)])
    b_sel.append((ends, tail, end))
    f_doc = torch.cat([doc[m] for m, _, _ in f_sel])
    f_start = torch.cat([a[m] for m, a, _ in f_sel])
    f_end = torch.cat([b[m] for m, _, b in f_sel])
    b_doc = torch.cat([doc[m] for m, _, _ in b_sel])
    b_start = torch.cat([a[m] for m, a, _ in b_sel])
    b_end = torch.cat([b[m] for m, _, b in b_sel])
    n_f, n_long = f_doc.numel(), int(long.sum())
    b_doc, b_start, b_end, kind, block = _split_bodies(
        lengths, prof, cp, var, blocks, n_long, b_doc, b_start, b_end, memo)
    n_b = b_doc.numel()
    excess = prof.excess.shape[0] > 0
    return Items(
        doc=torch.cat([f_doc, b_doc]), start=torch.cat([f_start, b_start]),
        end=torch.cat([f_end, b_end]),
        kind=torch.cat([_filler_kinds(lengths, prof, cp, var, f_doc, f_start, f_end, memo),
                        kind]),
        body=torch.cat([torch.zeros(n_f, dtype=torch.bool),
                        torch.full((n_b,), excess, dtype=torch.bool)]),
        block=torch.cat([torch.zeros(n_f, dtype=torch.int64), block]))


def _heads(prof: Profile, blocks: bool, start: torch.Tensor, end: torch.Tensor,
           long: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head length of each segment (0: none), the start of the "ends" tail item, which
    segments have one) of segments [start, end), ``long`` marking those with a body."""
    size = end - start
    if blocks:
        h = torch.full_like(size, prof.chunk)
    elif prof.head == "chunk":
        r = size % prof.chunk
        t = prof.tile
        h = torch.where(r == 0, 0, prof.chunk - (r + t - 1) // t * t)
    elif prof.head in ("prefix", "ends"):
        h = torch.full_like(size, prof.prefix)
    else:
        h = torch.zeros_like(size)
    t = prof.tile
    tail = torch.div(end - prof.suffix, t, rounding_mode="floor") * t  # "ends" only
    ends = long & (prof.head == "ends") & (start + h < tail) & (prof.suffix > 0)
    h = torch.where(long & ((prof.head != "ends") | (start + h < tail)), h, 0)
    return h, tail, ends


def _split_bodies(lengths: torch.Tensor, prof: Profile, cp: int, var: Variant,
                  blocks: bool, n_long: int, b_doc: torch.Tensor, b_start: torch.Tensor,
                  b_end: torch.Tensor, memo: dict) -> tuple[torch.Tensor, ...]:
    """The body items (the first ``n_long`` are the long segments' bodies) with their
    kinds and blocks: for ``blocks`` and ``split`` variants each long body cut at p into a
    remainder [start, p) and a tail block [p, end) (see :func:`cut_items`); else unchanged,
    mirrored (chunk-pair walked for chunked masks)."""
    n_b = b_doc.numel()
    kind = torch.full((n_b,), MIRRORED)
    block = torch.zeros(n_b, dtype=torch.int64)
    if not ((blocks or var.body == "split") and n_long and prof.excess.shape[0]):
        if prof.head == "chunk":
            kind[:n_long] = CHUNK_PAIRS
        return b_doc, b_start, b_end, kind, block
    if blocks:
        p, n_sh = tail_split(lengths, prof, cp, b_doc[:n_long], b_start[:n_long],
                             b_end[:n_long], memo)
        tail = torch.nonzero(n_sh >= 1).flatten()
    else:
        p = density_split(lengths, prof, b_doc[:n_long], b_start[:n_long],
                          b_end[:n_long], memo)
        if _MINLATE > 0:
            excess, tot_e = excess_of(lengths, prof, memo)
            small = excess(p, b_end[:n_long], lengths[b_doc[:n_long]]) < _MINLATE * tot_e / cp
            p = torch.where(small, b_end[:n_long], p)
        tail = torch.nonzero(p < b_end[:n_long]).flatten()
    rest = torch.nonzero(p > b_start[:n_long]).flatten()
    b_doc = torch.cat([b_doc[rest], b_doc[tail], b_doc[n_long:]])
    b_start, b_end = (torch.cat([b_start[rest], p[tail], b_start[n_long:]]),
                      torch.cat([p[rest], b_end[tail], b_end[n_long:]]))
    n_b = b_doc.numel()
    block = torch.cat([torch.full((rest.numel(),), REMAINDER),
                       torch.full((tail.numel(),), TAIL_BLOCK),
                       torch.zeros(n_b - rest.numel() - tail.numel(), dtype=torch.int64)])
    return b_doc, b_start, b_end, torch.full((n_b,), POSITION_ORDER), block


def _filler_kinds(lengths: torch.Tensor, prof: Profile, cp: int, var: Variant,
                  f_doc: torch.Tensor, f_start: torch.Tensor, f_end: torch.Tensor,
                  memo: dict) -> torch.Tensor:
    """How each filler item is walked: in position order (``var.fill == "prefix"``),
    except items holding more than ``var.big`` ranks' work, which stay mirrored: in
    position order such an item's stretches would range from far too sparse (its start)
    to far too dense for the rank-by-rank solver."""
    n_f = f_doc.numel()
    if var.fill != "prefix":
        return torch.full((n_f,), MIRRORED)
    f_kind = torch.full((n_f,), POSITION_ORDER)
    if var.big < math.inf:
        m0 = prof.masks[0]
        fl = lengths[f_doc]
        w = (prefix_work(fl, f_end, m0) - prefix_work(fl, f_start, m0)).to(torch.float64)
        share = float(doc_work(lengths, prof, memo)[:, 0].sum()) / cp
        f_kind[w > var.big * share] = MIRRORED
    return f_kind
