"""The package's layering (README "Layout of the repository"): imports only go down.

Floors, top to bottom:
  (entry points) -> integrations -> {prepare} -> {config, attention} -> {strategies, sharding}
  -> {schedules} -> {plan} -> {masks, checks} -> kernels
Read from the source with ``ast`` (no import side effects): every ``from .x import`` /
``from ..x import`` inside ``plugin/`` is resolved to its top-level part of the package, and
no part may import a part on a higher floor, nor be in an import cycle with another part.
"""

from __future__ import annotations

import ast
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent.parent / "plugin"
FLOOR = {
    "train": 8,  # the torchtitan launcher (an entry point above the integrations)
    "integrations": 7, "prepare": 6, "config": 5, "attention": 5, "strategies": 4,
    "sharding": 4, "schedules": 3, "plan": 2, "masks": 1, "checks": 1, "kernels": 0,
}


def _part(path: Path) -> str:
    rel = path.relative_to(PLUGIN).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> set[str]:
    """Top-level package parts ``path`` imports (relative imports inside varlen_cp)."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(PLUGIN).parent.parts)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            target = base + (node.module.split(".") if node.module else [])
            if target:
                out.add(target[0])
            else:  # "from . import x" at the top level
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("varlen_cp."):
            out.add(node.module.split(".")[1])
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PLUGIN.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PLUGIN:
            continue  # the package root re-exports the public API
        part = _part(path)
        graph.setdefault(part, set()).update(_imports(path) - {part})
    return graph


def test_every_part_has_a_floor():
    assert set(_graph()) <= set(FLOOR), set(_graph()) - set(FLOOR)


def test_imports_only_go_down():
    for part, deps in _graph().items():
        for dep in deps:
            assert dep in FLOOR, f"{part} imports unknown part {dep}"
            assert FLOOR[dep] < FLOOR[part] or (FLOOR[dep] == FLOOR[part] and
                                                part not in _graph().get(dep, ())), \
                f"{part} (floor {FLOOR[part]}) imports {dep} (floor {FLOOR[dep]})"


def test_no_import_cycle_between_parts():
    graph = _graph()

    def visit(part, seen):
        assert part not in seen, f"import cycle: {' -> '.join(seen + (part,))}"
        for dep in graph.get(part, ()):
            visit(dep, seen + (part,))

    for part in graph:
        visit(part, ())
