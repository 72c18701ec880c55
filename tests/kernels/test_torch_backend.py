"""The pure-PyTorch twin (torch_fwd / torch_bwd) vs the dense fp64 reference.

Each case checks out, lse, dq, dk, dv with the tolerance rule of docs/design.md: error vs fp64 at
most 2x (out, lse) / 3x (grads) that of plain PyTorch in the inputs' dtype, plus a floor.
Cases run twice: with the twin's own schedule, and with a tiny one (16-row blocks, 24-key
chunks) so that multi-block, multi-chunk and grouped paths run on small shapes. Also:
hypothesis-generated batches, the ring-attention use of backward (merged out/lse from two
key halves), rows that see nothing, the work bound (computed scores vs visited pairs),
schedule tile efficiency on a long document, and input validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.lanes import fast_first, slow
from varlen_cp.kernels import torch_attn
from varlen_cp.kernels.mask_math import count_visible
from varlen_cp.kernels.schedule import build_block_schedule
from varlen_cp.kernels.torch_attn import torch_bwd, torch_fwd
from tests.reference import assert_close_to_reference, reference_attn

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3}
NEG_INF = float("-inf")


@dataclass
class Case:
    """One twin call: per-segment (Lq, Lk), heads, dims, mask, positions."""

    segments: list
    heads: tuple[int, int] = (2, 1)
    dims: tuple[int, int] = (32, 32)
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    chunk: int = 0
    positions: str = "implicit"   # implicit | explicit | shuffled | q_only
    seed: int = 0
    extra: dict = field(default_factory=dict)


CASES = {
    "empty_and_len1": Case([(0, 0), (1, 1), (5, 5), (0, 3), (17, 17), (4, 0)]),
    "one_long": Case([(300, 300)]),
    "one_long_full": Case([(200, 200)], causal=False),
    "many_short": Case([(3, 3)] * 20 + [(1, 1), (2, 2), (9, 9)], causal=False),
    "win_0_0": Case([(40, 40), (33, 33)], causal=False, window=(0, 0)),
    "win_3_2": Case([(50, 50), (7, 7)], causal=False, window=(3, 2)),
    "win_m1_5": Case([(45, 45), (12, 12)], causal=False, window=(-1, 5)),
    "causal_swa": Case([(120, 120), (30, 30)], window=(9, -1)),
    "chunk_1": Case([(20, 20), (9, 9)], chunk=1),
    "chunk_1_shuffled": Case([(40, 40)], causal=False, chunk=1, positions="shuffled", seed=8),
    "chunk_7": Case([(60, 60), (11, 11)], causal=False, chunk=7),
    "chunk_13_causal_win": Case([(90, 90)], chunk=13, window=(5, -1)),
    "gqa_6_2": Case([(37, 37), (20, 20)], heads=(6, 2)),
    "gqa_8_1": Case([(37, 37), (20, 20)], heads=(8, 1), causal=False, chunk=5),
    "padding": Case([(40, 40), (25, 25)], positions="explicit"),
    "padding_shuffled": Case([(40, 40), (25, 25)], positions="shuffled", window=(6, 6),
                             causal=False),
    "q_only_explicit": Case([(30, 30), (10, 10)], positions="q_only", chunk=4),
    "lq_ne_lk": Case([(5, 9), (20, 12), (0, 4), (3, 0), (33, 70)]),
    "lq_ne_lk_win": Case([(5, 9), (20, 12), (33, 70)], window=(4, 2), causal=False),
    "lq_ne_lk_explicit": Case([(14, 30), (30, 14)], positions="explicit", window=(8, -1)),
    "dim_80": Case([(40, 40), (9, 9)], dims=(80, 80)),
    "dim_96": Case([(40, 40), (9, 9)], dims=(96, 96), window=(7, 0), causal=False),
    "mla_192_128": Case([(40, 40), (9, 9)], dims=(192, 128), heads=(4, 2)),
}


# ----------------------------------------------------------------------------- helpers
def _cu(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu


def _positions(lengths: list[int], span: list[int], gen: torch.Generator, shuffle: bool
               ) -> torch.Tensor:
    """Distinct document positions per segment from [0, span), ~15% set to padding (-1)."""
    parts = []
    for n, s in zip(lengths, span):
        pos = torch.randperm(max(s, n), generator=gen)[:n]
        pos = pos if shuffle else pos.sort().values
        pos[torch.rand(n, generator=gen) < 0.15] = -1
        parts.append(pos)
    return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)


def _make(case: Case, dtype: torch.dtype):
    """Inputs, positions and cu_seqlens of a case (deterministic per seed)."""
    gen = torch.Generator().manual_seed(case.seed)
    lq = [a for a, _ in case.segments]
    lk = [b for _, b in case.segments]
    hq, hkv = case.heads
    d, dv = case.dims
    q = torch.randn(sum(lq), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lk), hkv, dv, generator=gen).to(dtype)
    dout = torch.randn(sum(lq), hq, dv, generator=gen).to(dtype)
    qp = kp = None
    if case.positions != "implicit":
        span = [max(a, b) + 3 for a, b in case.segments]
        shuffle = case.positions == "shuffled"
        qp = _positions(lq, span, gen, shuffle)
        kp = None if case.positions == "q_only" else _positions(lk, span, gen, shuffle)
    return q, k, v, dout, _cu(lq), _cu(lk), qp, kp


def _reference(q, k, v, dout, cu_q, cu_k, qp, kp, case: Case, scale: float, dtype):
    """(out, lse, dq, dk, dv) of the dense reference computed in ``dtype``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attn(*leaves, cu_q, cu_k, softmax_scale=scale, causal=case.causal,
                              window_size=case.window, chunk_size=case.chunk,
                              q_positions=qp, k_positions=kp, dtype=dtype)
    if not out.requires_grad:  # no segment has both queries and keys: nothing to differentiate
        return (out, lse, *(torch.zeros_like(t, dtype=dtype) for t in leaves))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t, dtype=dtype) if g is None else g
             for t, g in zip(leaves, grads)]
    return (out, lse, *grads)


