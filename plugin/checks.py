"""Argument checks shared by every layer of the package: one wording for one mistake.

Each raises ``ValueError`` naming the field and the value, before anything is computed or
communicated (docs/design.md). No torch and no package imports, so any module may use them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


def is_int(x: Any) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never to us)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(name: str, value: Any, minimum: int | None = None, *,
              optional: bool = False) -> Any:
    """``value`` if it is an int >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}an int{bound}, got {value!r}")
    return value


def check_positive(name: str, value: Any, unit: str = "") -> float:
    """``value`` as a float if it is a finite number > 0 (an int or a float, not a bool);
    ``unit`` is named in the message, e.g. ``" (bytes per second)"``."""
    try:   # (an int too large for a float is not finite either)
        ok = (not isinstance(value, bool) and isinstance(value, (int, float))
              and math.isfinite(value) and value > 0)
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number > 0{unit}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
