"""Pieces shared by the Triton varlen attention kernels: mask math, loads, launch choices.

The ``@triton.jit`` helpers evaluate the mask contract of the package (causal, sliding
window, Llama 4 chunks, padding positions < 0) on int32 positions, bound which tiles a
block has to visit from the fact that both ends of a query's visible key interval never
decrease with its position (see ``kernels/mask_math.py`` for the host twin), split those
tiles into *full* ones (every pair visible: no per-element mask) and boundary ones, and
decode the work list every kernel starts from. Host-side: tile sizes and launch options
per GPU architecture, the constexpr switches, and work lists built on the device.

Padding rows (explicit position < 0) are never read where they could meet a real row: the
kernels mask those loads by position (or, when the schedule guarantees that no padding lies
inside a visited range, by the range alone), so NaN or inf left in them (torch.empty
padding) cannot reach a real row through 0 x NaN in a product, and their own gradients and
outputs come out 0.

Limits: positions (explicit or implicit) must lie in [-2**31, 2**30) (the api rejects others
when they are on the host); windows and chunk sizes beyond 2**30 are clamped to it, which
changes nothing for such positions and keeps every sum and difference of real positions
inside int32.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def device_arch(device) -> int | None:
    """Compute capability as 80, 90, ... of a CUDA device (cached), None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def triton_block_sizes(head_dim: int, head_dim_v: int, dtype: torch.dtype | None = None,
                       arch: int | None = None) -> tuple[int, int]:
    """(block_m, block_n) of a schedule for these head dims, input dtype and GPU
    architecture (None: no GPU, the interpreter): the query block of the forward and dQ
    kernels and the key block of the dK/dV kernel. Each kernel walks the other side in
    steps of its own (:func:`kernel_tiles`).

    64 x 64 for 16-bit inputs at every head dim and architecture: 64 rows is what one
    Hopper warp group's wgmma takes (a 32-key block made MLA's dK/dV fall back to
    mma.sync), and larger query blocks waste more rows on short documents. fp32 inputs at
    a padded head dim of 256 take 32 x 32: with 64 x 32 the dQ and dK/dV kernels needed
    192 and 200 KB of shared memory (sm80), more than an A100's 163 KB. ``dtype=None``
    gives the 16-bit choice; ``arch`` is taken for tables that will differ per GPU.
    """
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if dtype == torch.float32 and widest > 128:
        return 32, 32
    return 64, 64


# Per architecture class and padded (d, dv) of 16-bit inputs, per kernel: (the step of the
# side the schedule leaves free: keys for fwd / dQ, queries for dK/dV; num_warps;
# num_stages). Chosen from bench/kernel_report.py (triton 3.8, causal): the fewest SASS
# instructions per 64x64 tile in the full-tile loop among configurations without spills,
# unless those cost over 1.25x the fewest (then the spills are listed); >= 3 stages, so the
# loops keep copies in flight. sm90 bf16 (wgmma everywhere):
# - d 64: 64-wide steps everywhere; fwd 285, dQ 242, dK/dV 332 instructions per tile.
# - d 128: fwd 64 keys, 4 warps (255 registers, 349; 128 x 64 with 8 warps: 341 but
#   double the query block). dQ 32 keys (182 registers, 392; 64 keys spilled 24-92 bytes).
#   dK/dV 32 queries, 4 warps (255 registers; 64 queries spilled 250-600 bytes, 8 warps
#   split the 64-key block across warp groups and spilled too).
# - MLA 192/128: fwd 64 keys (238 registers, 177 KB of shared memory). dQ 32 keys, 4 warps
#   (80-160 bytes of spills, 480; 8 warps: none, but 1264). dK/dV 8 warps (249 registers;
#   4 warps spilled 700 bytes).
# - 256/256: as MLA, fwd with 32 keys (the 64 x 256 accumulator; 32-64 bytes of spills).
# sm80 (mma.sync) differs where its registers run out sooner: dK/dV at d 64 steps 32
# queries (64 spilled 32 bytes); at d 128 the forward keeps 64 keys with 60 bytes of
# spills (32 keys: none, but 1004 instructions per tile instead of 694) and dK/dV 32
# queries with 8 (16: none, 1520 instead of 888); MLA's forward takes 32 keys (its
# 64 x 64 tiles need 177 KB, more than an A100's 163 KB).
_TILES = {
    90: {
        (64, 64): {"fwd": (64, 4, 3), "dq": (64, 4, 3), "dkdv": (64, 4, 3)},
        (128, 128): {"fwd": (64, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 4, 3)},
        (256, 128): {"fwd": (64, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 8, 3)},
        (256, 256): {"fwd": (32, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 8, 3)},
    },
    80: {
        (64, 64): {"fwd": (64, 4, 3), "dq": (64, 4, 3), "dkdv": (32, 4, 3)},
        (128, 128): {"fwd": (64, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 4, 3)},
        (256, 128): {"fwd": (32, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 8, 3)},
        (256, 256): {"fwd": (32, 4, 3), "dq": (32, 4, 3), "dkdv": (32, 8, 3)},
    },
}


