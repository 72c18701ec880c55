"""The ``balanced`` layout's ``nest`` variant: long causal-like documents cut into nested
pieces, each a rank's, a late stretch with an early one (``plan/balanced/nested.py``).

Pieces, work and fetches are counted here densely (a piece index per position; the keys
before a rank's last position in a document that it does not hold), independently of the
walk's closed forms; the layout's balance with ``CPPlan`` (the plan's tables).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.mixes import MIXES
from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan import Balanced
from varlen_cp.plan.balanced import DEFAULT_TILE_TOKENS, balanced_runs, normalize_masks
from varlen_cp.plan.balanced import solve as S
from varlen_cp.plan.balanced.nested import group_labels, nested_pieces
from tests.helpers.plan_checks import assert_runs_unchanged_without, causal_fetch, drop_variants

def _without_nest(monkeypatch) -> None:
    """The layout as it was before the ``nest`` variant: its attempts dropped."""
    drop_variants(monkeypatch, S, lambda v: v.nest)


@pytest.mark.parametrize("length, work, rho", [(4713, 1.2e6, 60.0), (3970, 1.0e6, 0.0),
                                               (32768, 2e7, 150.0), (700, 5e4, 10.0)])
def test_pieces_partition_the_document_and_fetch_less(length: int, work: float,
                                                       rho: float) -> None:
    """Every position in exactly one piece; every piece but the last carries work +
    rho * its tokens within 1%; the most-fetching piece fetches at most 0.93x what the
    piece holding the end would in position order (same work: measured 0.85x for 4713
    tokens, 0.92x for 32768)."""
    seg, idx, hs, hl, ts, tl = nested_pieces(np.array([length]), work, rho)
    assert (seg == 0).all()
    piece = np.full(length, -1)
    for i, a, b, c, d in zip(idx, hs, hl, ts, tl):
        for lo, n in ((a, b), (c, d)):
            assert (piece[lo:lo + n] == -1).all()
            piece[lo:lo + n] = i
    assert (piece >= 0).all()
    n = int(idx.max()) + 1
    pos = np.arange(length)
    w = np.bincount(piece, weights=pos + 1.0, minlength=n)  # causal pairs: p + 1 keys
    t = np.bincount(piece, minlength=n)
    assert np.allclose(w[:-1], work + rho * t[:-1], rtol=0.01)
    last = np.zeros(n, dtype=np.int64)
    np.maximum.at(last, piece, pos)
    fetch = last + 1 - t
    end = np.searchsorted(np.cumsum(pos[::-1] + 1.0), w[0])  # position order, same work
    assert fetch.max() <= 0.93 * (length - end - 1), (fetch.max(), length - end - 1)


@pytest.mark.parametrize("length, work", [(489, 23889.62226667435), (2, 0.5), (21, 231 / 35)])
def test_pieces_partition_when_the_last_is_under_a_token(length: int, work: float) -> None:
    """Pieces are rounded end by end: where the walk's remainder is under a token it still
    makes a piece of it (a review found position 313 of 489 in no piece)."""
    seg, idx, hs, hl, ts, tl = nested_pieces(np.array([length]), work, 0.0)
    count = np.zeros(length, dtype=np.int64)
    for a, b, c, d in zip(hs, hl, ts, tl):
        count[a:a + b] += 1
        count[c:c + d] += 1
    assert (count == 1).all(), np.flatnonzero(count != 1)


def test_pieces_of_several_documents_at_once() -> None:
    """A batch of segments walks as each alone (the grid of F and the steps per segment)."""
    lengths = np.array([4713, 700, 3970])
    works = np.array([1.2e6, 5e4, 1.0e6])
    together = nested_pieces(lengths, works, 30.0)
    for s in range(lengths.size):
        alone = nested_pieces(lengths[s:s + 1], works[s], 30.0)
        sel = together[0] == s
        for a, b in zip(together[1:], alone[1:]):
            assert np.array_equal(a[sel], b)


def test_long_documents_nested_at_cp64(monkeypatch) -> None:
    """1000 log-normal documents per 128K tokens at cp 64, 8K tokens a rank: the three
    longest (4713, 3970, 3235 tokens) are nested. Every mask meets its targets, the rank
    holding the longest one's end also holds a stretch of its first quarter, each of them
    lies in one aligned block of 8 ranks, and the rank that fetches most fetches at most
    0.9x the position-order layout's (measured 4031 against 4815 keys)."""
    cp = 64
    lengths = np.asarray(MIXES["lognormal_1k"](8192 * cp))
    masks = [(AttnMask(), 1)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=Balanced(masks=masks))
    assert plan.token_imbalance() <= 1.02
    assert plan.work_imbalance(AttnMask()) <= 1.03
    new = balanced_runs(lengths, cp, normalize_masks(masks), DEFAULT_TILE_TOKENS)
    assert torch.equal(plan.runs.doc, torch.from_numpy(new[1]))
    rank, doc, start, length = new
    longest = np.argsort(-lengths)[:3]
    for d in longest:
        assert np.unique(rank[doc == d] // 8).size == 1, d
    d = longest[0]
    end_rank = rank[(doc == d) & (start + length == lengths[d])]
    assert ((rank == end_rank) & (doc == d) & (start < lengths[d] // 4)).any()
    _without_nest(monkeypatch)
    old = balanced_runs(lengths, cp, normalize_masks(masks), DEFAULT_TILE_TOKENS)
    f_new = causal_fetch(*new, lengths, cp).max()
    f_old = causal_fetch(*old, lengths, cp).max()
    assert f_new <= 0.9 * f_old, (f_new, f_old)


@pytest.mark.parametrize("mix, total, cp", [("lognormal_1k", 131072, 64),
                                            ("one_128k", 65536, 8), ("short_4k", 65536, 8)])
def test_layout_unchanged_where_nothing_is_nested(monkeypatch, mix: str, total: int,
                                                  cp: int) -> None:
    """Where no document holds two ranks' work (short documents), or the pieces would hold
    more than half the ranks (1000 documents at 2K tokens a rank; one document of all the
    work), the runs are those of the layout without the ``nest`` variant."""
    lengths = np.asarray(MIXES[mix](total))
    masks = normalize_masks([(AttnMask(chunk_size=8192), 3), (AttnMask(), 1)])
    assert_runs_unchanged_without(monkeypatch, lambda v: v.nest, lengths, cp, masks)


@pytest.mark.parametrize("first, cp", [([0, 7, 12, 16], 32), ([0, 10, 17, 21], 64),
                                       ([0, 3, 6], 10), ([0, 5, 9], 12)])
def test_group_labels(first: list[int], cp: int) -> None:
    """Labels are a permutation; a segment of at most 8 pieces lies in one aligned block
    of 8 labels; ranks without pieces keep their order."""
    first = np.asarray(first)
    label = group_labels(first, cp)
    assert np.array_equal(np.sort(label), np.arange(cp))
    for a, b in zip(first[:-1], first[1:]):
        if b - a <= 8:
            assert np.unique(label[a:b] // 8).size == 1
    rest = label[first[-1]:]
    assert (np.diff(rest) > 0).all()
