"""flash_coverage: host-only counts of the work each strategy runs on FlashAttention (no
CUDA, no registered kernels: the tables are host tables)."""

import pytest

from tests.helpers.cp_grid import DOCS, LAYOUTS, small_plan
from varlen_cp import AttnMask
from varlen_cp.tables.coverage import FlashCoverage, flash_coverage
from varlen_cp.tables.flash_form import FlashRoute
from varlen_cp.tables.selected import pair_counts

ROUTE = FlashRoute("flash", q_row_bytes=64, kv_row_bytes=32)
BLOCK = (16, 16)
MASKS = {"causal": AttnMask(causal=True), "full": AttnMask(causal=False),
         "chunked": AttnMask(causal=True, chunk_size=16)}
RANK_STRATEGIES = ("p2p", "all_gather", "dispatch")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("world", [2, 4])
def test_exact_masks_all_on_flash(layout, mask, world):
    for rank in range(world):
        plan = small_plan(DOCS, world, rank, layout, mask)
        want = int(pair_counts(plan, mask)[rank].sum())
        for strategy in RANK_STRATEGIES:
            cov = flash_coverage(plan, mask, strategy, ROUTE, BLOCK)
            assert isinstance(cov, FlashCoverage) and cov.rank == rank
            assert cov.total_pairs == want > 0, (strategy, rank)
            assert cov.flash_pairs == want, (strategy, rank, cov)
            assert cov.pair_share == 1.0 and cov.call_share == 1.0
            assert cov.other_calls == 0 and cov.fa_calls >= cov.flash_calls >= 1
        a2a = flash_coverage(plan, mask, "a2a", ROUTE, BLOCK)
        every = sum(mask.document_work(n) for n in DOCS)
        assert a2a.total_pairs == int(pair_counts(plan, mask).sum()) == every
        assert a2a.flash_pairs == every and a2a.flash_calls == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_route_nothing_on_flash(layout):
    mask = MASKS["causal"]
    plan = small_plan(DOCS, 4, 1, layout, mask)
    for strategy in (*RANK_STRATEGIES, "a2a"):
        cov = flash_coverage(plan, mask, strategy, None, BLOCK)
        assert cov.flash_pairs == cov.flash_calls == cov.fa_calls == 0
        assert cov.other_calls >= 1 and cov.total_pairs > 0
        assert cov.pair_share == 0.0 and cov.call_share == 0.0


def test_stages_and_unknown_strategy():
    mask = MASKS["causal"]
    plan = small_plan(DOCS, 4, 2, "balanced", mask)
    want = int(pair_counts(plan, mask)[2].sum())
    for stages in (1, 3):
        assert flash_coverage(plan, mask, "dispatch", ROUTE, BLOCK, stages).flash_pairs == want
    with pytest.raises(ValueError, match="strategy"):
        flash_coverage(plan, mask, "ring", ROUTE, BLOCK)
