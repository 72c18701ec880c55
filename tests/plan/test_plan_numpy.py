"""The planner's numpy paths against independent or torch references.

The balanced layout's solver and the token tables compute in numpy (per-op cost on small
arrays, page faults on large temporaries); these tests pin the closed forms of visible pairs
(``runs.pair_work``, ``runs.prefix_pairs``) to direct counts and to each other, the
in-place per-token ramp to ``repeat`` + ``arange`` (int32 near 2**30 included), and the
per-token document table, now built on demand, to one derived from the local cu_seqlens.
The layouts themselves are pinned by tests/plan/test_balanced_layout.py. ~1 s on one core.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan import Balanced
from varlen_cp.plan.runs import pair_work, prefix_pairs
from varlen_cp.plan.tokens import _ramp

MASKS = [
    AttnMask(), AttnMask(causal=False), AttnMask(chunk_size=8192), AttnMask(chunk_size=1),
    AttnMask(chunk_size=100), AttnMask(window_size=(4096, 0)), AttnMask(window_size=(5, 5)),
    AttnMask(causal=False, window_size=(-1, 0)), AttnMask(causal=False, chunk_size=64),
    AttnMask(causal=False, window_size=(2048, 2048)), AttnMask(chunk_size=96, window_size=(30, 0)),
]


def _counted(mask: AttnMask, a, b, c, e) -> list[int]:
    """Visible pairs of queries [a, b) x keys [c, e), counted by ``AttnMask.count_visible``."""
    return [mask.count_visible(torch.arange(a_, b_), torch.arange(c_, e_))
            if a_ < b_ and c_ < e_ else 0 for a_, b_, c_, e_ in zip(a, b, c, e)]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_pair_work_counts_the_visible_pairs(mask: AttnMask) -> None:
    """Query ranges [a, b) x key ranges [c, e), empty and reversed ones included, against
    a direct count."""
    g = torch.Generator().manual_seed(2)
    for top in (40, 300):
        a, b, c, e = (torch.randint(0, top, (300,), generator=g).numpy() for _ in range(4))
        got = pair_work(a, b, c, e, mask)
        assert got.dtype == np.int64 and got.tolist() == _counted(mask, a, b, c, e), mask


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_prefix_pairs_is_pair_work_from_position_0(mask: AttnMask) -> None:
    """The prefix form (its own shortcuts: triangle numbers, whole chunks) against the
    general closed form at positions up to 2**30, and against a direct count at small."""
    g = torch.Generator().manual_seed(0)
    for top in (2, 300, 200_000, 1 << 30):
        doc_len = torch.randint(0, top, (2000,), generator=g)
        stop = (torch.rand(2000, generator=g, dtype=torch.float64) * (doc_len + 1)).long()
        doc_len, stop = doc_len.numpy(), torch.minimum(stop, doc_len).numpy()
        zero = np.zeros_like(stop)
        got = prefix_pairs(doc_len, stop, mask)
        assert got.dtype == np.int64, mask
        assert np.array_equal(got, pair_work(zero, stop, zero, doc_len, mask)), (mask, top)
        if top <= 300:
            assert got[:200].tolist() == _counted(mask, zero[:200], stop[:200], zero[:200],
                                                  doc_len[:200]), mask


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_ramp_equals_repeat_plus_arange(dtype: type) -> None:
    rng = np.random.default_rng(2)
    count = rng.integers(1, 50, 300)
    first_row = np.cumsum(count) - count
    # Starts near 2**30 (the largest real position) in any order: steps of both signs.
    first_value = rng.integers((1 << 30) - 10_000, (1 << 30) - 50, 300)
    want = np.repeat(first_value - first_row, count) + np.arange(int(count.sum()))
    got = _ramp(first_value, first_row, count, int(count.sum()), dtype)
    assert got.dtype == dtype and np.array_equal(got, want)
    assert _ramp(first_value[:0], first_row[:0], count[:0], 0, dtype).size == 0


@pytest.mark.parametrize("layout", [Balanced(masks=[(AttnMask(chunk_size=64), 3),
                                                    (AttnMask(), 1)], tile_tokens=16),
                                    "te", "dual_chunk", "contiguous"])
def test_documents_built_on_demand_match_the_local_cu_seqlens(layout) -> None:
    lengths = [300, 7, 0, 45, 128, 1, 90]
    cu = torch.tensor([0] + lengths).cumsum(0)
    plan = CPPlan.build(cu, cp_size=4, cp_rank=0, layout=layout)
    want = torch.cat([torch.repeat_interleave(
        torch.arange(len(lengths)), plan.local_cu_seqlens_of(r).diff().long())
        for r in range(4)])
    assert torch.equal(plan.all_documents(), want)
    assert plan.all_documents() is plan.all_documents()  # built once
