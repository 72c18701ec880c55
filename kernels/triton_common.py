"""Pieces shared by the Triton varlen attention kernels: mask math, loads, launch choices.

The ``@triton.jit`` helpers evaluate the mask contract of the package (causal, sliding
window, Llama 4 chunks, padding positions < 0) on int32 positions, bound which tiles a
block has to visit from the fact that both ends of a query's visible key interval never
decrease with its position (see ``kernels/mask_math.py`` for the host twin), and load the
segment bounds and row tiles every kernel starts from. Host-side: tile sizes, launch
options, the constexpr switches and schedule checks the forward and backward share.

Padding rows (explicit position < 0) are never loaded: their Q, K, V and dO read as 0, so
NaN or inf left in them (torch.empty padding) cannot reach a real row through 0 x NaN in a
product, and their own gradients come out 0.

Limits: positions (explicit or implicit) must lie in [-2**31, 2**30) (the api rejects others
when they are on the host); windows and chunk sizes beyond 2**30 are clamped to it, which
changes nothing for such positions and keeps every sum and difference of real positions
inside int32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Stand-in for "unbounded" in int32 interval math: beyond any position, with headroom for
# adding a window (also <= BIG) without int32 overflow.
BIG = 1 << 30
_BIG: tl.constexpr = tl.constexpr(BIG)  # the same bound, readable inside @triton.jit code
LOG2E = math.log2(math.e)  # the kernels run the softmax in base 2


def clamp_mask_param(value: int) -> int:
    """Clamp a window / chunk length to ``BIG`` so in-kernel int32 math cannot overflow."""
    return min(int(value), BIG)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs need IEEE (TF32 loses ~3 digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded_head_dim(d: int) -> int:
    """Head dims are tiled at the next power of two (80 -> 128, 192 -> 256), min 16 for tl.dot."""
    return max(16, triton.next_power_of_2(int(d)))


def triton_block_sizes(head_dim: int, head_dim_v: int,
                       dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(block_m, block_n) the kernels prefer for these head dims and input dtype (>= 32 each).

    64x64 keeps Q, the fp32 accumulator and one K/V tile in registers up to a padded head
    dim of 128; at 256 (e.g. MLA's 192) the key tile is halved so the fp32 accumulator of
    64 x 256 plus K and V tiles still fit with 8 warps. fp32 inputs at 256 also halve the
    query tile: with 64x32 the dQ and dK/dV kernels need 192 and 200 KB of shared memory
    (ptxas, sm80, triton 3.9), more than an A100's 163 KB; 32x32 needs 128 and 132 KB.
    ``dtype=None`` gives the 16-bit choice.
    """
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if widest <= 128:
        return 64, 64
    return (32, 32) if dtype == torch.float32 else (64, 32)


def launch_options(dtype: torch.dtype, head_dim: int, head_dim_v: int,
                   kernel: str = "fwd") -> dict:
    """``num_warps`` / ``num_stages`` for one kernel ("fwd", "dq" or "dkdv").

    Chosen from ptxas resource reports (bf16/fp16, sm80 and sm90, triton 3.9), not from
    timings: no GPU was available when they were set.
    - fwd / dQ: 4 warps up to padded d = 128 (no spills), 8 above.
    - dK/dV holds two [block_n, d] fp32 accumulators besides K and V: with 4 warps it
      spills even at d = 64 (48 bytes on sm80), with 8 it does not. At d = 256 the default
      3 stages need 169 KB of shared memory, more than an A100 has (164 KB); 2 need 103 KB.
    - fp32 inputs take the IEEE dot (no tensor cores), where prefetching gains little and
      3 stages need 180-205 KB at d >= 128; one stage keeps d <= 128 launchable on A100.
    """
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if kernel == "dkdv":
        options = {"num_warps": 8}
        if widest > 128:
            options["num_stages"] = 2
    else:
        options = {"num_warps": 4 if widest <= 128 else 8}
    if dtype == torch.float32:
        options["num_stages"] = 1
    return options


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim as contiguous; other strides are passed in."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_block(name: str, value: int) -> None:
    """Tile sizes must be powers of two >= 16 (tl.arange and tl.dot minimums)."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def resolve_blocks(schedule, block_sizes, dtype: torch.dtype, head_dim: int,
                   head_dim_v: int) -> tuple[int, int]:
    """Tile sizes: the schedule's (its tables are per block), else the override, else default."""
    if schedule is not None:
        bm, bn = schedule.block_m, schedule.block_n
    elif block_sizes is not None:
        bm, bn = block_sizes
    else:
        bm, bn = triton_block_sizes(head_dim, head_dim_v, dtype)
    check_block("block_m", bm)
    check_block("block_n", bn)
    return int(bm), int(bn)