def kernel_tiles(kernel: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                 block_m: int, block_n: int, arch: int | None) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_N, launch options) of one kernel ("fwd", "dq" or "dkdv").

    The schedule fixes one side (the query block of fwd / dQ, the key block of dK/dV); the
    other is the kernel's step from the table above. Without a GPU (the interpreter) and
    for fp32 inputs both sides are the schedule's: the interpreter's cost is per step, and
    the IEEE fp32 dot runs without tensor cores, where one stage keeps d <= 128 within an
    A100's shared memory (3 stages needed 180-205 KB).
    """
    widest = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if dtype == torch.float32 or arch is None:
        warps = 4 if widest <= 64 or (kernel != "dkdv" and widest <= 128) else 8
        return block_m, block_n, {"num_warps": warps,
                                  "num_stages": 1 if dtype == torch.float32 else 3}
    table = _TILES[90 if arch >= 90 else 80]
    dims = (max(padded_head_dim(head_dim), 64), max(padded_head_dim(head_dim_v), 64))
    row = table.get(dims) or table[(widest, widest)]
    step, warps, stages = row[kernel]
    if kernel == "dkdv":
        return step, block_n, {"num_warps": warps, "num_stages": stages}
    return block_m, step, {"num_warps": warps, "num_stages": stages}


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim as contiguous; other strides are passed in."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_block(name: str, value: int) -> None:
    """Tile sizes must be powers of two >= 16 (tl.arange and tl.dot minimums)."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def resolve_blocks(schedule, block_sizes, dtype: torch.dtype, head_dim: int,
                   head_dim_v: int, arch: int | None = None) -> tuple[int, int]:
    """Tile sizes: the schedule's (its tables are per block), else the override, else default."""
    if schedule is not None:
        bm, bn = schedule.block_m, schedule.block_n
    elif block_sizes is not None:
        bm, bn = block_sizes
    else:
        bm, bn = triton_block_sizes(head_dim, head_dim_v, dtype, arch)
    check_block("block_m", bm)
    check_block("block_n", bn)
    return int(bm), int(bn)


