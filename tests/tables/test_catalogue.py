"""One catalogue of strategies (``varlen_cp.tables.catalogue``) that the registry, the
options and ``auto`` read: the same names in the same order everywhere, the staged trait
from one place, and no other module of the package listing strategy names. Under 1 s."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from varlen_cp import config
from varlen_cp.tables import auto, catalogue
from varlen_cp.strategies import STRATEGIES, get_strategy

PLUGIN = Path(__file__).resolve().parents[2] / "plugin"


def test_registry_options_and_auto_read_the_catalogue():
    names = catalogue.STRATEGY_NAMES
    assert list(STRATEGIES) == list(names)
    assert {n: s.staged for n, s in STRATEGIES.items()} == \
        {t.name: t.overlap == "stages" for t in catalogue.CATALOGUE}
    assert config.STRATEGY_CHOICES == (*names, "auto")
    assert config.STAGED_STRATEGIES == (*catalogue.STAGED, "auto") == \
        ("all_gather", "dispatch", "auto")
    assert sorted(auto.CANDIDATES) == sorted(names)
    assert [catalogue.traits(n).tie_rank for n in auto.CANDIDATES] == list(range(len(names)))
    for bad in ("ring", None, "auto"):
        with pytest.raises(ValueError, match="strategy must be one of"):
            get_strategy(bad)


def test_no_other_module_lists_strategy_names():
    """A literal tuple, list, set or dict of two or more strategy names outside the
    catalogue would be a second list to keep in step."""
    names = set(catalogue.STRATEGY_NAMES)
    found = []
    for path in PLUGIN.rglob("*.py"):
        if path.name == "catalogue.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            elts = node.keys if isinstance(node, ast.Dict) else \
                node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            listed = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
            if len(listed) >= 2:
                found.append(f"{path.relative_to(PLUGIN)}:{node.lineno} {listed}")
    assert not found, found
