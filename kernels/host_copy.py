"""Host -> device copies of host-built tables, from pinned staging buffers that are reused.

Every table the plan and the schedules build (cu_seqlens, positions, tile ranges, index
maps) lives on the host and is copied to the device once per plan, usually by the planner
thread while the current step runs. ``non_blocking=True`` from pageable memory is not
asynchronous on CUDA: the driver stages the bytes through its own pinned buffer and the
calling thread waits until the stream reaches the copy, i.e. behind the running step's
kernels (the planner thread is tied to GPU progress, a cache miss in forward stalls it).

:func:`to_device` packs the tables of one call into ONE pinned staging buffer (a host
memcpy), issues ONE ``non_blocking`` copy into one device buffer and returns views of it
(one allocation and one copy per kernel call's tables instead of six). It records an event
on the current stream after the copy; a staging buffer goes back into the pool and is handed
out again only once its event has completed, i.e. once the copy has read it, so bytes still
in flight are never overwritten (a busy pool grows by one buffer instead of waiting).
Targets other than CUDA: no copy and no pinning at all (``pin_memory`` needs a CUDA driver;
on a CPU the tables are already where they are used).

Limits: the copy is ordered on the calling thread's current stream; a consumer on another
stream must wait for it (the integrations run everything on the default stream). Staging
buffers are kept for the process's life (at most ``MAX_BUFFERS``, sized to the largest
call: a few MB at 128K tokens).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

ALIGN = 16            # byte offset of each table in the staging buffer (any dtype's view)
MIN_BYTES = 1 << 16   # smallest staging buffer; sizes round up to powers of two
MAX_BUFFERS = 8       # free buffers kept per device beyond those in flight


@dataclass
class _Slot:
    buffer: torch.Tensor          # pinned uint8
    event: Any = None             # recorded after the last copy from it; None: never used
    busy: bool = False            # being filled by a thread right now

    def ready(self) -> bool:
        return not self.busy and (self.event is None or self.event.query())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _on_device(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _event(device: torch.device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class HostStager:
    """Pool of pinned staging buffers per device (see the module docstring). The three
    factories are injectable so that the pool's logic is testable without a GPU."""

    def __init__(self, pinned: Callable[[int], torch.Tensor] = _pinned,
                 on_device: Callable[[int, torch.device], torch.Tensor] = _on_device,
                 event: Callable[[torch.device], Any] = _event) -> None:
        self._pinned, self._on_device, self._event = pinned, on_device, event
        self._slots: dict[str, list[_Slot]] = {}
        self._lock = threading.Lock()
        self.allocations = 0   # staging buffers made (tests, diagnostics)

    def _take(self, nbytes: int, device: torch.device) -> _Slot:
        with self._lock:
            slots = self._slots.setdefault(str(device), [])
            fits = [s for s in slots if s.buffer.numel() >= nbytes and s.ready()]
            if fits:
                slot = min(fits, key=lambda s: s.buffer.numel())
            else:
                size = max(MIN_BYTES, 1 << (nbytes - 1).bit_length())
                slot = _Slot(self._pinned(size))
                self.allocations += 1
                free = [s for s in slots if s.ready()]
                if len(free) >= MAX_BUFFERS:   # drop the smallest free one
                    slots.remove(min(free, key=lambda s: s.buffer.numel()))
                slots.append(slot)
            slot.busy = True
            return slot

    def copy(self, tensors: Sequence[Optional[torch.Tensor]], device: torch.device
             ) -> list[Optional[torch.Tensor]]:
        """Device copies (views of one device buffer) of the host ``tensors`` (None kept)."""
        host = [None if t is None else t.detach().contiguous() for t in tensors]
        offsets, total = [], 0
        for t in host:
            offsets.append(total)
            if t is not None:
                total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        if total == 0:
            return [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device)
                    for t in host]
        slot = self._take(total, device)
        try:
            for t, at in zip(host, offsets):
                if t is not None and t.numel():
                    n = t.numel() * t.element_size()
                    slot.buffer[at:at + n].view(t.dtype).copy_(t.reshape(-1))
            dev = self._on_device(total, device)
            dev.copy_(slot.buffer[:total], non_blocking=True)
            slot.event = self._event(device)
        finally:
            slot.busy = False
        out: list[Optional[torch.Tensor]] = []
        for t, at in zip(host, offsets):
            if t is None:
                out.append(None)
            else:
                n = t.numel() * t.element_size()
                out.append(dev[at:at + n].view(t.dtype).view(t.shape))
        return out


_STAGER = HostStager()


def stager() -> HostStager:
    """The process-wide pool (replaceable in tests through :func:`set_stager`)."""
    return _STAGER


def set_stager(new: HostStager) -> HostStager:
    """Install ``new`` as the process-wide pool; returns the previous one."""
    global _STAGER
    old, _STAGER = _STAGER, new
    return old


def to_device(tensors: Sequence[Optional[torch.Tensor]], device: Any
              ) -> list[Optional[torch.Tensor]]:
    """``tensors`` (host tables, or None) on ``device``: on CUDA one ``non_blocking`` copy
    from a pinned, reused staging buffer (module docstring); elsewhere the tensors
    themselves (CPU) or a plain copy."""
    device = torch.device(device)
    if device.type == "cuda":
        return _STAGER.copy(tensors, device)
    return [t if t is None or t.device == device else t.to(device) for t in tensors]


def one_to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """:func:`to_device` of a single table."""
    return to_device([t], device)[0]