def check_schedule(schedule, n_seg: int, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The tables must match this call's segments and block counts (shape metadata only)."""
    if schedule is None:
        return
    want_kv = (n_seg, triton.cdiv(max(max_seqlen_q, 1), schedule.block_m), 2)
    want_q = (n_seg, triton.cdiv(max(max_seqlen_k, 1), schedule.block_n), 2)
    if tuple(schedule.kv_range.shape) != want_kv:
        raise ValueError(f"schedule.kv_range has shape {tuple(schedule.kv_range.shape)}, "
                         f"expected {want_kv} for these cu_seqlens_q / max_seqlen_q")
    if tuple(schedule.q_range.shape) != want_q:
        raise ValueError(f"schedule.q_range has shape {tuple(schedule.q_range.shape)}, "
                         f"expected {want_q} for these cu_seqlens_k / max_seqlen_k")


def kernel_constants(dtype: torch.dtype, head_dim: int, head_dim_v: int, block_m: int,
                     block_n: int, causal: bool, window_left: int, window_right: int,
                     chunk_size: int, explicit_q: bool, explicit_k: bool,
                     use_schedule: bool) -> dict:
    """Keyword arguments shared by the three kernels: mask values and constexpr switches.

    Constexpr flags drop unused mask terms and tile modes at compile time. The scan flags
    mark explicit positions without a schedule: only then is a per-tile skip test needed.
    """
    return dict(
        window_left=clamp_mask_param(max(window_left, 0)),
        window_right=clamp_mask_param(max(window_right, 0)),
        chunk_size=clamp_mask_param(chunk_size) if chunk_size > 0 else 1,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=padded_head_dim(head_dim), BLOCK_DV=padded_head_dim(head_dim_v),
        CAUSAL=bool(causal), HAS_WL=window_left >= 0, HAS_WR=window_right >= 0,
        HAS_CHUNK=chunk_size > 0, EXPLICIT_Q=explicit_q, EXPLICIT_K=explicit_k,
        USE_SCHEDULE=use_schedule, SCAN_Q=explicit_q and not use_schedule,
        SCAN_K=explicit_k and not use_schedule, DOT_PREC=dot_precision(dtype),
    )


# --------------------------------------------------------------------------- device side


@triton.jit
def floor_div(x, c):
    """Floor division for c > 0, whether ``//`` truncates (GPU) or floors (interpreter)."""
    q = x // c
    return tl.where(x - q * c < 0, q - 1, q)


@triton.jit
def key_lo(p, window_left, chunk_size, HAS_WL: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Smallest key position query position ``p`` sees (keys below 0 never exist)."""
    lo = tl.maximum(p * 0, 0)
    if HAS_WL:
        lo = tl.maximum(lo, p - window_left)
    if HAS_CHUNK:
        lo = tl.maximum(lo, floor_div(p, chunk_size) * chunk_size)
    return lo


@triton.jit
def key_hi(p, window_right, chunk_size, CAUSAL: tl.constexpr, HAS_WR: tl.constexpr,
           HAS_CHUNK: tl.constexpr):
    """Largest key position query position ``p`` sees."""
    hi = p * 0 + _BIG
    if CAUSAL:
        hi = tl.minimum(hi, p)
    if HAS_WR:
        hi = tl.minimum(hi, p + window_right)
    if HAS_CHUNK:
        hi = tl.minimum(hi, floor_div(p, chunk_size) * chunk_size + chunk_size - 1)
    return hi


@triton.jit
def query_lo(k, window_right, chunk_size, CAUSAL: tl.constexpr, HAS_WR: tl.constexpr,
             HAS_CHUNK: tl.constexpr):
    """Smallest query position that sees key position ``k`` (inverse of ``key_hi``)."""
    lo = k * 0 - _BIG
    if CAUSAL:
        lo = tl.maximum(lo, k)
    if HAS_WR:
        lo = tl.maximum(lo, k - window_right)
    if HAS_CHUNK:
        lo = tl.maximum(lo, floor_div(k, chunk_size) * chunk_size)
    return lo


@triton.jit
def query_hi(k, window_left, chunk_size, HAS_WL: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Largest query position that sees key position ``k`` (inverse of ``key_lo``)."""
    hi = k * 0 + _BIG
    if HAS_WL:
        hi = tl.minimum(hi, k + window_left)
    if HAS_CHUNK:
        hi = tl.minimum(hi, floor_div(k, chunk_size) * chunk_size + chunk_size - 1)
    return hi


@triton.jit
def visible(p, k, window_left, window_right, chunk_size, CAUSAL: tl.constexpr,
            HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Pairwise mask of query positions ``p`` [M, 1] vs key positions ``k`` [1, N].

    Padding and bounds are the caller's; differences instead of sums keep int32 safe.
    Chunks compare against the query's chunk start so the division runs per row, not per pair.
    """
    vis = (p * 0 + k * 0) == 0  # all-true, in the broadcast shape
    if CAUSAL:
        vis = vis & (k <= p)
    if HAS_WL:
        vis = vis & (p - k <= window_left)
    if HAS_WR:
        vis = vis & (k - p <= window_right)
    if HAS_CHUNK:
        start = floor_div(p, chunk_size) * chunk_size
        vis = vis & (k >= start) & (k - start < chunk_size)
    return vis


@triton.jit
def position_bounds(pos, valid):
    """(min, max) of the valid entries of an int32 vector; (BIG, -BIG) when none is valid."""
    lo = tl.min(tl.where(valid, pos, _BIG), axis=0)
    hi = tl.max(tl.where(valid, pos, -_BIG), axis=0)
    return lo, hi


@triton.jit
def segment_bounds(CU_Q, CU_K, seg):
    """(q_start, len_q, k_start, len_k) of segment ``seg``."""
    q_start = tl.load(CU_Q + seg)
    len_q = tl.load(CU_Q + seg + 1) - q_start
    k_start = tl.load(CU_K + seg)
    len_k = tl.load(CU_K + seg + 1) - k_start
    return q_start, len_q, k_start, len_k


@triton.jit
def load_rows(PTR, rows, row_ok, head, stride_t, stride_h, offs_d, HEAD_DIM: tl.constexpr):
    """[len(rows), len(offs_d)] tile of one head at absolute (int64) token ``rows``.

    Rows where ``row_ok`` is False (padding, or past the visited range) and the padded head
    dims are not read: they are 0, whatever the memory holds. A masked load, not a multiply,
    so NaN / inf in padding never enters a dot product.
    """
    return tl.load(PTR + rows[:, None] * stride_t + head * stride_h + offs_d[None, :],
                   mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def load_kv_tile(K, V, k_start, offs_n, k_valid, kv_head, offs_d, offs_dv, stride_kt,
                 stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr):
    """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] tiles of one K/V head at segment offsets
    ``offs_n``; keys that are not ``k_valid`` (padding, past the range) read as 0.

    With explicit positions the mask makes these loads wait for the positions load: for
    sm90 (bf16, d 128) the forward then keeps one K/V buffer fewer (82 instead of 115 KB of
    shared memory). A select on tiles loaded with the range mask alone keeps the buffers
    but adds a shared -> register -> shared round trip before each dot (+22% PTX). Neither
    is timed on a GPU yet; implicit positions compile as before (the mask is the range).
    """
    cols = (k_start + offs_n).to(tl.int64)
    k = load_rows(K, cols, k_valid, kv_head, stride_kt, stride_kh, offs_d, HEAD_DIM)
    v = load_rows(V, cols, k_valid, kv_head, stride_vt, stride_vh, offs_dv, HEAD_DIM_V)
    return k, v


@triton.jit
def query_rows(QPOS, q_start, len_q, len_k, pid_m, BLOCK_M: tl.constexpr,
               EXPLICIT_Q: tl.constexpr):
    """The query block ``pid_m`` of a segment: (offsets, int64 token rows, positions, valid).

    Shared prologue of the forward and dQ kernels; implicit positions are bottom-right
    aligned (offset + len_k - len_q).
    """
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos, q_valid = load_positions(QPOS, q_start, offs_m, len_q, len_k - len_q, EXPLICIT_Q)
    rows = (q_start + offs_m).to(tl.int64)
    return offs_m, rows, q_pos, q_valid


@triton.jit
def load_positions(POS, start, offs, bound, shift, EXPLICIT: tl.constexpr):
    """Positions of rows ``offs`` of a segment beginning at ``start``, and which are real.

    Rows at or past ``bound`` (the end of the visited range, <= the segment length) count
    as absent, so the mask agrees with the K/V (or Q) loads, which stop there too.

    Implicit positions are ``offs + shift`` (bottom-right alignment: shift = Lk - Lq for
    queries, 0 for keys) and never padding; explicit ones < 0 are padding.
    """
    in_seg = offs < bound
    if EXPLICIT:
        pos = tl.load(POS + start + offs, mask=in_seg, other=-1)
        valid = in_seg & (pos >= 0)
    else:
        pos = offs + shift
        valid = in_seg
    return pos, valid


@triton.jit
def key_block_range(KV_RANGE, table_off, q_pos, q_valid, Lk, window_left, window_right,
                    chunk_size, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                    HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
                    EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr):
    """Key offsets ``[start, end)`` a query block visits, and its key position span.

    The span ``[klo, khi]`` is lo(min p) .. hi(max p) over the block's real queries; both
    interval ends are monotone in p, so it covers every key any of them sees. With implicit
    key positions (position = offset) the span is the offset range itself; with explicit
    ones the caller scans the segment and skips tiles whose positions miss the span.
    """
    pmin, pmax = position_bounds(q_pos, q_valid)
    klo = key_lo(pmin, window_left, chunk_size, HAS_WL, HAS_CHUNK)
    khi = key_hi(pmax, window_right, chunk_size, CAUSAL, HAS_WR, HAS_CHUNK)
    if USE_SCHEDULE:
        start = tl.load(KV_RANGE + table_off)
        end = tl.minimum(tl.load(KV_RANGE + table_off + 1), Lk)
    elif EXPLICIT_K:
        start = klo * 0
        end = start + Lk
    else:
        start = tl.maximum(klo, 0)
        end = tl.minimum(khi + 1, Lk)
    # No real query (all padding) or an empty span: visit nothing.
    end = tl.where((pmin <= pmax) & (klo <= khi), tl.maximum(end, start), start)
    return start, end, klo, khi


@triton.jit
def query_block_range(Q_RANGE, table_off, k_pos, k_valid, Lq, q_shift, window_left,
                      window_right, chunk_size, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                      HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
                      EXPLICIT_Q: tl.constexpr, USE_SCHEDULE: tl.constexpr):
    """Query offsets ``[start, end)`` a key block is seen from, and their position span.

    The mirror of :func:`key_block_range`: implicit query positions are ``offset + q_shift``
    (bottom-right alignment), so the span converts back to offsets by subtracting the shift.
    """
    kmin, kmax = position_bounds(k_pos, k_valid)
    qlo = query_lo(kmin, window_right, chunk_size, CAUSAL, HAS_WR, HAS_CHUNK)
    qhi = query_hi(kmax, window_left, chunk_size, HAS_WL, HAS_CHUNK)
    if USE_SCHEDULE:
        start = tl.load(Q_RANGE + table_off)
        end = tl.minimum(tl.load(Q_RANGE + table_off + 1), Lq)
    elif EXPLICIT_Q:
        start = qlo * 0
        end = start + Lq
    else:
        start = tl.maximum(qlo - q_shift, 0)
        end = tl.minimum(qhi - q_shift + 1, Lq)
    end = tl.where((kmin <= kmax) & (qlo <= qhi), tl.maximum(end, start), start)
    return start, end, qlo, qhi


@triton.jit
def tile_may_see(pos, valid, lo, hi):
    """Whether a tile's real positions can meet the span ``[lo, hi]`` (scan mode's skip test).

    Only the int32 positions are read for this test, so a skipped tile costs one small load
    instead of two K/V tiles and two matmuls.
    """
    tmin, tmax = position_bounds(pos, valid)
    return (tmin <= hi) & (tmax >= lo) & (tmin <= tmax)
