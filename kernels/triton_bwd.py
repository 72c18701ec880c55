"""Triton backward of varlen attention (FA2 formulas), as two kernels without atomics.

With delta = rowsum(dO * O), P = exp(S * scale - lse): dV = P^T dO, dS = P * (dO V^T - delta),
dQ = scale * dS K, dK = scale * dS^T Q. ``out`` and ``lse`` are taken as given: in context
parallelism they are the merged results of all steps, which makes these the partial
gradients of this call's keys (never recompute them here). Delta depends only on the final
dO, O, LSE (and the LSE's gradient), so a CP backward computes it once per layer
(:func:`triton_bwd_stats`, with the LSE in base 2) and passes it to every step's call.

- dK/dV kernel: one program per (work-list key block, kv head); for each query head of
  the GQA group it loops over the query tiles that can see the block, so the group sum
  stays in registers and the query-tile loop (the one that runs long) is the pipelined one.
- dQ kernel: one program per (work-list query block, query head) loops over its key tiles,
  chosen exactly as in the forward.
Both split their loop as the forward does: full tiles (every pair visible) without masks,
boundary tiles with the per-element mask. No atomics: results are deterministic, and the
interpreter cannot do bf16 atomics.

Padding rows (explicit position < 0) never meet a real row: their loads are masked by
position where they may lie in a visited range, their delta reads as 0 and their lse as
+inf (P = 0), so NaN / inf in them reaches no real row's gradient; their own gradients are 0.

Limits: as the forward (positions in [-2**31, 2**30), head dims padded to a power of two).
fp32 inputs at padded head dim 256 take 32x32 tiles (``triton_common.triton_block_sizes``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    LOG2E, boundary_offset, boundary_tiles, device_arch, device_work_list,
    kernel_constants, kernel_tiles, key_ranges, load_full_tile, load_positions, load_rows,
    query_ranges, resolve_blocks, segment_bounds, tile_may_see, tile_split, unit_last_stride,
    visible, work_item,
)
from .validation import check_schedule


@triton.jit
def _row_stats(LSE2, DELTA, offs, ok, FULL: tl.constexpr):
    """Base-2 lse and delta of rows ``offs`` (pointers already at the head and segment), as
    :func:`triton_bwd_stats` stored them: +inf and 0 on rows that saw no key, so that
    P = exp2(s - lse) = 0 there without a mask. Rows that are not ``ok`` read as such a row;
    ``FULL`` rows all exist: no load mask."""
    if FULL:
        return tl.load(LSE2 + offs), tl.load(DELTA + offs)
    return (tl.load(LSE2 + offs, mask=ok, other=float("inf")),
            tl.load(DELTA + offs, mask=ok, other=0.0))


# ------------------------------------------------------------------------------- dK / dV


@triton.jit
def _next_tile(i, g, i_lo, i_hi):
    """The (tile, head) walk of the dK/dV loops: tiles i_lo..i_hi-1 of head g, then g + 1."""
    i += 1
    wrap = i == i_hi
    return tl.where(wrap, i_lo, i), g + wrap.to(tl.int32)


@triton.jit
def _dkdv_full_tiles(dk, dv, k, v, Q, DO, LSE2, DELTA, q_offs, do_offs, q_start, start, i_lo,
                     i_hi, head0, group, total_q, offs_m0, offs_d, offs_dv, stride_qt,
                     stride_qh, stride_dot, stride_doh, qk_scale, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Query tiles that see every key of the block, for every head of the GQA group, in one
    flat loop (an outer loop over heads cost ~20 registers and spills at d 128): no mask.
    Orientation [keys, queries]: dK and dV come out without transposes."""
    i = i_lo
    g = i_lo * 0
    for _ in range(0, (i_hi - i_lo) * group):
        head = head0 + g
        row = (q_start + start + i * BLOCK_M).to(tl.int64)
        q = load_full_tile(Q + row * stride_qt + head * stride_qh, q_offs, offs_d, HEAD_DIM,
                           BLOCK_D)
        do = load_full_tile(DO + row * stride_dot + head * stride_doh, do_offs, offs_dv,
                            HEAD_DIM_V, BLOCK_DV)
        at = head.to(tl.int64) * total_q + row
        lse2, delta = _row_stats(LSE2 + at, DELTA + at, offs_m0, offs_m0 >= 0, True)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
        i, g = _next_tile(i, g, i_lo, i_hi)
    return dk, dv


