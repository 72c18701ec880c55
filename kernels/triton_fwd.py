"""Triton forward of varlen (THD + cu_seqlens) attention with position-based masks.

One program per (query block, segment, query head): online softmax in base 2 with fp32
accumulators over the key tiles its queries can see, then ``out`` in q's dtype and the
natural-log LSE. Which key tiles are visited (cost follows the visible area, not the
document length): the schedule's ``kv_range`` when given; else, with implicit key positions,
the range derived from the block's query positions; else (explicit key positions) every
tile of the segment, skipping K/V loads and math when the tile's positions miss the span.

Padding rows (explicit position < 0) are never loaded (Q, K, V read as 0), so NaN / inf in
them stays out of every product. The launch grid covers ``max_seqlen_q`` (the api passes
the real longest segment when it can read it on the host).

Limits: head dims are padded to a power of two (>= 16) in registers; positions must lie in
[-2**31, 2**30); GQA needs Hq % Hkv == 0. Inputs are assumed validated by the caller (the
api layer), contiguous in the last dim, on one device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    LOG2E, check_schedule, key_block_range, kernel_constants, launch_options, load_kv_tile,
    load_positions, load_rows, query_rows, resolve_blocks, segment_bounds, tile_may_see,
    unit_last_stride, visible,
)


@triton.jit
def _fwd_tile(
    q, q_pos, q_valid, m_i, l_i, acc, K, V, k_start, kv_head, offs_n, k_pos, k_valid,
    offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window_left,
    window_right, chunk_size, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (m, l, acc)."""
    k, v = load_kv_tile(K, V, k_start, offs_n, k_valid, kv_head, offs_d, offs_dv, stride_kt,
                        stride_kh, stride_vt, stride_vh, HEAD_DIM, HEAD_DIM_V)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    vis = visible(q_pos[:, None], k_pos[None, :], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    s = tl.where(vis & q_valid[:, None] & k_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids
    # -inf - -inf = NaN while exp2(-inf) still gives 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, RMAX, CU_Q, CU_K, QPOS, KPOS, KV_RANGE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q, n_qblocks, group, qk_scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    STORE_MAX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    head = tl.program_id(2)
    q_start, len_q, k_start, len_k = segment_bounds(CU_Q, CU_K, seg)
    if pid_m * BLOCK_M >= len_q:  # the grid covers max_seqlen_q; shorter segments end here
        return
    kv_head = head // group

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m, rows, q_pos, q_valid = query_rows(QPOS, q_start, len_q, len_k, pid_m, BLOCK_M,
                                              EXPLICIT_Q)
    row_in = offs_m < len_q
    q = load_rows(Q, rows, q_valid, head, stride_qt, stride_qh, offs_d, HEAD_DIM)

    start, end, klo, khi = key_block_range(
        KV_RANGE, (seg * n_qblocks + pid_m) * 2, q_pos, q_valid, len_k, window_left,
        window_right, chunk_size, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_K, USE_SCHEDULE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
        # Only the scan mode needs a per-tile test; the other modes' ranges are exact, and a
        # branch in the loop body would keep the compiler from pipelining the K/V loads.
        if SCAN_K:
            if tile_may_see(k_pos, k_valid, klo, khi):
                m_i, l_i, acc = _fwd_tile(
                    q, q_pos, q_valid, m_i, l_i, acc, K, V, k_start, kv_head, offs_n, k_pos,
                    k_valid, offs_d, offs_dv, stride_kt, stride_kh, stride_vt,
                    stride_vh, qk_scale, window_left, window_right, chunk_size, HEAD_DIM,
                    HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, DOT_PREC)
        else:
            m_i, l_i, acc = _fwd_tile(
                q, q_pos, q_valid, m_i, l_i, acc, K, V, k_start, kv_head, offs_n, k_pos,
                k_valid, offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh,
                qk_scale, window_left, window_right, chunk_size, HEAD_DIM, HEAD_DIM_V,
                CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, DOT_PREC)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty),
             mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + head.to(tl.int64) * total_q + rows, lse, mask=row_in)
    if STORE_MAX:
        # m_i is the running max of scores * scale * log2(e): back to natural units.
        tl.store(RMAX + head.to(tl.int64) * total_q + rows, m_i * 0.6931471805599453,
                 mask=row_in)


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
    block_m, block_n = resolve_blocks(schedule, block_sizes, q.dtype, head_dim, head_dim_v)
    check_schedule(schedule, n_seg, max_seqlen_q, max_seqlen_k)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    out = torch.zeros(total_q, n_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((n_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    # Rows the grid skips (beyond every segment) keep -inf, like their lse.
    row_max = torch.full_like(lse, float("-inf")) if return_max else None
    result = (out, lse) if row_max is None else (out, lse, row_max)
    if total_q == 0 or n_seg == 0 or max_seqlen_q <= 0:
        return result
    n_qblocks = triton.cdiv(max_seqlen_q, block_m)
    dummy = cu_seqlens_q  # stands in for absent optional tensors; never dereferenced
    _fwd_kernel[(n_qblocks, n_seg, n_heads)](
        q, k, v, out, lse, lse if row_max is None else row_max, cu_seqlens_q, cu_seqlens_k,
        dummy if q_positions is None else q_positions,
        dummy if k_positions is None else k_positions,
        dummy if schedule is None else schedule.kv_range,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        total_q, n_qblocks if schedule is None else schedule.kv_range.shape[1],
        n_heads // k.shape[1], softmax_scale * LOG2E,
        **kernel_constants(q.dtype, head_dim, head_dim_v, block_m, block_n, causal,
                           window_left, window_right, chunk_size, q_positions is not None,
                           k_positions is not None, schedule is not None),
        STORE_MAX=row_max is not None,
        **launch_options(q.dtype, head_dim, head_dim_v, "fwd"),
    )
    return result
