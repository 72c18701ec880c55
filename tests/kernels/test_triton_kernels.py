"""Triton varlen attention kernels vs the dense fp64 reference (forward and backward).

On CPU the kernels run under TRITON_INTERPRET=1 (~10 ms per tile iteration), so shapes stay
tiny and tiles are 32 wide; bf16 and large shapes run only where CUDA exists. Each case
checks out, lse, dq, dk, dv with the tolerance rule of docs/design.md: error vs fp64 at most 2x
(out, lse) / 3x (grads) that of plain PyTorch in the inputs' dtype, plus a small floor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

if not torch.cuda.is_available():  # conftest does this first; kept for running the file alone
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.lanes import fast_first, slow
from varlen_cp.kernels.schedule import build_block_schedule  # noqa: E402
from varlen_cp.kernels.triton_attn import (  # noqa: E402
    triton_block_sizes, triton_bwd, triton_fwd,
)
from tests.reference import assert_close_to_reference, reference_attn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = (32, 32)
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

# (Lq, Lk) per segment: a length-1 query, an empty query segment with keys, a segment with
# queries but no keys, Lq != Lk both ways (implicit positions go negative when Lq > Lk).
SEGMENTS = [(1, 3), (0, 5), (40, 40), (6, 0), (29, 23)]

# name: (causal, (window_left, window_right), chunk_size)
MASKS = {
    "causal": (True, (-1, -1), 0),
    "full": (False, (-1, -1), 0),
    "win_0_0": (False, (0, 0), 0),
    "win_3_2": (False, (3, 2), 0),
    "win_right_5": (False, (-1, 5), 0),
    "causal_win_5": (True, (5, -1), 0),
    "chunk_1": (False, (-1, -1), 1),
    "chunk_7": (False, (-1, -1), 7),
    "chunk_7_causal": (True, (-1, -1), 7),
    "chunk_16": (False, (-1, -1), 16),
    "chunk_16_causal": (True, (-1, -1), 16),
}


@dataclass
class Case:
    """One kernel call: shapes, mask, which positions are explicit, and tile mode."""

    mask: str = "causal"
    segments: list = field(default_factory=lambda: list(SEGMENTS))
    heads: tuple[int, int] = (2, 1)
    dims: tuple[int, int] = (32, 32)
    dtype: torch.dtype = torch.float32
    explicit_q: bool = False
    explicit_k: bool = False
    schedule: bool = False
    shuffle: bool = False  # explicit positions out of order inside segments
    blocks: tuple[int, int] | None = BLOCKS  # None: the kernels' defaults (GPU tests)
    seed: int = 0


def _cu(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


def _positions(lengths: list[int], span: list[int], gen: torch.Generator, shuffle: bool
               ) -> torch.Tensor:
    """Distinct document positions per segment drawn from [0, span), ~15% padding (-1)."""
    parts = []
    for n, s in zip(lengths, span):
        pos = torch.randperm(s, generator=gen)[:n]
        pos = pos if shuffle else pos.sort().values
        pad = torch.rand(n, generator=gen) < 0.15
        parts.append(torch.where(pad, -1, pos))
    return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)


def _inputs(c: Case):
    gen = torch.Generator().manual_seed(c.seed)
    lq = [s[0] for s in c.segments]
    lk = [s[1] for s in c.segments]
    hq, hkv = c.heads
    d, dv = c.dims
    tq, tk = sum(lq), sum(lk)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(c.dtype)

    q, k, v, dout = rand(tq, hq, d), rand(tk, hkv, d), rand(tk, hkv, dv), rand(tq, hq, dv)
    span = [max(a, b) + 4 for a, b in zip(lq, lk)]  # documents a bit longer than either side
    q_pos = _positions(lq, span, gen, c.shuffle) if c.explicit_q else None
    k_pos = _positions(lk, span, gen, c.shuffle) if c.explicit_k else None
    return q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), q_pos, k_pos


def _reference(q, k, v, dout, cu_q, cu_k, mask, q_pos, k_pos, dtype):
    """(out, lse, dq, dk, dv) of the dense reference computed in ``dtype``."""
    causal, window, chunk = MASKS[mask] if isinstance(mask, str) else mask
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attn(*leaves, cu_q, cu_k, causal=causal, window_size=window,
                              chunk_size=chunk, q_positions=q_pos, k_positions=k_pos,
                              dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return (out.detach(), lse, *grads)


def _to_device(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _run_kernels(q, k, v, dout, cu_q, cu_k, max_q, max_k, mask, q_pos, k_pos, schedule,
                 blocks=BLOCKS):
    causal, (wl, wr), chunk = MASKS[mask] if isinstance(mask, str) else mask
    tiles = blocks or triton_block_sizes(q.shape[-1], v.shape[-1])
    q, k, v, dout, cu_q, cu_k = (t.to(DEVICE) for t in (q, k, v, dout, cu_q, cu_k))
    sched = None
    if schedule:
        sched = build_block_schedule(
            cu_q.cpu(), cu_k.cpu(), max_q, max_k, causal=causal, window_left=wl,
            window_right=wr, chunk_size=chunk, q_positions=q_pos, k_positions=k_pos,
            block_m=tiles[0], block_n=tiles[1]).to(DEVICE)
    args = (cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5, causal, wl, wr, chunk,
            _to_device(q_pos), _to_device(k_pos), sched)
    override = None if schedule else blocks
    out, lse = triton_fwd(q, k, v, *args, block_sizes=override)
    grads = triton_bwd(dout, q, k, v, out, lse, *args, block_sizes=override)
    return [t.cpu() for t in (out, lse, *grads)]


def _finite_lse(lse: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    return torch.where(empty, torch.zeros_like(lse), lse)


def _check(c: Case) -> None:
    q, k, v, dout, cu_q, cu_k, max_q, max_k, q_pos, k_pos = _inputs(c)
    got = _run_kernels(q, k, v, dout, cu_q, cu_k, max_q, max_k, c.mask, q_pos, k_pos,
                       c.schedule, c.blocks)
    ref = _reference(q, k, v, dout, cu_q, cu_k, c.mask, q_pos, k_pos, torch.float64)
    plain = _reference(q, k, v, dout, cu_q, cu_k, c.mask, q_pos, k_pos, c.dtype)
    _compare(got, ref, plain, c.dtype)


def _compare(got, ref, plain, dtype) -> None:
    out, lse, dq, dk, dv = got
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
    assert lse.dtype == torch.float32
    empty = ref[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "lse: -inf rows differ"
    assert (out[empty.transpose(0, 1)] == 0).all(), "rows with no visible key must be 0"
    floor = FLOOR[dtype]
    assert_close_to_reference("out", out, ref[0], plain[0], factor=2, floor=floor)
    assert_close_to_reference("lse", _finite_lse(lse, empty), _finite_lse(ref[1], empty),
                              _finite_lse(plain[1], empty), factor=2, floor=floor)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], plain[2:]):
        assert_close_to_reference(name, g, r, p, factor=3, floor=floor)


# ------------------------------------------------------------------ tile modes x masks


@pytest.mark.parametrize("mask", fast_first(list(MASKS)))
def test_implicit_positions(mask):
    """Implicit positions on both sides: key and query ranges derived analytically."""
    _check(Case(mask=mask))


@pytest.mark.parametrize("mask", fast_first(list(MASKS)))
def test_explicit_positions_scan(mask):
    """Explicit positions with padding, no schedule: tiles skipped by their positions."""
    _check(Case(mask=mask, explicit_q=True, explicit_k=True, seed=1))


@pytest.mark.parametrize("mask", fast_first(["causal", "full", "win_3_2", "causal_win_5",
                                             "chunk_1", "chunk_16_causal"]))
def test_schedule(mask):
    """Host schedule (block 32) with explicit positions and padding.

    The ranges come from the host; in the kernel only the per-element mask depends on the
    mask kind, which the other modes cover for every kind.
    """
    _check(Case(mask=mask, explicit_q=True, explicit_k=True, schedule=True, seed=2))


@pytest.mark.parametrize("mask", fast_first(["causal", "win_right_5", "chunk_16_causal"]))
def test_schedule_implicit(mask):
    """Host schedule built from implicit bottom-right positions (Lq != Lk segments)."""
    _check(Case(mask=mask, schedule=True, seed=3))


@pytest.mark.parametrize("mask", fast_first(["causal", "win_3_2", "chunk_7_causal"]))
@pytest.mark.parametrize("side", fast_first(["q", "k"]))
def test_one_side_explicit(mask, side):
    """One side explicit: the forward/dQ and dK/dV kernels then use different tile modes."""
    _check(Case(mask=mask, explicit_q=side == "q", explicit_k=side == "k", seed=4))


@pytest.mark.parametrize("schedule", fast_first([False, True]))
def test_unsorted_positions(schedule):
    """Out-of-order positions: the per-element mask keeps results exact."""
    _check(Case(mask="win_3_2", explicit_q=True, explicit_k=True, shuffle=True,
                schedule=schedule, seed=5))


# ------------------------------------------------------------------ full and boundary tiles

LONG = [(150, 150), (97, 130), (64, 64), (0, 7), (5, 0)]


def _trailing_padding(lengths: list[int], pad: int) -> torch.Tensor:
    """Sorted positions 0.. per segment, its last ``pad`` tokens padding (the CP layouts'
    invariant: no padding inside a visited range, so loads follow the ranges alone)."""
    parts = [torch.cat([torch.arange(max(n - pad, 0)), torch.full((min(pad, n),), -1)])
             for n in lengths]
    return torch.cat(parts).to(torch.int32)


@pytest.mark.parametrize("mask,heads,mode", [
    ("causal", (6, 2), "implicit"),
    ((True, (100, -1), 0), (2, 2), "trailing_padding"),
    ((False, (-1, -1), 48), (4, 1), "random_padding"),
    ("full", (2, 1), "implicit"),
])
@slow  # ~50 s on 2 cores: segments of several tiles on the interpreter
def test_full_and_boundary_tiles(mask, heads, mode):
    """Segments of several 32-wide tiles: the unmasked full-tile loops run most tiles, the
    masked boundary loops the diagonal, window and chunk edges, in one call; GQA walks its
    heads in dK/dV's flat (head, query tile) loop. Schedules with padding only after each
    segment's real tokens (padded=False: loads bounded by ranges) and anywhere (padded)."""
    c = Case(mask=mask, segments=LONG, heads=heads, seed=20)
    q, k, v, dout, cu_q, cu_k, max_q, max_k, _, _ = _inputs(c)
    q_pos = k_pos = None
    if mode == "trailing_padding":
        q_pos = _trailing_padding([a for a, _ in LONG], 3)
        k_pos = _trailing_padding([b for _, b in LONG], 5)
    elif mode == "random_padding":
        gen = torch.Generator().manual_seed(21)
        q_pos = _positions([a for a, _ in LONG], [max(a, b) for a, b in LONG], gen, False)
        k_pos = _positions([b for _, b in LONG], [max(a, b) for a, b in LONG], gen, False)
    schedule = q_pos is not None
    if schedule:
        causal, (wl, wr), chunk = mask
        sched = build_block_schedule(cu_q, cu_k, max_q, max_k, causal=causal, window_left=wl,
                                     window_right=wr, chunk_size=chunk, q_positions=q_pos,
                                     k_positions=k_pos, block_m=32, block_n=32)
        assert sched.padded == (mode == "random_padding")
        if not sched.padded:  # (padding inside every range leaves no full tile)
            full = sched.kv_full[..., 1] - sched.kv_full[..., 0]
            assert int((full >= 64).sum()) >= 2, "the case must have blocks with full tiles"
    got = _run_kernels(q, k, v, dout, cu_q, cu_k, max_q, max_k, mask, q_pos, k_pos, schedule)
    ref = _reference(q, k, v, dout, cu_q, cu_k, mask, q_pos, k_pos, torch.float64)
    plain = _reference(q, k, v, dout, cu_q, cu_k, mask, q_pos, k_pos, torch.float32)
    _compare(got, ref, plain, torch.float32)


