"""FlashAttention-class kernels: torch's own flash ops ("flash") and FlashAttention 4 ("fa4").

Both run FlashAttention's varlen form: segments of query rows against segments of key rows
(``cu_seqlens_q`` / ``cu_seqlens_k``), one window per call, causal and window masks aligned
to each segment's bottom-right corner: query row i of a segment with sq queries and sk keys
sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (-1: unbounded; causal
is right = 0). Which of our calls can be written that way, and how, is decided on the host
(``varlen_cp.tables.flash_form``); this module only runs such calls.

- "flash": ``torch.ops.aten._flash_attention_forward`` / ``_backward``, called directly
  (same schema in torch 2.11 and 2.14): FlashAttention-2 in every CUDA build of torch,
  FA3 or FA4 once activated with ``torch.nn.attention.activate_flash_attention_impl``
  (which re-registers these very ops). Not through torch's varlen wrapper in
  ``torch.nn.attention``: it drops the LSE gradient and, on torch 2.14, sends non-causal
  calls to cuDNN, whose packed-input alignment is top-left. On a CPU tensor the same ops run whatever CPU kernel
  is registered for them (none in torch: the tests register an emulator).
- "fa4": the ``flash-attn-4`` package (``flash_attn.cute.interface``), called directly;
  it also takes the LSE's gradient (``dlse``).

Conventions fixed here, once: a row that sees no key gets LSE -inf (FA2 / FA3 write +inf,
FA4 -inf), so an LSE merge never takes it for a real score; the backward is handed +inf
on such rows (P = exp(s - lse) = 0 there). Rows
outside every segment are never written by FlashAttention: callers cover every row with a
segment (``flash_form`` adds empty ones).

Limits ("flash"): fp16 / bf16, q, k and v of one head dim (a multiple of 8, <= 256), no
LSE gradient, no row max. "fa4": fp16 / bf16, head dims per architecture (sm90: 8..256;
sm100: 8..128, (192, 128), (256, 256)), no row max.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

FLASH_IMPL_BACKENDS = ("flash", "fa4")
"""The backends that run calls in FlashAttention's form (``validation.BACKENDS``' others
are ours, or "auto")."""
FA4_VERSION = "4.0.0b36"
"""The flash-attn-4 release this module is written and tested against (``varlen-cp[fa4]``
pins it; tests/kernels/test_flash_emulator.py checks its call signatures)."""

_DTYPES = (torch.float16, torch.bfloat16)


TRITON_BEATS_FA2_FROM = (9, 0)
"""From this compute capability on, ``auto`` keeps our Triton kernels where torch's flash
ops would run FA2: on an H200 (torch 2.11, bf16, d 128) FA2 did 333 / 312 TFLOP/s forward /
backward on one 32K causal document against our kernels' 420 / 355, and lost on most of the
CP-rank replay's calls too (bench/results/NVIDIA_H200.json). Below it (A100 and older) FA2
is the field's tuned kernel and ours are untimed: ``auto`` takes FA2 there."""


# ------------------------------------------------------------------------ availability
def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device``; (0, 0) where this process
    has no CUDA to ask (tables planned for a CUDA device on a host without one, as the
    tests' stand-in device does: the preference below sm90 then applies)."""
    if not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(device))


