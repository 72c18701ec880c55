"""Test setup: run Triton kernels on the interpreter when there is no GPU, and mark the
CUDA-only tests.

TRITON_INTERPRET must be set before triton is first imported, so this runs at conftest
import time, before any test module imports varlen_cp's kernels.

The ``cuda`` marker (``pytest -m cuda``: what bench/gpu.sh runs on a lent GPU) goes to
every test that carries it or that is skipped exactly when CUDA is absent (a ``skipif``
whose condition is ``not torch.cuda.is_available()`` and whose reason names CUDA or a
GPU), so a new CUDA test needs no registration. A test marked ``cuda`` is skipped without
CUDA.
"""

import os
import re
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set "
                           "TRITON_INTERPRET=1; run the tests with pytest from the repo root")
    os.environ["TRITON_INTERPRET"] = "1"



_NAMES_CUDA = re.compile(r"\b(CUDA|GPU)s?\b", re.IGNORECASE)


def _cuda_only(item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    no_cuda = not torch.cuda.is_available()
    for mark in item.iter_markers("skipif"):
        cond = mark.args[0] if mark.args else mark.kwargs.get("condition")
        reason = str(mark.kwargs.get("reason", ""))
        if isinstance(cond, bool) and cond == no_cuda and _NAMES_CUDA.search(reason):
            return True
    return False


# Triton < 3.7's interpreter with numpy >= 2.4 cannot run the kernels
# (varlen_cp/kernels/environment.py): the tests that interpret them skip with that reason
# instead of failing (the Triton backend raises the reason; a kernel interpreted directly
# dies inside triton on numpy's refusal).
def _interpreter_problem():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from varlen_cp.kernels.environment import installed_version, interpreter_problem
    return interpreter_problem(installed_version("triton"), installed_version("numpy"))


INTERPRETER_PROBLEM = _interpreter_problem()
_NUMPY_REFUSAL = "only 0-dimensional arrays can be converted to Python scalars"


def interpreter_skip(failure: str, problem) -> str | None:
    """The skip reason for a test that failed with ``failure`` (its exception's text, a
    worker's traceback included) when the interpreter cannot run here (``problem``), or
    None: a real failure."""
    if problem and (problem in failure or _NUMPY_REFUSAL in failure):
        return f"Triton's interpreter cannot run here: {problem}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if INTERPRETER_PROBLEM and report.failed and call.excinfo is not None:
        reason = interpreter_skip(str(call.excinfo.value), INTERPRETER_PROBLEM)
        if reason:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _cuda_only(item):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Host planning is many tiny ops: on 2 oversubscribed cores OpenMP hand-offs made each
    ~15 ms instead of ~10 us (measured), so tests of host tables run single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Hypothesis: generated batches must be reproducible in CI and not flag slow examples.
try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