@triton.jit
def _dkdv_boundary_tile(dk, dv, k, v, k_pos, Q, DO, LSE2, DELTA, QPOS, q_start, offs_m, end,
                        q_shift, head, total_q, offs_d, offs_dv, stride_qt, stride_qh,
                        stride_dot, stride_doh, qk_scale, window_left, window_right,
                        chunk_size, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                        HAS_CHUNK: tl.constexpr, EXPLICIT_Q: tl.constexpr,
                        Q_PAD: tl.constexpr, DOT_PREC: tl.constexpr):
    """One query tile of one head against the key block, the mask evaluated per element."""
    q_pos, q_valid = load_positions(QPOS, q_start, offs_m, end, q_shift, EXPLICIT_Q)
    q_read = q_valid if Q_PAD else offs_m < end  # see the forward's boundary tile
    rows = (q_start + offs_m).to(tl.int64)
    q = load_rows(Q, rows, q_read, head, stride_qt, stride_qh, offs_d, HEAD_DIM)
    do = load_rows(DO, rows, q_read, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
    at = head.to(tl.int64) * total_q
    lse2, delta = _row_stats(LSE2 + at, DELTA + at, rows, q_read, False)
    # Rows not read have lse +inf (P = 0); keys not real get P but their rows of dK, dV
    # are dropped at the store: neither needs a term here.
    vis = visible(q_pos[None, :], k_pos[:, None], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    p_t = tl.where(vis, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, CU_Q, CU_K, QPOS, KPOS, Q_RANGE, Q_FULL, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_q, n_kv_heads, n_kblocks, group, scale, qk_scale, window_left, window_right,
    chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    HAS_FULL: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, Q_PAD: tl.constexpr,
    K_PAD: tl.constexpr, DOT_PREC: tl.constexpr, STEP_M: tl.constexpr,
):
    tile, seg, blk, kv_head = work_item(TILES, n_kv_heads, n_kblocks)
    if tile < 0:
        return
    q_start, len_q, k_start, len_k = segment_bounds(CU_Q, CU_K, seg)
    q_shift = len_k - len_q  # implicit query position = offset + q_shift

    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_pos, k_valid = load_positions(KPOS, k_start, offs_n, len_k, 0, EXPLICIT_K)
    cols = (k_start + offs_n).to(tl.int64)
    k = load_rows(K, cols, k_valid, kv_head, stride_kt, stride_kh, offs_d, HEAD_DIM)
    v = load_rows(V, cols, k_valid, kv_head, stride_vt, stride_vh, offs_dv, HEAD_DIM_V)

    start, end, full_start, full_end, qlo, qhi = query_ranges(
        Q_RANGE, Q_FULL, tile, k_pos, k_valid, blk, len_q, len_k, window_left,
        window_right, chunk_size, BLOCK_N, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q,
        EXPLICIT_K, USE_SCHEDULE, HAS_FULL)
    i_lo, i_hi = tile_split(start, end, full_start, full_end, BLOCK_M)
    offs_mb = tl.arange(0, STEP_M)
    n_head, n_boundary, tail = boundary_tiles(start, end, i_lo, i_hi, BLOCK_M, STEP_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    head0 = kv_head * group
    if not SCAN_Q and (HAS_FULL or not USE_SCHEDULE):  # modes that know full tiles
        dk, dv = _dkdv_full_tiles(
            dk, dv, k, v, Q, DO, LSE2, DELTA, offs_m0[:, None] * stride_qt + offs_d[None, :],
            offs_m0[:, None] * stride_dot + offs_dv[None, :], q_start, start, i_lo, i_hi,
            head0, group, total_q, offs_m0, offs_d, offs_dv, stride_qt, stride_qh,
            stride_dot, stride_doh, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D,
            BLOCK_DV, DOT_PREC)
    j = n_head * 0
    g = n_head * 0
    for _ in range(0, n_boundary * group):
        offs_m = boundary_offset(j, start, n_head, tail, STEP_M) + offs_mb
        if SCAN_Q:  # see the forward: only the scan mode pays for a branch in the loop
            q_pos, q_valid = load_positions(QPOS, q_start, offs_m, end, q_shift, EXPLICIT_Q)
            if tile_may_see(q_pos, q_valid, qlo, qhi):
                dk, dv = _dkdv_boundary_tile(
                    dk, dv, k, v, k_pos, Q, DO, LSE2, DELTA, QPOS, q_start, offs_m, end,
                    q_shift, head0 + g, total_q, offs_d, offs_dv, stride_qt, stride_qh,
                    stride_dot, stride_doh, qk_scale, window_left, window_right, chunk_size,
                    HEAD_DIM, HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q,
                    Q_PAD, DOT_PREC)
        else:
            dk, dv = _dkdv_boundary_tile(
                dk, dv, k, v, k_pos, Q, DO, LSE2, DELTA, QPOS, q_start, offs_m, end, q_shift,
                head0 + g, total_q, offs_d, offs_dv, stride_qt, stride_qh, stride_dot,
                stride_doh, qk_scale, window_left, window_right, chunk_size, HEAD_DIM,
                HEAD_DIM_V, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q, Q_PAD, DOT_PREC)
        j, g = _next_tile(j, g, 0, n_boundary)

    # Padding keys are not stored: their dK, dV stay the zeros they were made with (full
    # tiles ran on their zero K and V, which gives them nonzero gradients).
    keep = k_valid[:, None]
    tl.store(DK + cols[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=keep & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + cols[:, None] * stride_dvt + kv_head * stride_dvh + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=keep & (offs_dv[None, :] < HEAD_DIM_V))


# ------------------------------------------------------------------------------------ dQ


@triton.jit
def _dq_full_tiles(dq, q, do, lse2, delta, K_seg, V_seg, k_offs, v_offs, start, i_lo, i_hi,
                   offs_d, offs_dv, stride_kt, stride_vt, qk_scale, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key tiles every query of the block sees: no mask (dQ before the final scale)."""
    K_tile = K_seg + (start + i_lo * BLOCK_N).to(tl.int64) * stride_kt
    V_tile = V_seg + (start + i_lo * BLOCK_N).to(tl.int64) * stride_vt
    for _ in range(i_lo, i_hi):
        k = load_full_tile(K_tile, k_offs, offs_d, HEAD_DIM, BLOCK_D)
        v = load_full_tile(V_tile, v_offs, offs_dv, HEAD_DIM_V, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        K_tile += BLOCK_N * stride_kt
        V_tile += BLOCK_N * stride_vt
    return dq


@triton.jit
def _dq_boundary_tile(dq, q, do, lse2, delta, q_pos, K, V, KPOS, k_start, kv_head, offs_n,
                      end, offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh,
                      qk_scale, window_left, window_right, chunk_size,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, CAUSAL: tl.constexpr,
                      HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
                      EXPLICIT_K: tl.constexpr, K_PAD: tl.constexpr,
                      DOT_PREC: tl.constexpr):
    """One key tile's contribution to dQ with the mask evaluated per element."""
    k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
    k_read = k_valid if K_PAD else offs_n < end  # see the forward's boundary tile
    cols = (k_start + offs_n).to(tl.int64)
    k = load_rows(K, cols, k_read, kv_head, stride_kt, stride_kh, offs_d, HEAD_DIM)
    v = load_rows(V, cols, k_read, kv_head, stride_vt, stride_vh, offs_dv, HEAD_DIM_V)
    vis = visible(q_pos[:, None], k_pos[None, :], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK) & k_valid[None, :]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    p = tl.where(vis, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, CU_Q, CU_K, QPOS, KPOS, KV_RANGE, KV_FULL, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    total_q, n_heads, n_qblocks, group, scale, qk_scale, window_left, window_right,
    chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    EXPLICIT_Q: tl.constexpr, EXPLICIT_K: tl.constexpr, USE_SCHEDULE: tl.constexpr,
    HAS_FULL: tl.constexpr, SCAN_Q: tl.constexpr, SCAN_K: tl.constexpr, Q_PAD: tl.constexpr,
    K_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile, seg, blk, head = work_item(TILES, n_heads, n_qblocks)
    if tile < 0:
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
    do = load_rows(DO, rows, q_valid, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
    # Padding rows and rows that saw nothing: P = 0 (lse reads +inf), delta 0.
    lse2, delta = _row_stats(LSE2 + head.to(tl.int64) * total_q,
                             DELTA + head.to(tl.int64) * total_q, rows, q_valid, False)

    start, end, full_start, full_end, klo, khi = key_ranges(
        KV_RANGE, KV_FULL, tile, q_pos, q_valid, blk, len_q, len_k, window_left,
        window_right, chunk_size, BLOCK_M, CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_Q,
        EXPLICIT_K, USE_SCHEDULE, HAS_FULL)
    i_lo, i_hi = tile_split(start, end, full_start, full_end, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    K_seg = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    V_seg = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    k_offs = offs_n0[:, None] * stride_kt + offs_d[None, :]
    v_offs = offs_n0[:, None] * stride_vt + offs_dv[None, :]
    if not SCAN_K and (HAS_FULL or not USE_SCHEDULE):  # modes that know full tiles
        dq = _dq_full_tiles(dq, q, do, lse2, delta, K_seg, V_seg, k_offs, v_offs, start,
                            i_lo, i_hi, offs_d, offs_dv, stride_kt, stride_vt, qk_scale,
                            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PREC)
    n_head, n_boundary, tail = boundary_tiles(start, end, i_lo, i_hi, BLOCK_N, BLOCK_N)
    for j in range(0, n_boundary):
        offs_n = boundary_offset(j, start, n_head, tail, BLOCK_N) + offs_n0
        if SCAN_K:
            k_pos, k_valid = load_positions(KPOS, k_start, offs_n, end, 0, EXPLICIT_K)
            if tile_may_see(k_pos, k_valid, klo, khi):
                dq = _dq_boundary_tile(
                    dq, q, do, lse2, delta, q_pos, K, V, KPOS, k_start, kv_head, offs_n, end,
                    offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                    window_left, window_right, chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL,
                    HAS_WL, HAS_WR, HAS_CHUNK, EXPLICIT_K, K_PAD, DOT_PREC)
        else:
            dq = _dq_boundary_tile(
                dq, q, do, lse2, delta, q_pos, K, V, KPOS, k_start, kv_head, offs_n, end,
                offs_d, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                window_left, window_right, chunk_size, HEAD_DIM, HEAD_DIM_V, CAUSAL, HAS_WL,
                HAS_WR, HAS_CHUNK, EXPLICIT_K, K_PAD, DOT_PREC)

    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty),
             mask=q_valid[:, None] & (offs_d[None, :] < HEAD_DIM))


# --------------------------------------------------------------------------------- delta


@triton.jit
def _stats_kernel(DO, O, LSE, DLSE, STATS, stride_dot, stride_doh, stride_ot, stride_oh,
                  n_rows, total_q, HEAD_DIM_V: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr):
    """STATS[0] = delta = rowsum(dO * O) - dlse, STATS[1] = lse * log2(e); +inf and 0 on
    rows whose lse is -inf. fp32 in registers, one pass over dO and O."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = rows < total_q
    mask = ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    r64 = rows.to(tl.int64)
    do = tl.load(DO + r64[:, None] * stride_dot + head * stride_doh + offs_dv[None, :],
                 mask=mask, other=0.0)
    o = tl.load(O + r64[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
                mask=mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    at = head.to(tl.int64) * total_q + rows
    lse = tl.load(LSE + at, mask=ok, other=float("-inf"))
    if HAS_DLSE:
        delta -= tl.load(DLSE + at, mask=ok, other=0.0)
    dead = lse == float("-inf")
    tl.store(STATS + at, tl.where(dead, 0.0, delta), mask=ok)
    tl.store(STATS + n_rows + at, tl.where(dead, float("inf"), lse * 1.4426950408889634),
             mask=ok)


def triton_bwd_stats(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dlse: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [2, Hq, Tq]: delta = rowsum(dO * O) - dlse and the LSE in base 2, with 0 and +inf
    on rows whose lse is -inf (they saw no key: P = 0 there without a mask, and a
    non-finite rowsum(dO * O) never meets it). What the backward kernels read per row; it
    depends only on the final dO, O, LSE (and dlse), so a CP backward computes it once per
    layer and hands it to every step (``triton_bwd(stats=...)``). One pass over dO and O,
    without fp32 copies of them."""
    total_q, n_heads, head_dim_v = out.shape
    stats = torch.empty(2, n_heads, total_q, dtype=torch.float32, device=out.device)
    if total_q == 0:
        return stats
    dout, out = unit_last_stride(dout), unit_last_stride(out)
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    block_t = max(16, min(128, 8192 // block_dv))
    lse = lse.contiguous()
    _stats_kernel[(triton.cdiv(total_q, block_t), n_heads)](
        dout, out, lse, lse if dlse is None else dlse.float().contiguous(), stats,
        dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), n_heads * total_q,
        total_q, HEAD_DIM_V=head_dim_v, BLOCK_T=block_t, BLOCK_DV=block_dv,
        HAS_DLSE=dlse is not None, num_warps=4)
    return stats


# ------------------------------------------------------------------------------ launcher


def bwd_specialization(kernel: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                       block_m: int, block_n: int, causal: bool, window_left: int,
                       window_right: int, chunk_size: int, explicit_q: bool, explicit_k: bool,
                       schedule, arch: int | None) -> tuple[dict, dict]:
    """(constexpr keyword arguments, launch options) of one "dq" or "dkdv" launch; the
    static report compiles exactly these. ``block_m`` / ``block_n``: the schedule's."""
    full = None if schedule is None else (schedule.kv_full if kernel == "dq"
                                          else schedule.q_full)
    bm, bn, options = kernel_tiles(kernel, dtype, head_dim, head_dim_v, block_m, block_n,
                                   arch)
    consts = kernel_constants(
        dtype, head_dim, head_dim_v, bm, bn, causal, window_left, window_right, chunk_size,
        explicit_q, explicit_k, schedule is not None, has_full=full is not None,
        padded=schedule is None or schedule.padded)
    if kernel == "dkdv":
        # Boundary query tiles of half the rows: the per-element mask's operands set the
        # kernel's register peak (d 128, sm90: 48-60 bytes of spills at 32 rows, none at 16).
        consts["STEP_M"] = bm // 2 if bm > 16 else bm
    return consts, options


def triton_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
               window_right: int, chunk_size: int, q_positions, k_positions, schedule=None, *,
               block_sizes: tuple[int, int] | None = None, dlse=None, stats=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) in the input dtypes; dk/dv summed over the GQA group.

    ``dlse`` [Hq, Tq] (None = 0), the gradient of the LSE output, enters as
    delta = rowsum(dO * O) - dlse (dlse/dS = P), so the kernels need no change for it.
    ``stats`` (:func:`triton_bwd_stats` of the same dout, out, lse, dlse) skips that pass:
    a CP backward computes it once per layer, not once per step.

    ``block_sizes`` (block_m, block_n) overrides the default tiles when no schedule is given.
    """
    total_q, n_heads, head_dim = q.shape
    total_k, n_kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    n_seg = cu_seqlens_q.shape[0] - 1
    arch = device_arch(q.device)
    block_m, block_n = resolve_blocks(schedule, block_sizes, q.dtype, head_dim, head_dim_v,
                                      arch)
    # a launcher called directly (not through kernels.api) still refuses a schedule made
    # for other segments (shape metadata only; the one check, validation's)
    check_schedule(schedule, n_seg, max_seqlen_q, max_seqlen_k)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if total_q == 0 or total_k == 0 or n_seg == 0 or min(max_seqlen_q, max_seqlen_k) <= 0:
        return dq, dk, dv
    dout = unit_last_stride(dout)
    lse = lse.contiguous()
    if stats is None:
        stats = triton_bwd_stats(dout, out, lse, dlse)
    delta, lse2 = stats[0], stats[1]
    dummy = cu_seqlens_q  # stands in for absent optional tensors; never dereferenced
    q_pos = dummy if q_positions is None else q_positions
    k_pos = dummy if k_positions is None else k_positions
    mask = (causal, window_left, window_right, chunk_size)
    explicit = (q_positions is not None, k_positions is not None)
    group = n_heads // n_kv_heads

    n_kblocks = triton.cdiv(max_seqlen_k, block_n)
    k_tiles = (device_work_list(cu_seqlens_k, block_n, n_kblocks, total_k) if schedule is None
               else schedule.k_tiles)
    if k_tiles.numel():
        consts, options = bwd_specialization("dkdv", q.dtype, head_dim, head_dim_v, block_m,
                                             block_n, *mask, *explicit, schedule, arch)
        _dkdv_kernel[(k_tiles.numel() * n_kv_heads,)](
            q, k, v, dout, lse2, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
            dummy if schedule is None else schedule.q_range,
            dummy if schedule is None or schedule.q_full is None else schedule.q_full,
            k_tiles,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
            dv.stride(1), total_q, n_kv_heads, n_kblocks, group, softmax_scale,
            softmax_scale * LOG2E, **consts, **options)

    n_qblocks = triton.cdiv(max_seqlen_q, block_m)
    q_tiles = (device_work_list(cu_seqlens_q, block_m, n_qblocks, total_q) if schedule is None
               else schedule.q_tiles)
    if q_tiles.numel():
        consts, options = bwd_specialization("dq", q.dtype, head_dim, head_dim_v, block_m,
                                             block_n, *mask, *explicit, schedule, arch)
        _dq_kernel[(q_tiles.numel() * n_heads,)](
            q, k, v, dout, lse2, delta, dq, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
            dummy if schedule is None else schedule.kv_range,
            dummy if schedule is None or schedule.kv_full is None else schedule.kv_full,
            q_tiles,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
            total_q, n_heads, n_qblocks, group, softmax_scale, softmax_scale * LOG2E,
            **consts, **options)
    return dq, dk, dv