def active_flash_impl() -> Optional[str]:
    """The implementation torch's flash ops run once switched: "FA3" / "FA4" after
    ``torch.nn.attention.activate_flash_attention_impl`` (``flash_impl``), None for the
    built-in FA2 (also on a torch without that registry)."""
    from torch.nn import attention
    current = getattr(attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


def has_flash_kernel(device: torch.device) -> bool:
    """Whether torch's flash ops have a kernel for ``device``'s dispatch key (CUDA builds:
    yes; CPU: only when one was registered, as the tests do)."""
    key = "CUDA" if device.type == "cuda" else "CPU"
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_flash_attention_forward", key))


@functools.cache
def fa4_interface():
    """``flash_attn.cute.interface`` of flash-attn-4, or None when it cannot be imported."""
    try:
        return importlib.import_module("flash_attn.cute.interface")
    except Exception:  # not installed, or its CUDA libraries missing: not usable here
        return None


def call_limits(backend: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                need_lse_grad: bool = False, need_max: bool = False) -> Optional[str]:
    """Why ``backend`` ("flash" or "fa4") cannot run calls of this kind on any machine
    (None: it can on some): the limits that depend on the call alone, which the offline
    plan report applies too (FA4's sm100 head dims are machine limits: in ``unsupported``)."""
    if need_max:
        return "the row max (QK-clip) is not an output of FlashAttention"
    if dtype not in _DTYPES:
        return f"{dtype} (FlashAttention takes float16 / bfloat16)"
    if backend == "flash":
        if need_lse_grad:
            return "an LSE gradient (sinks, or a returned LSE): FA2 / FA3 drop it"
        if head_dim != head_dim_v:
            return f"head dims {head_dim}/{head_dim_v} (torch's flash ops need one head dim)"
        if head_dim % 8 or head_dim > 256:
            return f"head dim {head_dim} (torch's flash ops: a multiple of 8, <= 256)"
        return None
    if head_dim % 8 or head_dim_v % 8 or not (8 <= min(head_dim, head_dim_v)
                                              and max(head_dim, head_dim_v) <= 256):
        return f"head dims {head_dim}/{head_dim_v} (FA4: 8..256, multiples of 8)"
    return None


def unsupported(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                head_dim_v: int, need_lse_grad: bool = False, need_max: bool = False
                ) -> Optional[str]:
    """Why ``backend`` ("flash" or "fa4") cannot run calls of this kind on ``device``
    (None: it can): :func:`call_limits`, then what this machine has. The reason names the
    limit, for the plan report and the docs."""
    why = call_limits(backend, dtype, head_dim, head_dim_v, need_lse_grad, need_max)
    if why is not None:
        return why
    if backend == "flash":
        return None if has_flash_kernel(device) else \
            f"no flash kernel registered for {device.type}"
    if fa4_interface() is None:
        return "the flash-attn-4 package is not installed (pip install varlen-cp[fa4])"
    if device.type == "cuda":
        major = capability(device)[0]
        if major < 9:
            return f"sm{major}x (FA4's backward needs sm90 or newer)"
        small = head_dim <= 128 and head_dim_v <= 128
        if major >= 10 and not (small or (head_dim, head_dim_v) in ((192, 128), (256, 256))):
            return f"head dims {head_dim}/{head_dim_v} on sm{major}x (FA4: <= 128, 192/128, 256)"
    return None


# ------------------------------------------------------------------------------- calls
def _windows(window: tuple[int, int]) -> tuple[bool, Optional[int], Optional[int]]:
    """(causal, left, right) as both libraries want them: (-1, 0) is the plain causal
    call; other windows explicit, None for an unbounded side."""
    left, right = window
    if left < 0 and right == 0:
        return True, None, None
    return False, (None if left < 0 else left), (None if right < 0 else right)


def flash_fwd(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
              window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, Hq, Dv] in q's dtype, lse fp32 [Hq, Tq], -inf on rows that see nothing)
    of one varlen call; ``cu_q`` / ``cu_k`` int32 on q's device covering every row."""
    causal, left, right = _windows(window)
    if backend == "flash":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right)
        # FA2 / FA3: +inf marks a row without keys (an LSE merge must not read it as a score)
        lse = lse.masked_fill_(lse == float("inf"), float("-inf"))
    else:
        out, lse, *_ = fa4_interface()._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, softmax_scale=scale, causal=causal, window_size_left=left,
            window_size_right=right, return_lse=True)
    return out, lse


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """The LSE FlashAttention's backward is handed: +inf where the (merged) LSE is -inf,
    so P = exp(s - lse) is 0 on rows that see nothing, explicitly (FA2 / FA3 / FA4 read an
    LSE of -inf as 0, which is harmless only while such rows have no visible pair in the
    call: +inf does not depend on that). Made once per layer, shared by its calls."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def flash_bwd(backend: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
              window: tuple[int, int], dlse: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one varlen call given the FINAL out / lse (``backward_lse`` of the
    merged one) and, "fa4" only, the LSE's gradient. Deterministic when torch's
    deterministic algorithms are on (aten reads the flag; FA4 is passed it)."""
    causal, left, right = _windows(window)
    if backend == "flash":
        if dlse is not None:
            raise RuntimeError("backend 'flash' cannot take an LSE gradient; such calls are "
                               "routed to 'fa4' or the Triton kernels when planned")
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        unused = torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=scale, window_size_left=left, window_size_right=right)
    dq, dk, dv, *_ = fa4_interface()._flash_attn_bwd(
        q, k, v, out, dout, lse, scale, causal, window_size_left=left,
        window_size_right=right, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, deterministic=torch.are_deterministic_algorithms_enabled(),
        dlse=dlse)
    return dq, dk, dv


