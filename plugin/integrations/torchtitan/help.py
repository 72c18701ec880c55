"""``--help`` of the torchtitan launcher: every TOML section and its keys, with defaults.

The defaults are the plugin's (``config.default_trainer_config``: a tiny Llama 4 style model
on synthetic data), read from the live config objects, so the list cannot drift from the
code; each key's first docstring sentence comes from the field's own docstring (as tyro
reads it), else from a ``name: text`` line of its class docstring, when there is one.
Imports torchtitan (call after ``cpu_mode.enable_cpu_mode``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

DOC_WIDTH = 72  # characters of a key's description kept on its line


def toml_value(value: Any) -> str:
    """A default as it would be written in TOML ("(unset)" for None)."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return f"<{type(value).__name__}>"


def class_doc(cls: type, name: str) -> str:
    """A field's description from a class docstring written as ``name: text`` lines with
    indented continuations (``CPConfig``'s style), searched along the MRO."""
    for klass in cls.__mro__:
        lines = (klass.__doc__ or "").splitlines()
        for i, line in enumerate(lines):
            head, sep, text = line.strip().partition(":")
            if sep and head == name and text.strip():
                indent = len(line) - len(line.lstrip())
                more = []
                for nxt in lines[i + 1:]:
                    if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= indent:
                        break
                    more.append(nxt.strip())
                return " ".join([text.strip()] + more)
    return ""


def field_doc(cls: type, name: str) -> str:
    """The first sentence of a field's docstring, shortened to DOC_WIDTH ('' if none)."""
    try:
        from tyro._docstrings import get_field_docstring

        doc = get_field_docstring(cls, name, ()) or ""
    except Exception:  # a private tyro helper: no description rather than no help
        doc = ""
    doc = " ".join((doc or class_doc(cls, name)).split())
    doc = doc.split(". ")[0].rstrip(".")
    return doc if len(doc) <= DOC_WIDTH else doc[:DOC_WIDTH - 3] + "..."


def section_lines(name: str, obj: Any) -> list[str]:
    """``[name]`` and one line per settable key (nested sections after it)."""
    from ...job_file import fields_of

    lines, nested = [f"[{name}]"], []
    for key in fields_of(obj):
        value = getattr(obj, key)
        if dataclasses.is_dataclass(value):
            nested.append((f"{name}.{key}", value))
            continue
        doc = field_doc(type(obj), key)
        lines.append(f"  {key} = {toml_value(value)}" + (f"    # {doc}" if doc else ""))
    for sub, value in nested:
        lines += section_lines(sub, value)
    return lines


def help_text(usage: str) -> str:
    """``usage`` (the launcher's docstring), then every section with its keys."""
    from . import cpu_mode
    from .config import GENERIC_SECTIONS, JOB_KEYS, OPTIMIZER_KEYS, default_trainer_config

    config = default_trainer_config()
    out = [usage.rstrip(), "",
           "Sections and keys (TOML [section] key = value, or --section.key value), with "
           "the plugin's defaults:", ""]
    out += ["[job]"] + [f"  {k} = {toml_value(getattr(config, k, ''))}"
                        for k in JOB_KEYS if k != "description"] + ['  description = ""']
    group = config.optimizer.param_groups[0]
    kwargs = group.optimizer_kwargs
    betas = kwargs.get("betas", (0.9, 0.95))
    values = {"name": group.optimizer_name, "lr": kwargs.get("lr"), "eps": kwargs.get("eps"),
              "weight_decay": kwargs.get("weight_decay"), "beta1": betas[0],
              "beta2": betas[1], "implementation": config.optimizer.implementation}
    out += ["[optimizer]"] + [f"  {k} = {toml_value(values.get(k))}" for k in OPTIMIZER_KEYS]
    out += ["[activation_checkpoint]", '  mode = "none"    # "selective" | "full"; then the '
            "keys of torchtitan's SelectiveAC / FullAC config"]
    out += section_lines("dataloader", config.dataloader)
    out.append("  (dataset = any other name: torchtitan's HF text dataloader, with "
               "dataset_path and the tokenizer of [job] hf_assets_path)")
    for section in GENERIC_SECTIONS:
        out += section_lines(section, getattr(config, section))
    cpu = "; ".join(f"{s}.{k} = {toml_value(v)}" for s, kv in cpu_mode.cpu_overrides().items()
                    for k, v in kv.items())
    out += ["", f"Without CUDA the launcher also sets: {cpu}."]
    return "\n".join(out)
