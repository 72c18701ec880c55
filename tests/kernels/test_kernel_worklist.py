"""Work-list grids and the once-per-layer backward stats of the Triton kernels.

- What the launchers launch, recorded by standing in for the kernels: one program per
  listed block and head, a 1-D grid (any number of segments), at most 1.1x the non-empty
  (segment, block) tiles plus one wave, counted independently from the positions. Shapes:
  the issue's 64K-token document plus 1000 documents of 64 tokens at cp 8 (balanced
  layout, every ring step of rank 0), one long document, many short ones, and the public
  op's device-built list (no host schedule).
- A batch of 70,000 segments (beyond CUDA's 65,535 grid rows) runs on the interpreter and
  matches the dense reference.
- The backward's per-row stats (delta, base-2 LSE) against a direct computation, and a
  backward given them equals one that makes them; a CP backward makes them once per
  layer, not once per ring step or stage (2 gloo ranks).
~40 s on 2 cores (most of it the gloo launch and the 128K-token plan).
"""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.reference import reference_attn
from tests.helpers.lanes import fast_first, slow
from varlen_cp import AttnMask, CPPlan
from varlen_cp.kernels import build_block_schedule, triton_bwd as bwd_mod, triton_fwd as fwd_mod
from varlen_cp.kernels.mask_math import count_visible
from varlen_cp.kernels.torch_attn import torch_bwd_stats
from varlen_cp.kernels.triton_common import device_work_list
from varlen_cp.tables.holders import rank_holders
from varlen_cp.tables.ring import p2p_tables

WAVE = 132 * 2  # one wave: H100 SMs x 2 resident programs (the kernels' 4-8 warps, ~100 KB)


class _Recorder:
    """Stands in for a @triton.jit kernel: records launch grids, runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def _record(monkeypatch):
    rec = {name: _Recorder() for name in ("fwd", "dq", "dkdv", "stats")}
    monkeypatch.setattr(fwd_mod, "_fwd_kernel", rec["fwd"])
    monkeypatch.setattr(bwd_mod, "_dq_kernel", rec["dq"])
    monkeypatch.setattr(bwd_mod, "_dkdv_kernel", rec["dkdv"])
    monkeypatch.setattr(bwd_mod, "_stats_kernel", rec["stats"])
    return rec


def _launch(call_tables, heads=(4, 2), d=16):
    """Run the forward and backward launchers on zero tensors of the call's sizes."""
    cu_q, cu_k, max_q, max_k, q_pos, k_pos, sched = call_tables
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.zeros(tq, heads[0], d, dtype=torch.float16)
    k = torch.zeros(tk, heads[1], d, dtype=torch.float16)
    out, lse = fwd_mod.triton_fwd(q, k, k, cu_q, cu_k, max_q, max_k, 0.1, True, -1, -1, 0,
                                  q_pos, k_pos, sched)
    bwd_mod.triton_bwd(out, q, k, k, out, lse, cu_q, cu_k, max_q, max_k, 0.1, True, -1, -1,
                       0, q_pos, k_pos, sched)


def _nonempty_tiles(cu_q, q_pos, cu_k, k_pos, block, mask, by_keys=False):
    """(segment, block) tiles of ``block`` query rows (or, ``by_keys``, key rows) with a
    visible pair of real tokens, counted with mask_math.count_visible per block:
    independent of the schedule's searches."""
    n = 0
    for s in range(cu_q.numel() - 1):
        qp = q_pos[int(cu_q[s]):int(cu_q[s + 1])].long()
        kp = k_pos[int(cu_k[s]):int(cu_k[s + 1])].long()
        rows, other = (kp, qp[qp >= 0]) if by_keys else (qp, kp[kp >= 0])
        for b in range(0, rows.numel(), block):
            part = rows[b:b + block]
            part = part[part >= 0]
            if not part.numel() or not other.numel():
                continue
            pairs = (count_visible(other, part, *mask) if by_keys
                     else count_visible(part, other, *mask))
            n += pairs > 0
    return n


def _check_grids(rec, sched, heads, tiles_q, tiles_k):
    hq, hkv = heads
    fwd, dq, dkdv = rec["fwd"].grids, rec["dq"].grids, rec["dkdv"].grids
    assert fwd == dq == [(sched.q_tiles.numel() * hq,)], (fwd, dq)
    assert dkdv == [(sched.k_tiles.numel() * hkv,)], dkdv
    assert fwd[0][0] <= 1.1 * tiles_q * hq + WAVE, (fwd, tiles_q)
    assert dkdv[0][0] <= 1.1 * tiles_k * hkv + WAVE, (dkdv, tiles_k)


