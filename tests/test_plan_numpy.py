"""The planner's numpy paths against independent or torch references.

The balanced layout's solver and the token tables compute in numpy (per-op cost on small
arrays, page faults on large temporaries); these tests pin the numpy twins to the torch
functions the schedules still use (``runs.prefix_pairs``, ``runs.pair_work``,
``units.unit_runs``), the
in-place per-token ramp to ``repeat`` + ``arange`` (int32 near 2**30 included), and the
per-token document table, now built on demand, to one derived from the local cu_seqlens.
The layouts themselves are pinned by tests/test_balanced_layout.py. ~1 s on one core.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan import Balanced
from varlen_cp.plan.balanced import normalize_masks
from varlen_cp.plan.balanced.items import cut_items
from varlen_cp.plan.balanced.profile import profile_of
from varlen_cp.plan.balanced.units import unit_runs, unit_runs_np, units_of
from varlen_cp.plan.balanced.variants import Variant
from varlen_cp.plan.runs import pair_work, pair_work_np, prefix_pairs, prefix_pairs_np
from varlen_cp.plan.tables import _ramp

MASKS = [
    AttnMask(), AttnMask(causal=False), AttnMask(chunk_size=8192), AttnMask(chunk_size=1),
    AttnMask(chunk_size=100), AttnMask(window_size=(4096, 0)), AttnMask(window_size=(5, 5)),
    AttnMask(causal=False, window_size=(-1, 0)), AttnMask(causal=False, chunk_size=64),
    AttnMask(causal=False, window_size=(2048, 2048)), AttnMask(chunk_size=96, window_size=(30, 0)),
]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_prefix_pairs_np_equals_the_torch_form(mask: AttnMask) -> None:
    g = torch.Generator().manual_seed(0)
    for top in (2, 300, 200_000, 1 << 30):
        doc_len = torch.randint(0, top, (2000,), generator=g)
        stop = (torch.rand(2000, generator=g, dtype=torch.float64) * (doc_len + 1)).long()
        stop = torch.minimum(stop, doc_len)
        want = prefix_pairs(doc_len, stop, mask)
        got = prefix_pairs_np(doc_len.numpy(), stop.numpy(), mask)
        assert got.dtype == np.int64 and np.array_equal(got, want.numpy()), (mask, top)


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_pair_work_np_equals_the_torch_form_and_a_count(mask: AttnMask) -> None:
    """Query ranges [a, b) x key ranges [c, e), empty and reversed ones included: the
    torch form at large positions, a direct count (``AttnMask.count_visible``) at small."""
    g = torch.Generator().manual_seed(2)
    for top, n in ((40, 300), (300, 300), (1 << 30, 2000)):
        a, b, c, e = (torch.randint(0, top, (n,), generator=g) for _ in range(4))
        want = pair_work(a, b, c, e, mask)
        got = pair_work_np(a.numpy(), b.numpy(), c.numpy(), e.numpy(), mask)
        assert got.dtype == np.int64 and np.array_equal(got, want.numpy()), (mask, top)
        if top == 40:
            count = [mask.count_visible(torch.arange(a_, b_), torch.arange(c_, e_))
                     if a_ < b_ and c_ < e_ else 0
                     for a_, b_, c_, e_ in zip(*(t.tolist() for t in (a, b, c, e)))]
            assert got.tolist() == count, mask


def test_unit_runs_np_equals_unit_runs() -> None:
    lengths = torch.tensor([200, 37, 64, 129, 5, 300])
    masks = normalize_masks([(AttnMask(chunk_size=48), 3), (AttnMask(), 1)])
    prof = profile_of(masks, 16)
    units = units_of(cut_items(lengths, prof, 3, Variant()), lengths, prof)
    n = units.a_len + units.b_len
    g = torch.Generator().manual_seed(1)
    unit = torch.arange(n.numel())
    o1 = (torch.rand(n.numel(), generator=g) * (n + 1)).long().clamp(max=n)
    o2 = o1 + (torch.rand(n.numel(), generator=g) * (n - o1 + 1)).long().clamp(max=n - o1)
    want = unit_runs(units, unit, o1, o2)
    got = unit_runs_np(units, unit.numpy(), o1.numpy(), o2.numpy())
    for (ws, wn), (gs, gn) in zip(want, got):
        assert np.array_equal(ws.numpy(), gs) and np.array_equal(wn.numpy(), gn)


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
