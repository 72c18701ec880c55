"""Run a function on N gloo processes (CPU) and bring back results or worker tracebacks.

Workers come from a forkserver that imported torch and varlen_cp once: a launch then costs
well under a second instead of the 3-5 s of a fresh interpreter per rank, and no worker
inherits the pytest process's OpenMP threads (plain fork after torch has run ops can hang).
Each worker calls ``torch.set_num_threads(1)`` first, joins a file-store process group in
the test's tmp_path with a timeout on every collective, runs ``fn(rank, world, *args)`` and
reports its return value or its traceback. The parent waits with a deadline and kills its
own workers on a timeout, so a stuck collective fails the test and never hangs it.

Run many cases per launch (loop inside ``fn``): process start and group setup dominate.
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue as queue_mod
import threading
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

# Imported once by the forkserver, so workers start with them loaded: torch._dynamo alone
# takes ~6 s to import (the kernels' custom ops pull it in on their first call).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "varlen_cp",
            "varlen_cp.attention", "varlen_cp.kernels.torch_attn", "tests.dist_utils",
            "tests.reference", "tests.helpers.cp_grid", "tests.helpers.guards"]
_CTX = None
_launch_ids = itertools.count()


def _context():
    """The forkserver context, created (with its preload list) on first use."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _worker(rank: int, world: int, store: str, timeout_s: float, fn: Callable,
            args: tuple, results) -> None:
    import torch
    torch.set_num_threads(1)  # first: 2 shared cores, N ranks
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable, world: int, tmp_path: Any, *args: Any,
                    timeout_s: float = 180.0, collective_timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the values in rank
    order. ``fn`` must be a module-level function (it is pickled by name). Raises
    AssertionError with every failing worker's traceback, or on a timeout."""
    ctx = _context()
    store = os.path.join(str(tmp_path), f"store_{os.getpid()}_{next(_launch_ids)}")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world, store, collective_timeout_s, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, value)
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead:  # a worker died without reporting (segfault, os._exit)
                time.sleep(0.5)  # its last message may still be in flight
                while True:
                    try:
                        rank, ok, value = results.get_nowait()
                        got[rank] = (ok, value)
                    except queue_mod.Empty:
                        break
                if any(r not in got for r in dead):
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    missing = [r for r in range(world) if r not in got]
    if missing:
        failures.append(f"ranks {missing} reported nothing within {timeout_s:.0f} s "
                        f"(exit codes {[procs[r].exitcode for r in missing]})")
    if failures:
        raise AssertionError(f"{fn.__name__} on {world} ranks failed:\n" + "\n".join(failures))
    return [got[r][1] for r in range(world)]


def launch_concurrently(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run every job (usually launches of ``run_distributed``) at the same time, each in
    its own thread: multi-process launches spend most of their time starting processes and
    importing, so two at once take about as long as one. Returns each job's result by name
    once all have ended; the first job's exception, if any, is raised here (the test's
    thread) after that."""
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def run(name: str, job: Callable[[], Any]) -> None:
        try:
            results[name] = job()
        except BaseException as e:  # re-raised below, in the caller's thread
            errors[name] = e

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in jobs:
        if name in errors:
            raise errors[name]
    return results
