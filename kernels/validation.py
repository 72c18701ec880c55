"""Argument checks for the varlen op, run before any compute.

Shape, dtype and device checks always run (they read metadata only). Checks of *values*
(cu_seqlens monotone and consistent, max_seqlen large enough, positions inside the kernels'
int32 range) run only when the value tensors live on the host, because reading a device
tensor would sync the stream, and never while torch.compile traces. Every failure is a
ValueError naming the argument and its value.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "triton", "torch", "flash", "fa4")
"""Kernel backends: "auto" (FlashAttention-class kernels on CUDA where a call is exact in
their form, our Triton kernels for the rest; the PyTorch twin on CPUs), "triton", "torch"
(our kernels only), "flash" (torch's flash ops where exact), "fa4" (flash-attn-4 where
exact); our kernels take what FlashAttention cannot express (``kernels.flash``)."""
MAX_HEAD_DIM = 256
# Positions are int32 in the kernels, which add windows (clamped to 2**30) to real ones:
# real positions must stay below 2**30; padding may be any int32 value below 0.
POSITION_MIN, POSITION_LIMIT = -(1 << 31), 1 << 30


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_mask_args(window_size, chunk_size, softmax_scale) -> None:
    """Validate the mask and scale arguments (pure Python values)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        _fail(f"window_size must be a pair of ints, got {window_size!r}")
    if window_size[0] < -1 or window_size[1] < -1:
        _fail(f"window_size entries must be >= -1, got {tuple(window_size)!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        _fail(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and not isinstance(softmax_scale, bool)
                                          and math.isfinite(softmax_scale)
                                          and softmax_scale > 0):
        _fail(f"softmax_scale must be a finite positive float or None, got {softmax_scale!r}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; one float dtype, one device, GQA."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            _fail(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got "
                  f"{getattr(t, 'shape', type(t))}")
        if t.dtype not in FLOAT_DTYPES:
            _fail(f"{name}.dtype must be float16, bfloat16 or float32, got {t.dtype}")
        if t.shape[1] < 1 or t.shape[2] < 1:
            _fail(f"{name} must have at least one head and a head_dim >= 1, got shape "
                  f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.shape[2] != k.shape[2]:
        _fail(f"head dims differ: q has {q.shape[2]}, k has {k.shape[2]}")
    if k.shape[1] != v.shape[1]:
        _fail(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    if k.shape[0] != v.shape[0]:
        _fail(f"k and v disagree on tokens: shapes {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        _fail(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]} (GQA)")
    for name, d in (("q/k head_dim", q.shape[2]), ("v head_dim", v.shape[2])):
        if not 1 <= d <= MAX_HEAD_DIM:
            _fail(f"{name} must be in 1..{MAX_HEAD_DIM}, got {d}")


def check_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                     max_q: int, max_k: int, device: torch.device
                     ) -> tuple[int, int] | None:
    """cu_seqlens_q/k: 1-D int, equal length >= 1, on q's device or the host; and values.

    Returns the longest (query, key) segments when both were read on the host, else None.
    """
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
            _fail(f"{name} must be a 1-D tensor with at least one entry, got "
                  f"{getattr(cu, 'shape', type(cu))}")
        if cu.dtype not in INT_DTYPES:
            _fail(f"{name}.dtype must be int32 or int64, got {cu.dtype}")
        if cu.device != device and cu.device.type != "cpu":
            _fail(f"{name} is on {cu.device}, expected {device} or the host")
    if cu_q.numel() != cu_k.numel():
        _fail(f"cu_seqlens_q and cu_seqlens_k must have the same length (one entry per "
              f"segment + 1), got {cu_q.numel()} and {cu_k.numel()}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            _fail(f"{name} must be an int >= 0, got {m!r}")
    if torch.compiler.is_compiling():
        return None
    longest_qk = []
    for name, cu, total, mx in (("cu_seqlens_q", cu_q, total_q, max_q),
                                ("cu_seqlens_k", cu_k, total_k, max_k)):
        if cu.device.type != "cpu":
            continue  # values on the device: reading them would sync the stream
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0:
            _fail(f"{name}[0] must be 0, got {int(cu[0])}")
        if bool((lens < 0).any()):
            bad = int(torch.nonzero(lens < 0)[0])
            _fail(f"{name} must be non-decreasing, but {name}[{bad + 1}]={int(cu[bad + 1])} < "
                  f"{name}[{bad}]={int(cu[bad])}")
        if int(cu[-1]) != total:
            _fail(f"{name}[-1]={int(cu[-1])} does not match the tensor's {total} tokens")
        longest = int(lens.max()) if lens.numel() else 0
        if mx < longest:
            _fail(f"max_seqlen_{name[-1]}={mx} is smaller than the longest segment ({longest})")
        longest_qk.append(longest)
    return tuple(longest_qk) if len(longest_qk) == 2 else None


def check_positions(name: str, pos, total: int, device: torch.device) -> None:
    """Optional positions: 1-D int tensor, one per token, on the device or the host."""
    if pos is None:
        return
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1:
        _fail(f"{name} must be a 1-D tensor, got {getattr(pos, 'shape', type(pos))}")
    if pos.dtype not in INT_DTYPES:
        _fail(f"{name}.dtype must be int32 or int64, got {pos.dtype}")
    if pos.numel() != total:
        _fail(f"{name} has {pos.numel()} entries, expected one per token ({total})")
    if pos.device != device and pos.device.type != "cpu":
        _fail(f"{name} is on {pos.device}, expected {device} or the host")
    if pos.device.type != "cpu" or pos.numel() == 0 or torch.compiler.is_compiling():
        return  # values on the device: reading them would sync the stream
    lo, hi = (int(x) for x in torch.aminmax(pos))
    if hi >= POSITION_LIMIT or lo < POSITION_MIN:
        bad = hi if hi >= POSITION_LIMIT else lo
        _fail(f"{name} must lie in [{POSITION_MIN}, {POSITION_LIMIT}) (int32 kernels; < 0 "
              f"is padding), got {bad}")


def check_backend(backend: str, device: torch.device) -> str:
    """Our kernels' backend for ``backend`` (reject unknown names): 'auto' and the
    FlashAttention-class backends run the calls FlashAttention cannot express on Triton on
    CUDA and on the PyTorch twin elsewhere."""
    if backend not in BACKENDS:
        _fail(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("auto", "flash", "fa4"):
        return "triton" if device.type == "cuda" else "torch"
    return backend


def check_schedule(schedule, n_seg: int, max_q: int, max_k: int) -> None:
    """A caller-provided BlockSchedule must match this call's segments and lengths."""
    if schedule is None:
        return
    nqb = -(-max(max_q, 1) // schedule.block_m)
    nkb = -(-max(max_k, 1) // schedule.block_n)
    for name, blocks, side, mx in (("kv_range", nqb, "q", max_q), ("kv_full", nqb, "q", max_q),
                                   ("q_range", nkb, "k", max_k), ("q_full", nkb, "k", max_k)):
        table = getattr(schedule, name, None)
        if table is not None and tuple(table.shape) != (n_seg, blocks, 2):
            _fail(f"schedule.{name} has shape {tuple(table.shape)}, expected "
                  f"{(n_seg, blocks, 2)} for {n_seg} segments, max_seqlen_{side}={mx}")
    for name in ("q_tiles", "k_tiles"):
        if getattr(schedule, name, None) is None:
            _fail(f"schedule.{name} is missing: build the schedule from host tensors "
                  f"(BlockSchedule lists the non-empty blocks from host ranges)")
