"""The one reader of TOML job files: the torchtitan launcher, the megatron launcher and
``varlen-cp-plan`` read files with it, so a mistake is the same one line in all three.

What it owns (no torch, no framework import):

- :func:`input_file` / :func:`read_toml`: a file that is missing, a folder, unreadable,
  not UTF-8 (named with its line) or not valid TOML is a :class:`ConfigError` naming the
  file (and the flag or key that named it), never a traceback.
- :func:`check_output`: an output file or folder that cannot be written is refused before
  the work that would write it.
- :class:`Setting` / :func:`flatten_toml` / :func:`parse_cli`: a file and
  ``--section.key value`` overrides as one list of dotted settings, each knowing its source.
- :func:`apply_section`: settings applied to a section's dataclass. An unknown key, a key
  given a section or a section given a value, and a value of the wrong type are refused
  naming the key, the section and the source; then the dataclass's own ``__post_init__``
  checks run, and their errors are prefixed the same way.
- :func:`convert`: TOML values of plain types (bool, int, float, str, None, ``Literal``,
  unions of them) are checked here, with our rules (a bool is never a number, an int for a
  float becomes a float). Other types and command-line strings go to the caller's
  ``fallback`` (the torchtitan launcher passes tyro's parser, torchtitan's own rules).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A job file or command-line setting that cannot be applied."""


# ------------------------------------------------------------------------ files
def input_file(path: str | Path, what: str) -> Path:
    """``path`` if it can be read (a file or a pipe); ConfigError naming ``what`` (a flag
    such as ``--config``, or "config file") and the path: missing, a folder, or
    unreadable."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what}: {str(p)!r} is a folder; give a file")
    if not p.exists():   # (a pipe is fine: --lengths <(zcat lengths.gz))
        raise ConfigError(f"{what}: no such file {str(p)!r}")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {str(p)!r}: {e.strerror or e}") from None
    return p


def not_utf8(what: str, path: Path, line: int, e: UnicodeDecodeError) -> ConfigError:
    """The one message for a byte that is not UTF-8: ``what``, the file, the line."""
    return ConfigError(f"{what}: {path}: not UTF-8 text at line {line} ({e.reason}, byte "
                       f"{e.object[e.start:e.start + 1]!r})")


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The TOML document of ``path`` (:func:`input_file`'s checks first); a byte that is not
    UTF-8 or a syntax error is a ConfigError naming the file and the line."""
    p = input_file(path, what)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(what, p, data[:e.start].count(b"\n") + 1, e) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what}: {p} is not valid TOML: {e}") from None


def check_output(what: str, path: str | Path, *, folder: bool) -> None:
    """``path`` can be written as a file (``folder`` False; its folder is made if missing)
    or made as a folder: ConfigError naming ``what`` (a flag or key) otherwise. Nothing is
    created: run before the work, so a typo costs none of it."""
    p = Path(path)
    parent = p if folder else p.parent
    if not folder and p.is_dir():
        raise ConfigError(f"{what}: {p} is a folder; give a file name")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{what}: {p} exists and is not a folder")
    base = parent   # the nearest existing folder above: where it would be made
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{what}: cannot make the folder {parent}: {base} is a file")
    if not os.access(base, os.W_OK):
        raise ConfigError(f"{what}: the folder {base} is not writable")


# ------------------------------------------------------------------------ settings
@dataclasses.dataclass
class Setting:
    """One value to apply: dotted path (section.key[.subkey]), value, where it came from."""

    path: tuple[str, ...]
    value: Any
    source: str
    raw: bool = False  # a command-line string still to be parsed against the field type

    def where(self) -> str:
        if self.source == "command line":
            return f"--{'.'.join(self.path)} (command line)"
        section = ".".join(self.path[:-1])
        return f"[{section}] {self.path[-1]} in {self.source}"


def flatten_toml(data: dict[str, Any], source: str) -> list[Setting]:
    """TOML tables -> settings; top-level keys must live in a section."""
    out: list[Setting] = []

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, prefix + (key,))
            elif not prefix:
                raise ConfigError(f"{source}: key {key!r} must be inside a [section]")
            else:
                out.append(Setting(prefix + (key,), value, source))

    walk(data, ())
    return out


def parse_cli(args: list[str]) -> tuple[str | None, list[Setting]]:
    """``--config FILE`` and ``--section.key value`` pairs from the command line."""
    config_path: str | None = None
    settings: list[Setting] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected command-line argument {arg!r} "
                              "(expected --config FILE or --section.key value)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                value = "true"  # a bare flag: --debug.print_config
            else:
                value = nxt
                i += 1
        i += 1
        if name == "config":
            config_path = value
            continue
        parts = tuple(name.split("."))
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"command-line option --{name} must be --section.key")
        settings.append(Setting(parts, value, "command line", raw=True))
    return config_path, settings


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _unknown_section(name: str, source: str, known: tuple[str, ...]) -> ConfigError:
    return ConfigError(f"unknown section [{name}] in {source}; known sections: "
                       f"{', '.join(known)}")


def by_section(settings: list[Setting], known: tuple[str, ...]) -> dict[str, list[Setting]]:
    """Settings grouped by section; ConfigError for a section not in ``known``."""
    out: dict[str, list[Setting]] = {}
    for s in settings:
        if s.path[0] not in known:
            raise _unknown_section(s.path[0], s.source, known)
        out.setdefault(s.path[0], []).append(s)
    return out


