"""Attempts: the ways one layout may cut the documents into items and solve the lists, and
the order in which :func:`~.solve.balanced_runs` tries them (the first that meets the
targets is taken).

Locality variants come first: they keep what a rank holds of a document in few contiguous
stretches (filler in position order, long documents in nested pieces first where there are
no bodies, chunked bodies in tail blocks of whole rank shares, window bodies split into
late and early parts, by document group or on a few ranks first where their excess is
small, or kept whole and nested first where every body's excess is small; a tail block's
stretches in chunks too dense in chunked work for whole shares mirrored, where the plain
blocks fail) and run only where every mask looks left (a filler prefix is then causal-like
under all of them) or there is one mask. The fold variants (mirrored tiles, chunk pairs) come
last: they are always feasible when anything is. The ``few`` variant keeps big filler items
in position order (``big`` unbounded, its own items and units): on the batches it serves
its most-fetching rank then fetches less (1000 documents, cp 32: 4268 against 4905 keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profile import Profile, locality


@dataclass(frozen=True)
class Variant:
    """How one attempt cuts the documents and solves the lists (see the package docstring).

    body:   "fold" (chunk pairs / mirrored bodies), "blocks" (chunked + causal: bodies in
            position order, split into tail blocks of whole rank shares and remainders) or
            "split" (window + causal: bodies in position order, split into a late part
            dense in excess and an early part).
    pair:   bodies cut as a dense / sparse pair (to equal tokens and excess) instead of one
            list cut by excess.
    keep_small: long segments with negligible excess stay filler.
    fill:   "mirror" or "prefix" (filler items in position order; items holding more than
            ``big`` ranks' work stay mirrored).
    solver: "vector" (the k-ary search over the whole pair), "seq" (rank by rank, one dense
            and one sparse list) or "classes" (rank by rank, two density classes per side).
    few:    ``split`` bodies on fewer ranks than cp, each a larger share: solve.py tries
            the counts of :func:`~.phases.holder_counts` and keeps the one whose layout
            fetches least (of those that meet the targets).
    holders: the count of one such attempt (0: every rank).
    mirror_tail: ``blocks`` tail blocks walked mirrored in the chunks where a whole rank
            share at the chunk's end would hold more than a rank's mean chunked work
            (items.py), filler in position order, whatever its size; tried where
            ``blocks`` does not meet the targets (and may: ``items.mirror_tail_reachable``).
            Like ``by_doc``, taken only where it meets the targets exactly and fetches 5%
            less (solve.py's ``_fetch_cost``) than what the later attempts give, or where
            those miss the targets.
    by_doc: ``split`` bodies by document group (body_split.py's ``group_split``: each
            document dense in excess a group, the sparse ones joining a group with room;
            a group's split point at its own mean), tokens in proportion to excess within
            a group, groups on whole ranks, the early parts walked back from the late
            part's start: a rank's late and early stretches come from one document.
            Taken as ``mirror_tail`` is.
    nest:   whole short segments of at least two ranks' work are cut into nested pieces
            (nested.py: a rank holding a late stretch also holds an early one), each on a
            rank of its own, before the filler (masks that all look left, no bodies);
            shares the items and units of the same variant without it.
    nest_long: ``nest`` on a batch with window bodies whose excess is small: long
            segments with up to ``segments.NEST_KEEP_EXCESS`` of a rank's mean work in
            excess stay whole filler and are nested like short ones (their pieces'
            ranks take their excess less filler: phases.py's ``_excess_shift``); tried
            first where no segment has more and a long one may be nested
            (``nested.long_nestable``), taken only where it meets the
            targets exactly and fetches 5% less than what the later attempts give, or
            where those miss the targets.
    """

    body: str = "fold"
    pair: bool = False
    keep_small: bool = True
    fill: str = "mirror"
    big: float = math.inf
    solver: str = "vector"
    few: bool = False
    holders: int = 0
    nest: bool = False
    mirror_tail: bool = False
    by_doc: bool = False
    nest_long: bool = False


FOLD_VARIANTS = (Variant(), Variant(pair=True), Variant(pair=True, keep_small=False))


def choose_variants(prof: Profile, bodies: bool, prefix_ok: bool = True) -> list[Variant]:
    """Attempts in order (the first that meets the targets is taken): locality-first
    variants where their pieces keep the masks' work in a fixed relation (every mask
    looks left, so a filler item's prefix is causal-like under all of them), then the
    fold variants (always feasible when anything is). ``bodies``: some segment carries
    excess (:func:`~.segments.has_bodies`); ``prefix_ok``: no filler item is too sparse at
    its start for the filler-only locality variants
    (:func:`~.segments.prefixes_dense_enough`)."""
    left = all(locality(m)[1] for m in prof.masks)
    if not bodies and (len(prof.masks) == 1 or left):
        local = [Variant(fill="prefix", solver="seq"), Variant(fill="prefix", solver="classes")]
        if left:
            local.insert(0, Variant(fill="prefix", solver="seq", nest=True))
        return (local if prefix_ok else []) + list(FOLD_VARIANTS[:1])
    if not left:
        return list(FOLD_VARIANTS)
    local = []
    if prof.head == "chunk":
        local.append(Variant(body="blocks", fill="prefix", big=2.0, solver="classes"))
        local.append(Variant(body="blocks", fill="prefix", solver="seq", mirror_tail=True))
    elif prof.head == "prefix":
        local.append(Variant(fill="prefix", solver="seq", nest=True, nest_long=True))
        local.append(Variant(body="split", fill="prefix", solver="seq", few=True))
        local.append(Variant(body="split", fill="prefix", solver="seq", by_doc=True))
        local.append(Variant(body="split", fill="prefix", big=2.0, solver="seq"))
        local.append(Variant(body="split", fill="prefix", big=2.0, solver="classes"))
    return local + list(FOLD_VARIANTS)

