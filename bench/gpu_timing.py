"""Timing and time budgets of the GPU suite (``bench/gpu.sh``).

``measure`` times a callable: CUDA events around each repetition on a GPU (median of the
repetitions, after a warm-up that also pays Triton's and torch.compile's compilation), the
wall clock on a CPU (the dry run: a timing there only proves the path runs). The number of
repetitions adapts to the call's length (about ``target_s`` of timed work, 3..``max_reps``),
so a 30 ms backward and a 0.1 ms short-document forward both get a stable median without
spending the suite's 10 minutes on either.

``Budget`` is a deadline: every part of the suite gets one, and a case that would start
after it is recorded as skipped ("budget") instead of run, so the suite always ends, and
always writes its JSON, within its time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Budget:
    """A deadline (``time.monotonic()`` seconds) with a name for the records."""

    name: str
    deadline: float

    @classmethod
    def of(cls, name: str, seconds: float, within: "Budget | None" = None) -> "Budget":
        """``seconds`` from now, but never past ``within``'s deadline."""
        end = time.monotonic() + seconds
        if within is not None:
            end = min(end, within.deadline)
        return cls(name, end)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float = 0.0) -> bool:
        """True when ``seconds`` of work still end before the deadline."""
        return self.left() > seconds


@dataclass(frozen=True)
class Timing:
    """Median milliseconds over ``reps`` repetitions (``first_ms``: the warm-up call);
    ``last``: what the last call returned (so a dry run calls each function once)."""

    ms: float
    reps: int
    first_ms: float
    last: Any = field(default=None, repr=False, compare=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once_ms(fn: Callable[[], object], device: torch.device, keep: list) -> float:
    """Milliseconds of one call; its result replaces ``keep[0]``."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        keep[0] = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    keep[0] = fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(fn: Callable[[], object], device: torch.device, *, target_s: float = 0.3,
            max_reps: int = 20, min_reps: int = 3, budget: Budget | None = None) -> Timing:
    """Median time of ``fn`` (see the module docstring). ``min_reps=0``: the warm-up call
    is the timing (the dry run). Fewer repetitions when ``budget`` runs short (at least
    one)."""
    keep: list = [None]
    _sync(device)
    first = _once_ms(fn, device, keep)
    _sync(device)
    if min_reps == 0:
        return Timing(first, 1, first, keep[0])
    # the warm-up includes compilation: time one more call to size the repetitions
    probe = _once_ms(fn, device, keep)
    reps = int(min(max_reps, max(min_reps, target_s * 1e3 / max(probe, 1e-3))))
    if budget is not None:
        per_call_s = max(probe, 1e-3) / 1e3
        reps = max(1, min(reps, int(budget.left() / per_call_s / 2)))
    times = [_once_ms(fn, device, keep) for _ in range(reps)]
    _sync(device)
    times.sort()
    return Timing(times[len(times) // 2], reps, first, keep[0])
