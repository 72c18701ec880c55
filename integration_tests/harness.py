"""Test registry, per-test watchdog, cross-rank agreement and the PASS/FAIL summary.

Every rank runs the same tests in the same order. After each test the ranks agree on its
outcome (the worst wins: a test that failed on one rank failed), so all ranks take the same
path and rank 0's summary speaks for the job. A watchdog thread bounds each test, the
agreement included: when it fires, the rank prints the failure and the summary and exits
with ``EXIT_TIMEOUT`` at once, so a stuck collective ends the job (torchrun / srun then stop
the other ranks) instead of hanging it. Limits: a timed-out test cannot be interrupted and
skipped - a timeout ends the whole run. Imports no torch (its unit tests stay fast).
"""

from __future__ import annotations

import faulthandler
import fnmatch
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

# Ordered so that agreement across ranks is a MAX: FAIL beats SKIP beats PASS.
PASS, SKIP, FAIL = 0, 1, 2
STATUS_NAMES = {PASS: "PASS", SKIP: "SKIP", FAIL: "FAIL"}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3


class Skip(Exception):
    """Raise from a test to skip it; the message is the reason printed on the SKIP line."""


@dataclass(frozen=True)
class TestSpec:
    """One registered test: ``fn(ctx)`` returns a short detail string (or None) on success,
    raises ``Skip`` to skip, anything else fails it."""

    name: str
    fn: Callable[[Any], str | None]
    timeout_s: float
    doc: str = ""


REGISTRY: dict[str, TestSpec] = {}


