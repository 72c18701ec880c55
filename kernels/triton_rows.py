"""Triton attention over rows described by (document, position) tables: the graph-safe
mode's GPU kernels.

A graph-safe call (``varlen_cp.strategies.static``) must launch the same grids with the
same host arguments for every batch. These kernels take each side's rows as tables of the
buffers' length (capacity): the rows *sorted* by (document, position) as device tables
(``DOC``, ``POS``; -1 for a padding row or an unused slot, which sees nothing and is seen by
nothing) and ``IDX``, where each sorted row lives in the q / k / v buffers. Which rows of the
other side a block has to visit is a device table too (``LO`` / ``HI`` per block, in the
other side's sorted order: :func:`varlen_cp.kernels.rows.block_ranges`), so

- the grid is one program per (block of the buffer, head): ``cdiv(capacity, BLOCK)`` x heads,
  whatever the batch; a block with nothing to visit (unused slots, a rank without tokens)
  finds ``LO == HI`` and exits after its first loads;
- the loop bounds are read on the device; every key tile inside them is masked per element:
  same document (>= 0) and the mask on the positions (``triton_common.visible``). The range
  of one block is the union of its queries' visible intervals, from the first query's low
  end to the last one's high end in (document, position) order, so a block inside one
  document visits exactly the tiles its queries can see.

Forward: online softmax in base 2 (fp32), out in fp32 (the static strategies fold partials
by their LSE) and the natural-log LSE, -inf and 0 on rows that see nothing. Backward (FA2
formulas, no atomics, deterministic): delta and base-2 LSE from ``triton_bwd_stats``; a dQ
kernel per query block and a dK/dV kernel per key block and kv head that loops over the
query heads of its GQA group; fp32 results, zero on rows no program writes.

Limits: as the varlen kernels (head dims padded to a power of two >= 16, positions in
[0, 2**30), GQA with Hq % Hkv == 0); the tables must be sorted by (document, position) with
every padding row's document -1 (:mod:`varlen_cp.kernels.rows` builds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (LOG2E, device_arch, kernel_constants, kernel_tiles, load_rows,
                            resolve_blocks, unit_last_stride, visible)
from .triton_bwd import triton_bwd_stats


@triton.jit
def _side(DOC, POS, IDX, offs, n):
    """(buffer rows int64, documents, positions, real) of sorted rows ``offs``."""
    inside = offs < n
    doc = tl.load(DOC + offs, mask=inside, other=-1)
    pos = tl.load(POS + offs, mask=inside, other=-1)
    row = tl.load(IDX + offs, mask=inside, other=0).to(tl.int64)
    return row, doc, pos, doc >= 0


@triton.jit
def _seen(q_doc, q_pos, q_ok, k_doc, k_pos, k_ok, window_left, window_right, chunk_size,
          CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
          HAS_CHUNK: tl.constexpr):
    """[M, N] visibility: one document, both rows real, the mask on the positions."""
    vis = visible(q_pos[:, None], k_pos[None, :], window_left, window_right, chunk_size,
                  CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    return vis & (q_doc[:, None] == k_doc[None, :]) & q_ok[:, None] & k_ok[None, :]


@triton.jit
def _query_block(Q, QDOC, QPOS, QIDX, stride_qt, stride_qh, n_q, n_heads, group,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (block, head, kv head) and its query block: (rows, documents,
    positions, real, q tile)."""
    pid = tl.program_id(0)
    blk = pid // n_heads
    head = pid - blk * n_heads
    rows, q_doc, q_pos, q_ok = _side(QDOC, QPOS, QIDX, blk * BLOCK_M + tl.arange(0, BLOCK_M),
                                     n_q)
    q = load_rows(Q, rows, q_ok, head, stride_qt, stride_qh, tl.arange(0, BLOCK_D), HEAD_DIM)
    return blk, head, head // group, rows, q_doc, q_pos, q_ok, q


