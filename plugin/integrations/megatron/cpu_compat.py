"""CPU shims for megatron-core: the one place that bends megatron to run without CUDA.

Used only on CPU (tests, the CPU demo); on a GPU none of this is needed or applied.
megatron-core 0.16.1 hard-codes CUDA in a few spots a CPU run reaches:
``torch.cuda.current_device()`` (RotaryEmbedding, DotProductAttention), tensors created with
``device="cuda"`` (the no-pipelining schedule's token counter, fused_softmax's causal and
sliding-window masks), ``pin_memory=True`` + ``.cuda()`` (``get_pos_emb_on_this_cp_rank``),
and the CUDA RNG tracker. ``megatron_on_cpu()`` redirects them to the CPU for its duration:
a torch function mode rewrites CUDA device arguments to "cpu", drops ``pin_memory`` and
makes ``Tensor.cuda`` / ``Tensor.pin_memory`` no-ops; ``torch.cuda.current_device`` returns
0, which the mode then maps to the CPU as well.

Limits: process-wide while active (not thread-safe); costs a Python call per torch op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_IDENTITY_METHODS = {torch.Tensor.cuda, torch.Tensor.pin_memory}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index names a CUDA device
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements of every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _IDENTITY_METHODS:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def is_cpu_only() -> bool:
    """True when this process has no usable CUDA device (the shims are needed)."""
    return not torch.cuda.is_available()


def init_cpu_rng(seed: int = 0) -> None:
    """Seed torch and install megatron's CUDA-free RNG tracker (dropout regions fork it)."""
    from megatron.core.tensor_parallel import random as mp_random

    torch.manual_seed(seed)
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run megatron-core code on the CPU; a no-op when CUDA is available."""
    if not is_cpu_only():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]