# ------------------------------------------------------------------ dtypes, dims, GQA


@pytest.mark.parametrize("mask,dims,explicit", fast_first([
    ("causal", (32, 32), False),
    ("win_3_2", (80, 80), True),
    ("chunk_7_causal", (48, 32), False),
    ("full", (32, 48), True),
], unpack=True))
def test_fp16_head_dims(mask, dims, explicit):
    _check(Case(mask=mask, dims=dims, dtype=torch.float16, explicit_q=explicit,
                explicit_k=explicit, seed=6))


def test_head_dim_80_dv_differs_fp32():
    _check(Case(mask="causal_win_5", dims=(80, 48), seed=7))


@pytest.mark.parametrize("heads,dtype", fast_first([((6, 2), torch.float32),
                                                   ((8, 1), torch.float16)], unpack=True))
def test_gqa(heads, dtype):
    segs = [(20, 20), (0, 3), (17, 21)]
    _check(Case(mask="causal", segments=segs, heads=heads, dtype=dtype, seed=8))


# ------------------------------------------------------------------ edge cases


def test_rows_without_keys_are_zero_not_nan():
    """All-padding queries/keys, keyless segments, and rows a window leaves empty."""
    segs = [(5, 0), (9, 9), (12, 6)]
    q, k, v, dout, cu_q, cu_k, max_q, max_k, _, _ = _inputs(Case(segments=segs, seed=9))
    q_pos = torch.tensor([-1] * 5 + list(range(9)) + [-1] * 6 + list(range(20, 26)),
                         dtype=torch.int32)
    k_pos = torch.tensor([-1] * 9 + list(range(6)), dtype=torch.int32)
    mask = (True, (2, -1), 0)  # queries at 20..25 are too far from keys 0..5: empty rows
    for schedule in (False, True):
        out, lse, dq, dk, dv = _run_kernels(q, k, v, dout, cu_q, cu_k, max_q, max_k, mask,
                                            q_pos, k_pos, schedule)
        for t in (out, lse, dq, dk, dv):
            assert not torch.isnan(t).any()
        assert (lse == float("-inf")).all()
        for t in (out, dq, dk, dv):
            assert (t == 0).all()