def check_sections(doc: dict[str, Any], known: tuple[str, ...], source: str) -> None:
    """Every top-level entry of ``doc`` is a table named in ``known`` (an empty one too)."""
    for name, value in doc.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key {name!r} must be inside a [section]")
        if name not in known:
            raise _unknown_section(name, source, known)


def _unknown_key(s: Setting, known: Any) -> ConfigError:
    section = ".".join(s.path[:-1])
    return ConfigError(f"unknown key {s.path[-1]!r} in [{section}] ({s.where()}); known keys: "
                       f"{', '.join(sorted(known))}")


def check_table(section: str, table: dict[str, Any], known: dict[str, Any], source: str
                ) -> dict[str, Any]:
    """``table``'s keys checked against ``known`` (key -> type) and its values of plain
    types converted as :func:`convert` does; values of other types as given (for tables
    that become keyword arguments of a framework's class, which checks them itself)."""
    out = {}
    for key, value in table.items():
        s = Setting((section, key), value, source)
        if key not in known:
            raise _unknown_key(s, known)
        out[key] = convert(s, known[key], lambda s, tp: s.value)
    return out


# ------------------------------------------------------------------------ values
def describe(tp: Any) -> str:
    """A type as a user reads it: int, float | int, 'p2p' | 'te', list[str]."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_args(tp):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def wrong_type(s: Setting, tp: Any) -> ConfigError:
    return ConfigError(f"{s.where()}: wrong type for {'.'.join(s.path)}: expected "
                       f"{describe(tp)}, got {s.value!r} ({type(s.value).__name__})")


_NOT_PLAIN = object()   # a type this module does not check itself (the fallback does)
_MISMATCH = object()    # a plain type the value does not have


def _plain(value: Any, tp: Any) -> Any:
    """``value`` as plain type ``tp``; ``_MISMATCH`` if it is not one, ``_NOT_PLAIN`` if
    ``tp`` is not a plain type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if any(type(a) is type(value) and a == value
                            for a in typing.get_args(tp)) else _MISMATCH
    if origin is typing.Union or origin is types.UnionType:
        found = [_plain(value, a) for a in typing.get_args(tp)]
        if any(f is _NOT_PLAIN for f in found):
            return _NOT_PLAIN
        return next((f for f in found if f is not _MISMATCH), _MISMATCH)
    if tp is type(None):
        return None if value is None else _MISMATCH
    if tp is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _MISMATCH
    if tp is str:
        return value if isinstance(value, str) else _MISMATCH
    return _NOT_PLAIN


Fallback = Callable[[Setting, Any], Any]


def convert(s: Setting, tp: Any, fallback: Fallback | None = None) -> Any:
    """The value of ``s`` as type ``tp``: a TOML value of a plain type checked here, the
    rest by ``fallback`` (module docstring); ConfigError naming the setting otherwise."""
    if not s.raw:
        value = _plain(s.value, tp)
        if value is _MISMATCH:
            raise wrong_type(s, tp)
        if value is not _NOT_PLAIN:
            return value
    if fallback is None:
        raise ConfigError(f"{s.where()}: {'.'.join(s.path)} (type {describe(tp)}) cannot be "
                          "read here")
    return fallback(s, tp)


# ------------------------------------------------------------------------ sections
def fields_of(obj: Any) -> dict[str, Any]:
    """Settable field name -> resolved annotation of a dataclass (or its instance)."""
    cls = obj if isinstance(obj, type) else type(obj)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward refs: fall back to the raw annotations
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)
            if f.init and not f.name.startswith("_")}


def rebuild(obj: Any, values: dict[str, Any], section: str, settings: list[Setting]) -> Any:
    """``obj`` with ``values``, its ``__post_init__`` checks run; errors name the section,
    the field (``section.field``) and where the settings came from."""
    try:
        return dataclasses.replace(obj, **values)
    except (ValueError, TypeError, AssertionError) as e:
        msg = str(e)
        field_names = {f.name for f in dataclasses.fields(obj)}
        if msg.split(" ", 1)[0] in field_names:  # "strategy must be ..." -> "varlen_cp.strat..."
            msg = f"{section}.{msg}"
        sources = sorted({s.source for s in settings}) or ["defaults"]
        raise ConfigError(f"[{section}] ({', '.join(sources)}): {msg}") from e


def apply_section(obj: Any, settings: list[Setting], depth: int = 1,
                  fallback: Fallback | None = None) -> Any:
    """Dataclass ``obj`` with ``settings`` (their ``path[depth:]``) applied, in order (the
    command line comes last, so it wins)."""
    known = fields_of(obj)
    section = ".".join(settings[0].path[:depth]) if settings else "?"
    values: dict[str, Any] = {}
    nested: dict[str, list[Setting]] = {}
    for s in settings:
        key = s.path[depth]
        if key not in known:
            raise _unknown_key(Setting(s.path[:depth + 1], s.value, s.source, s.raw), known)
        child_is_section = dataclasses.is_dataclass(getattr(obj, key))
        if depth + 1 < len(s.path):
            if not child_is_section:
                raise ConfigError(f"{s.where()}: {'.'.join(s.path[:depth + 1])} is a value of "
                                  f"type {describe(known[key])}, not a section")
            nested.setdefault(key, []).append(s)
        elif child_is_section:
            raise ConfigError(f"{s.where()}: {'.'.join(s.path)} is a section; set its keys "
                              "instead")
        else:
            values[key] = convert(s, known[key], fallback)
    for key, sub in nested.items():
        values[key] = apply_section(getattr(obj, key), sub, depth + 1, fallback)
    return rebuild(obj, values, section, settings)