def register(name: str, timeout_s: float = 300.0,
             registry: dict[str, TestSpec] | None = None) -> Callable:
    """Decorator: add ``fn`` to the registry under ``name`` (tests run in insertion order)."""
    table = REGISTRY if registry is None else registry
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")

    def deco(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"test name {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip().splitlines()
        table[name] = TestSpec(name, fn, float(timeout_s), doc[0] if doc else "")
        return fn
    return deco


def select(registry: dict[str, TestSpec], patterns: list[str] | None) -> list[TestSpec]:
    """Tests whose name matches any glob in ``patterns`` (all when None/empty), in registry
    order. ValueError naming a pattern that matches nothing (a typo must not pass as 0 tests)."""
    if not patterns:
        return list(registry.values())
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in registry):
            raise ValueError(f"--tests pattern {p!r} matches no test; known: "
                             f"{', '.join(registry)}")
    return [t for n, t in registry.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@dataclass
class Outcome:
    name: str
    status: int
    detail: str
    seconds: float


class Watchdog:
    """A daemon thread that calls ``on_timeout(name, timeout_s)`` when an armed deadline
    passes before ``disarm``. ``on_timeout`` is expected to end the process (it runs on the
    watchdog thread, the main thread is presumably stuck)."""

    def __init__(self, on_timeout: Callable[[str, float], None]) -> None:
        self._on_timeout = on_timeout
        self._cond = threading.Condition()
        self._armed: tuple[str, float, float] | None = None  # name, timeout, deadline
        self._thread = threading.Thread(target=self._loop, name="test-watchdog", daemon=True)
        self._thread.start()

    def arm(self, name: str, timeout_s: float) -> None:
        with self._cond:
            self._armed = (name, timeout_s, time.monotonic() + timeout_s)
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._armed is None:
                    self._cond.wait()
                    continue
                name, timeout_s, deadline = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed = None
            self._on_timeout(name, timeout_s)


def _fmt(status: int, name: str, detail: str, seconds: float | None = None) -> str:
    line = f"{STATUS_NAMES[status]}  {name}"
    if detail:
        line += f"  ({detail})"
    if seconds is not None:
        line += f"  {seconds:.1f} s"
    return line


def summary_line(outcomes: list[Outcome], seconds: float, where: str = "",
                 not_run: int = 0) -> str:
    """The final line: 'integration: N passed, N failed, N skipped ...'."""
    n = {s: sum(o.status == s for o in outcomes) for s in STATUS_NAMES}
    line = (f"integration: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped"
            f"{f', {not_run} not run' if not_run else ''} in {seconds:.1f} s")
    return f"{line} ({where})" if where else line


@dataclass
class Suite:
    """Runs tests on this rank. ``agree(status) -> status`` is the cross-rank MAX (identity
    on one process); ``exit_fn`` ends the process on a timeout (``os._exit`` in real runs:
    a stuck collective may hold locks that a normal exit would wait on)."""

    rank: int
    agree: Callable[[int], int]
    where: str = ""
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    exit_fn: Callable[[int], None] = os._exit
    timeout_override_s: float | None = None

    def __post_init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self._total = 0
        self._t0 = time.monotonic()

    def _say(self, line: str, *, all_ranks: bool = False) -> None:
        if self.rank == 0:
            print(line, file=self.out, flush=True)
        elif all_ranks:
            print(f"[rank {self.rank}] {line}", file=self.out, flush=True)

    def _timeout(self, name: str, timeout_s: float) -> None:
        self._say(_fmt(FAIL, name, f"timeout after {timeout_s:g} s on rank {self.rank}: a "
                       "collective or a computation is stuck"), all_ranks=True)
        print(f"[rank {self.rank}] stacks at the timeout of {name}:", file=self.err, flush=True)
        try:
            faulthandler.dump_traceback(file=self.err, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a StringIO in unit tests has no fd
            pass
        done = self.outcomes + [Outcome(name, FAIL, "timeout", timeout_s)]
        not_run = self._total - len(done)
        self._say(summary_line(done, time.monotonic() - self._t0, self.where, not_run),
                  all_ranks=True)
        self.exit_fn(EXIT_TIMEOUT)

    def _run_one(self, test: TestSpec, ctx: Any) -> tuple[int, str]:
        try:
            detail = test.fn(ctx)
            return PASS, "" if detail is None else str(detail)
        except Skip as e:
            return SKIP, str(e)
        except Exception as e:  # any error is this test's failure, the suite goes on
            tb = traceback.format_exc()
            print(f"[rank {self.rank}] {test.name} failed:\n{tb}", file=self.err, flush=True)
            msg = str(e).strip().splitlines()
            return FAIL, f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]

    def _abandon(self, name: str, detail: str, seconds: float) -> int:
        """End the run after ``name`` failed in a way the ranks cannot agree on."""
        self.outcomes.append(Outcome(name, FAIL, detail, seconds))
        self._say(_fmt(FAIL, name, detail, seconds), all_ranks=True)
        self._say(summary_line(self.outcomes, time.monotonic() - self._t0, self.where,
                               self._total - len(self.outcomes)), all_ranks=True)
        return EXIT_FAILED

    def run(self, tests: list[TestSpec], ctx: Any) -> int:
        """Run ``tests`` in order; print one line per test (rank 0) and the summary.
        Returns the exit status: EXIT_OK, or EXIT_FAILED when any test failed."""
        self._total = len(tests)
        dog = Watchdog(self._timeout)
        for test in tests:
            timeout_s = self.timeout_override_s or test.timeout_s
            start = time.monotonic()
            dog.arm(test.name, timeout_s)
            status, detail = self._run_one(test, ctx)
            try:
                agreed = self.agree(status)
            except Exception as e:  # a peer died or timed out: ranks cannot go on together
                dog.disarm()
                return self._abandon(test.name, f"cross-rank agreement failed: "
                                     f"{type(e).__name__}: {e}"[:300], time.monotonic() - start)
            dog.disarm()
            if agreed not in STATUS_NAMES:  # never expected; a FAIL beats a crash here
                agreed, detail = FAIL, f"ranks out of step: agreement returned {agreed!r}"
            elif agreed != status:
                detail = ("failed on another rank (see its log)" if agreed == FAIL
                          else "skipped on another rank")
            seconds = time.monotonic() - start
            self.outcomes.append(Outcome(test.name, agreed, detail, seconds))
            self._say(_fmt(agreed, test.name, detail, seconds))
        self._say(summary_line(self.outcomes, time.monotonic() - self._t0, self.where))
        return EXIT_FAILED if any(o.status == FAIL for o in self.outcomes) else EXIT_OK
