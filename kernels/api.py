"""The public varlen attention op: validation, backend dispatch, custom-op registration.

``varlen_attn`` mirrors ``flash_attn_varlen_func`` and adds per-token positions, chunked
(Llama 4) masks, padding tokens and a choice of backend. ``varlen_attn_fwd`` /
``varlen_attn_bwd`` are the validated non-autograd halves; ``varlen_fwd_unchecked`` /
``varlen_bwd_unchecked`` are the same ops for callers that validated once (the CP
strategies, per ring step and layer): no checks, no host sync, no copies. Measured around
no-op kernels at 1K documents on one CPU core: the public halves cost ~55 us per call (the
twin used to re-check another ~30-40 us, now skipped), the unchecked ones ~15 us (the
custom-op dispatch itself). ``varlen_bwd_stats`` gives the backward's per-row terms
(delta, base-2 LSE), which a CP backward computes once per layer for all its steps.

The LSE output is differentiable (its gradient enters the backward as delta -= dlse), which
lets attention sinks (``sink.apply_softmax_sink``) be applied after the op, or after a CP
merge; the forward can also return each row's max logit for QK-clip.

Both halves are ``torch.library.custom_op``s with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces through them as opaque nodes. Inputs are validated
before anything is computed (see ``validation``). Host-side metadata (cu_seqlens and
positions on the CPU) is welcome even for CUDA tensors: it is validated on the host, a tile
schedule is built from it there, and it is copied to the device without a sync.

``max_seqlen_q/k`` may be loose upper bounds, as flash-attn callers pass them: with host
cu_seqlens (and no caller schedule) the real longest segments replace them, so neither the
launch grid nor any host table grows with the bound. With device cu_seqlens the bound sizes
the launch grid (reading the lengths would sync) and nothing on the host.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from . import environment, flash, validation
from .host_copy import one_to_device
from .schedule import BlockSchedule, build_block_schedule
from .sink import apply_softmax_sink, check_softmax_args, max_logit_of

# Read once at import (never inside forward): Triton on a CPU needs its interpreter, which
# must be switched on before triton is first imported.
_TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# None, or why the interpreter cannot run with the installed triton / numpy (triton < 3.7
# with numpy >= 2.4): raised when the Triton backend is picked, not at import, so the torch
# backend keeps working in such an environment.
_INTERPRETER_PROBLEM = (environment.interpreter_problem(
    environment.installed_version("triton"), environment.installed_version("numpy"))
    if _TRITON_INTERPRETED else None)


@functools.cache
def _backend_module(backend: str):
    """(fwd, bwd) of a resolved backend; the twin gets ``check=False`` (validated here)."""
    if backend in flash.FLASH_IMPL_BACKENDS:
        return (functools.partial(_flash_fwd, backend), functools.partial(_flash_bwd, backend))
    if backend == "triton":
        from .triton_bwd import triton_bwd
        from .triton_fwd import triton_fwd
        return triton_fwd, triton_bwd
    from .torch_attn import torch_bwd, torch_fwd
    return (functools.partial(torch_fwd, check=False),
            functools.partial(torch_bwd, check=False))


def _flash_fwd(backend, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, chunk,
               q_pos, k_pos, schedule, return_max=False):
    """The op's forward on FlashAttention (planned only without positions, chunks, a
    schedule or the row max: FA's alignment is then the op's own)."""
    return flash.flash_fwd(backend, q, k, v, cu_q, cu_k, max(max_q, 2), max_k, scale,
                           (wl, 0 if causal else wr))


def _flash_bwd(backend, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, wl,
               wr, chunk, q_pos, k_pos, schedule, dlse=None, stats=None):
    """The op's backward on FlashAttention; an LSE gradient that "flash" cannot take
    goes to our kernels, which need nothing but the same arguments."""
    if dlse is not None and backend == "flash":
        _, bwd = _backend_module(validation.check_backend("auto", q.device))
        return bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr,
                   chunk, q_pos, k_pos, schedule, dlse=dlse)
    return flash.flash_bwd(backend, dout, q, k, v, out, flash.backward_lse(lse), cu_q, cu_k,
                           max(max_q, 2), max_k, scale, (wl, 0 if causal else wr), dlse)


def resolve_backend(backend: str, device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere; ValueError for unknown names, and for
    'triton' on a CPU without the interpreter (TRITON_INTERPRET=1 before import);
    RuntimeError for 'triton' under an interpreter that cannot run with the installed numpy."""
    device = torch.device(device)
    backend = validation.check_backend(backend, device)
    if backend == "triton" and _INTERPRETER_PROBLEM is not None:
        raise RuntimeError(_INTERPRETER_PROBLEM)
    if backend == "triton" and device.type != "cuda" and not _TRITON_INTERPRETED:
        raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before "
                         "varlen_cp is imported; use backend='torch' (or 'auto') on CPUs")
    return backend


