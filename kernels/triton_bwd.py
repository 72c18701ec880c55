"""Triton backward of varlen attention (FA2 formulas), as two kernels without atomics.

With delta = rowsum(dO * O), P = exp(S * scale - lse): dV = P^T dO, dS = P * (dO V^T - delta),
dQ = scale * dS K, dK = scale * dS^T Q. ``out`` and ``lse`` are taken as given: in context
parallelism they are the merged results of all steps, which makes these the partial
gradients of this call's keys (never recompute them here).

- dK/dV kernel: one program per (key block, segment, kv head) loops over the query blocks
  that can see it and over the GQA group's query heads, so the group sum stays in registers.
- dQ kernel: one program per (query block, segment, query head) loops over its key tiles,
  chosen exactly as in the forward.
No atomics: results are deterministic, and the interpreter cannot do bf16 atomics.

Padding rows (explicit position < 0) are never loaded: their Q, dO, K, V read as 0 and
their delta as 0, so NaN / inf in them reaches no real row's gradient, and their own
gradients are 0.

Limits: as the forward (positions in [-2**31, 2**30), head dims padded to a power of two).
fp32 inputs at padded head dim 256 need 192-200 KB of shared memory with 64x32 tiles
(ptxas, sm80, one stage), more than an A100 has (163 KB): the default tiles for fp32 there
are 32x32 (128-132 KB, see ``triton_common.triton_block_sizes``); 16-bit inputs fit 64x32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sink import lse_grad_rows
from .triton_common import (
    LOG2E, check_schedule, key_block_range, kernel_constants, launch_options, load_kv_tile,
    load_positions, load_rows, query_block_range, query_rows, resolve_blocks, segment_bounds,
    tile_may_see, unit_last_stride, visible,
)


@triton.jit
def _load_row_stats(LSE, DELTA, head, rows, row_ok, total_q):
    """lse (as base-2, -inf rows replaced by 0), whether the row is live, and delta.

    Live: ``row_ok`` (a real query row) with a finite lse. Other rows have P = 0 and get
    delta 0, so a non-finite delta there (rowsum(dO * O) of NaN padding) cannot make
    0 * (dP - delta) NaN.
    """
    off = head.to(tl.int64) * total_q + rows
    lse = tl.load(LSE + off, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + off, mask=row_ok, other=0.0)
    live = lse != float("-inf")
    # A select on the loaded vector: masking the load by ``live`` would chain it to the lse
    # load (+11% PTX in the dK/dV kernel, sm90).
    return tl.where(live, lse * 1.4426950408889634, 0.0), live, tl.where(live, delta, 0.0)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, k_pos, k_valid, Q, DO, LSE, DELTA, q_start, offs_m, q_pos, q_valid,
    kv_head, group, offs_d, offs_dv, stride_qt, stride_qh, stride_dot, stride_doh, total_q,
    qk_scale, window_left, window_right, chunk_size, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One query tile against the key block, for every query head of the GQA group."""
    # Transposed orientation [keys, queries]: dK and dV come out without transposes.
    vis = visible(q_pos[None, :], k_pos[:, None], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    vis = vis & q_valid[None, :] & k_valid[:, None]
    rows = (q_start + offs_m).to(tl.int64)
    # The mask is shared by the group's heads; only Q, dO and the row stats change.
    for g in range(group):
        head = kv_head * group + g
        q = load_rows(Q, rows, q_valid, head, stride_qt, stride_qh, offs_d, HEAD_DIM)
        do = load_rows(DO, rows, q_valid, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
        lse2, live, delta = _load_row_stats(LSE, DELTA, head, rows, q_valid, total_q)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        p_t = tl.where(vis & live[None, :], tl.exp2(s_t - lse2[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, QPOS, KPOS, Q_RANGE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_q, n_kblocks, group, scale, qk_scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    seg = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start, len_q, k_start, len_k = segment_bounds(CU_Q, CU_K, seg)
    if pid_n * BLOCK_N >= len_k:
        return
    q_shift = len_k - len_q  # implicit query position = offset + q_shift

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_pos, k_valid = load_positions(KPOS, k_start, offs_n, len_k, 0, EXPLICIT_K)
    cols = (k_start + offs_n).to(tl.int64)
    col_in = offs_n < len_k
    k, v = load_kv_tile(K, V, k_start, offs_n, k_valid, kv_head, offs_d, offs_dv, stride_kt,
                        stride_kh, stride_vt, stride_vh, HEAD_DIM, HEAD_DIM_V)

    start, end, qlo, qhi = query_block_range(
        Q_RANGE, (seg * n_kblocks + pid_n) * 2, k_pos, k_valid, len_q, q_shift, window_left,
        window_right, chunk_size, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q, USE_SCHEDULE)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        q_pos, q_valid = load_positions(QPOS, q_start, offs_m, end, q_shift, EXPLICIT_Q)
        if SCAN_Q:  # see the forward: only the scan mode pays for a branch in the loop
            if tile_may_see(q_pos, q_valid, qlo, qhi):
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, k_pos, k_valid, Q, DO, LSE, DELTA, q_start, offs_m, q_pos,
                    q_valid, kv_head, group, offs_d, offs_dv, stride_qt, stride_qh,
                    stride_dot, stride_doh, total_q, qk_scale, window_left, window_right,
                    chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK,
                    DOT_PREC)
        else:
            dk, dv = _dkdv_tile(
                dk, dv, k, v, k_pos, k_valid, Q, DO, LSE, DELTA, q_start, offs_m, q_pos,
                q_valid, kv_head, group, offs_d, offs_dv, stride_qt, stride_qh,
                stride_dot, stride_doh, total_q, qk_scale, window_left, window_right,
                chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, DOT_PREC)

    # Padding keys store their zero gradients too (dk, dv stay 0 where K, V were not read).
    tl.store(DK + cols[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty),
             mask=col_in[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + cols[:, None] * stride_dvt + kv_head * stride_dvh + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=col_in[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, row_ok, q_pos, K, V, k_start, kv_head, offs_n, k_pos, k_valid,
    offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window_left,
    window_right, chunk_size, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One key tile's contribution to dQ (before the final softmax-scale factor)."""
    k, v = load_kv_tile(K, V, k_start, offs_n, k_valid, kv_head, offs_d, offs_dv, stride_kt,
                        stride_kh, stride_vt, stride_vh, HEAD_DIM, HEAD_DIM_V)
    vis = visible(q_pos[:, None], k_pos[None, :], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    vis = vis & row_ok[:, None] & k_valid[None, :]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, QPOS, KPOS, KV_RANGE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    total_q, n_qblocks, group, scale, qk_scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    head = tl.program_id(2)
    q_start, len_q, k_start, len_k = segment_bounds(CU_Q, CU_K, seg)
    if pid_m * BLOCK_M >= len_q:
        return
    kv_head = head // group

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m, rows, q_pos, q_valid = query_rows(QPOS, q_start, len_q, len_k, pid_m, BLOCK_M,
                                              EXPLICIT_Q)
    q = load_rows(Q, rows, q_valid, head, stride_qt, stride_qh, offs_d, HEAD_DIM)
    do = load_rows(DO, rows, q_valid, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
    # Rows with lse = -inf saw nothing (P = 0 there), padding rows included.
    lse2, row_ok, delta = _load_row_stats(LSE, DELTA, head, rows, q_valid, total_q)

    start, end, klo, khi = key_block_range(
        KV_RANGE, (seg * n_qblocks + pid_m) * 2, q_pos, q_valid, len_k, window_left,
        window_right, chunk_size, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_K, USE_SCHEDULE)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
        if SCAN_K:
            if tile_may_see(k_pos, k_valid, klo, khi):
                dq = _dq_tile(
                    dq, q, do, lse2, delta, row_ok, q_pos, K, V, k_start, kv_head, offs_n,
                    k_pos, k_valid, offs_d, offs_dv, stride_kt, stride_kh, stride_vt,
                    stride_vh, qk_scale, window_left, window_right, chunk_size, HEAD_DIM,
                    HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, DOT_PREC)
        else:
            dq = _dq_tile(
                dq, q, do, lse2, delta, row_ok, q_pos, K, V, k_start, kv_head, offs_n, k_pos,
                k_valid, offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh,
                qk_scale, window_left, window_right, chunk_size, HEAD_DIM, HEAD_DIM_V,
                CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, DOT_PREC)

    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m < len_q)[:, None] & (offs_d[None, :] < HEAD_DIM))


def triton_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
               window_right: int, chunk_size: int, q_positions, k_positions, schedule=None, *,
               block_sizes: tuple[int, int] | None = None, dlse=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) in the input dtypes; dk/dv summed over the GQA group.

    ``dlse`` [Hq, Tq] (None = 0), the gradient of the LSE output, enters as
    delta = rowsum(dO * O) - dlse (dlse/dS = P), so the kernels need no change for it.

    ``block_sizes`` (block_m, block_n) overrides the default tiles when no schedule is given.
    """
    total_q, n_heads, head_dim = q.shape
    total_k, n_kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    n_seg = cu_seqlens_q.shape[0] - 1
    block_m, block_n = resolve_blocks(schedule, block_sizes, q.dtype, head_dim, head_dim_v)
    check_schedule(schedule, n_seg, max_seqlen_q, max_seqlen_k)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if total_q == 0 or total_k == 0 or n_seg == 0 or min(max_seqlen_q, max_seqlen_k) <= 0:
        return dq, dk, dv
    dout = unit_last_stride(dout)
    lse = lse.contiguous()
    # [Hq, Tq] like lse, so both load with one index; a torch op is fine off the inner loop.
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    if dlse is not None:
        delta = delta - lse_grad_rows(dlse, lse)
    delta = delta.contiguous()
    dummy = cu_seqlens_q  # stands in for absent optional tensors; never dereferenced
    q_pos = dummy if q_positions is None else q_positions
    k_pos = dummy if k_positions is None else k_positions
    common = kernel_constants(q.dtype, head_dim, head_dim_v, block_m, block_n, causal,
                              window_left, window_right, chunk_size, q_positions is not None,
                              k_positions is not None, schedule is not None)
    group = n_heads // n_kv_heads
    n_kblocks = triton.cdiv(max_seqlen_k, block_n)
    _dkdv_kernel[(n_kblocks, n_seg, n_kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
        dummy if schedule is None else schedule.q_range,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        total_q, n_kblocks, group, softmax_scale, softmax_scale * LOG2E,
        **launch_options(q.dtype, head_dim, head_dim_v, "dkdv"), **common)
    n_qblocks = triton.cdiv(max_seqlen_q, block_m)
    _dq_kernel[(n_qblocks, n_seg, n_heads)](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
        dummy if schedule is None else schedule.kv_range,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        total_q, n_qblocks, group, softmax_scale, softmax_scale * LOG2E,
        **launch_options(q.dtype, head_dim, head_dim_v, "dq"), **common)
    return dq, dk, dv
