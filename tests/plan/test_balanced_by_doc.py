"""The ``balanced`` layout's ``by_doc`` variant: window + causal bodies split per document
group (each dense document a group, the sparse ones joining a group with room), tokens in
proportion to excess within a group, the early parts walked back from the late part's
start, groups on whole ranks: a rank's late and early stretches come from one document.

Fetches are counted from the runs by dense per-rank masks (tests/helpers/plan_checks.py),
balance with ``CPPlan.work_imbalance`` and the closed forms' independent dense counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.mixes import MIXES
from varlen_cp import AttnMask
from varlen_cp.plan.balanced import (DEFAULT_TILE_TOKENS, balanced_runs, normalize_masks,
                                     prefix_work)
from varlen_cp.plan.balanced import solve as S
from varlen_cp.plan.balanced.body_split import GROUP_CAP, group_split
from varlen_cp.plan.balanced.items import REVERSED, cut_items
from varlen_cp.plan.balanced.profile import profile_of
from varlen_cp.plan.balanced.segments import segments_of
from varlen_cp.plan.balanced.units import unit_runs, units_of
from varlen_cp.plan.balanced.variants import Variant
from tests.helpers.plan_checks import (assert_runs_unchanged_without, balanced_within_targets,
                                       causal_fetch, drop_variants, window_fetch)

WINDOW = 4096
SWA = AttnMask(window_size=(WINDOW, 0))
GEMMA = [(SWA, 5), (AttnMask(), 1)]


def _without_by_doc(monkeypatch) -> None:
    """The layout as it was before the variant: its attempt dropped."""
    drop_variants(monkeypatch, S, lambda v: v.by_doc)


def test_late_and_early_stretches_of_one_document(monkeypatch) -> None:
    """A few long among short at cp 64 (8K tokens a rank; documents of 32768 and 20000
    tokens), SWA 5:1: with equal tokens a rank the plain split gave ranks the end of the
    32K document's late part with the 20K one's early part (53K causal keys to fetch).
    By document groups every mask stays within its targets, no rank holds body stretches
    of both, and the ranks that fetch most fetch less: measured 53354 -> 36566 causal,
    16716 -> 14057 window keys."""
    cp = 64
    lengths = np.asarray(MIXES["few_long"](8192 * cp))
    masks = normalize_masks(GEMMA)
    balanced_within_targets(lengths, cp, GEMMA)
    new = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    rank, doc, start, length = new
    body = start + length > WINDOW
    both = [r for r in range(cp) if {0, 52} <= set(doc[(rank == r) & body].tolist())]
    assert both == []
    _without_by_doc(monkeypatch)
    old = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    ca_new, ca_old = (causal_fetch(*r, lengths, cp).max() for r in (new, old))
    w_new, w_old = (window_fetch(*r, lengths, cp, WINDOW).max() for r in (new, old))
    assert ca_new <= 0.75 * ca_old, (ca_new, ca_old)
    assert w_new <= 0.9 * w_old, (w_new, w_old)


def test_groups_and_split_points() -> None:
    """On that batch: each group's filler-column (window) work is at most ``GROUP_CAP``
    of what its share of excess brings a rank, counted by the closed forms; each group
    has one dense document (the one walked back), and each body's split point is where a
    token's excess first reaches its group's mean (up to the tile)."""
    cp = 64
    lengths = np.asarray(MIXES["few_long"](8192 * cp))
    mw = normalize_masks(GEMMA)
    prof = profile_of(mw, DEFAULT_TILE_TOKENS)
    memo: dict = {}
    doc, start, end, long = segments_of(lengths, prof, cp, True, memo)
    b_doc, b_start, b_end = doc[long], start[long] + WINDOW, end[long]
    p, group, dense = group_split(lengths, prof, cp, b_doc, b_start, b_end, memo)
    dl = lengths[b_doc]

    def work(mask, a, b):
        return (prefix_work(dl, b, mask) - prefix_work(dl, a, mask)).astype(float)

    exc = work(AttnMask(), b_start, b_end) - work(SWA, b_start, b_end)
    win = work(SWA, b_start, b_end)
    total_exc = float((prefix_work(lengths, lengths, AttnMask())
                       - prefix_work(lengths, lengths, SWA)).sum())
    total_win = float(prefix_work(lengths, lengths, SWA).sum())
    n_g = int(group.max()) + 1
    assert n_g == 2 and np.bincount(group, weights=dense).tolist() == [1.0] * n_g
    g_x = np.bincount(group, weights=exc)
    g_w = np.bincount(group, weights=win)
    assert (g_w / (total_win / cp) <= GROUP_CAP * g_x / (total_exc / cp) + 1e-9).all()
    # the 32768- and 20000-token documents are the dense ones
    assert sorted(b_doc[dense].tolist()) == [0, 52]
    mean = (g_x / np.bincount(group, weights=(b_end - b_start).astype(float)))[group]
    tile = DEFAULT_TILE_TOKENS
    for i in range(b_doc.size):
        tok = np.arange(b_start[i], b_end[i])
        d = tok - np.minimum(tok, WINDOW)  # a token's excess: causal keys - window keys
        first = int(tok[np.argmax(d >= mean[i])]) if (d >= mean[i]).any() else int(b_end[i])
        assert first <= p[i] < max(first + tile, b_start[i] + 1) or p[i] == b_end[i] == first


def test_reversed_items_are_walked_from_their_end() -> None:
    """A dense document's early part is walked back: every first few units of its fold
    cover a stretch ending where the item ends (a rank taking the next units holds one
    stretch that continues its predecessor's downward)."""
    cp = 64
    lengths = np.asarray(MIXES["few_long"](8192 * cp))
    prof = profile_of(normalize_masks(GEMMA), DEFAULT_TILE_TOKENS)
    items = cut_items(lengths, prof, cp, Variant(body="split", fill="prefix", by_doc=True))
    units = units_of(items, lengths, prof)
    rev = np.flatnonzero(items.kind == REVERSED)
    assert rev.size == 2
    for i in rev:
        u = np.flatnonzero(units.item == i)
        u = u[np.argsort(units.ufold[u])]
        held = np.zeros(int(items.end[i]), dtype=bool)
        for k in u:
            for a, n in unit_runs(units, np.array([k]), np.array([0]),
                                  np.array([units.a_len[k] + units.b_len[k]])):
                held[int(a[0]): int(a[0] + n[0])] = True
            low = int(np.flatnonzero(held).min())
            assert held[low:].all() and low >= items.start[i]


@pytest.mark.parametrize("mix, cp, total", [("lognormal_long", 8, 131072),
                                            ("lognormal_1k", 32, 8192 * 32),
                                            ("lognormal_long", 64, 8192 * 64)])
def test_layout_unchanged_where_groups_do_not_help(monkeypatch, mix: str, cp: int,
                                                   total: int) -> None:
    """Where the groups do not lower the most-fetching rank's keys by 5% (a heavy tail at
    cp 8: 2%, for work 1.029 instead of 1.003) or do not form (no two dense documents),
    the runs are those of the layout without the variant."""
    lengths = np.asarray(MIXES[mix](total))
    masks = normalize_masks(GEMMA)
    assert_runs_unchanged_without(monkeypatch, lambda v: v.by_doc, lengths, cp, masks)