def _run_twin(q, k, v, dout, cu_q, cu_k, qp, kp, case: Case, scale: float,
              block: int | None = None):
    """(out, lse, dq, dk, dv) of the twin; ``block``: pass a schedule with that block size."""
    lq, lk = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    max_q = int(lq.max()) if lq.numel() else 0
    max_k = int(lk.max()) if lk.numel() else 0
    args = (cu_q, cu_k, max_q, max_k, scale, case.causal, *case.window, case.chunk, qp, kp)
    schedule = None
    if block is not None:
        schedule = build_block_schedule(
            cu_q, cu_k, max_q, max_k, causal=case.causal, window_left=case.window[0],
            window_right=case.window[1], chunk_size=case.chunk, q_positions=qp,
            k_positions=kp, block_m=block, block_n=block)
    out, lse = torch_fwd(q, k, v, *args, schedule)
    grads = torch_bwd(dout, q, k, v, out, lse, *args, schedule)
    return (out, lse, *grads)


def _assert_lse(got: torch.Tensor, ref64: torch.Tensor, plain: torch.Tensor, floor: float):
    """LSE: -inf exactly where the reference has it, finite values under the rule."""
    dead = ref64 == NEG_INF
    assert torch.equal(got == NEG_INF, dead), "lse: -inf rows differ from the reference"
    live = ~dead
    assert_close_to_reference("lse", got[live], ref64[live], plain[live], factor=2.0,
                              floor=floor)