# -------------------------------------------------------------------------- resolution
def check_available(backend: str, device: torch.device) -> None:
    """ValueError when "flash" / "fa4" cannot run on ``device`` at all (no kernel registered
    for a CPU; the package missing). Asks nothing of the GPU, so a launcher checks it
    before any process touches one."""
    device = torch.device(device)
    if backend == "flash" and not has_flash_kernel(device):
        raise ValueError(f"backend='flash' on {device.type}: torch has no flash attention "
                         f"kernel for this device (CUDA builds have one; on a CPU only a "
                         f"registered implementation, as the tests register, can run it)")
    if backend == "fa4" and fa4_interface() is None:
        raise ValueError("backend='fa4' needs the flash-attn-4 package "
                         f"(pip install 'varlen-cp[fa4]', version {FA4_VERSION})")


def resolve_flash(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                  head_dim_v: int, need_lse_grad: bool = False, need_max: bool = False
                  ) -> tuple[Optional[str], Optional[str]]:
    """(FlashAttention-class backend for this kind of call or None, why not): "auto" picks
    "fa4" where installed and able, else "flash" where torch's flash ops run FA3 / FA4
    (activated) or the GPU predates sm90 (FA2 there), else our Triton kernels, which beat
    FA2 on sm90 and newer (``TRITON_BEATS_FA2_FROM``); on CPUs our PyTorch twin; "flash" /
    "fa4" are taken where they can run this kind of call and give way
    to our kernels where not (the reason says why). ValueError when "flash" / "fa4" cannot
    run on ``device`` at all (no kernel registered for a CPU; the package missing)."""
    device = torch.device(device)
    if backend in ("triton", "torch"):
        return None, f"backend {backend!r}"
    if backend == "auto":
        if device.type != "cuda":
            return None, "backend 'auto' on a CPU runs the PyTorch twin"
        why = unsupported("fa4", device, dtype, head_dim, head_dim_v, need_lse_grad, need_max)
        if why is None:
            return "fa4", None
        why_flash = unsupported("flash", device, dtype, head_dim, head_dim_v, need_lse_grad,
                                need_max)
        if why_flash:   # (also where torch has no CUDA kernel: asked before the GPU is)
            return None, why_flash
        if active_flash_impl() is None and capability(device) >= TRITON_BEATS_FA2_FROM:
            return None, (f"torch's flash ops run FA2, which our Triton kernels outrun on "
                          f"sm{''.join(map(str, capability(device)))} "
                          f"(bench/results/NVIDIA_H200.json); "
                          f"'auto' takes FA when flash-attn-4 is installed or flash_impl "
                          f"activates FA3 / FA4")
        return "flash", None
    check_available(backend, device)
    why = unsupported(backend, device, dtype, head_dim, head_dim_v, need_lse_grad, need_max)
    return (None, why) if why else (backend, None)


FLASH_IMPLS = ("FA3", "FA4")


def activate_flash_impl(impl: Optional[str]) -> None:
    """Switch torch's flash ops (backend "flash") to FlashAttention 3 or 4
    (``torch.nn.attention.activate_flash_attention_impl``), as torchtitan does at start-up;
    None: leave them as they are (FA2). ValueError naming the package when it is missing."""
    if impl is None:
        return
    if impl not in FLASH_IMPLS:
        raise ValueError(f"flash_impl must be one of {FLASH_IMPLS} or None, got {impl!r}")
    from torch.nn import attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        raise ValueError(f"flash_impl={impl!r} needs torch >= 2.11 "
                         f"(torch.nn.attention.activate_flash_attention_impl); this is "
                         f"torch {torch.__version__}")
    try:
        attention.activate_flash_attention_impl(impl)
    except Exception as e:  # the implementation's package is missing or cannot load
        package = "flash_attn_interface (FlashAttention 3, built from source)" \
            if impl == "FA3" else f"flash-attn-4 (pip install 'varlen-cp[fa4]')"
        raise ValueError(f"flash_impl={impl!r}: torch could not activate it ({e}); it needs "
                         f"{package} on a CUDA machine") from None
