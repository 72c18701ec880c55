"""Installed-version checks of the kernels (kernels/environment.py): triton < 3.7's CPU
interpreter fails with numpy >= 2.4, and the Triton backend says so instead of dying inside
a kernel. The pairs below are the measured ones (triton 3.6.0 failed with numpy 2.4 and 2.5
and passed with 2.3; triton 3.7.0's and 3.8.0's interpreters squeeze the array first)."""

import pytest
import torch

from tests.reference import reference_attn
from varlen_cp.kernels import api, environment

FAILING = [("3.6.0", "2.4.1"), ("3.6.0", "2.5.0"), ("3.5.1", "2.4.0"),
           ("3.6.0+git1234", "2.4.0rc1")]
WORKING = [("3.6.0", "2.3.5"), ("3.6.0", "1.26.4"), ("3.7.0", "2.4.6"), ("3.8.0", "2.5.0"),
           ("3.10.0", "2.4.0"), (None, "2.4.1"), (None, None)]


@pytest.mark.parametrize("triton_version, numpy_version", FAILING)
def test_interpreter_problem_names_the_versions_and_the_fix(triton_version, numpy_version):
    problem = environment.interpreter_problem(triton_version, numpy_version)
    assert problem is not None
    assert triton_version in problem and numpy_version in problem
    assert "numpy<2.4" in problem and "triton >= 3.7" in problem


@pytest.mark.parametrize("triton_version, numpy_version", WORKING)
def test_interpreter_problem_none_where_the_interpreter_works(triton_version, numpy_version):
    assert environment.interpreter_problem(triton_version, numpy_version) is None


def test_interpreter_without_numpy_says_to_install_it():
    assert "pip install numpy" in environment.interpreter_problem("3.8.0", None)


def test_this_environment_can_interpret():
    """The stack these tests run on (main or oldest) has a working pair; where it has not,
    the interpreter tests skip with the reason (tests/conftest.py), and so does this."""
    installed = (environment.installed_version("triton"), environment.installed_version("numpy"))
    problem = environment.interpreter_problem(*installed)
    if problem:
        pytest.skip(f"Triton's interpreter cannot run here: {problem}")
    assert api._INTERPRETER_PROBLEM is None


def test_interpreter_failures_become_skips_with_the_reason():
    from tests.conftest import interpreter_skip

    problem = environment.interpreter_problem("3.6.0", "2.4.1")
    raised = f"RuntimeError: {problem}"            # the Triton backend's own error
    inside = ("InterpreterError: TypeError('only 0-dimensional arrays can be converted to "
              "Python scalars')")                  # a kernel interpreted directly
    worker = f"rank 1 failed:\nTraceback (most recent call last):\n  ...\n{raised}"
    for failure in (raised, inside, worker):
        assert interpreter_skip(failure, problem) == \
            f"Triton's interpreter cannot run here: {problem}"
    assert interpreter_skip("AssertionError: 1 != 2", problem) is None   # a real failure
    assert interpreter_skip(raised, None) is None   # a working pair: never skipped


def test_triton_backend_raises_the_problem_and_torch_still_works(monkeypatch):
    problem = environment.interpreter_problem("3.6.0", "2.4.1")
    monkeypatch.setattr(api, "_INTERPRETER_PROBLEM", problem)
    with pytest.raises(RuntimeError, match=r"numpy<2\.4"):
        api.resolve_backend("triton", "cpu")
    assert api.resolve_backend("auto", "cpu") == "torch"
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="triton 3.6.0"):
        api.varlen_attn(q, k, v, cu, cu, 5, 5, causal=True, backend="triton")
    out = api.varlen_attn(q, k, v, cu, cu, 5, 5, causal=True, backend="torch")
    ref, _ = reference_attn(q.double(), k.double(), v.double(), cu, cu, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