def block_sizes_for(backend: str, device, head_dim: int, head_dim_v: int, *,
                    dtype: Optional[torch.dtype] = None) -> tuple[int, int]:
    """(block_m, block_n) a ``BlockSchedule`` must use to be passed to ``backend``.

    ``dtype`` (q's) picks the Triton tiles that fit that dtype: fp32 at head dims > 128
    takes smaller ones (see ``triton_common.triton_block_sizes``); None means 16-bit.
    """
    backend = validation.check_backend(backend, torch.device(device))
    if backend == "triton":
        from .triton_common import device_arch, triton_block_sizes
        return triton_block_sizes(head_dim, head_dim_v, dtype, device_arch(device))
    # The twin walks query blocks of DEFAULT_BLOCK_M rows and takes any key range, so one
    # size serves both ends of the schedule.
    from .torch_attn import DEFAULT_BLOCK_M
    return DEFAULT_BLOCK_M, DEFAULT_BLOCK_M


def _schedule_args(schedule: Optional[BlockSchedule]):
    """A schedule as the custom ops' arguments (tensors, ints and a bool: opaque to compile)."""
    if schedule is None:
        return None, None, None, None, None, None, 0, 0, True
    return (schedule.kv_range, schedule.q_range, schedule.kv_full, schedule.q_full,
            schedule.q_tiles, schedule.k_tiles, schedule.block_m, schedule.block_n,
            schedule.padded)


def _unpack_schedule(kv_range, q_range, kv_full, q_full, q_tiles, k_tiles, block_m, block_n,
                     padded) -> Optional[BlockSchedule]:
    if kv_range is None:
        return None
    return BlockSchedule(block_m, block_n, kv_range, q_range, -1, kv_full, q_full, q_tiles,
                         k_tiles, padded)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("varlen_cp::varlen_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, causal: bool, window_left: int, window_right: int,
            chunk_size: int, q_positions: Optional[torch.Tensor],
            k_positions: Optional[torch.Tensor], backend: str,
            kv_range: Optional[torch.Tensor], q_range: Optional[torch.Tensor],
            kv_full: Optional[torch.Tensor], q_full: Optional[torch.Tensor],
            q_tiles: Optional[torch.Tensor], k_tiles: Optional[torch.Tensor],
            block_m: int, block_n: int, padded: bool, return_max: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A custom op has a fixed number of outputs: without return_max the row max is an empty
    # [Hq, 0] stand-in that costs nothing.
    fwd, _ = _backend_module(backend)
    res = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, chunk_size, q_positions, k_positions,
              _unpack_schedule(kv_range, q_range, kv_full, q_full, q_tiles, k_tiles, block_m,
                               block_n, padded), return_max=return_max)
    if return_max:
        return res
    out, lse = res
    return out, lse, lse.new_empty(lse.shape[0], 0)


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, chunk_size, q_positions, k_positions, backend, kv_range,
      q_range, kv_full, q_full, q_tiles, k_tiles, block_m, block_n, padded, return_max):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    row_max = q.new_empty(q.shape[1], q.shape[0] if return_max else 0, dtype=torch.float32)
    return out, lse, row_max


@torch.library.custom_op("varlen_cp::varlen_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
            cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, causal: bool, window_left: int, window_right: int,
            chunk_size: int, q_positions: Optional[torch.Tensor],
            k_positions: Optional[torch.Tensor], backend: str,
            kv_range: Optional[torch.Tensor], q_range: Optional[torch.Tensor],
            kv_full: Optional[torch.Tensor], q_full: Optional[torch.Tensor],
            q_tiles: Optional[torch.Tensor], k_tiles: Optional[torch.Tensor],
            block_m: int, block_n: int, padded: bool, stats: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, bwd = _backend_module(backend)
    return bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, softmax_scale, causal, window_left, window_right, chunk_size,
               q_positions, k_positions,
               _unpack_schedule(kv_range, q_range, kv_full, q_full, q_tiles, k_tiles, block_m,
                                block_n, padded), dlse=dlse, stats=stats)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, chunk, q_pos, k_pos, backend,
     *tables, block_m, block_n, padded, _return_max) = inputs
    out, lse, row_max = output
    ctx.mark_non_differentiable(row_max)  # the max logit is a statistic, not a loss term
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, q_pos, k_pos, *tables)
    ctx.meta = (max_q, max_k, scale, causal, wl, wr, chunk, backend, block_m, block_n, padded)


