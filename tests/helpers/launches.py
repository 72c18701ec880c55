"""One launch of gloo processes for the selected cases of a parametrized test.

Starting a world (processes, process group, imports) costs more than most of its cases, so
a grid test keeps one launch per group of cases (e.g. one strategy at one cp) while pytest
sees one item per case (``-k`` re-runs one): the group's first item runs, in one launch,
every case of its group that this session selected (all of them on a full run, only those
that ``-k`` / ``-m`` kept otherwise), and each item then checks its own case's result. A
launch that fails as a whole (a worker's exception, a timeout) fails every item of its group
with the same report.
"""

from __future__ import annotations

from typing import Any, Callable


def selected_siblings(request, group: tuple[str, ...]) -> list[dict]:
    """The parameters of every item of this session that belongs to the same test function
    as ``request``'s and has the same values of the ``group`` parameters, in run order."""
    node = request.node
    key = tuple(node.callspec.params[name] for name in group)
    return [item.callspec.params for item in request.session.items
            if getattr(item, "originalname", None) == node.originalname
            and getattr(item, "module", None) is node.module and hasattr(item, "callspec")
            and tuple(item.callspec.params[name] for name in group) == key]


class GroupLaunches:
    """Runs ``launch(siblings)`` once per value of the ``group`` parameters and keeps its
    result (or its failure) for the group's other items. Give each test function its own
    instance through a module-scoped fixture."""

    def __init__(self, group: tuple[str, ...]):
        self.group = group
        self._done: dict[tuple, tuple[bool, Any]] = {}

    def result(self, request, launch: Callable[[list[dict]], Any]) -> Any:
        key = tuple(request.node.callspec.params[name] for name in self.group)
        if key not in self._done:
            try:
                self._done[key] = (True, launch(selected_siblings(request, self.group)))
            except Exception as e:  # noqa: BLE001 -- reported by every item of the group
                self._done[key] = (False, f"{type(e).__name__}: {e}")
        ok, value = self._done[key]
        if not ok:
            raise AssertionError(f"the launch of {dict(zip(self.group, key))} failed:\n{value}")
        return value


def assert_case_clean(per_rank: list[dict], case: Any,
                      messages: Callable[[Any], list[str]] = lambda entry: entry) -> None:
    """Every rank's results (one dict per rank, keyed by case) hold ``case`` and no error
    for it; ``messages`` reads the error list out of a case's entry."""
    assert all(case in r for r in per_rank), "a rank did not run this case"
    found = [msg for r in per_rank for msg in messages(r[case])]
    assert not found, "\n".join(found)
