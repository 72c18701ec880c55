"""Test setup: run Triton kernels on the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs at conftest
import time, before any test module imports varlen_cp's kernels.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set "
                           "TRITON_INTERPRET=1; run the tests with pytest from the repo root")
    os.environ["TRITON_INTERPRET"] = "1"



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