def test_backward_takes_lse_as_given():
    """P = 0 wherever the given lse is -inf, even where this call's keys are visible.

    (CP passes merged out/lse; an -inf row must contribute nothing, never NaN.)
    """
    c = Case(mask="causal", segments=[(20, 20), (9, 12)], seed=14)
    q, k, v, dout, cu_q, cu_k, max_q, max_k, _, _ = _inputs(c)
    out = torch.randn_like(dout)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    sched = build_block_schedule(cu_q, cu_k, max_q, max_k, causal=True, window_left=-1,
                                 window_right=-1, chunk_size=0, block_m=BLOCKS[0],
                                 block_n=BLOCKS[1]).to(DEVICE)
    tensors = [t.to(DEVICE) for t in (dout, q, k, v, out, lse, cu_q, cu_k)]
    for schedule, blocks in ((None, BLOCKS), (sched, None)):
        grads = triton_bwd(*tensors, max_q, max_k, 0.2, True, -1, -1, 0, None, None,
                           schedule, block_sizes=blocks)
        for g in grads:
            assert (g.cpu() == 0).all()


@slow
def test_skips_tiles_out_of_range():
    """Tiles no query of a block can see are never loaded: poison them with NaN.

    Keys 96..127 hold NaN; with window (3, 2) rows 0..63 see keys <= 65 only, so their
    outputs, dq, and dk/dv of keys 0..31 must be exact in every tile mode. (A kernel that
    multiplied a visited NaN tile by p = 0 would spread NaN into these rows.)
    """
    mask = "win_3_2"
    c = Case(mask=mask, segments=[(128, 128)], heads=(1, 1), seed=10)
    q, k, v, dout, cu_q, cu_k, max_q, max_k, _, _ = _inputs(c)
    ref = _reference(q, k, v, dout, cu_q, cu_k, mask, None, None, torch.float64)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[96:] = float("nan")
    v_bad[96:] = float("nan")
    arange = torch.arange(128, dtype=torch.int32)
    for pos, schedule in ((None, False), (arange, False), (arange, True)):
        out, lse, dq, dk, dv = _run_kernels(q, k_bad, v_bad, dout, cu_q, cu_k, max_q, max_k,
                                            mask, pos, pos, schedule)
        for name, got, want in (("out", out[:64], ref[0][:64]), ("lse", lse[:, :64],
                                ref[1][:, :64]), ("dq", dq[:64], ref[2][:64]),
                                ("dk", dk[:32], ref[3][:32]), ("dv", dv[:32], ref[4][:32])):
            err = (got.double() - want.double()).abs().max().item()
            assert err < 1e-5, f"{name} (positions={pos is not None}, {schedule=}): {err}"