def device_work_list(cu: torch.Tensor, block: int, n_blocks: int, total: int) -> torch.Tensor:
    """int32 work list ``segment * n_blocks + block`` of every block holding rows, built
    with device ops of known sizes (no sync), padded with -1 to a host-known length.

    For calls without a host schedule (cu_seqlens on the device). The length is
    ``min(n_seg * n_blocks, (total + n_seg * (block - 1)) // block)``: at most one program
    more per segment than there are blocks, since each segment's last block may be partial.
    """
    n_seg = cu.numel() - 1
    bound = max(min(n_seg * n_blocks, (total + n_seg * (block - 1)) // block), 1)
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    counts = torch.div(lens + block - 1, block, rounding_mode="floor")
    ends = torch.cumsum(counts, 0)
    idx = torch.arange(bound, device=cu.device, dtype=torch.int64)
    seg = torch.searchsorted(ends, idx, right=True)
    live = seg < n_seg
    seg = seg.clamp(max=max(n_seg - 1, 0))
    blk = idx - (ends - counts)[seg]
    return torch.where(live, seg * n_blocks + blk, -1).to(torch.int32)


def kernel_constants(dtype: torch.dtype, head_dim: int, head_dim_v: int, block_m: int,
                     block_n: int, causal: bool, window_left: int, window_right: int,
                     chunk_size: int, explicit_q: bool, explicit_k: bool,
                     use_schedule: bool, has_full: bool = False, padded: bool = True) -> dict:
    """Keyword arguments shared by the three kernels: mask values and constexpr switches.

    Constexpr flags drop unused mask terms and tile modes at compile time. The scan flags
    mark explicit positions without a schedule: only then is a per-tile skip test needed.
    The padding flags say that a padding token may lie inside a visited range, so that
    side's loads in the masked loop must follow the positions, not just the range.
    """
    return dict(
        window_left=clamp_mask_param(max(window_left, 0)),
        window_right=clamp_mask_param(max(window_right, 0)),
        chunk_size=clamp_mask_param(chunk_size) if chunk_size > 0 else 1,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=padded_head_dim(head_dim), BLOCK_DV=padded_head_dim(head_dim_v),
        CAUSAL=bool(causal), HAS_WL=window_left >= 0, HAS_WR=window_right >= 0,
        HAS_CHUNK=chunk_size > 0, EXPLICIT_Q=explicit_q, EXPLICIT_K=explicit_k,
        USE_SCHEDULE=use_schedule, HAS_FULL=bool(use_schedule and has_full),
        SCAN_Q=explicit_q and not use_schedule, SCAN_K=explicit_k and not use_schedule,
        Q_PAD=explicit_q and (padded or not use_schedule),
        K_PAD=explicit_k and (padded or not use_schedule), DOT_PREC=dot_precision(dtype),
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
def work_item(TILES, n_heads, n_blocks):
    """(tile, segment, block, head) of this program: programs walk the work list with the
    heads innermost, so the longest tiles of every head start first. tile < 0: no work."""
    pid = tl.program_id(0)
    item = pid // n_heads
    head = pid - item * n_heads
    tile = tl.load(TILES + item)
    seg = tl.maximum(tile, 0) // n_blocks
    return tile, seg, tile - seg * n_blocks, head


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
def load_full_tile(PTR, offsets, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tile every row of which exists (inside a full range): no row mask, so the load
    depends on nothing but the address and stays in flight across loop iterations. Only a
    padded head dim (80 -> 128) masks its columns (a constant mask)."""
    if HEAD_DIM == BLOCK_D:
        return tl.load(PTR + offsets)
    return tl.load(PTR + offsets, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


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
def tile_split(start, end, full_start, full_end, BLOCK: tl.constexpr):
    """Of the tiles ``start + i * BLOCK`` covering ``[start, end)``: the index range
    ``[i_lo, i_hi)`` of those inside ``[full_start, full_end)`` (run without masks)."""
    n = tl.cdiv(end - start, BLOCK)
    i_lo = tl.minimum(tl.cdiv(tl.maximum(full_start - start, 0), BLOCK), n)
    i_hi = tl.maximum(tl.minimum(tl.maximum(full_end - start, 0) // BLOCK, n), i_lo)
    return i_lo, i_hi


@triton.jit
def boundary_tiles(start, end, i_lo, i_hi, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """The boundary tiles around the full ones: ``[start, start + i_lo * BLOCK)`` and
    ``[start + i_hi * BLOCK, end)``, walked in steps of ``STEP`` (which divides BLOCK: the
    dK/dV kernel halves it there to fit its registers). -> (n_head, n_total, tail start)."""
    n_head = tl.cdiv(tl.minimum(start + i_lo * BLOCK, end) - start, STEP)
    tail = start + i_hi * BLOCK
    return n_head, n_head + tl.cdiv(tl.maximum(end - tail, 0), STEP), tail


@triton.jit
def boundary_offset(j, start, n_head, tail, STEP: tl.constexpr):
    """Offset of the j-th boundary tile (see :func:`boundary_tiles`)."""
    return tl.where(j < n_head, start + j * STEP, tail + (j - n_head) * STEP)


@triton.jit
def block_position_bounds(pos, valid, blk, length, shift, BLOCK: tl.constexpr,
                          EXPLICIT: tl.constexpr):
    """(min, max) position of a block's real rows. Implicit positions (offset + shift) give
    them from scalars: a reduction would leave them in vector registers, which cost the
    loops ~80 register-to-uniform moves per tile and spills (dK/dV, d 128, sm90)."""
    if EXPLICIT:
        return position_bounds(pos, valid)
    first = blk * BLOCK
    return first + shift, tl.minimum(first + BLOCK, length) - 1 + shift


@triton.jit
def key_ranges(KV_RANGE, KV_FULL, tile, q_pos, q_valid, blk, len_q, len_k, window_left,
               window_right, chunk_size, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
               EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr,
               USE_SCHEDULE: tl.constexpr, HAS_FULL: tl.constexpr):
    """Key offsets a query block visits ``[start, end)``, the full sub-range
    ``[full_start, full_end)`` every real row of the block sees, and the key position
    span ``[klo, khi]`` (scan mode's per-tile skip test).

    Without a schedule both come from the rows' position bounds: the span is
    lo(min p) .. hi(max p) (both interval ends are monotone in p), and the full range is
    lo(max p) .. hi(min p). With implicit key positions (position = offset) they are offset
    ranges; with explicit ones (scan mode) the whole segment is visited, all masked.
    """
    if USE_SCHEDULE:
        start = tl.load(KV_RANGE + tile * 2)
        end = tl.maximum(tl.minimum(tl.load(KV_RANGE + tile * 2 + 1), len_k), start)
        if HAS_FULL:
            full_start = tl.load(KV_FULL + tile * 2)
            full_end = tl.load(KV_FULL + tile * 2 + 1)
        else:
            full_start = start
            full_end = start
        klo = start
        khi = end
    else:
        pmin, pmax = block_position_bounds(q_pos, q_valid, blk, len_q, len_k - len_q,
                                           BLOCK_M, EXPLICIT_Q)
        klo = key_lo(pmin, window_left, chunk_size, HAS_WL, HAS_CHUNK)
        khi = key_hi(pmax, window_right, chunk_size, CAUSAL, HAS_WR, HAS_CHUNK)
        live = (pmin <= pmax) & (klo <= khi)  # no real row, or an empty span: nothing
        if EXPLICIT_K:
            start = klo * 0
            end = tl.where(live, len_k, 0)
            full_start = start
            full_end = start
        else:
            start = tl.maximum(klo, 0)
            end = tl.where(live, tl.maximum(tl.minimum(khi + 1, len_k), start), start)
            full_start = tl.maximum(key_lo(pmax, window_left, chunk_size, HAS_WL, HAS_CHUNK),
                                    start)
            full_end = tl.minimum(key_hi(pmin, window_right, chunk_size, CAUSAL, HAS_WR,
                                         HAS_CHUNK) + 1, end)
    return start, end, full_start, full_end, klo, khi


@triton.jit
def query_ranges(Q_RANGE, Q_FULL, tile, k_pos, k_valid, blk, len_q, len_k, window_left,
                 window_right, chunk_size, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
                 EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr,
                 USE_SCHEDULE: tl.constexpr, HAS_FULL: tl.constexpr):
    """The mirror of :func:`key_ranges` for a key block: query offsets it is seen from, the
    full sub-range of queries that see all its real keys, and the query position span.
    Implicit query positions are ``offset + len_k - len_q`` (bottom-right alignment)."""
    if USE_SCHEDULE:
        start = tl.load(Q_RANGE + tile * 2)
        end = tl.maximum(tl.minimum(tl.load(Q_RANGE + tile * 2 + 1), len_q), start)
        if HAS_FULL:
            full_start = tl.load(Q_FULL + tile * 2)
            full_end = tl.load(Q_FULL + tile * 2 + 1)
        else:
            full_start = start
            full_end = start
        qlo = start
        qhi = end
    else:
        kmin, kmax = block_position_bounds(k_pos, k_valid, blk, len_k, 0, BLOCK_N,
                                           EXPLICIT_K)
        qlo = query_lo(kmin, window_right, chunk_size, CAUSAL, HAS_WR, HAS_CHUNK)
        qhi = query_hi(kmax, window_left, chunk_size, HAS_WL, HAS_CHUNK)
        live = (kmin <= kmax) & (qlo <= qhi)
        q_shift = len_k - len_q
        if EXPLICIT_Q:
            start = qlo * 0
            end = tl.where(live, len_q, 0)
            full_start = start
            full_end = start
        else:
            start = tl.maximum(qlo - q_shift, 0)
            end = tl.where(live, tl.maximum(tl.minimum(qhi - q_shift + 1, len_q), start),
                           start)
            full_start = tl.maximum(query_lo(kmax, window_right, chunk_size, CAUSAL, HAS_WR,
                                             HAS_CHUNK) - q_shift, start)
            full_end = tl.minimum(query_hi(kmin, window_left, chunk_size, HAS_WL, HAS_CHUNK)
                                  - q_shift + 1, end)
    return start, end, full_start, full_end, qlo, qhi


@triton.jit
def tile_may_see(pos, valid, lo, hi):
    """Whether a tile's real positions can meet the span ``[lo, hi]`` (scan mode's skip test).

    Only the int32 positions are read for this test, so a skipped tile costs one small load
    instead of two K/V tiles and two matmuls.
    """
    tmin, tmax = position_bounds(pos, valid)
    return (tmin <= hi) & (tmax >= lo) & (tmin <= tmax)
