"""Pieces shared by the Triton varlen attention kernels: mask math and launch choices.

The ``@triton.jit`` helpers evaluate the mask contract of the package (causal, sliding
window, Llama 4 chunks, padding positions < 0) on int32 positions, and bound which tiles a
block has to visit from the fact that both ends of a query's visible key interval never
decrease with its position (see ``kernels/mask_math.py`` for the host twin).

Limits: positions (explicit or implicit) must lie in (-2**30, 2**30); windows and chunk sizes
beyond that are clamped to 2**30, which changes nothing for such positions and keeps every
sum and difference inside int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Stand-in for "unbounded" in int32 interval math: beyond any position, with headroom for
# adding a window (also <= BIG) without int32 overflow.
BIG = 1 << 30
_BIG: tl.constexpr = tl.constexpr(BIG)  # the same bound, readable inside @triton.jit code


def clamp_mask_param(value: int) -> int:
    """Clamp a window / chunk length to ``BIG`` so in-kernel int32 math cannot overflow."""
    return min(int(value), BIG)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs need IEEE (TF32 loses ~3 digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded_head_dim(d: int) -> int:
    """Head dims are tiled at the next power of two (80 -> 128, 192 -> 256), min 16 for tl.dot."""
    return max(16, triton.next_power_of_2(int(d)))


def triton_block_sizes(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(block_m, block_n) the kernels prefer for these head dims (>= 32 each).

    64x64 keeps Q, the fp32 accumulator and one K/V tile in registers up to a padded head
    dim of 128; at 256 (e.g. MLA's 192) the key tile is halved so the fp32 accumulator of
    64 x 256 plus K and V tiles still fit with 8 warps.
    """
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    return (64, 64) if widest <= 128 else (64, 32)


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
def load_kv_tile(K, V, k_start, offs_n, n_valid, kv_head, offs_d, offs_dv, stride_kt,
                 stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr):
    """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] tiles of one K/V head at segment offsets
    ``offs_n``; rows at or past ``n_valid`` and the padded head dims read as 0."""
    cols = (k_start + offs_n).to(tl.int64)
    col_in = offs_n < n_valid
    k = tl.load(K + cols[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=col_in[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + cols[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    return k, v


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