def test_strided_views():
    """q, k, v as views into one packed qkv tensor: row and head strides are honoured."""
    segs = [(20, 20), (13, 13)]
    c = Case(mask="causal", segments=segs, heads=(2, 1), seed=13)
    q, k, v, dout, cu_q, cu_k, max_q, max_k, _, _ = _inputs(c)
    qkv = torch.cat([q, k, v], dim=1)  # [T, 4, D]: q heads 0-1, k head 2, v head 3
    views = qkv[:, :2], qkv[:, 2:3], qkv[:, 3:]
    assert not views[0].is_contiguous()
    got = _run_kernels(*views, dout, cu_q, cu_k, max_q, max_k, "causal", None, None, False)
    ref = _reference(q, k, v, dout, cu_q, cu_k, "causal", None, None, torch.float64)
    plain = _reference(q, k, v, dout, cu_q, cu_k, "causal", None, None, torch.float32)
    _compare(got, ref, plain, torch.float32)


def test_block_sizes():
    for d, dv in ((32, 32), (64, 64), (80, 80), (128, 128), (192, 128), (256, 256), (48, 32)):
        for arch in (None, 80, 90):
            bm, bn = triton_block_sizes(d, dv, arch=arch)
            assert bm >= 32 and bn >= 32
            assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    # Key blocks of 64 rows at MLA's 192/128: one wgmma warp group (32 fell back to
    # mma.sync on sm90); fp32 at padded 256 stays within an A100's shared memory.
    assert triton_block_sizes(192, 128, arch=90) == (64, 64)
    assert triton_block_sizes(256, 256, torch.float32, arch=80) == (32, 32)