def _check(case: Case, dtype: torch.dtype, block: int | None = None):
    q, k, v, dout, cu_q, cu_k, qp, kp = _make(case, dtype)
    scale = case.dims[0] ** -0.5
    got = _run_twin(q, k, v, dout, cu_q, cu_k, qp, kp, case, scale, block)
    ref = _reference(q, k, v, dout, cu_q, cu_k, qp, kp, case, scale, torch.float64)
    plain = _reference(q, k, v, dout, cu_q, cu_k, qp, kp, case, scale, dtype)
    floor = FLOOR[dtype]
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert got[0].shape == (q.shape[0], q.shape[1], v.shape[-1])
    assert got[1].shape == (q.shape[1], q.shape[0])
    assert [g.dtype for g in got[2:]] == [dtype] * 3
    assert_close_to_reference("out", got[0], ref[0], plain[0], factor=2.0, floor=floor)
    _assert_lse(got[1], ref[1], plain[1], floor)
    for name, g, r, p in zip(("dq", "dk", "dv"), got[2:], ref[2:], plain[2:]):
        assert g.shape == r.shape
        assert_close_to_reference(name, g, r, p, factor=3.0, floor=floor)


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Small key chunks and group caps so tiny shapes walk several chunks and groups."""
    monkeypatch.setattr(torch_attn, "_KEY_CHUNK", 24)
    monkeypatch.setattr(torch_attn, "_GROUP_ELEMS", 1 << 12)


# ----------------------------------------------------------------------------- grid
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    _check(CASES[name], dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_small_tiles(name, tiny_tiles):
    _check(CASES[name], torch.float32, block=16)


@pytest.mark.parametrize("dim", [32, 80, 96, 192])
def test_head_dims_fp16_small_tiles(dim, tiny_tiles):
    _check(Case([(50, 50), (7, 7)], heads=(4, 2), dims=(dim, dim), window=(11, 0),
                causal=False), torch.float16, block=16)


# ----------------------------------------------------------------------------- hypothesis
@st.composite
def _cases(draw):
    n_seg = draw(st.integers(1, 5))
    lq = draw(st.lists(st.integers(0, 40), min_size=n_seg, max_size=n_seg))
    lk = lq if draw(st.booleans()) else draw(
        st.lists(st.integers(0, 40), min_size=n_seg, max_size=n_seg))
    hkv = draw(st.sampled_from([1, 2]))
    grp = draw(st.sampled_from([1, 3]))
    return Case(
        list(zip(lq, lk)), heads=(hkv * grp, hkv), dims=(32, draw(st.sampled_from([32, 16]))),
        causal=draw(st.booleans()),
        window=(draw(st.sampled_from([-1, 0, 1, 4])), draw(st.sampled_from([-1, 0, 2]))),
        chunk=draw(st.sampled_from([0, 0, 1, 3, 8])),
        positions=draw(st.sampled_from(["implicit", "explicit", "shuffled", "q_only"])),
        seed=draw(st.integers(0, 2 ** 16)),
        extra={"block": draw(st.sampled_from([None, 8, 16]))})


@slow
@settings(max_examples=30, deadline=None)
@given(case=_cases())
def test_generated_batches(case):
    block = case.extra["block"]
    if block is None:
        _check(case, torch.float32)
        return
    with mock.patch.object(torch_attn, "_KEY_CHUNK", 24), \
            mock.patch.object(torch_attn, "_GROUP_ELEMS", 1 << 12):
        _check(case, torch.float32, block=block)


# ----------------------------------------------------------------------------- semantics
def _merge(o1, l1, o2, l2):
    """Combine two partial results over disjoint key sets (the ring-attention merge)."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(lse == NEG_INF, 0.0, lse)
    w1 = torch.exp(l1 - safe).t()[..., None]
    w2 = torch.exp(l2 - safe).t()[..., None]
    return (o1.double() * w1 + o2.double() * w2).float(), lse


def test_backward_with_merged_out_lse():
    """Backward of each key half with the *merged* out/lse sums to the full gradients."""
    case = Case([(30, 30), (50, 50), (1, 1)], heads=(4, 2), window=(12, -1),
                positions="explicit", seed=3)
    q, k, v, dout, cu_q, cu_k, qp, kp = _make(case, torch.float32)
    scale = 32 ** -0.5
    mask = (case.causal, *case.window, case.chunk)
    # Split every segment's keys into a first and second part (at a third of its length).
    starts, lens = cu_k[:-1].tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    cut = [n // 3 for n in lens]
    idx1 = [torch.arange(s, s + c) for s, c in zip(starts, cut)]
    idx2 = [torch.arange(s + c, s + n) for s, c, n in zip(starts, cut, lens)]
    parts = []
    for idx, seg_lens in ((idx1, cut), (idx2, [n - c for n, c in zip(lens, cut)])):
        ix = torch.cat(idx)
        parts.append((ix, k[ix], v[ix], kp[ix], _cu(seg_lens)))
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    partial = [torch_fwd(q, kk, vv, cu_q, cu, max_q, int((cu[1:] - cu[:-1]).max()), scale,
                         *mask, qp, pp) for _, kk, vv, pp, cu in parts]
    out, lse = _merge(*partial[0], *partial[1])
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for ix, kk, vv, pp, cu in parts:
        g = torch_bwd(dout, q, kk, vv, out, lse, cu_q, cu, max_q,
                      int((cu[1:] - cu[:-1]).max()), scale, *mask, qp, pp)
        dq += g[0]
        dk[ix], dv[ix] = g[1], g[2]
    ref = _reference(q, k, v, dout, cu_q, cu_k, qp, kp, case, scale, torch.float64)
    plain = _reference(q, k, v, dout, cu_q, cu_k, qp, kp, case, scale, torch.float32)
    assert_close_to_reference("merged out", out, ref[0], plain[0], factor=2.0, floor=1e-5)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], plain[2:]):
        assert_close_to_reference(name, g, r, p, factor=3.0, floor=1e-5)


