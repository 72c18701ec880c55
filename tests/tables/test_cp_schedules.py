"""Host tables of the strategies (varlen_cp.tables) against independent counts.

- ``pair_work`` (closed form) against ``AttnMask.count_visible`` and tests/reference.py's
  dense mask;
- which ranks' keys each rank's queries see (and how many) against a dense count per
  pair of ranks;
- tile schedules computed from block ends and sorted keys (one call, and every call of a
  ring at once) against the kernels' per-token ``build_block_schedule`` (identical, except
  that trailing padding keys are left out of a range: they are masked anyway);
- ``build_tables`` builds every table the forward reads (the forward then builds none).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.reference import reference_mask
from varlen_cp import AttnMask, AttnOptions, CPPlan
from varlen_cp.config import CPConfig
from varlen_cp.kernels import build_block_schedule
from varlen_cp.kernels.schedule import work_list
from varlen_cp.plan.runs import pair_work
from varlen_cp.prefetch import AttnShape, build_tables
from varlen_cp.tables.holders import block_schedule, rank_holders
from varlen_cp.tables.hybrid import group_holders, hybrid_ring_tables
from varlen_cp.tables.ring import p2p_tables, rank_visibility, ring_length
from varlen_cp.tables.selected import fetch_counts, pair_counts
from tests.staged_reference import select_keys

MASKS = [AttnMask(), AttnMask(causal=False), AttnMask(window_size=(7, 0)),
         AttnMask(causal=False, window_size=(3, 5)), AttnMask(causal=False, window_size=(0, 4)),
         AttnMask(causal=False, window_size=(-1, 2)), AttnMask(window_size=(5, 5)),
         AttnMask(causal=False, chunk_size=16), AttnMask(chunk_size=10),
         AttnMask(chunk_size=10, window_size=(3, 0)),
         AttnMask(causal=False, chunk_size=7, window_size=(2, 3)), AttnMask(chunk_size=1)]
DOCS = [300, 17, 1, 90, 5, 411, 0, 64, 700]
LAYOUTS = ("dual_chunk", "te", "contiguous", "balanced")


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_pair_work_matches_a_dense_count(mask):
    rng = random.Random(0)
    a, b, c, e, want = [], [], [], [], []
    for _ in range(150):
        length = rng.randint(1, 50)
        lo, hi = sorted(rng.randint(0, length) for _ in range(2))
        klo, khi = sorted(rng.randint(0, length) for _ in range(2))
        dense = reference_mask(torch.arange(lo, hi), torch.arange(klo, khi),
                               causal=mask.causal, window_size=mask.window_size,
                               chunk_size=mask.chunk_size)
        a.append(lo), b.append(hi), c.append(klo), e.append(khi)
        want.append(int(dense.sum()))
    got = pair_work(*(torch.tensor(x) for x in (a, b, c, e)), mask)
    assert got.tolist() == want


@pytest.mark.parametrize("mask", MASKS[:6] + MASKS[8:10], ids=repr)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_visibility_and_fetch_counts_match_per_rank_counts(layout, mask):
    for cp in (2, 3, 5):
        plan = CPPlan.build(_cu(DOCS), cp_size=cp, cp_rank=0, layout=layout)
        vis = rank_visibility(plan, mask)
        fetch = fetch_counts(plan, mask)
        exact = pair_counts(plan, mask)
        for s in range(cp):
            q_pos, q_cu = plan.positions_of(s), plan.local_cu_seqlens_of(s)
            for j in range(cp):
                k_pos, k_cu = plan.positions_of(j), plan.local_cu_seqlens_of(j)
                pairs, keys = 0, 0
                for d in range(plan.n_docs):
                    qp = q_pos[q_cu[d]:q_cu[d + 1]].long()
                    kp = k_pos[k_cu[d]:k_cu[d + 1]].long()
                    qp, kp = qp[qp >= 0], kp[kp >= 0]
                    if qp.numel() and kp.numel():
                        m = mask.visible(qp, kp)
                        pairs += int(m.sum())
                        keys += int(m.any(0).sum())
                assert (int(vis[s, j]) > 0) == (pairs > 0), (layout, cp, mask, s, j)
                assert int(exact[s, j]) == pairs, (layout, cp, mask, s, j)
                assert int(fetch[s, j]) == keys, (layout, cp, mask, s, j)
        # the ring stops after the last step anyone needs
        t_needed = [t for t in range(1, cp) if any(int(vis[s, (s - t) % cp])
                                                   for s in range(cp))]
        assert ring_length(vis) == 1 + max(t_needed, default=0)


def _reference_schedule(q, k, mask, block):
    causal, wl, wr, chunk = mask.params
    return build_block_schedule(q.cu, k.cu, q.max_len, k.max_len, causal=causal,
                                window_left=wl, window_right=wr, chunk_size=chunk,
                                q_positions=q.pos, k_positions=k.pos, block_m=block[0],
                                block_n=block[1])


def _same_real_rows(got, want, holder):
    """Equal ranges, or ranges that differ only by trailing padding rows."""
    assert got.shape == want.shape
    cu = holder.cu.long()
    for s, j in (got != want).any(-1).nonzero().tolist():
        (a0, a1), (b0, b1) = got[s, j].tolist(), want[s, j].tolist()
        seg = holder.pos[cu[s]:cu[s + 1]]
        assert [int(x) for x in seg[a0:a1] if x >= 0] == \
            [int(x) for x in seg[b0:b1] if x >= 0], (s, j, got[s, j], want[s, j])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_schedules_match_the_per_token_builder(layout):
    for cp in (1, 3, 4):
        plan = CPPlan.build(_cu(DOCS), cp_size=cp, cp_rank=0, layout=layout)
        holders = rank_holders(plan)
        for mask in MASKS[::2]:
            sel = select_keys(plan, mask, cp - 1).holder
            for block in ((64, 64), (32, 16)):
                for q, k in ((holders[0], holders[-1]), (holders[-1], sel)):
                    got, want = block_schedule(q, k, mask, block), \
                        _reference_schedule(q, k, mask, block)
                    _same_real_rows(got.kv_range, want.kv_range, k)
                    _same_real_rows(got.q_range, want.q_range, q)
                    # the full (unmasked) sub-ranges too, and no padding inside any range
                    _same_real_rows(got.kv_full, want.kv_full, k)
                    _same_real_rows(got.q_full, want.q_full, q)
                    assert not got.padded  # (the per-token builder may end on padding)
                    # work lists made from the live blocks = made from the whole tables
                    assert torch.equal(got.q_tiles, work_list(got.kv_range))
                    assert torch.equal(got.k_tiles, work_list(got.q_range))
                    if layout != "te":  # no padding: identical
                        assert got.visited_pairs == want.visited_pairs
                # every call of the ring, computed together
                for r in range(cp):
                    tab = p2p_tables(plan, mask, block, r)
                    for t, call in enumerate(tab.calls):
                        if call is not None:
                            src = holders[tab.source(r, t)]
                            want = _reference_schedule(holders[r], src, mask, block)
                            _same_real_rows(call.schedule.kv_range, want.kv_range, src)
                            _same_real_rows(call.schedule.q_range, want.q_range, holders[r])
                            _same_real_rows(call.schedule.kv_full, want.kv_full, src)
                            _same_real_rows(call.schedule.q_full, want.q_full, holders[r])
                if cp == 4:
                    groups = group_holders(plan, 2)
                    tab = hybrid_ring_tables(plan, mask, 2, 1, block)
                    for t, call in enumerate(tab.calls):
                        if call is not None:
                            q, k = groups.holder(1), groups.holder(tab.source(1, t))
                            want = _reference_schedule(q, k, mask, block)
                            _same_real_rows(call.schedule.kv_range, want.kv_range, k)


def prepare_worker(rank, world):
    """Per strategy: build_tables, then forward + backward of every mask, counting the
    plan-cache entries the call itself had to build (none may be missing)."""
    from tests.helpers.cp_grid import global_inputs
    from varlen_cp.attention import cp_varlen_attn

    masks = [(AttnMask(chunk_size=64), 3), (AttnMask(), 1)]
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=32, head_dim_v=16,
                      dtype=torch.float32)
    cached, misses = CPPlan.cached, {}

    def counting(self, key, fn):
        if key not in self._cache:
            misses.setdefault(current, []).append(repr(key))
        return cached(self, key, fn)

    for current in ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch", "auto"):
        config = CPConfig(strategy=current, layout="balanced", validate=False)
        plan = CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=rank,
                            layout=config.layout_spec(masks))
        build_tables(plan, config, masks, shape, "cpu")
        q, k, v, dout = (plan.shard(t) for t in global_inputs(DOCS, 4, 2, seed=0))
        q.requires_grad_()
        CPPlan.cached = counting
        try:
            for mask, _ in masks:
                out = cp_varlen_attn(q, k, v, plan, mask,
                                     options=AttnOptions(strategy=current, validate=False))
                out.backward(dout)
        finally:
            CPPlan.cached = cached
    return misses


def test_build_tables_builds_every_table_the_forward_reads(tmp_path):
    from tests.dist_utils import run_distributed
    assert run_distributed(prepare_worker, 2, tmp_path) == [{}, {}]
