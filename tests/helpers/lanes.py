"""The fast lane: ``bash scripts/run_tests.sh --fast`` runs ``pytest -m "not slow and not
cuda"`` (docs/testing.md). A test marked ``slow`` still runs in the full run, which
``.ci/run`` keeps; the fast lane keeps a representative part of every area.
"""

from __future__ import annotations

import pytest

slow = pytest.mark.slow


def fast_first(values, keep: int = 1, unpack: bool = False) -> list:
    """``values`` for ``pytest.mark.parametrize`` with every value after the first ``keep``
    marked slow: the fast lane runs the first cases, the full run all of them (ids are
    unchanged). ``unpack``: each value is the tuple of several argnames."""
    def param(v, marks):
        return pytest.param(*v, marks=marks) if unpack else pytest.param(v, marks=marks)
    return [param(v, () if i < keep else (slow,)) for i, v in enumerate(values)]
