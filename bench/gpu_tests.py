"""The CUDA-only tests, as the GPU suite runs them: ``pytest -m cuda`` in a subprocess.

tests/conftest.py gives the ``cuda`` marker to every test that is skipped without CUDA (a
``skipif`` on "no CUDA", or the marker itself), so this needs no list of tests. Only the
test files that mention CUDA at all are collected: collecting every file imports
torchtitan and megatron (45 s on the 2-core CI machine, and they may be missing where the
GPU is lent); ``--continue-on-collection-errors`` keeps one broken file from hiding the
others' results. Per-test outcomes come from pytest's JUnit XML.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_timing import Budget

ROOT = Path(__file__).resolve().parent.parent
_MENTIONS_CUDA = re.compile(r"cuda\.is_available|mark\.cuda")


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """Test files (relative to ``root``) that can hold a CUDA-only test."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if _MENTIONS_CUDA.search(p.read_text(errors="replace")))


def parse_junit(path: Path) -> dict:
    """Counts and per-test outcomes of a JUnit XML report."""
    tree = ET.parse(path)
    cases = []
    for tc in tree.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:300]
                break
        cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                      "seconds": float(tc.get("time") or 0.0), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "cases": cases}


class CudaTests:
    """The CUDA-only tests in a pytest subprocess, started at construction; :meth:`result`
    waits for it (within the budget given at the start) and reads its report. The GPU run
    waits at once (a test beside a benchmark would skew both); the dry run lets it run
    beside the other parts (2 cores: ~10 s less)."""

    def __init__(self, budget: Budget, python: str = sys.executable) -> None:
        self.budget, self.files = budget, cuda_test_files()
        self.proc: subprocess.Popen | None = None
        self.note = None if importlib.util.find_spec("pytest") else \
            "pytest is not installed here"
        if self.note:
            return
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        self.xml, self.log = tmp / "cuda_tests.xml", tmp / "pytest.log"
        cmd = [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={self.xml}", *self.files]
        self.t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ))

    def result(self) -> dict:
        """Counts, per-test outcomes, the tail of pytest's output, ``status``."""
        if self.proc is None:
            return {"status": "not run", "note": self.note}
        try:
            rc = self.proc.wait(timeout=max(1.0, self.budget.left()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        out = {"files": self.files, "returncode": rc, "seconds": time.monotonic() - self.t0,
               "output_tail": self.log.read_text(errors="replace")[-3000:]}
        if self.xml.exists():
            out.update(parse_junit(self.xml))
        self._tmp.cleanup()
        counts = out.get("counts", {})
        if rc is None:
            out["status"] = "timeout"
            out["note"] = f"stopped at the {self.budget.name} budget's end"
        elif rc == 5:   # the marker selected nothing: say so, it is not a pass
            out["status"] = "no tests selected"
        else:
            bad = rc != 0 or counts.get("failed") or counts.get("error")
            out["status"] = "failed" if bad else "ok"
        print(f"  CUDA tests: {out['status']}, {counts} in {out['seconds']:.0f} s "
              f"(pytest exit {rc})", flush=True)
        return out