def test_bad_schedule_and_blocks_raise():
    c = Case(segments=[(10, 10)], heads=(1, 1))
    q, k, v, _, cu_q, cu_k, max_q, max_k, _, _ = _inputs(c)
    sched = build_block_schedule(cu_q, cu_k, 64, 64, causal=True, window_left=-1,
                                 window_right=-1, chunk_size=0, block_m=32, block_n=32)
    args = (cu_q, cu_k, max_q, max_k, 0.1, True, -1, -1, 0, None, None)
    with pytest.raises(ValueError, match="kv_range"):
        triton_fwd(q, k, v, *args, sched)
    with pytest.raises(ValueError, match="block_m"):
        triton_fwd(q, k, v, *args, block_sizes=(24, 32))


# GPU compilation (sm80 / sm90 without a GPU, the static targets): tests/kernels/test_kernel_static.py


# ------------------------------------------------------------------ GPU only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("mask", ["causal", "win_3_2", "chunk_16_causal", "full"])
@pytest.mark.parametrize("explicit", [False, True])
def test_bf16_cuda(mask, explicit):
    _check(Case(mask=mask, dtype=torch.bfloat16, explicit_q=explicit, explicit_k=explicit,
                heads=(4, 2), dims=(64, 64), seed=11))


@needs_cuda
@pytest.mark.parametrize("dims", [(128, 128), (192, 128), (96, 96)])
@pytest.mark.parametrize("schedule", [False, True])
def test_large_cuda(dims, schedule):
    segs = [(700, 700), (1, 1), (0, 9), (1300, 1500), (513, 257)]
    for mask in ("causal", "chunk_16_causal", "win_right_5"):
        _check(Case(mask=mask, segments=segs, heads=(8, 2), dims=dims, dtype=torch.bfloat16,
                    schedule=schedule, explicit_q=schedule, explicit_k=schedule, blocks=None,
                    seed=12))