def _backward(ctx, dout, dlse, _drow_max):
    q, k, v, out, lse, cu_q, cu_k, q_pos, k_pos, *tables = ctx.saved_tensors
    max_q, max_k, scale, causal, wl, wr, chunk, backend, block_m, block_n, padded = ctx.meta
    # Either output may be unused by the loss (e.g. only lse): its gradient is then None.
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k,
                         scale, causal, wl, wr, chunk, q_pos, k_pos, backend, *tables,
                         block_m, block_n, padded, None)
    return (dq, dk, dv) + (None,) * 22


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------ argument prep
def _to_device_int32(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """int32 ``t`` on ``device``: host metadata is cast on the host and copied from a
    pinned staging buffer (``host_copy``); device metadata is cast in place."""
    if t is None:
        return None
    if t.device.type == "cpu":
        return one_to_device(t.to(torch.int32), device).contiguous()
    return t.to(device=device, dtype=torch.int32).contiguous()


def _on_host(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _auto_schedule(q, v, cu_q, cu_k, max_q, max_k, mask, q_pos, k_pos, backend):
    """Build the Triton tile schedule on the host when the metadata is already there.

    Only for explicit positions: with implicit ones the kernel derives exact tile bounds
    itself. Skipped while compiling (host tensor math would break the graph).
    """
    if (backend != "triton" or (q_pos is None and k_pos is None)
            or torch.compiler.is_compiling() or not _on_host(cu_q, cu_k, q_pos, k_pos)):
        return None
    from .triton_common import device_arch, triton_block_sizes
    block_m, block_n = triton_block_sizes(q.shape[-1], v.shape[-1], q.dtype,
                                          device_arch(q.device))
    causal, wl, wr, chunk = mask
    sched = build_block_schedule(cu_q, cu_k, max_q, max_k, causal=causal, window_left=wl,
                                 window_right=wr, chunk_size=chunk, q_positions=q_pos,
                                 k_positions=k_pos, block_m=block_m, block_n=block_n)
    return sched.to(q.device)


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal, window_size, chunk_size, q_positions, k_positions, backend, schedule,
             need_max=False):
    """Validate everything, then return the custom ops' arguments that follow the tensors.
    A call without positions, chunks or a schedule is FlashAttention's own call: "auto",
    "flash" and "fa4" run it there where they can (``flash.resolve_flash``)."""
    validation.check_qkv(q, k, v)
    validation.check_mask_args(window_size, chunk_size, softmax_scale)
    device = q.device
    longest = validation.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                          max_seqlen_q, max_seqlen_k, device)
    validation.check_positions("q_positions", q_positions, q.shape[0], device)
    validation.check_positions("k_positions", k_positions, k.shape[0], device)
    requested, backend = backend, resolve_backend(backend, device)
    if (q_positions is None and k_positions is None and not chunk_size and schedule is None
            and requested not in ("triton", "torch")):
        fa, _ = flash.resolve_flash(requested, device, q.dtype, q.shape[2], v.shape[2],
                                    need_max=need_max)
        backend = fa or backend
    validation.check_schedule(schedule, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k)
    mask = (bool(causal), window_size[0], window_size[1], chunk_size or 0)
    if schedule is None and longest is not None:
        # max_seqlen is only a bound (10**9 for 14 tokens cost 6-13 s and ~2 GB of host
        # tables); any bound >= the longest segment is exact for the kernels. A caller's
        # schedule keeps the caller's values, which its table shapes were checked against.
        max_seqlen_q, max_seqlen_k = longest
    if schedule is None:
        schedule = _auto_schedule(q, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, mask, q_positions, k_positions, backend)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return (_to_device_int32(cu_seqlens_q, device), _to_device_int32(cu_seqlens_k, device),
            max_seqlen_q, max_seqlen_k, scale, *mask,
            _to_device_int32(q_positions, device), _to_device_int32(k_positions, device),
            backend, *_schedule_args(schedule))


