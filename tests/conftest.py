"""Test setup: run Triton kernels on the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs at conftest
import time, before any test module imports varlen_cp's kernels.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set "
                           "TRITON_INTERPRET=1; run the tests with pytest from the repo root")
    os.environ["TRITON_INTERPRET"] = "1"

# Hypothesis: generated batches must be reproducible in CI and not flag slow examples.
try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
