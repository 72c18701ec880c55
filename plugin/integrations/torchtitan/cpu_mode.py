"""CPU mode: the documented switches that let torchtitan 0.3.0 train on a machine without CUDA.

torchtitan picks its device once, at import of ``torchtitan.tools.utils`` (``device_type``
defaults to "cuda" when no accelerator is found), and several modules copy that value at
their own import. So ``enable_cpu_mode()`` must run before any other torchtitan import; the
launcher (``varlen_cp.integrations.torchtitan.train``) calls it first. Everything this module
changes:

- ``torchtitan.tools.utils.device_type`` -> "cpu" (so ``init_distributed`` picks gloo,
  torch's default backend for cpu) and ``device_module`` -> ``CpuDeviceModule``: torch.cpu
  plus the few ``torch.cuda``-style calls torchtitan makes (device name, properties,
  memory stats), answered with the host's values.
- single-process launches (no torchrun) get the rendezvous variables torchrun would set
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
- ``force_sum_reduction(model)``: FSDP reduces gradients with PREMUL_SUM, which gloo
  rejects; asking FSDP for plain SUM reductions fixes it (gradient division is already off
  in torchtitan: the loss is normalised by the global token count). ``with_sum_reduction``
  appends it to a torchtitan model's own parallelize function.
- ``cpu_overrides()``: config values CPU runs need: fp32 parameters (bf16 was ~3x slower on
  an AVX2-only CPU and the fp32 CP=1 vs CP=N comparison needs fp32), no CUDA graphs.
  ``[compile] enable = true`` works on CPU too (inductor needs a C++ compiler; "aot_eager"
  does not): the CP attention is one opaque custom op in the compiled blocks.
Limits: nothing here makes CUDA-only kernels run on CPU (varlen_cp's torch backend does the
attention); CUDA graphs and float8 stay off.
"""

from __future__ import annotations

import os
import socket
import sys
import types
from typing import Any

import torch

_ENABLED = False


def cuda_available() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


def enable_cpu_mode() -> None:
    """Point torchtitan at the CPU. Must run before any other torchtitan module is imported."""
    global _ENABLED
    if _ENABLED:
        return
    late = [m for m in ("torchtitan.trainer", "torchtitan.distributed.utils",
                        "torchtitan.distributed.parallel_dims") if m in sys.modules]
    if late:
        raise RuntimeError(f"enable_cpu_mode() must run before torchtitan modules are imported; "
                           f"already imported: {late}")
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = CpuDeviceModule()
    _ENABLED = True


class CpuDeviceModule:
    """``torch.cpu`` with the extra ``torch.cuda``-style functions torchtitan calls on its
    device module (its memory monitor and trainer); memory statistics are not tracked."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(name="cpu", total_memory=pages * page_size)

    @staticmethod
    def current_device() -> int:
        # torch.cpu answers "cpu"; torchtitan passes this to barrier(device_ids=[...]), which
        # wants an int (gloo ignores it).
        return 0

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def is_cpu_mode() -> bool:
    return _ENABLED


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_single_process_env() -> None:
    """Set torchrun's rendezvous variables for a plain ``python -m`` launch (one process)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def cpu_overrides() -> dict[str, dict[str, Any]]:
    """Config values (section -> key -> value) that CPU runs need; applied before the TOML."""
    return {
        "training": {"mixed_precision_param": "float32", "disable_cuda_graphs": True},
    }


def with_sum_reduction(parallelize_fn: Any) -> Any:
    """A model's parallelize function followed by ``force_sum_reduction`` (for torchtitan's
    own models, whose parallelize functions apply FSDP themselves)."""

    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize_fn(model, **kwargs)
        force_sum_reduction(model)
        return model

    parallelize.varlen_cp_cpu = True  # type: ignore[attr-defined]
    return parallelize


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Make every FSDP module reduce with SUM (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