# ---------------------------------------------------------------------------- public ops
def varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=None, causal=False, window_size=(-1, -1), *, chunk_size=None,
                q_positions=None, k_positions=None, return_lse=False, backend="auto",
                schedule=None, return_max_logit=False, softmax_type="vanilla", sink=None):
    """Differentiable varlen attention, with flash_attn_varlen_func's arguments.

    q [total_q, Hq, D]; k [total_k, Hkv, D]; v [total_k, Hkv, Dv]; Hq % Hkv == 0 (GQA).
    Segment i of q (rows cu_seqlens_q[i]:cu_seqlens_q[i+1]) attends to segment i of k.
    ``max_seqlen_q/k`` may be upper bounds (as in flash-attn); see the module docstring.
    Masks: ``causal``, ``window_size=(left, right)`` (-1 unbounded) and ``chunk_size``
    (Llama 4 chunked attention) apply together, on positions: ``q_positions`` /
    ``k_positions`` (int [total], position within the document, < 2**30; < 0 marks padding
    that sees and is seen by nothing: its q/k/v/dout are never read, so NaN there is
    harmless, and its gradients are 0), or flash-attn's bottom-right alignment when omitted.
    ``backend``: "auto" (CUDA: FlashAttention for calls without positions, chunks, a
    schedule or the max logit, which are FA's own, else Triton; CPU: torch), "flash" /
    "fa4" (FlashAttention for such calls, ours for the rest; ``kernels.flash``), "triton"
    or "torch".
    ``schedule``: an optional host-built ``BlockSchedule`` (block sizes from
    ``block_sizes_for``) that bounds which tiles are visited.
    ``softmax_type``: "vanilla", "off-by-one" (a zero sink logit per head) or "learnable"
    (``sink``: fp32 [Hq] logits, which receive a gradient); see ``sink.apply_softmax_sink``.
    Returns out [total_q, Hq, Dv] in q's dtype; then with ``return_lse`` the fp32
    natural-log LSE [Hq, total_q] (differentiable; it includes the sink when one is used);
    then with ``return_max_logit`` the fp32 [Hq] max of the scaled visible scores (not
    differentiable, -inf for a head that sees nothing). A tuple when more than one.
    Rows that see no key get out 0 and LSE -inf (the sink logit with a sink).
    """
    args = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, chunk_size, q_positions, k_positions,
                    backend, schedule, return_max_logit)
    check_softmax_args(softmax_type, sink, q.shape[1], q.device)
    out, lse, row_max = _fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), *args,
                                bool(return_max_logit))
    out, lse = apply_softmax_sink(out, lse, softmax_type, sink)
    results = (out,) + ((lse,) if return_lse else ())
    if return_max_logit:
        results += (max_logit_of(row_max),)
    return results if len(results) > 1 else out


def varlen_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale=None, causal=False, window_size=(-1, -1), *,
                    chunk_size=None, q_positions=None, k_positions=None, backend="auto",
                    schedule=None, return_max_logit=False) -> tuple[torch.Tensor, ...]:
    """Forward only, no autograd: returns (out, lse), or with ``return_max_logit``
    (out, lse, row_max) with row_max fp32 [Hq, total_q] the max scaled visible score of
    each row (-inf where a row sees nothing). Other arguments as ``varlen_attn``."""
    args = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, chunk_size, q_positions, k_positions,
                    backend, schedule, return_max_logit)
    with torch.no_grad():
        out, lse, row_max = _fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), *args,
                                    bool(return_max_logit))
    return (out, lse, row_max) if return_max_logit else (out, lse)


