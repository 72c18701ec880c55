"""The ``balanced`` layout's ``mirror_tail`` variant (and the fetch cost that decides
whether it and ``by_doc`` are taken): chunked + causal bodies in tail
blocks of whole rank shares, each block's stretch in a chunk where a whole share would be
too dense in chunked work walked mirrored, where the plain ``blocks`` variant cannot reach
its filler targets (it then fell back to the chunk-pair fold, whose ranks hold pieces of
several long documents).

Fetches are counted from the runs by dense per-rank masks (tests/helpers/plan_checks.py),
balance with ``CPPlan.work_imbalance`` (the plan's tables and mask_math), independently of
the solver's closed forms.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.mixes import MIXES
from varlen_cp import AttnMask
from varlen_cp.plan.balanced import (DEFAULT_TILE_TOKENS, balanced_runs, normalize_masks,
                                     prefix_work)
from varlen_cp.plan.balanced import solve as S
from varlen_cp.plan.balanced.items import (MIRRORED, TAIL_BLOCK, cut_items,
                                           mirror_tail_reachable)
from varlen_cp.plan.balanced.phases import solve_attempt
from varlen_cp.plan.balanced.profile import profile_of
from varlen_cp.plan.balanced.units import units_of
from varlen_cp.plan.balanced.variants import Variant
from tests.helpers.plan_checks import (assert_runs_unchanged_without, balanced_within_targets,
                                       causal_fetch, chunked_fetch, drop_variants,
                                       window_fetch)

CHUNK = 8192
LLAMA4 = [(AttnMask(chunk_size=CHUNK), 3), (AttnMask(), 1)]


def _without_mirror_tail(monkeypatch) -> None:
    """The layout as it was before the variant: its attempt dropped."""
    drop_variants(monkeypatch, S, lambda v: v.mirror_tail)


def _batch(mix: str, cp: int) -> np.ndarray:
    return np.asarray(MIXES[mix](8192 * cp))


def test_dense_chunk_tails_mirrored(monkeypatch) -> None:
    """A few long among short at cp 64 (8K tokens a rank; documents of 32768 and 20000
    tokens), Llama 4 masks: the plain ``blocks`` attempt gives the ranks holding chunk 1's
    last shares more chunked work than a rank's mean (no room for filler), so the layout
    fell back to the fold. Mirrored, every mask is within its targets and the ranks that
    fetch most fetch less: measured 18708 -> 14720 chunked, 45199 -> 36481 causal keys."""
    cp = 64
    lengths = _batch("few_long", cp)
    masks = normalize_masks(LLAMA4)
    balanced_within_targets(lengths, cp, LLAMA4)
    new = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    _without_mirror_tail(monkeypatch)
    old = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    ch_new, ch_old = (chunked_fetch(*r, lengths, cp, CHUNK).max() for r in (new, old))
    ca_new, ca_old = (causal_fetch(*r, lengths, cp).max() for r in (new, old))
    assert ch_new <= 0.85 * ch_old, (ch_new, ch_old)
    assert ca_new <= 0.85 * ca_old, (ca_new, ca_old)
    # Tail blocks of whole shares: apart from the rank where one document's block ends
    # and the next begins, no rank holds the chunk 1+ stretches of both long documents.
    rank, doc, start, length = new
    late = start + length > CHUNK
    both = [r for r in range(cp) if {0, 52} <= set(doc[(rank == r) & late].tolist())]
    assert len(both) <= 1, both


def test_mirrored_items_cover_the_tail_blocks() -> None:
    """The variant's items hold the same positions as the plain ``blocks`` items; each
    tail block is cut at the chunk boundaries up to the last dense chunk (here chunk 1:
    a share there is 1/64 of the excess over 8192 tokens), those stretches mirrored and
    inside one chunk, the rest in position order."""
    cp = 64
    lengths = _batch("few_long", cp)
    prof = profile_of(normalize_masks(LLAMA4), DEFAULT_TILE_TOKENS)
    plain = cut_items(lengths, prof, cp, Variant(body="blocks", fill="prefix", solver="seq"))
    mirrored = cut_items(lengths, prof, cp, Variant(body="blocks", fill="prefix",
                                                    solver="seq", mirror_tail=True))

    def covered(items, sel) -> set[tuple[int, int]]:
        return {(int(d), p) for d, a, b in zip(items.doc[sel], items.start[sel],
                                               items.end[sel]) for p in range(a, b)}

    assert covered(plain, plain.body) == covered(mirrored, mirrored.body)
    assert covered(plain, plain.block == TAIL_BLOCK) == covered(
        mirrored, mirrored.block == TAIL_BLOCK)
    tail = np.flatnonzero(mirrored.block == TAIL_BLOCK)
    mir = tail[mirrored.kind[tail] == MIRRORED]
    assert mir.size == 2  # chunk 1 of the 32768- and the 20000-token documents
    a, b = mirrored.start[mir], mirrored.end[mir]
    assert ((a // CHUNK == 1) & (b <= 2 * CHUNK)).all()
    rest = tail[mirrored.kind[tail] != MIRRORED]
    assert (mirrored.start[rest] >= 2 * CHUNK).all()


@pytest.mark.parametrize("mix, cp", [("lognormal_long", 64), ("few_long", 32),
                                     ("te_buckets", 16)])
def test_layout_unchanged_where_blocks_reach(monkeypatch, mix: str, cp: int) -> None:
    """Where the plain ``blocks`` attempt reaches its targets, the variant is never tried:
    the runs are those of the layout without it."""
    lengths = _batch(mix, cp)
    masks = normalize_masks(LLAMA4)
    assert_runs_unchanged_without(monkeypatch, lambda v: v.mirror_tail, lengths, cp, masks)


def test_not_built_where_chunk_one_stays_too_dense() -> None:
    """A few long among short at cp 8 with 128K tokens (16K a rank): even mirrored, a
    share of excess in chunk 1 holds more chunked work than a rank's mean, so the
    precheck skips the variant; solved anyway, the attempt indeed misses its targets."""
    cp = 8
    lengths = np.asarray(MIXES["few_long"](131072))
    mw = normalize_masks(LLAMA4)
    prof = profile_of(mw, DEFAULT_TILE_TOKENS)
    assert not mirror_tail_reachable(lengths, prof, cp, {})
    assert mirror_tail_reachable(_batch("few_long", 64), prof, 64, {})
    var = Variant(body="blocks", fill="prefix", solver="seq", mirror_tail=True)
    items = cut_items(lengths, prof, cp, var)
    lay = solve_attempt(units_of(items, lengths, prof), prof, cp, var, items, lengths)
    assert lay.unreachable or S._score(lay.per_rank) > 1.0


def test_fold_kept_where_it_fetches_less(monkeypatch) -> None:
    """Two 3-chunk documents among 200 short ones at cp 8 (chunks of 1024): ``blocks``
    misses its targets and ``mirror_tail`` meets them, but the fold, which meets them
    too, fetches fewer keys (found by a random search: 2304 against 3616 causal keys), so
    the fold is kept."""
    lengths = np.array([3072, 3072] + [32] * 200, dtype=np.int64)
    masks = normalize_masks([(AttnMask(chunk_size=1024), 3), (AttnMask(), 1)])
    prof = profile_of(masks, DEFAULT_TILE_TOKENS)
    var = Variant(body="blocks", fill="prefix", solver="seq", mirror_tail=True)
    items = cut_items(lengths, prof, 8, var)
    lay = solve_attempt(units_of(items, lengths, prof), prof, 8, var, items, lengths)
    assert S._score(lay.per_rank) <= 1.0  # it would meet the targets
    assert_runs_unchanged_without(monkeypatch, lambda v: v.mirror_tail, lengths, 8, masks)


@pytest.mark.parametrize("seed", range(6))
def test_fetch_cost_matches_dense_counts(seed: int) -> None:
    """The solver's ``_fetch_cost`` (the keys the most-fetching rank fetches, per mask)
    equals the dense counts for causal, window and chunked masks: random positions of
    random documents given to random ranks."""
    g = np.random.default_rng(seed)
    for _ in range(20):
        cp = int(g.integers(2, 6))
        lengths = g.integers(1, 60, size=int(g.integers(1, 8)))
        doc = np.repeat(np.arange(lengths.size), lengths)
        pos = np.concatenate([np.arange(n) for n in lengths])
        runs = S._merge_runs(g.integers(0, cp, size=doc.size), doc, pos, np.ones_like(pos))
        w, c = int(g.integers(1, 20)), int(g.integers(2, 20))
        for mask, dense in [(AttnMask(), causal_fetch(*runs, lengths, cp)),
                            (AttnMask(window_size=(w, 0)),
                             window_fetch(*runs, lengths, cp, w)),
                            (AttnMask(chunk_size=c), chunked_fetch(*runs, lengths, cp, c))]:
            prof = profile_of(normalize_masks([(mask, 1)]), 8)
            assert S._fetch_cost(*runs, lengths, prof, cp) == dense.max()


def test_nearest_attempt_where_every_attempt_misses() -> None:
    """Llama 4 masks on a batch of a random search (409K tokens, 1887 documents, cp 64,
    ``bench/results/balance_misses.json``) that no attempt balances within 1.03: the
    ``mirror_tail`` attempt misses least (chunked work 1.049 of the mean, where the fold
    taken before read 1.093), and the layout is the nearest attempt's."""
    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "balance_misses.json"
    batch = next(b for b in json.loads(path.read_text())["batches"]
                 if b["chunk_size"] == CHUNK)
    lengths, cp = np.asarray(batch["lengths"], dtype=np.int64), batch["cp"]
    masks = normalize_masks(LLAMA4)
    rank, doc, start, length = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    work = [np.bincount(rank, weights=(prefix_work(lengths[doc], start + length, m)
                                       - prefix_work(lengths[doc], start, m)).astype(float),
                        minlength=cp) for m, _ in masks]
    imb = [float(w.max() / w.mean()) for w in work]
    assert max(imb) <= 1.05 < batch["imbalance_before"][1], (imb, batch["imbalance_before"])