@triton.jit
def _key_tile(K, V, KDOC, KPOS, KIDX, offs_n, hi, kv_head, stride_kt, stride_kh, stride_vt,
              stride_vh, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Sorted key rows ``offs_n`` (those at or past ``hi`` absent): (buffer rows, documents,
    positions, real, k tile, v tile)."""
    cols, k_doc, k_pos, k_ok = _side(KDOC, KPOS, KIDX, offs_n, hi)
    k = load_rows(K, cols, k_ok, kv_head, stride_kt, stride_kh, tl.arange(0, BLOCK_D),
                  HEAD_DIM)
    v = load_rows(V, cols, k_ok, kv_head, stride_vt, stride_vh, tl.arange(0, BLOCK_DV),
                  HEAD_DIM_V)
    return cols, k_doc, k_pos, k_ok, k, v


@triton.jit
def _scores(q, q_doc, q_pos, q_ok, K, V, KDOC, KPOS, KIDX, offs_n, hi, kv_head, stride_kt,
            stride_kh, stride_vt, stride_vh, window_left, window_right, chunk_size,
            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
            HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key tile of a query block's loop: (k, v, raw scores q k^T, visibility)."""
    _, k_doc, k_pos, k_ok, k, v = _key_tile(K, V, KDOC, KPOS, KIDX, offs_n, hi, kv_head,
                                            stride_kt, stride_kh, stride_vt, stride_vh,
                                            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    vis = _seen(q_doc, q_pos, q_ok, k_doc, k_pos, k_ok, window_left, window_right, chunk_size,
                CAUSAL, HAS_WL, HAS_WR, HAS_CHUNK)
    return k, v, s, vis


@triton.jit
def _rows_fwd_kernel(
    Q, K, V, O, LSE, RMAX, QDOC, QPOS, QIDX, KDOC, KPOS, KIDX, LO, HI,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    n_q, n_k, total_q, n_heads, group, qk_scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr, STORE_MAX: tl.constexpr,
):
    blk, head, kv_head, rows, q_doc, q_pos, q_ok, q = _query_block(
        Q, QDOC, QPOS, QIDX, stride_qt, stride_qh, n_q, n_heads, group, HEAD_DIM, BLOCK_M,
        BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    lo = tl.load(LO + blk)
    hi = tl.load(HI + blk)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k, v, s, vis = _scores(q, q_doc, q_pos, q_ok, K, V, KDOC, KPOS, KIDX,
                               start + offs_n0, hi, kv_head, stride_kt, stride_kh,
                               stride_vt, stride_vh, window_left, window_right, chunk_size,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, CAUSAL, HAS_WL,
                               HAS_WR, HAS_CHUNK, DOT_PREC)
        s = tl.where(vis, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no -inf - -inf = NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :], out,
             mask=q_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + head.to(tl.int64) * total_q + rows, lse, mask=q_ok)
    if STORE_MAX:   # m_i is in log2 units of the scaled scores: back to natural units
        tl.store(RMAX + head.to(tl.int64) * total_q + rows, m_i * 0.6931471805599453,
                 mask=q_ok)


@triton.jit
def _rows_dq_kernel(
    Q, K, V, DO, STATS, DQ, QDOC, QPOS, QIDX, KDOC, KPOS, KIDX, LO, HI,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, n_q, n_k, total_q, n_heads, group, qk_scale, scale,
    window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    blk, head, kv_head, rows, q_doc, q_pos, q_ok, q = _query_block(
        Q, QDOC, QPOS, QIDX, stride_qt, stride_qh, n_q, n_heads, group, HEAD_DIM, BLOCK_M,
        BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    do = load_rows(DO, rows, q_ok, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
    at = head.to(tl.int64) * total_q + rows
    delta = tl.load(STATS + at, mask=q_ok, other=0.0)
    lse2 = tl.load(STATS + n_heads * total_q + at, mask=q_ok, other=float("inf"))
    lo = tl.load(LO + blk)
    hi = tl.load(HI + blk)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k, v, s, vis = _scores(q, q_doc, q_pos, q_ok, K, V, KDOC, KPOS, KIDX,
                               start + offs_n0, hi, kv_head, stride_kt, stride_kh,
                               stride_vt, stride_vh, window_left, window_right, chunk_size,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, CAUSAL, HAS_WL,
                               HAS_WR, HAS_CHUNK, DOT_PREC)
        p = tl.where(vis, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             dq * scale, mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _rows_dkdv_kernel(
    Q, K, V, DO, STATS, DK, DV, QDOC, QPOS, QIDX, KDOC, KPOS, KIDX, LO, HI,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, n_q, n_k, total_q, n_heads, n_kv_heads,
    group, qk_scale, scale, window_left, window_right, chunk_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid // n_kv_heads
    kv_head = pid - blk * n_kv_heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m0 = tl.arange(0, BLOCK_M)
    cols, k_doc, k_pos, k_ok, k, v = _key_tile(
        K, V, KDOC, KPOS, KIDX, blk * BLOCK_N + tl.arange(0, BLOCK_N), n_k, kv_head,
        stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    lo = tl.load(LO + blk)
    hi = tl.load(HI + blk)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(0, group):   # the query heads of this kv head: the GQA sum in registers
        head = kv_head * group + g
        for start in range(lo, hi, BLOCK_M):
            rows, q_doc, q_pos, q_ok = _side(QDOC, QPOS, QIDX, start + offs_m0, hi)
            q = load_rows(Q, rows, q_ok, head, stride_qt, stride_qh, offs_d, HEAD_DIM)
            do = load_rows(DO, rows, q_ok, head, stride_dot, stride_doh, offs_dv, HEAD_DIM_V)
            at = head.to(tl.int64) * total_q + rows
            delta = tl.load(STATS + at, mask=q_ok, other=0.0)
            lse2 = tl.load(STATS + n_heads * total_q + at, mask=q_ok, other=float("inf"))
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)          # [N, M]
            vis_t = tl.trans(_seen(q_doc, q_pos, q_ok, k_doc, k_pos, k_ok, window_left,
                                   window_right, chunk_size, CAUSAL, HAS_WL, HAS_WR,
                                   HAS_CHUNK))
            p_t = tl.where(vis_t, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    tl.store(DK + cols[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             dk * scale, mask=k_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + cols[:, None] * stride_dvt + kv_head * stride_dvh + offs_dv[None, :], dv,
             mask=k_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


def rows_specialization(kernel: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                        block_m: int, block_n: int, causal: bool, window_left: int,
                        window_right: int, chunk_size: int, arch: int | None
                        ) -> tuple[dict, dict]:
    """(constexpr keyword arguments, launch options) of one launch of ``kernel`` ("fwd",
    "dq", "dkdv"). The tables' block (ranges are per block: the query block of fwd / dQ,
    the key block of dK/dV) is kept; the other side's step is the varlen kernels' choice
    for the GPU (``kernel_tiles``: e.g. 32 query rows per step of dK/dV at d 128, where 64
    spill), which any step may be, since the loops take any range."""
    bm, bn, options = kernel_tiles(kernel, dtype, head_dim, head_dim_v, block_m, block_n,
                                   arch)
    if kernel == "dkdv" and arch is not None and max(head_dim, head_dim_v) > 64:
        # (its key rows' tables and indices stay live across the loop: at 4 warps and
        # d 128 that spilled)
        options = {**options, "num_warps": 8}
    every = kernel_constants(dtype, head_dim, head_dim_v, bm, bn, causal,
                             window_left, window_right, chunk_size, True, True, False)
    keep = ("window_left", "window_right", "chunk_size", "HEAD_DIM", "HEAD_DIM_V",
            "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "CAUSAL", "HAS_WL", "HAS_WR",
            "HAS_CHUNK", "DOT_PREC")
    return {name: every[name] for name in keep}, options


def rows_blocks(dtype: torch.dtype, head_dim: int, head_dim_v: int, device,
                block_sizes: tuple[int, int] | None = None) -> tuple[int, int]:
    """(block_m, block_n) of these kernels on ``device`` (the varlen kernels' defaults;
    ``block_sizes`` overrides them: tests use 16 to keep the interpreter fast)."""
    return resolve_blocks(None, block_sizes, dtype, head_dim, head_dim_v,
                          device_arch(device))


# The launches run inside two custom ops that write into buffers made by the caller, so
# that the dispatcher sees them as ops with their arguments (what the tests' replay of a
# step records and re-runs, as a CUDA graph would) and torch.compile treats them as opaque.
@torch.library.custom_op("varlen_cp::rows_fwd", mutates_args=("out", "lse", "row_max"))
def _rows_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, row_max: torch.Tensor, q_doc: torch.Tensor,
                 q_pos: torch.Tensor, q_idx: torch.Tensor, k_doc: torch.Tensor,
                 k_pos: torch.Tensor, k_idx: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, scale: float, causal: bool, window_left: int,
                 window_right: int, chunk_size: int, block_m: int, block_n: int,
                 store_max: bool) -> None:
    total_q, n_heads, head_dim = q.shape
    consts, options = rows_specialization("fwd", q.dtype, head_dim, v.shape[-1], block_m,
                                          block_n, causal, window_left, window_right,
                                          chunk_size, device_arch(q.device))
    _rows_fwd_kernel[(triton.cdiv(q_doc.numel(), block_m) * n_heads,)](
        q, k, v, out, lse, row_max, q_doc, q_pos, q_idx, k_doc, k_pos, k_idx, lo, hi,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), q_doc.numel(), k_doc.numel(), total_q, n_heads,
        n_heads // k.shape[1], scale * LOG2E, STORE_MAX=store_max, **consts, **options)


@torch.library.custom_op("varlen_cp::rows_bwd", mutates_args=("dq", "dk", "dv"))
def _rows_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q_doc: torch.Tensor,
                 q_pos: torch.Tensor, q_idx: torch.Tensor, k_doc: torch.Tensor,
                 k_pos: torch.Tensor, k_idx: torch.Tensor, q_lo: torch.Tensor,
                 q_hi: torch.Tensor, k_lo: torch.Tensor, k_hi: torch.Tensor, scale: float,
                 causal: bool, window_left: int, window_right: int, chunk_size: int,
                 block_m: int, block_n: int) -> None:
    total_q, n_heads, head_dim = q.shape
    n_kv, head_dim_v = k.shape[1], v.shape[-1]
    stats = triton_bwd_stats(dout, out, lse, dlse)
    arch = device_arch(q.device)
    mask = (causal, window_left, window_right, chunk_size)
    common = (q_doc.numel(), k_doc.numel(), total_q, n_heads)
    consts, options = rows_specialization("dq", q.dtype, head_dim, head_dim_v, block_m,
                                          block_n, *mask, arch)
    _rows_dq_kernel[(triton.cdiv(q_doc.numel(), block_m) * n_heads,)](
        q, k, v, dout, stats, dq, q_doc, q_pos, q_idx, k_doc, k_pos, k_idx, q_lo, q_hi,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), *common,
        n_heads // n_kv, scale * LOG2E, scale, **consts, **options)
    consts, options = rows_specialization("dkdv", q.dtype, head_dim, head_dim_v, block_m,
                                          block_n, *mask, arch)
    _rows_dkdv_kernel[(triton.cdiv(k_doc.numel(), block_n) * n_kv,)](
        q, k, v, dout, stats, dk, dv, q_doc, q_pos, q_idx, k_doc, k_pos, k_idx, k_lo, k_hi,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), *common, n_kv, n_heads // n_kv, scale * LOG2E, scale,
        **consts, **options)


def rows_fwd(q, k, v, q_side, k_side, ranges, mask_args, scale: float, blocks, *,
             return_max: bool = False):
    """(out fp32 [Tq, Hq, Dv], lse fp32 [Hq, Tq], row max or None) of q's rows against k's.

    ``q_side`` / ``k_side``: (doc, pos, idx) int32 tables, sorted (module docstring);
    ``ranges``: (lo, hi) int32 [cdiv(Tq, block_m)] in k's sorted order; ``mask_args``:
    (causal, window_left, window_right, chunk_size); ``blocks``: (block_m, block_n)."""
    total_q, n_heads, _ = q.shape
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    out = torch.zeros(total_q, n_heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((n_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    # (always a buffer: a mutated argument of the op may not alias another one)
    row_max = torch.full_like(lse, float("-inf"))
    if total_q and k.shape[0]:
        _rows_fwd_op(q, k, v, out, lse, row_max, *q_side, *k_side, *ranges, float(scale),
                     *_mask_scalars(mask_args), *blocks, bool(return_max))
    return out, lse, (row_max if return_max else None)


def rows_bwd(dout, q, k, v, out, lse, dlse, q_side, k_side, q_ranges, k_ranges,
             mask_args, scale: float, blocks):
    """fp32 (dq, dk, dv) of :func:`rows_fwd` given the FINAL out and lse of the query rows
    (a partial call's keys get their share of the merged softmax). ``q_ranges``: per query
    block, in k's sorted order (the forward's); ``k_ranges``: per key block, in q's."""
    # dO in the inputs' dtype (tl.dot takes one dtype): the strategies hand fp32 dO where it
    # only travelled in fp32 (Ulysses' exchange) or was made as zeros like the fp32 out
    dout = dout.to(v.dtype)
    q, k, v, dout = (unit_last_stride(t) for t in (q, k, v, dout))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if q.shape[0] and k.shape[0]:
        _rows_bwd_op(dout, q, k, v, out, lse, dlse, dq, dk, dv, *q_side, *k_side,
                     *q_ranges, *k_ranges, float(scale), *_mask_scalars(mask_args), *blocks)
    return dq, dk, dv


def _mask_scalars(mask_args: tuple) -> tuple[bool, int, int, int]:
    causal, window_left, window_right, chunk_size = mask_args
    return bool(causal), int(window_left), int(window_right), int(chunk_size)