def _check_bwd_tensors(dout, q, v, out, lse, dlse) -> None:
    """Shapes of the backward-only inputs, before any compute."""
    if dout.shape != out.shape or out.shape[:2] != q.shape[:2] or out.shape[2] != v.shape[2]:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must both be "
                         f"[total_q, Hq, Dv] = {(q.shape[0], q.shape[1], v.shape[2])}")
    if lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 [Hq, total_q] = {(q.shape[1], q.shape[0])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    if dlse is not None and (not isinstance(dlse, torch.Tensor)
                             or dlse.shape != lse.shape or dlse.dtype != torch.float32
                             or dlse.device != lse.device):
        raise ValueError(f"dlse must be None or fp32 [Hq, total_q] = "
                         f"{(q.shape[1], q.shape[0])} on {lse.device}, got "
                         f"{getattr(dlse, 'dtype', type(dlse))} "
                         f"{tuple(getattr(dlse, 'shape', ()))} on {getattr(dlse, 'device', '-')}")


def varlen_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), *,
                    chunk_size=None, q_positions=None, k_positions=None, backend="auto",
                    schedule=None, dlse=None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward only: (dq, dk, dv) for this call's keys.

    ``out`` and ``lse`` may be the final results merged over several calls (a CP step
    sequence): the gradients are then this call's share, as ring attention needs.
    ``dlse`` (fp32 [Hq, total_q] or None = zeros) is the gradient of that final LSE (e.g.
    from a sink or a loss on the LSE); pass the same one to every step.
    """
    args = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, chunk_size, q_positions, k_positions,
                    backend, schedule)
    _check_bwd_tensors(dout, q, v, out, lse, dlse)
    with torch.no_grad():
        return _bwd_op(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                       out.contiguous(), lse.contiguous(),
                       None if dlse is None else dlse.contiguous(), *args, None)


# ------------------------------------------------------------- validated-once entries
def varlen_fwd_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                         causal: bool, window_left: int, window_right: int, chunk_size: int,
                         q_positions: Optional[torch.Tensor],
                         k_positions: Optional[torch.Tensor], backend: str,
                         schedule: Optional[BlockSchedule], return_max: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``varlen_attn_fwd`` without validation, for callers that validated once (CP steps).

    Contract (unchecked; a violation is undefined behaviour, not a ValueError): arguments
    as ``varlen_attn_fwd`` would accept them; cu_seqlens and positions (or None) int32 on
    q's device; ``max_seqlen_*`` >= the longest segment (and matching ``schedule``'s
    tables when one is given); ``chunk_size`` 0 for none; ``backend`` from
    ``resolve_backend``; ``schedule`` None or on q's device. No host sync (the torch twin
    on a GPU excepted, see ``torch_attn``), no copies of the metadata; the same custom op as the
    public entry (torch.compile traces it), under no_grad. -> (out, lse, row_max or None unless
    ``return_max``).
    """
    with torch.no_grad():
        out, lse, row_max = _fwd_op(q.contiguous(), k.contiguous(), v.contiguous(),
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    float(softmax_scale), bool(causal), window_left,
                                    window_right, chunk_size, q_positions, k_positions,
                                    backend, *_schedule_args(schedule), bool(return_max))
    return out, lse, (row_max if return_max else None)


def varlen_bwd_unchecked(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         softmax_scale: float, causal: bool, window_left: int,
                         window_right: int, chunk_size: int,
                         q_positions: Optional[torch.Tensor],
                         k_positions: Optional[torch.Tensor], backend: str,
                         schedule: Optional[BlockSchedule],
                         stats: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``varlen_attn_bwd`` without validation: (dq, dk, dv). The contract of
    ``varlen_fwd_unchecked``, plus ``dout`` like out, ``lse`` and ``dlse`` (or None) fp32
    [Hq, total_q]. ``stats``: :func:`varlen_bwd_stats` of the same dout, out, lse, dlse
    and backend (then ``dlse`` is not read), computed once for every call that shares them
    (the steps of a CP backward); None computes it here."""
    with torch.no_grad():
        return _bwd_op(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                       out.contiguous(), lse.contiguous(),
                       None if dlse is None else dlse.contiguous(), cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale),
                       bool(causal), window_left, window_right, chunk_size, q_positions,
                       k_positions, backend, *_schedule_args(schedule), stats)


@torch.library.custom_op("varlen_cp::bwd_stats", mutates_args=())
def _stats_op(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              dlse: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    if backend == "triton":
        from .triton_bwd import triton_bwd_stats
        return triton_bwd_stats(dout, out, lse, dlse)
    from .torch_attn import torch_bwd_stats
    return torch_bwd_stats(dout, out, lse, dlse)


@_stats_op.register_fake
def _(dout, out, lse, dlse, backend):
    wide = out.dtype == torch.float64 and backend == "torch"  # the twin's fp64 accumulation
    return lse.new_empty((2, *lse.shape), dtype=torch.float64 if wide else torch.float32)


def varlen_bwd_stats(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dlse: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """[2, Hq, total_q]: delta = rowsum(dO * O) - dlse, and the LSE in base 2, with 0 and
    +inf on rows whose lse is -inf; fp32 (fp64 for the twin's fp64 inputs). The per-row
    terms every backward call of one layer shares: a CP backward computes them once and
    passes them to each step's :func:`varlen_bwd_unchecked`, instead of each step
    recomputing delta (with fp32 temporaries the size of the output). Unchecked, like
    that entry; ``backend`` as resolved there."""
    with torch.no_grad():
        return _stats_op(dout.contiguous(), out.contiguous(), lse.contiguous(),
                         None if dlse is None else dlse.float().contiguous(), backend)
