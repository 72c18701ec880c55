"""Triton forward of varlen (THD + cu_seqlens) attention with position-based masks.

One program per (work-list tile, query head): a tile is one (segment, query block) with
something to visit, listed longest first by the host schedule (or, without one, every
block that holds rows, listed on the device). Online softmax in base 2 with fp32
accumulators over the key tiles its queries can see, then ``out`` in q's dtype and the
natural-log LSE. Key tiles come in two kinds: *full* tiles, which every real query of the
block sees entirely (the bulk of a long document), run without any per-element mask and
with loads that depend only on their address, so the compiler keeps several in flight;
*boundary* tiles (the diagonal, a window's edges, chunk starts) evaluate the mask on the
positions. Which tiles: the schedule's ``kv_range`` / ``kv_full`` when given; else, with
implicit key positions, ranges derived from the block's query positions; else (explicit
key positions on the device: scan mode) every tile of the segment, masked, skipping K/V
loads and math when the tile's positions miss the block's span.

Padding rows (explicit position < 0) never meet a real row: padding queries read Q as 0
and store nothing (their out stays 0, their LSE -inf); padding keys are masked out of the
scores and, where one may lie in a visited range, out of the K/V loads.

Limits: head dims are padded to a power of two (>= 16) in registers; positions must lie in
[-2**31, 2**30); GQA needs Hq % Hkv == 0. Inputs are assumed validated by the caller (the
api layer), contiguous in the last dim, on one device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    LOG2E, boundary_offset, boundary_tiles, device_arch, device_work_list,
    kernel_constants, kernel_tiles, key_ranges, load_full_tile, load_positions, load_rows,
    resolve_blocks, segment_bounds, tile_may_see, tile_split, unit_last_stride, visible,
    work_item,
)
from .validation import check_schedule


@triton.jit
def _fwd_full_tiles(q, m_i, l_i, acc, K_seg, V_seg, k_offs, v_offs, start, i_lo, i_hi,
                    offs_d, offs_dv, stride_kt, stride_vt, qk_scale,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key tiles every query of the block sees: no mask, the scale folded into one FMA."""
    K_tile = K_seg + (start + i_lo * BLOCK_N).to(tl.int64) * stride_kt
    V_tile = V_seg + (start + i_lo * BLOCK_N).to(tl.int64) * stride_vt
    for _ in range(i_lo, i_hi):
        k = load_full_tile(K_tile, k_offs, offs_d, HEAD_DIM, BLOCK_D)
        v = load_full_tile(V_tile, v_offs, offs_dv, HEAD_DIM_V, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
        K_tile += BLOCK_N * stride_kt
        V_tile += BLOCK_N * stride_vt
    return m_i, l_i, acc


@triton.jit
def _fwd_boundary_tile(q, q_pos, m_i, l_i, acc, K, V, KPOS, k_start, kv_head, offs_n, end,
                       offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                       window_left, window_right, chunk_size, HEAD_DIM: tl.constexpr,
                       HEAD_DIM_V: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                       HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
                       EXPLICIT_K: tl.constexpr, K_PAD: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    """One key tile with the mask evaluated per element: returns the updated (m, l, acc)."""
    k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
    # Padding keys hold anything (NaN): with K_PAD they may lie in range and are not read.
    # Otherwise the range alone bounds the load, which then waits for no other load.
    k_read = k_valid if K_PAD else offs_n < end
    cols = (k_start + offs_n).to(tl.int64)
    k = load_rows(K, cols, k_read, kv_head, stride_kt, stride_kh, offs_d, HEAD_DIM)
    v = load_rows(V, cols, k_read, kv_head, stride_vt, stride_vh, offs_dv, HEAD_DIM_V)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    vis = visible(q_pos[:, None], k_pos[None, :], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK) & k_valid[None, :]
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids
    # -inf - -inf = NaN while exp2(-inf) still gives 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, RMAX, CU_Q, CU_K, QPOS, KPOS, KV_RANGE, KV_FULL, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q, n_heads, n_qblocks, group, qk_scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    HAS_FULL: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, Q_PAD: tl.constexpr,
    K_PAD: tl.constexpr, DOT_PREC: tl.constexpr, STORE_MAX: tl.constexpr,
):
    tile, seg, blk, head = work_item(TILES, n_heads, n_qblocks)
    if tile < 0:  # past the end of a device-built work list
        return
    q_start, len_q, k_start, len_k = segment_bounds(CU_Q, CU_K, seg)
    kv_head = head // group

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos, q_valid = load_positions(QPOS, q_start, offs_m, len_q, len_k - len_q, EXPLICIT_Q)
    rows = (q_start + offs_m).to(tl.int64)
    q = load_rows(Q, rows, q_valid, head, stride_qt, stride_qh, offs_d, HEAD_DIM)

    start, end, full_start, full_end, klo, khi = key_ranges(
        KV_RANGE, KV_FULL, tile, q_pos, q_valid, blk, len_q, len_k, window_left,
        window_right, chunk_size, BLOCK_M, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q,
        EXPLICIT_K, USE_SCHEDULE, HAS_FULL)
    i_lo, i_hi = tile_split(start, end, full_start, full_end, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    K_seg = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_seg = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    k_offs = offs_n0[:, None] * stride_kt + offs_d[None, :]
    v_offs = offs_n0[:, None] * stride_vt + offs_dv[None, :]
    if not SCAN_K and (HAS_FULL or not USE_SCHEDULE):  # modes that know full tiles
        m_i, l_i, acc = _fwd_full_tiles(q, m_i, l_i, acc, K_seg, V_seg, k_offs, v_offs,
                                        start, i_lo, i_hi, offs_d, offs_dv, stride_kt,
                                        stride_vt, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                                        BLOCK_D, BLOCK_DV, DOT_PREC)
    n_head, n_boundary, tail = boundary_tiles(start, end, i_lo, i_hi, BLOCK_N, BLOCK_N)
    for j in range(0, n_boundary):
        offs_n = boundary_offset(j, start, n_head, tail, BLOCK_N) + offs_n0
        # Only the scan mode needs a per-tile test; the other modes' ranges are exact, and a
        # branch in the loop body would keep the compiler from pipelining the K/V loads.
        if SCAN_K:
            k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
            if tile_may_see(k_pos, k_valid, klo, khi):
                m_i, l_i, acc = _fwd_boundary_tile(
                    q, q_pos, m_i, l_i, acc, K, V, KPOS, k_start, kv_head, offs_n, end,
                    offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                    window_left, window_right, chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL,
                    HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_K, K_PAD, DOT_PREC)
        else:
            m_i, l_i, acc = _fwd_boundary_tile(
                q, q_pos, m_i, l_i, acc, K, V, KPOS, k_start, kv_head, offs_n, end, offs_d,
                offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window_left,
                window_right, chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR,
                HAS_CHUNK, EXPLICIT_K, K_PAD, DOT_PREC)

    # Padding queries ran on Q = 0: their rows are not stored (out stays 0, lse -inf).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty),
             mask=q_valid[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + head.to(tl.int64) * total_q + rows, lse, mask=q_valid)
    if STORE_MAX:
        # m_i is the running max of scores * scale * log2(e): back to natural units.
        tl.store(RMAX + head.to(tl.int64) * total_q + rows, m_i * 0.6931471805599453,
                 mask=q_valid)


def fwd_specialization(dtype: torch.dtype, head_dim: int, head_dim_v: int, block_m: int,
                       block_n: int, causal: bool, window_left: int, window_right: int,
                       chunk_size: int, explicit_q: bool, explicit_k: bool, schedule,
                       store_max: bool, arch: int | None) -> tuple[dict, dict]:
    """(constexpr keyword arguments, launch options) of one forward launch; the static
    report (bench/kernel_report.py) compiles exactly these. ``block_m``: the schedule's
    query block; ``schedule``: the call's BlockSchedule, or None (its full ranges and
    padding flag pick the variant)."""
    bm, bn, options = kernel_tiles("fwd", dtype, head_dim, head_dim_v, block_m, block_n, arch)
    consts = kernel_constants(
        dtype, head_dim, head_dim_v, bm, bn, causal, window_left, window_right,
        chunk_size, explicit_q, explicit_k, schedule is not None,
        has_full=schedule is not None and schedule.kv_full is not None,
        padded=schedule is None or schedule.padded)
    consts["STORE_MAX"] = bool(store_max)
    return consts, options


def triton_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float, causal: bool, window_left: int, window_right: int,
               chunk_size: int, q_positions, k_positions, schedule=None, *,
               block_sizes: tuple[int, int] | None = None, return_max: bool = False
               ) -> tuple[torch.Tensor, ...]:
    """-> (out [Tq, Hq, Dv] in q.dtype, lse fp32 [Hq, Tq]), plus with ``return_max`` the
    row max of the scaled visible scores, fp32 [Hq, Tq] (-inf on rows that see nothing).

    ``block_sizes`` (block_m, block_n) overrides the default tiles when no schedule is given
    (tests use 32 to keep the interpreter fast).
    """
    total_q, n_heads, head_dim = q.shape
    head_dim_v = v.shape[-1]
    n_seg = cu_seqlens_q.shape[0] - 1
    arch = device_arch(q.device)
    block_m, block_n = resolve_blocks(schedule, block_sizes, q.dtype, head_dim, head_dim_v,
                                      arch)
    # a launcher called directly (not through kernels.api) still refuses a schedule made
    # for other segments (shape metadata only; the one check, validation's)
    check_schedule(schedule, n_seg, max_seqlen_q, max_seqlen_k)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    out = torch.zeros(total_q, n_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((n_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    # Rows no program writes (no visible key, padding) keep 0 / -inf, like their lse.
    row_max = torch.full_like(lse, float("-inf")) if return_max else None
    result = (out, lse) if row_max is None else (out, lse, row_max)
    if total_q == 0 or n_seg == 0 or max_seqlen_q <= 0:
        return result
    n_qblocks = triton.cdiv(max_seqlen_q, block_m)
    tiles = (device_work_list(cu_seqlens_q, block_m, n_qblocks, total_q) if schedule is None
             else schedule.q_tiles)
    if tiles.numel() == 0:
        return result
    consts, options = fwd_specialization(
        q.dtype, head_dim, head_dim_v, block_m, block_n, causal, window_left, window_right,
        chunk_size, q_positions is not None, k_positions is not None, schedule,
        row_max is not None, arch)
    dummy = cu_seqlens_q  # stands in for absent optional tensors; never dereferenced
    _fwd_kernel[(tiles.numel() * n_heads,)](
        q, k, v, out, lse, lse if row_max is None else row_max, cu_seqlens_q, cu_seqlens_k,
        dummy if q_positions is None else q_positions,
        dummy if k_positions is None else k_positions,
        dummy if schedule is None else schedule.kv_range,
        dummy if schedule is None or schedule.kv_full is None else schedule.kv_full, tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        total_q, n_heads, n_qblocks, n_heads // k.shape[1], softmax_scale * LOG2E,
        **consts, **options,
    )
    return result
