"""Host tile schedule: never skips a visible pair, and is tight for sorted positions."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import reference_mask
from varlen_cp.kernels import build_block_schedule
from varlen_cp.kernels.mask_math import implicit_positions

mask_st = st.tuples(st.booleans(), st.sampled_from([-1, 0, 3, 10]), st.sampled_from([-1, 0, 2]),
                    st.sampled_from([0, 1, 5, 7]))


def _batch(lq, lk):
    cu_q = torch.tensor([0, *itertools.accumulate(lq)])
    cu_k = torch.tensor([0, *itertools.accumulate(lk)])
    return cu_q, cu_k


def _random_schedule(lens, mask, explicit, pad_frac, bm, bn, seed):
    """A hypothesis case's batch, its schedule and the dense reference visibility of each
    segment: (query lengths, cu_q, cu_k, query and key positions, schedule, [visibility]);
    explicit positions start queries 3 later than keys and turn a ``pad_frac`` share of
    both into padding."""
    g = torch.Generator().manual_seed(seed)
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    cu_q, cu_k = _batch(lq, lk)
    if explicit:
        qp = torch.cat([torch.arange(n) + 3 for n in lq]).long()
        kp = torch.cat([torch.arange(n) for n in lk]).long()
        qp[torch.rand(qp.numel(), generator=g) < pad_frac] = -1
        kp[torch.rand(kp.numel(), generator=g) < pad_frac] = -1
    else:
        qp, kp = implicit_positions(cu_q, cu_k, sum(lq), sum(lk))
    causal, wl, wr, chunk = mask
    sch = build_block_schedule(cu_q, cu_k, max(lq), max(lk), causal=causal, window_left=wl,
                               window_right=wr, chunk_size=chunk,
                               q_positions=qp if explicit else None,
                               k_positions=kp if explicit else None, block_m=bm, block_n=bn)
    vis = [reference_mask(qp[cu_q[s]:cu_q[s + 1]], kp[cu_k[s]:cu_k[s + 1]], causal=causal,
                          window_size=(wl, wr), chunk_size=chunk, q_padding=explicit,
                          k_padding=explicit) for s in range(len(lq))]
    return lq, cu_q, cu_k, qp, kp, sch, vis


@pytest.mark.slow
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
       mask=mask_st, explicit=st.booleans(), pad_frac=st.sampled_from([0.0, 0.15]),
       bm=st.sampled_from([4, 8, 16]), bn=st.sampled_from([4, 8]), seed=st.integers(0, 99))
def test_schedule_covers_every_visible_pair(lens, mask, explicit, pad_frac, bm, bn, seed):
    lq, cu_q, cu_k, qp, kp, sch, visible = _random_schedule(lens, mask, explicit, pad_frac,
                                                            bm, bn, seed)
    for s, vis in enumerate(visible):
        for b in range(sch.kv_range.shape[1]):
            start, end = sch.kv_range[s, b].tolist()
            cols = vis[b * bm:(b + 1) * bm].any(0).nonzero().flatten()
            if cols.numel():
                assert start <= cols.min() and end > cols.max()
        for b in range(sch.q_range.shape[1]):
            start, end = sch.q_range[s, b].tolist()
            rows = vis[:, b * bn:(b + 1) * bn].any(1).nonzero().flatten()
            if rows.numel():
                assert start <= rows.min() and end > rows.max()


def test_schedule_is_tight_for_local_masks():
    """Visited area tracks the visible area (tile efficiency), not the document length.

    With block 32 and windows/chunks of ~400-512 the partial edge tiles cost < 10%."""
    n = 4096
    cu = torch.tensor([0, n])
    pos = torch.arange(n)
    for causal, wl, chunk in ((True, 512, 0), (True, -1, 512), (False, 400, 0)):
        sch = build_block_schedule(cu, cu, n, n, causal=causal, window_left=wl,
                                   window_right=-1 if causal else 400, chunk_size=chunk,
                                   q_positions=pos, k_positions=pos, block_m=32, block_n=32)
        visible = int(reference_mask(pos, pos, causal=causal,
                                     window_size=(wl, -1 if causal else 400),
                                     chunk_size=chunk).sum())
        assert visible <= sch.visited_pairs <= 1.10 * visible


def test_schedule_rejects_device_tensors_that_are_not_host():
    import pytest
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        build_block_schedule(torch.tensor([0, 4], device=meta), torch.tensor([0, 4]), 4, 4,
                             causal=True, window_left=-1, window_right=-1, chunk_size=0)


@settings(max_examples=60)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
       mask=mask_st, explicit=st.booleans(), pad_frac=st.sampled_from([0.0, 0.15]),
       bm=st.sampled_from([4, 8, 16]), bn=st.sampled_from([4, 8]), seed=st.integers(0, 99))
def test_full_ranges_are_visible_to_every_real_row(lens, mask, explicit, pad_frac, bm, bn,
                                                    seed):
    """kv_full / q_full: every (real row of the block, token in the range) pair is visible
    and no token in the range is padding (the kernels drop the mask there); with sorted
    positions the range is exactly the tokens every real row sees, when those are not
    split by padding."""
    lq, cu_q, cu_k, qp, kp, sch, visible = _random_schedule(lens, mask, explicit, pad_frac,
                                                            bm, bn, seed)
    for s, vis in enumerate(visible):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        real_q = qp[q0:q1] >= 0 if explicit else torch.ones(q1 - q0, dtype=torch.bool)
        real_k = kp[k0:k1] >= 0 if explicit else torch.ones(k1 - k0, dtype=torch.bool)
        for side, full, block, v, real_rows, real_cols in (
                ("kv", sch.kv_full, bm, vis, real_q, real_k),
                ("q", sch.q_full, bn, vis.t(), real_k, real_q)):
            for b in range(full.shape[1]):
                start, end = full[s, b].tolist()
                rows = torch.arange(min(b * block, v.shape[0]), min((b + 1) * block, v.shape[0]))
                rows = rows[real_rows[rows]]
                if end > start:
                    assert rows.numel(), (side, s, b)
                    assert bool(real_cols[start:end].all()), (side, s, b, "padding inside")
                    assert bool(v[rows][:, start:end].all()), (side, s, b, "not visible")
                if rows.numel() == 0:
                    continue
                every = v[rows].all(0).nonzero().flatten()
                if every.numel():
                    lo, hi = int(every.min()), int(every.max()) + 1
                    if bool(real_cols[lo:hi].all()):  # not split by padding: exact
                        assert (start, end) == (lo, hi), (side, s, b, (start, end), (lo, hi))


def test_work_lists_are_the_nonempty_blocks_longest_first():
    """q_tiles / k_tiles list exactly the blocks with a non-empty range, longest first."""
    lq, lk = [70, 0, 5, 33], [70, 9, 0, 40]
    cu_q, cu_k = _batch(lq, lk)
    sch = build_block_schedule(cu_q, cu_k, max(lq), max(lk), causal=True, window_left=20,
                               window_right=-1, chunk_size=0, block_m=16, block_n=16)
    for tiles, ranges in ((sch.q_tiles, sch.kv_range), (sch.k_tiles, sch.q_range)):
        span = (ranges[..., 1] - ranges[..., 0]).flatten()
        assert tiles.dtype == torch.int32
        assert sorted(tiles.tolist()) == torch.nonzero(span > 0).flatten().tolist()
        spans = span[tiles.long()].tolist()
        assert spans == sorted(spans, reverse=True)
