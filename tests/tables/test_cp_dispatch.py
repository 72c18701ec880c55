"""The ``dispatch`` CP strategy's keys and ``strategy="auto"``'s rule, on the host.

The keys dispatch fetches are exactly those some local query sees (a dense brute force over
each document's mask), so its byte count is the lower bound; its compute counts every
visible pair once; auto's choices on clear-cut batches, its cache, memory budget and tie
rule, and bad arguments. Both run against the single-device op in the strategy grid
(tests/strategies/test_cp_strategies.py: every layout x mask at cp 2-4, fp16 / bf16, bytes posted).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cp_grid import MASKS, cu, small_plan
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.shape import AttnShape
from varlen_cp.strategies import get_strategy
from tests.staged_reference import select_keys

dispatch = get_strategy("dispatch")

LAYOUTS = ("dual_chunk", "te", "balanced", "contiguous")
ONE_HEAD = AttnShape(n_heads=1, n_kv_heads=1, head_dim=1)  # pairs do not depend on heads


def _plan(docs, cp, rank, layout, mask=None):
    """Plans that really cut documents at these tiny sizes (balanced: for ``mask``)."""
    return small_plan(docs, cp, rank, layout, mask, tile_tokens=16)


# ------------------------------------------------------------------------ host: the keys
def _brute_needed(plan, mask, rank) -> list[int]:
    """Global indices of the keys some real query of ``rank`` sees, by a dense mask per
    document (independent of the interval union dispatch uses)."""
    cu = plan.cu_seqlens
    glob = plan.token_indices_of(rank)
    pos = plan.positions_of(rank).long()
    needed = []
    for d in range(plan.n_docs):
        length = int(cu[d + 1] - cu[d])
        q = pos[(glob >= cu[d]) & (glob < cu[d + 1])]
        if q.numel() == 0 or length == 0:
            continue
        seen = mask.visible(q, torch.arange(length)).any(0)
        needed += (int(cu[d]) + torch.nonzero(seen).flatten()).tolist()
    return needed


@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_needed_keys_are_exactly_the_visible_ones(layout, cp, mname, one_thread):
    """Per rank: the needed keys (local and fetched), in (doc, position) order, with
    owners and rows that point at those very tokens; bytes = the plan's needed ranges."""
    docs = [300, 17, 1, 90, 0, 5, 411]
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=64, head_dim_v=32)
    row = 2 * (64 + 32) * 2
    mask = MASKS[mname]
    plan = _plan(docs, cp, 0, layout, mask)
    every = torch.cat([plan.token_indices_of(r) for r in range(cp)])
    first = torch.tensor([0] + [plan.num_tokens_of(r) for r in range(cp)]).cumsum(0)
    fetched, sent_to = [], [0] * cp
    for r in range(cp):
        n = select_keys(plan, mask, r)
        glob = every[first[n.owner] + n.row]  # the token each (owner, row) is
        want = _brute_needed(plan, mask, r)
        assert glob.tolist() == want, (layout, cp, mname, r)
        doc = torch.searchsorted(plan.cu_seqlens, glob, right=True) - 1
        assert torch.equal(n.holder.pos.long(), glob - plan.cu_seqlens[doc])
        counts = torch.bincount(doc, minlength=plan.n_docs)
        assert torch.equal(n.holder.cu[1:].long(), torch.cumsum(counts, 0))
        remote = n.owner != r
        fetched.append(int(remote.sum()))
        for s in n.owner[remote].tolist():
            sent_to[s] += 1
    got = dispatch.bytes_sent_per_rank(plan, mask, shape)
    assert got == {"fwd": [s * row for s in sent_to],
                   "bwd": [f * row for f in fetched]}, (layout, cp, mname)


def test_dispatch_never_sends_more_than_all_gather_and_local_masks_send_little(one_thread):
    """One 400-token document over 4 contiguous ranks, causal window 7: each rank fetches
    the 7 keys before its slice, and nothing else."""
    plan = CPPlan.build(cu([400]), cp_size=4, cp_rank=0, layout="contiguous")
    mask = AttnMask(causal=True, window_size=(7, 0))
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=128, head_dim_v=128)
    row = 2 * 256 * 2
    got = dispatch.bytes_sent_per_rank(plan, mask, shape)
    assert got == {"fwd": [7 * row] * 3 + [0], "bwd": [0] + [7 * row] * 3}
    ag = get_strategy("all_gather").bytes_sent_per_rank(plan, mask, shape)
    assert all(a <= b for a, b in zip(got["fwd"], ag["fwd"]))


@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compute_counts_every_visible_pair_once(layout, cp, mname, one_thread):
    docs = [300, 17, 1, 90, 5, 411]
    mask = MASKS[mname]
    plan = _plan(docs, cp, 0, layout, mask)
    c = dispatch.compute_per_rank(plan, mask, ONE_HEAD, block=(64, 64))
    assert c["visible"] == [float(w) for w in plan.work_per_rank(mask)]
    assert all(a >= b for a, b in zip(c["visited"], c["visible"]))


# ------------------------------------------------------------------------ strategy="auto"
SHORT = torch.randint(64, 1024, (30,), generator=torch.Generator().manual_seed(0)).tolist()
LONG = [8192, 6144, 2048]