def test_rows_that_see_nothing():
    """Implicit Lq > Lk under causal, and padding: out 0, lse -inf, zero grads, no NaN."""
    cu_q, cu_k = _cu([12, 6]), _cu([4, 6])
    q, dout = torch.randn(18, 2, 32), torch.randn(18, 2, 32)
    k, v = torch.randn(10, 1, 32), torch.randn(10, 1, 32)
    qp = torch.cat([torch.arange(12) - 8, torch.tensor([-1, 0, 1, -1, 2, 3])]).int()
    for positions in (None, qp):
        args = (cu_q, cu_k, 12, 6, 0.2, True, -1, -1, 0, positions, None)
        out, lse = torch_fwd(q, k, v, *args)
        dq, dk, dv = torch_bwd(dout, q, k, v, out, lse, *args)
        # Implicit: query i of segment 0 sits at i - 8; rows 0..7 see no key. Explicit: the
        # same, plus the two padding rows of segment 1.
        dead = torch.zeros(18, dtype=torch.bool)
        dead[:8] = True
        if positions is not None:
            dead[[12, 15]] = True
        assert torch.equal(lse == NEG_INF, dead[None].expand(2, -1))
        assert torch.all(out[dead] == 0) and torch.all(dq[dead] == 0)
        for t in (out, lse, dq, dk, dv):
            assert not torch.isnan(t).any()


def test_backward_ignores_rows_with_minus_inf_lse():
    """A row whose given lse is -inf contributes nothing, whatever its scores."""
    cu = _cu([16])
    q, k, v, dout = (torch.randn(16, 1, 32) for _ in range(4))
    args = (cu, cu, 16, 16, 0.2, False, -1, -1, 0, None, None)
    out, lse = torch_fwd(q, k, v, *args)
    lse_cut = lse.clone()
    lse_cut[:, 5] = NEG_INF
    dq, dk, dv = torch_bwd(dout, q, k, v, out, lse_cut, *args)
    # Same as the row not being there: zero dO on it (then dP = 0 and delta = 0 too).
    dout_cut = dout.clone()
    dout_cut[5] = 0
    _, dk_ref, dv_ref = torch_bwd(dout_cut, q, k, v, out, lse, *args)
    assert torch.all(dq[5] == 0)
    torch.testing.assert_close(dk, dk_ref)
    torch.testing.assert_close(dv, dv_ref)


def test_given_schedule_matches_own():
    case = Case([(70, 70), (5, 5), (33, 33)], heads=(4, 2), chunk=16, window=(20, -1))
    q, k, v, dout, cu_q, cu_k, qp, kp = _make(case, torch.float32)
    own = _run_twin(q, k, v, dout, cu_q, cu_k, qp, kp, case, 0.2)
    given_ = _run_twin(q, k, v, dout, cu_q, cu_k, qp, kp, case, 0.2, block=32)
    for a, b in zip(own, given_):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)