@slow
def test_cp_calls_launch_their_nonempty_tiles(monkeypatch):
    """64K + 1000 x 64 tokens, cp 8, balanced: every ring step of rank 0 (the old grid
    launched cdiv(max_seqlen, 64) x segments programs per head: 128,128 for 253 tiles)."""
    cu = torch.tensor([0, 65536] + [64] * 1000).cumsum(0)
    plan = CPPlan.build(cu, cp_size=8, cp_rank=0, layout="balanced")
    mask = AttnMask()
    tab = p2p_tables(plan, mask, (64, 64), 0)
    holders = rank_holders(plan)
    checked = 0
    for t, call in enumerate(tab.calls):
        if call is None:
            continue
        rec = _record(monkeypatch)
        _launch((call.cu_q, call.cu_k, call.max_q, call.max_k, call.q_pos, call.k_pos,
                 call.schedule))
        src = holders[tab.source(0, t)]
        tiles_q = _nonempty_tiles(call.cu_q, call.q_pos, call.cu_k, call.k_pos, 64,
                                  mask.params)
        tiles_k = _nonempty_tiles(call.cu_q, call.q_pos, call.cu_k, call.k_pos, 64,
                                  mask.params, by_keys=True)
        _check_grids(rec, call.schedule, (4, 2), tiles_q, tiles_k)
        assert src.n_tokens == int(call.cu_k[-1])
        checked += 1
    assert checked >= 2


def test_host_schedules_launch_their_nonempty_tiles(monkeypatch):
    """One long document and many short ones, windowed and chunked: both kernels' grids."""
    cases = [([4096], (True, 512, -1, 0)), ([37] * 300 + [1000], (True, -1, -1, 0)),
             ([700, 3, 250] * 20, (False, -1, -1, 96))]
    for lengths, mask in cases:
        cu = torch.tensor([0] + lengths).cumsum(0)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(torch.int32)
        causal, wl, wr, chunk = mask
        sched = build_block_schedule(cu, cu, max(lengths), max(lengths), causal=causal,
                                     window_left=wl, window_right=wr, chunk_size=chunk,
                                     q_positions=pos, k_positions=pos, block_m=64,
                                     block_n=64)
        rec = _record(monkeypatch)
        _launch((cu.to(torch.int32), cu.to(torch.int32), max(lengths), max(lengths), pos, pos,
                 sched))
        tiles_q = _nonempty_tiles(cu, pos, cu, pos, 64, mask)
        tiles_k = _nonempty_tiles(cu, pos, cu, pos, 64, mask, by_keys=True)
        _check_grids(rec, sched, (4, 2), tiles_q, tiles_k)


