"""varlen_cp.host_memory: freed host memory stays in the heap for the next batch's tables.

Behaviour, not settings: a fresh process allocates and frees 20 x 1 MiB arrays a few times
(a batch's tables, made and dropped) and counts its minor page faults; with the tuning the
memory comes back from the heap (no faults), with glibc's defaults (the opt-out) it is
trimmed and faulted back every time (~5K faults per cycle). ~2 s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from varlen_cp import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's mallopt only")

CYCLES = """
import resource, numpy as np
from varlen_cp.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()

def cycle():
    tables = [np.ones(1 << 17) for _ in range(20)]   # 20 x 1 MiB, written
    del tables

cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str | None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    if setting is not None:
        env[host_memory.ENV] = setting
    out = subprocess.run([sys.executable, "-c", CYCLES], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_tables_are_reused_without_page_faults():
    applied, tuned = _faults(None)
    off, default = _faults("0")
    assert applied and not off
    # 5 cycles x 20 MiB: glibc's defaults fault most of the 25K pages back every time
    assert default > 5000, default
    assert tuned < default / 20, (tuned, default)


def test_bad_setting_is_refused(monkeypatch):
    monkeypatch.setattr(host_memory, "_state", {})
    monkeypatch.setenv(host_memory.ENV, "sometimes")
    with pytest.raises(ValueError, match="VARLEN_CP_MALLOC_TUNING.*sometimes"):
        host_memory.keep_freed_host_memory()


def test_the_prefetcher_applies_it_once(monkeypatch):
    """Starting a PlanPrefetcher (what both integrations do) applies the setting, once."""
    from varlen_cp.prefetch import PlanPrefetcher

    calls = []
    monkeypatch.setattr(host_memory, "_state", {})
    monkeypatch.setattr(host_memory, "_glibc", lambda: calls.append(1) or None)
    for _ in range(2):
        list(PlanPrefetcher([1, 2], lambda item: item, enabled=False))
    assert calls == [1] and host_memory._state == {"applied": False}