def test_schedule_reused_across_head_counts(tiny_tiles):
    """The twin memoizes its groups on the schedule, per head count: one schedule reused by
    calls with other head counts gives what a fresh schedule gives, and the memo stays
    bounded."""
    case = Case([(70, 70), (5, 5), (33, 33)], chunk=16, window=(20, -1))
    cu = _cu([70, 5, 33])

    def schedule():
        return build_block_schedule(cu, cu, 70, 70, causal=True, window_left=20,
                                    window_right=-1, chunk_size=16, block_m=16, block_n=16)

    shared = schedule()
    for hq in (1, 2, 3, 4, 5, 6):
        case.heads = (hq, 1)
        q, k, v, dout, cu_q, cu_k, qp, kp = _make(case, torch.float32)
        args = (cu_q, cu_k, 70, 70, 0.2, case.causal, *case.window, case.chunk, qp, kp)
        fresh = schedule()
        for a, b in zip(torch_fwd(q, k, v, *args, shared), torch_fwd(q, k, v, *args, fresh)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        out, lse = torch_fwd(q, k, v, *args, fresh)
        for a, b in zip(torch_bwd(dout, q, k, v, out, lse, *args, shared),
                        torch_bwd(dout, q, k, v, out, lse, *args, fresh)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(shared.__dict__["_twin_groups"]) == torch_attn._GROUP_MEMO_SIZE

# ----------------------------------------------------------------------------- work bound
def test_computed_scores_follow_the_schedule(monkeypatch):
    """A long SWA document computes ~visited pairs of scores, not total^2."""
    n, window, block = 2048, 64, 64
    cu = _cu([n])
    q, k, v = (torch.randn(n, 1, 32) for _ in range(3))
    counted = []
    real = torch_attn._masked_scores

    def counting(qh, kh, hidden, mq):
        s = real(qh, kh, hidden, mq)
        counted.append(s.numel())
        return s

    monkeypatch.setattr(torch_attn, "_masked_scores", counting)
    sched = build_block_schedule(cu, cu, n, n, causal=True, window_left=window,
                                 window_right=-1, chunk_size=0, block_m=block, block_n=block)
    out, lse = torch_fwd(q, k, v, cu, cu, n, n, 0.2, True, window, -1, 0, None, None, sched)
    computed = sum(counted)
    # Grouping pads an item by at most _GROUP_OVERHEAD_ELEMS per merge, a few percent here.
    assert sched.visited_pairs <= computed <= 1.1 * sched.visited_pairs
    assert computed < 0.1 * n * n
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("mask", [(True, 4096, 0, 0), (True, -1, -1, 8192),
                                  (False, 4096, 4096, 0), (True, 700, -1, 0)],
                         ids=["swa4096", "chunk8192", "swa4096_bidir", "swa700"])
def test_tile_efficiency_long_document(mask, block):
    """Visited pairs of the host schedule stay close to the visible ones on a 32K document.

    A row block of B rows under a window W visits at most W + B keys per row (vs ~W
    visible), so visited - visible <= rows x (B - 1) for windows and chunks alike, and the
    efficiency is >= 0.95 once W is large against B (the 4K/8K masks used in training).
    """
    n = 32768
    cu = _cu([n])
    pos = torch.arange(n)
    sched = build_block_schedule(cu, cu, n, n, causal=mask[0], window_left=mask[1],
                                 window_right=mask[2], chunk_size=mask[3], block_m=block,
                                 block_n=block)
    vis = count_visible(pos, pos, *mask)
    sides = 2 if mask[2] > 0 else 1  # a two-sided window widens both ends of the block
    assert vis <= sched.visited_pairs <= vis + sides * n * (block - 1)
    if mask[1] >= 4096 or mask[3] >= 8192:
        assert vis / sched.visited_pairs >= 0.95


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad, match", [
    ({"k": torch.randn(8, 3, 32), "v": torch.randn(8, 3, 32)}, "multiple"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32)}, "cu_seqlens_q"),
    ({"cu_seqlens_k": torch.tensor([0, 5], dtype=torch.int32)}, "cu_seqlens"),
    ({"max_seqlen_q": 2}, "max_seqlen_q=2"),
    ({"v": torch.randn(7, 1, 32)}, "shapes"),
])
def test_bad_input_raises(bad, match):
    kw = dict(q=torch.randn(8, 2, 32), k=torch.randn(8, 1, 32), v=torch.randn(8, 1, 32),
              cu_seqlens_q=_cu([3, 5]), cu_seqlens_k=_cu([3, 5]), max_seqlen_q=5,
              max_seqlen_k=5, softmax_scale=0.2, causal=True, window_left=-1,
              window_right=-1, chunk_size=0, q_positions=None, k_positions=None)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        torch_fwd(**kw)


def test_bad_schedule_raises():
    cu = _cu([40, 8])
    q, k, v = (torch.randn(48, 1, 32) for _ in range(3))
    sched = build_block_schedule(_cu([40]), _cu([40]), 40, 40, causal=True, window_left=-1,
                                 window_right=-1, chunk_size=0, block_m=16, block_n=16)
    with pytest.raises(ValueError, match="schedule"):
        torch_fwd(q, k, v, cu, cu, 40, 40, 0.2, True, -1, -1, 0, None, None, sched)