def test_device_work_list_covers_every_block_with_rows():
    """Without a host schedule the list is built on the device from cu_seqlens: every block
    holding rows exactly once, then -1, at most one program per segment beyond them."""
    for lengths in ([0, 5, 64, 65, 0, 200], [1] * 50, [0] * 7 + [3], [128]):
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        for block in (16, 64):
            n_blocks = -(-max(max(lengths), 1) // block)
            got = device_work_list(cu, block, n_blocks, int(cu[-1]))
            want = [s * n_blocks + b for s, n in enumerate(lengths)
                    for b in range(-(-n // block))]
            listed = got[got >= 0].tolist()
            assert listed == want
            assert bool((got[len(want):] == -1).all())
            assert got.numel() <= len(want) + len(lengths)


def test_more_segments_than_a_cuda_grid_row(monkeypatch):
    """70,000 segments (CUDA's grid y limit is 65,535; the old grid put segments there):
    a 1-D work-list grid, and results equal to the dense reference."""
    n_seg = 70_000
    lengths = torch.zeros(n_seg, dtype=torch.int64)
    lengths[[5, 40_000, 69_999]] = torch.tensor([20, 33, 9])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    pos = torch.cat([torch.arange(int(n)) for n in lengths[lengths > 0]]).to(torch.int32)
    sched = build_block_schedule(cu, cu, 33, 33, causal=True, window_left=-1,
                                 window_right=-1, chunk_size=0, q_positions=pos,
                                 k_positions=pos, block_m=32, block_n=32)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(62, 2, 16, generator=g) for _ in range(4))
    args = (cu.to(torch.int32), cu.to(torch.int32), 33, 33, 0.25, True, -1, -1, 0, pos, pos,
            sched)
    rec = _record(monkeypatch)
    fwd_mod.triton_fwd(q, k, v, *args)
    assert rec["fwd"].grids == [(4 * 2,)]  # blocks: 1 + 2 + 1, x 2 heads
    monkeypatch.undo()
    out, lse = fwd_mod.triton_fwd(q, k, v, *args)
    dq, dk, dv = bwd_mod.triton_bwd(dout, q, k, v, out, lse, *args)
    short = torch.tensor([0, 20, 53, 62])
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attn(*leaves, short, short, causal=True, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    for got, want in zip((out, lse, dq, dk, dv), (ref_out, ref_lse, *ref_grads)):
        torch.testing.assert_close(got.double(), want.detach().double(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ backward stats


def _stats_inputs():
    g = torch.Generator().manual_seed(3)
    t, h, dv = 50, 3, 24
    dout, out = torch.randn(t, h, dv, generator=g), torch.randn(t, h, dv, generator=g)
    lse = torch.randn(h, t, generator=g)
    lse[:, 7:11] = float("-inf")               # rows that saw nothing
    out[7:11] = float("nan")                   # whatever they hold must not matter
    dlse = torch.randn(h, t, generator=g)
    return dout, out, lse, dlse


def test_bwd_stats_match_a_direct_computation():
    dout, out, lse, dlse = _stats_inputs()
    dead = lse == float("-inf")
    for with_dlse in (False, True):
        d = (dout.double() * out.double()).sum(-1).t()
        if with_dlse:
            d = d - dlse.double()
        want = torch.stack([d.masked_fill(dead, 0.0),
                            (lse.double() * 1.4426950408889634).masked_fill(dead, float("inf"))])
        extra = (dlse,) if with_dlse else ()
        for got in (bwd_mod.triton_bwd_stats(dout, out, lse, *extra),
                    torch_bwd_stats(dout, out, lse, *extra)):
            assert got.shape == (2, 3, 50) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bwd_given_stats_equals_bwd_that_makes_them():
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 40, 47], dtype=torch.int32)
    q, k, v, dout = (torch.randn(47, 2, 32, generator=g) for _ in range(4))
    args = (cu, cu, 40, 40, 0.2, True, -1, -1, 0, None, None, None)
    out, lse = fwd_mod.triton_fwd(q, k, v, *args, block_sizes=(32, 32))
    dlse = torch.randn(2, 47, generator=g)
    stats = bwd_mod.triton_bwd_stats(dout, out, lse, dlse)
    a = bwd_mod.triton_bwd(dout, q, k, v, out, lse, *args, block_sizes=(32, 32), dlse=dlse)
    b = bwd_mod.triton_bwd(dout, q, k, v, out, lse, *args, block_sizes=(32, 32), stats=stats)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def stats_once_worker(rank, world):
    """Count the stats passes and backward calls of one CP layer's backward."""
    from tests.helpers.cp_grid import cp_run, global_inputs
    from varlen_cp import AttnOptions
    from varlen_cp.strategies import calls
    counts = {"stats": 0, "bwd": 0}
    stats, bwd = calls.Attn.bwd_stats, calls.Attn.bwd

    def count(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    calls.Attn.bwd_stats = count("stats", stats)
    calls.Attn.bwd = count("bwd", bwd)
    docs = [1, 2, 37, 9, 0, 130, 5, 23]
    out = {}
    try:
        for strategy, layout, opts in (("p2p", "dual_chunk", {}),
                                       ("dispatch", "balanced", {"overlap_stages": 2})):
            counts.update(stats=0, bwd=0)
            inputs = global_inputs(docs, 4, 2, seed=5)
            cp_run(rank, world, docs, layout, AttnMask(),
                   AttnOptions(strategy=strategy, backend="torch", **opts), inputs,
                   torch.float32)
            out[strategy] = dict(counts)
    finally:
        calls.Attn.bwd_stats, calls.Attn.bwd = stats, bwd
    return out


@slow
def test_cp_backward_makes_the_stats_once_per_layer(tmp_path):
    for counts in run_distributed(stats_once_worker, 2, tmp_path):
        for strategy, c in counts.items():
            assert c["stats"] == 1, (strategy, c)
            assert c["bwd"] >= 2, (strategy, c)  # ring steps / stages that share them
