"""The package's layering (docs/design.md, "Folders and floors"): imports only go down.

Floors, top to bottom:
  (entry point: cli) -> integrations -> {prefetch, report}
  -> {config, attention, graph_op, cp_call, resolve} -> {strategies, sharding} -> options
  -> tables -> plan -> {masks, shape, checks, mixes, host_memory, job_file} -> kernels
Read from the source with ``ast`` (no import side effects): every ``from .x import`` /
``from ..x import`` inside ``plugin/`` is resolved to its top-level part of the package, and
no part may import a part on a higher floor, nor be in an import cycle with another part.
"""

from __future__ import annotations

import ast
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[2] / "plugin"
FLOOR = {
    "cli": 9,    # varlen-cp-plan (reads the integrations' job files)
    "integrations": 8, "prefetch": 7, "report": 7, "config": 6, "attention": 6,
    "graph_op": 6, "cp_call": 6, "resolve": 6, "strategies": 5, "sharding": 5,
    "options": 4,  # AttnOptions: held by the strategies' call spec, so below them
    "tables": 3, "plan": 2,
    "masks": 1, "shape": 1, "checks": 1, "mixes": 1, "host_memory": 1,
    "job_file": 1,   # the one TOML job-file reader (launchers and varlen-cp-plan)
    "kernels": 0,
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


# ---- modules ------------------------------------------------------------------------------
# Circles between modules that another change removes. Delete an entry with the change that
# breaks it up; any other circle fails the test. (The last one, schedules.auto / cost /
# staged, went with issue 22 item 3: the cost model is a leaf of plugin/tables.)
KNOWN_MODULE_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLUGIN).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Every module of plugin/ ("plan.balanced.args"; a package is its ``__init__``) and
    the modules of plugin/ it imports: ``from .x import y`` counts as module ``x.y`` when
    that is a module, else as ``x``."""
    modules = {_module_name(p): p for p in PLUGIN.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        pkg = list(path.relative_to(PLUGIN).parent.parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                target = pkg[:len(pkg) - (node.level - 1)] + (
                    node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("varlen_cp."):
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join(target + [alias.name])
                if sub in modules:
                    deps.add(sub)
                elif ".".join(target) in modules:
                    deps.add(".".join(target))
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = {stack.pop()}
            while v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules() -> None:
    new = [sorted(c) for c in _cycles(_module_graph()) if c not in KNOWN_MODULE_CYCLES]
    assert not new, f"import cycles between modules: {new}"


def _imports_follow_the_listed_order(package: str) -> None:
    """The package docstring of ``package`` (e.g. "plan.balanced") lists its modules in
    import order (``- ``name``: ...``); each imports only modules listed before it, never
    the package."""
    import re

    init = PLUGIN.joinpath(*package.split("."), "__init__.py")
    order = re.findall(r"^- ``(\w+)``:", ast.get_docstring(ast.parse(init.read_text())),
                       re.M)
    graph = _module_graph()
    inside = {m for m in graph if m.startswith(f"{package}.")}
    assert inside == {f"{package}.{m}" for m in order}, (sorted(inside), order)
    for i, name in enumerate(order):
        deps = {d for d in graph[f"{package}.{name}"] if d.startswith(package)}
        later = deps - {f"{package}.{m}" for m in order[:i]}
        assert not later, f"{package}.{name} imports {sorted(later)}"


def test_balanced_modules_import_only_earlier_ones() -> None:
    """plugin/plan/balanced/: each module imports only those listed before it."""
    _imports_follow_the_listed_order("plan.balanced")


def test_staged_modules_import_only_earlier_ones() -> None:
    """plugin/tables/staged/: each module imports only those listed before it."""
    _imports_follow_the_listed_order("tables.staged")


# ---- tests --------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]


def _test_module_imports(path: Path) -> set[str]:
    """The modules of tests/ that ``path`` imports (``tests.x`` / ``from tests import x`` /
    ``from .x import``, at any depth of the file: inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "tests" if node.level == 1 else (node.module or "")
            if node.level == 1 and node.module:
                base = f"tests.{node.module}"
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            parts = n.split(".")[1:] if n.startswith("tests.") else []
            if parts:  # tests.kernels.test_x.f -> test_x; tests.helpers.grid -> helpers
                out.add(next((p for p in parts if p.startswith("test_")), parts[0]))
    return out


def test_finder_sees_test_imports(tmp_path) -> None:
    src = tmp_path / "test_x.py"
    src.write_text("import tests.test_a\nfrom tests import test_b, helpers\n"
                   "def f():\n    from tests.test_c import g\n    from .test_d import h\n"
                   "from tests.kernels.test_e import f\nfrom tests.helpers.grid import x\n")
    assert _test_module_imports(src) == {"test_a", "test_b", "helpers", "test_c", "test_d",
                                         "test_e"}


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/helpers/ (and reference.py, dist_utils.py): a test
    module that imports another runs that module's setup and couples their fixtures."""
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        imported = {m for m in _test_module_imports(path) if m.startswith("test_")}
        if imported:
            offenders[str(path.relative_to(TESTS))] = sorted(imported)
    assert not offenders, f"test modules importing test modules: {offenders}"


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with one letter added, removed or changed."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def test_test_file_names_differ_by_more_than_a_letter() -> None:
    """test_schedule.py (the kernels' tiles) beside test_schedules.py (the CP schedules)
    said nothing of either: a name says what it tests."""
    assert _one_edit_apart("test_plan", "test_plans") and not _one_edit_apart("ab", "ba")
    names = sorted(p.stem for p in TESTS.rglob("test_*.py"))
    close = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
             if _one_edit_apart(a, b)]
    assert not close, close


def test_test_folders_are_packages() -> None:
    """Each folder of tests (tests/kernels, tests/plan, ...) is a package, so its modules
    import as tests.<folder>.test_x and two folders may not shadow each other's names."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders
                     if not (f / "__init__.py").exists())
    assert not missing, f"test folders without __init__.py: {missing}"
