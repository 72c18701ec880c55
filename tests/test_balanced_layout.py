"""The ``balanced`` layout: exact chunk work, plan invariants, token and work balance.

The closed-form work of a query range is checked against a dense count from
tests/reference.py's mask (independent of mask_math); the layout against the same invariants
as the other layouts (tests/test_plan.py's helpers), equal token counts, work balance better
than dual_chunk for sliding-window and chunked masks, the layer weights, and bad input.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import reference_mask
from tests.test_plan import FIXED_MIXES, check_balanced, check_invariants
from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan.balanced import DEFAULT_CHUNK_TOKENS, prefix_work

EDGE_MASKS = [
    AttnMask(), AttnMask(causal=False), AttnMask(window_size=(7, 0)),
    AttnMask(causal=False, window_size=(3, 5)), AttnMask(causal=False, window_size=(0, 4)),
    AttnMask(causal=False, window_size=(-1, 2)), AttnMask(causal=False, window_size=(2, -1)),
    AttnMask(window_size=(5, 5)), AttnMask(causal=False, chunk_size=16),
    AttnMask(chunk_size=10), AttnMask(chunk_size=10, window_size=(3, 0)),
    AttnMask(causal=False, chunk_size=7, window_size=(2, 3)), AttnMask(chunk_size=1),
]
SWA = AttnMask(window_size=(256, 0))
CHUNKED = AttnMask(chunk_size=512)
CAUSAL = AttnMask()


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def _plans(lengths: list[int], cp: int, **kw) -> list[CPPlan]:
    return [CPPlan.build(_cu(lengths), cp_size=cp, cp_rank=r, layout="balanced", **kw)
            for r in range(cp)]


def _weighted_imbalance(plan: CPPlan, masks) -> float:
    work = [sum(w * plan.work_of(r, m) for m, w in masks) for r in range(plan.cp_size)]
    return max(work) * plan.cp_size / sum(work)


def _mix(seed: int, n_short: int, long_docs: list[int]) -> list[int]:
    """Log-normal short documents (mean ~60 tokens) with a few long ones among them."""
    g = torch.Generator().manual_seed(seed)
    short = torch.exp(torch.randn(n_short, generator=g) * 0.8 + 3.7).long().add(1).tolist()
    for i, n in enumerate(long_docs):
        short.insert((i * 7) % (len(short) + 1), n)
    return short


@pytest.mark.parametrize("mask", EDGE_MASKS, ids=repr)
def test_prefix_work_matches_dense_count(mask: AttnMask) -> None:
    for length in (0, 1, 2, 5, 10, 16, 17, 33, 40):
        pos = torch.arange(length)
        dense = reference_mask(pos, pos, causal=mask.causal, window_size=mask.window_size,
                               chunk_size=mask.chunk_size).sum(1).cumsum(0)
        expected = [0] + dense.tolist()
        stops = torch.arange(length + 1)
        got = prefix_work(torch.full_like(stops, length), stops, mask)
        assert got.tolist() == expected, (mask, length)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_invariants_fixed_mixes(cp: int) -> None:
    # (chunk_tokens, masks) pairs: every chunk size and mask set once per mix.
    cases = [(1, None), (4, [(AttnMask(chunk_size=8), 3.0), (CAUSAL, 1.0)]),
             (256, [AttnMask(causal=False, window_size=(3, 5))])]
    for lengths in FIXED_MIXES + [[300, 1, 17, 0, 64, 129, 700]]:
        for chunk, masks in cases:
            plans = _plans(lengths, cp, masks=masks, chunk_tokens=chunk)
            for r, p in enumerate(plans):
                assert torch.equal(p.token_indices, plans[0].token_indices_of(r))
                assert torch.equal(p.local_cu_seqlens, plans[0].local_cu_seqlens_of(r))
            check_invariants(plans[0], lengths)
            check_balanced(plans, lengths)


def test_defaults_and_attributes() -> None:
    plan = CPPlan.build(_cu([100, 50]), cp_size=2, cp_rank=0, layout="balanced")
    assert plan.masks == ((CAUSAL, 1.0),) and plan.chunk_tokens == DEFAULT_CHUNK_TOKENS
    plan = CPPlan.build(_cu([100, 50]), cp_size=2, cp_rank=0, layout="balanced",
                        masks=SWA, chunk_tokens=64)
    assert plan.masks == ((SWA, 1.0),) and plan.chunk_tokens == 64
    other = CPPlan.build(_cu([100, 50]), cp_size=2, cp_rank=0)
    assert other.masks == () and other.chunk_tokens == 0


@pytest.mark.parametrize("cp", [4, 8])
def test_local_masks_balanced_better_than_dual_chunk(cp: int) -> None:
    lengths = _mix(1, 150, [6000, 3000, 1800])
    for mask in (SWA, CHUNKED, CAUSAL):
        plans = _plans(lengths, cp, masks=[mask])
        check_invariants(plans[0], lengths)
        check_balanced(plans, lengths)
        bal = plans[0].work_imbalance(mask)
        dual = CPPlan.build(_cu(lengths), cp_size=cp, cp_rank=0).work_imbalance(mask)
        assert bal <= 1.03, (mask, bal)
        assert plans[0].token_imbalance() <= 1.02
        if mask != CAUSAL:  # dual_chunk is built for causal work
            assert bal < dual, (mask, bal, dual)


def test_one_long_document_is_dual_chunk_like() -> None:
    """One causal document: each rank gets a front and a back part of near-equal work."""
    plan = _plans([8192], 4)[0]
    assert plan.work_imbalance(CAUSAL) < 1.005
    assert plan.token_imbalance() == 1.0


def test_weights_are_honoured() -> None:
    """Llama 4 style 3:1 chunked:global weights: the plan built for them balances their
    weighted work, and better than plans built for either mask alone."""
    lengths = _mix(2, 80, [5000, 2100, 1300, 700])
    llama = [(CHUNKED, 3.0), (CAUSAL, 1.0)]
    for cp in (4, 8):
        mixed = _plans(lengths, cp, masks=llama)[0]
        assert _weighted_imbalance(mixed, llama) <= 1.03
        for alone in ([CHUNKED], [CAUSAL]):
            single = _plans(lengths, cp, masks=alone)[0]
            assert _weighted_imbalance(mixed, llama) < _weighted_imbalance(single, llama)
        # The weights' scale does not matter, their ratio does.
        scaled = _plans(lengths, cp, masks=[(CHUNKED, 6.0), (CAUSAL, 2.0)])[0]
        assert torch.equal(scaled.token_indices_of(cp - 1), mixed.token_indices_of(cp - 1))


def test_builds_are_deterministic() -> None:
    lengths = _mix(3, 200, [4000])
    masks = [(CHUNKED, 3.0), (CAUSAL, 1.0)]
    a = _plans(lengths, 8, masks=masks)[0]
    b = CPPlan.build(_cu(lengths).to(torch.int32), cp_size=8, cp_rank=0, layout="balanced",
                     masks=masks)
    for r in range(8):
        assert torch.equal(a.token_indices_of(r), b.token_indices_of(r))
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("kw, name", [
    ({"masks": []}, "masks"),
    ({"masks": "causal"}, "masks"),
    ({"masks": [CAUSAL, "x"]}, r"masks\[1\]"),
    ({"masks": [(CAUSAL,)]}, r"masks\[0\]"),
    ({"masks": [(CAUSAL, 0)]}, r"masks\[0\] weight"),
    ({"masks": [(CAUSAL, -1.0)]}, "weight"),
    ({"masks": [(CAUSAL, math.nan)]}, "weight"),
    ({"masks": [(CAUSAL, math.inf)]}, "weight"),
    ({"masks": [(CAUSAL, True)]}, "weight"),
    ({"masks": [(CAUSAL, "1")]}, "weight"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": 2.0}, "chunk_tokens"),
    ({"chunk_tokens": True}, "chunk_tokens"),
    ({"layout": "dual_chunk", "masks": [CAUSAL]}, "masks"),
    ({"layout": "contiguous", "chunk_tokens": 64}, "chunk_tokens"),
])
def test_bad_input(kw, name) -> None:
    args = {"cp_size": 2, "cp_rank": 0, "layout": "balanced"}
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        CPPlan.build(_cu([10, 20]), **args)
