"""Host memory for per-batch planning: keep freed heap memory instead of faulting it back.

Each batch's plan and tables are a few MB of host arrays (at 128K tokens: the token tables,
~2.5 MB, and each call's tile tables, up to ~1.2 MB each), made while the previous batch's
plan is dropped. With glibc's default malloc, freeing them trims the heap (its trim
threshold follows the largest freed block, ~2x a few MB) and arrays above the mmap
threshold get fresh pages from the kernel, so the next batch page-faults all of it back:
measured with ``bench/host_tables.py`` at cp 8 (one core, thread CPU time), 36-40% of
``build_plan`` + ``build_tables`` (few_long, a2a: 19.6 ms -> 11.5 ms; lognormal_1k, auto:
10.1 -> 8.4 ms), and ~25K minor faults per 100 MB allocated and freed.

:func:`keep_freed_host_memory` raises both thresholds once per process (trim 256 MiB, mmap
32 MiB) with ``mallopt``: freed blocks up to 32 MiB stay in the heap for the next batch.
The cost is that a process keeps up to 256 MiB of freed heap it would otherwise give back,
on nodes with hundreds of GB. It is process-wide (like tcmalloc or jemalloc preloaded),
logged at DEBUG on the ``varlen_cp`` logger, and opt-out: ``VARLEN_CP_MALLOC_TUNING=0`` keeps glibc's defaults. Nothing happens on
other C libraries (musl, macOS, Windows). The integrations call it when they start their
plan prefetcher; ``bench/host_tables.py`` times with it, as they run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

TRIM_THRESHOLD = 256 << 20       # free heap kept before glibc returns it to the kernel
MMAP_THRESHOLD = 32 << 20        # allocations below this come from the heap (glibc's max
                                 # dynamic value; larger ones are rare in planning)
ENV = "VARLEN_CP_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h parameter numbers

_lock = threading.Lock()
_state: dict[str, bool] = {}
_log = logging.getLogger("varlen_cp")


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc (None elsewhere: mallopt's parameters are glibc's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl has no such symbol  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


ON, OFF = ("1", "true", "on"), ("0", "false", "off")


def malloc_tuning() -> bool:
    """``VARLEN_CP_MALLOC_TUNING`` read (unset: on); ValueError naming the variable and its
    value for anything but 0 / 1 / true / false / on / off (empty included). The launchers
    call it before they build a model, so a typo fails there, not at the first batch."""
    raw = os.environ.get(ENV, "1")
    setting = raw.strip().lower()
    if setting not in ON + OFF:
        raise ValueError(f"environment variable {ENV} must be one of {', '.join(ON + OFF)} "
                         f"(unset: 1), got {raw!r}")
    return setting in ON


def keep_freed_host_memory() -> bool:
    """Keep freed host memory for reuse (see the module docstring); once per process.
    True when glibc took the settings (now or earlier), False when opted out with
    ``VARLEN_CP_MALLOC_TUNING=0`` or not on glibc."""
    with _lock:
        if "applied" in _state:
            return _state["applied"]
        applied = False
        libc = _glibc() if malloc_tuning() else None
        if libc is not None:
            applied = bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
                libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        _state["applied"] = applied
        if applied:   # debug: with the report switched off the plugin prints nothing
            _log.debug("varlen-cp: host malloc keeps freed memory for the next batch's plan "
                      "(glibc trim threshold %d MiB, mmap threshold %d MiB; %s=0 keeps "
                      "glibc's defaults)", TRIM_THRESHOLD >> 20, MMAP_THRESHOLD >> 20, ENV)
        return applied