def test_auto_picks_dispatch_for_local_masks_on_short_documents(one_thread):
    from varlen_cp.tables.auto import choose_strategy
    for mask in (AttnMask(window_size=(256, 0)), AttnMask(chunk_size=512)):
        for layout in ("balanced", "dual_chunk"):
            plan = _plan(SHORT, 4, 0, layout, mask) if layout == "balanced" else \
                CPPlan.build(cu(SHORT), cp_size=4, cp_rank=0, layout=layout)
            got = choose_strategy(plan, mask,
                                  AttnShape(n_heads=32, n_kv_heads=8, head_dim=128))
            assert got == "dispatch", (mask, layout, got)


def test_auto_on_global_masks_on_long_documents(one_thread, monkeypatch):
    """Compute-bound: every overlapping strategy is within the tolerance, so the pick is
    the one that sends the fewest bytes among them (dispatch, now that it overlaps too,
    where it sends less than the ring) and never all_gather."""
    from varlen_cp.tables import auto
    for mask in (AttnMask(causal=True), AttnMask(causal=False)):
        plan = CPPlan.build(cu(LONG), cp_size=4, cp_rank=0, layout="dual_chunk")
        for hq, hkv in ((32, 8), (8, 8), (16, 2)):
            shape = AttnShape(n_heads=hq, n_kv_heads=hkv, head_dim=128)
            got = auto.choose_strategy(plan, mask, shape)
            est = auto.estimates(plan, mask, shape)
            best = min(e.seconds for e in est.values())
            close = {n: e for n, e in est.items() if e.seconds <= best * 1.05}
            assert got in ("a2a", "p2p", "dispatch"), (mask, hq, hkv, got)
            assert got in close and est[got].bytes_sent == min(
                e.bytes_sent for e in close.values()), (mask, hq, hkv, got, est)
            with monkeypatch.context() as m:  # cached in the plan: no second estimate
                m.setattr(auto, "estimates", lambda *a, **k: pytest.fail("recomputed"))
                assert auto.choose_strategy(plan, mask, shape) == got
        # heads that don't split over cp: a2a is no candidate
        est = auto.estimates(plan, mask, AttnShape(n_heads=6, n_kv_heads=3, head_dim=64))
        assert "a2a" not in est and {"p2p", "dispatch", "all_gather"} <= set(est)


def test_auto_memory_budget_and_tie_rule(one_thread):
    from varlen_cp.tables.auto import CostModel, Estimate, choose_strategy, pick
    mask = AttnMask(window_size=(256, 0))
    plan = _plan(SHORT, 4, 0, "balanced", mask)
    shape = AttnShape(n_heads=32, n_kv_heads=8, head_dim=128)
    assert choose_strategy(plan, mask, shape, memory_budget_bytes=0) == "p2p"
    need = max(select_keys(plan, mask, r).owner.numel()
               for r in range(plan.cp_size)) * 8 * 256 * 2
    assert choose_strategy(plan, mask, shape, memory_budget_bytes=need) == "dispatch"
    assert choose_strategy(plan, mask, shape, memory_budget_bytes=need - 1) != "dispatch"
    # Within the tolerance the fewest bytes win; outside it the fastest.
    e = {"p2p": Estimate(1.00, 1.0, 0.0, 300, 0), "a2a": Estimate(1.04, 1.0, 0.04, 100, 9),
         "dispatch": Estimate(1.06, 1.0, 0.06, 50, 9)}
    assert pick(e, CostModel()) == "a2a"
    assert pick(e, CostModel(tolerance=0.1)) == "dispatch"
    assert pick(e, CostModel(tolerance=0.0)) == "p2p"
    assert pick(e, CostModel(), memory_budget_bytes=5) == "p2p"


def test_auto_bad_arguments():
    from varlen_cp.tables.auto import CostModel, choose_strategy
    plan = CPPlan.build(cu(LONG), cp_size=2, cp_rank=0, layout="dual_chunk")
    mask = AttnMask()
    kw = dict(n_heads=8, n_kv_heads=2, head_dim=64)
    for bad, match in ((dict(n_heads=0), "n_heads"), (dict(n_kv_heads=3), "multiple"),
                       (dict(head_dim_v=1.5), "head_dim_v"), (dict(dtype=True), "dtype")):
        with pytest.raises(ValueError, match=match):   # the shape checks its fields
            choose_strategy(plan, mask, AttnShape(**{**kw, **bad}))
    shape = AttnShape(**kw)
    for bad, match in ((dict(memory_budget_bytes=-1), "memory_budget_bytes"),
                       (dict(model="h100"), "model")):
        with pytest.raises(ValueError, match=match):
            choose_strategy(plan, mask, shape, **bad)
    for bad_shape in (kw, (8, 2, 64)):
        with pytest.raises(ValueError, match="shape must be a varlen_cp.AttnShape"):
            choose_strategy(plan, mask, bad_shape)
    for field in ("flops_per_s", "bytes_per_s"):
        with pytest.raises(ValueError, match=field):
            CostModel(**{field: 0})
    with pytest.raises(ValueError, match="tolerance"):
        CostModel(tolerance=1.0)
