"""The one job-file reader (``varlen_cp.job_file``), and that varlen-cp-plan and the
launchers say the same thing about the same bad file (issue 29).

- the reader's own rules: files (missing, a folder, unreadable, not UTF-8, bad TOML),
  plain values (a bool is never a number, an int for a float is a float, literals,
  optionals), unknown keys, the fallback for other types;
- parity: each bad torchtitan job file gives the launcher's ``ConfigError`` text, and
  varlen-cp-plan prints exactly that text after ``varlen-cp-plan: error:`` (exit 2, one
  line, nothing planned); without torchtitan the planner gives the same text for what it
  can check and names the keys it could not; a bad megatron job file is the same line in
  megatron's launcher and in the planner.
In-process, ~20 s.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest

from varlen_cp import job_file
from varlen_cp.cli import plan
from varlen_cp.job_file import ConfigError, Setting, convert, read_toml

REPO = Path(__file__).resolve().parents[2]
PLAN_ARGS = ("--mix", "short_4k", "--batches", "1")


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = plan.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path: Path, text: str | bytes, name: str = "job.toml") -> str:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


# ---------------------------------------------------------------- files
def test_read_toml_names_the_file_and_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"--config: '.*' is a folder; give a file"):
        read_toml(tmp_path, "--config")
    with pytest.raises(ConfigError, match=r"--config: no such file '.*missing.toml'"):
        read_toml(tmp_path / "missing.toml", "--config")
    bad = write(tmp_path, b"[training]\nsteps = 3\n# caf\xe9\n", "latin1.toml")
    with pytest.raises(ConfigError, match=r"--config: .*latin1.toml: not UTF-8 text at "
                                          r"line 3 \(invalid continuation byte"):
        read_toml(bad, "--config")
    with pytest.raises(ConfigError, match=r"config file: .*syntax.toml is not valid TOML"):
        read_toml(write(tmp_path, "[training\n", "syntax.toml"))
    assert read_toml(write(tmp_path, "[a]\nb = 1\n")) == {"a": {"b": 1}}


def test_unreadable_file_is_one_error(tmp_path, monkeypatch):
    p = Path(write(tmp_path, "[a]\nb = 1\n"))
    real_open = Path.open

    def denied(self, *args, **kwargs):   # as chmod 0 would be for a user that is not root
        if self == p:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(ConfigError, match=r"--config: cannot read '.*job.toml': Permission "
                                          r"denied"):
        read_toml(p, "--config")


# ---------------------------------------------------------------- values
def setting(value, raw: bool = False) -> Setting:
    return Setting(("model", "x"), value, "job.toml", raw)


@pytest.mark.parametrize("tp,value,want", [
    (int, 3, 3), (float, 2, 2.0), (float, 0.5, 0.5), (bool, False, False), (str, "a", "a"),
    (Optional[str], None, None), (int | None, 4, 4), (Literal["a", "b"], "b", "b"),
    (Literal[1, 2], 2, 2)])
def test_plain_values(tp, value, want):
    got = convert(setting(value), tp)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("tp,value,expected", [
    (int, True, "int"), (int, "3", "int"), (int, 2.0, "int"), (float, False, "float"),
    (str, 3, "str"), (bool, 1, "bool"), (Literal["a", "b"], "c", "'a' | 'b'"),
    (Literal[1], True, "1"), (int | None, "x", "int | None")])
def test_wrong_types_name_the_key_the_type_and_the_value(tp, value, expected):
    with pytest.raises(ConfigError) as e:
        convert(setting(value), tp)
    assert str(e.value) == (f"[model] x in job.toml: wrong type for model.x: expected "
                            f"{expected}, got {value!r} ({type(value).__name__})")


def test_other_types_and_command_line_strings_go_to_the_fallback():
    with pytest.raises(ConfigError, match=r"model.x \(type list\[int\]\) cannot be read here"):
        convert(setting([1, 2]), list[int])
    assert convert(setting([1, 2]), list[int], lambda s, tp: ("fb", s.value)) == \
        ("fb", [1, 2])
    assert convert(setting("3", raw=True), int, lambda s, tp: int(s.value)) == 3


@dataclass
class Inner:
    depth: int = 1


@dataclass
class Section:
    name: str = "a"
    size: int = 1
    inner: Inner = None  # type: ignore[assignment]

    def __post_init__(self):
        self.inner = self.inner or Inner()
        if self.size > 10:
            raise ValueError(f"size must be <= 10, got {self.size}")


def test_apply_section_keys_nesting_and_the_class_checks():
    settings = job_file.flatten_toml({"s": {"size": 3, "inner": {"depth": 2}}}, "job.toml")
    got = job_file.apply_section(Section(), settings)
    assert (got.size, got.inner.depth) == (3, 2)
    for doc, message in [
            ({"s": {"sise": 3}}, "unknown key 'sise' in [s] ([s] sise in job.toml); known "
                                 "keys: inner, name, size"),
            ({"s": {"inner": {"deep": 1}}}, "unknown key 'deep' in [s.inner] ([s.inner] deep "
                                            "in job.toml); known keys: depth"),
            ({"s": {"size": {"a": 1}}}, "[s.size] a in job.toml: s.size is a value of type "
                                        "int, not a section"),
            ({"s": {"inner": 3}}, "[s] inner in job.toml: s.inner is a section; set its keys "
                                  "instead"),
            ({"s": {"size": 11}}, "[s] (job.toml): s.size must be <= 10, got 11")]:
        with pytest.raises(ConfigError) as e:
            job_file.apply_section(Section(), job_file.flatten_toml(doc, "job.toml"))
        assert str(e.value) == message


def test_sections_are_checked_even_when_empty():
    with pytest.raises(ConfigError, match=r"unknown section \[trainng\] in job.toml; known "
                                          r"sections: training"):
        job_file.check_sections({"trainng": {}}, ("training",), "job.toml")
    with pytest.raises(ConfigError, match=r"job.toml: key 'steps' must be inside a \[section\]"):
        job_file.check_sections({"steps": 3}, ("training",), "job.toml")


# ---------------------------------------------------------------- torchtitan job files
BAD_TORCHTITAN = {
    "unknown_section": '[varlen_cpp]\nstrategy = "a2a"\n',
    "unknown_varlen_cp_key": '[varlen_cp]\nstrategi = "a2a"\n',
    "unknown_model_key": "[model]\nn_layer = 2\n",
    "model_type": '[model]\nn_heads = "eight"\n',
    "training_type": '[training]\nseq_len = "long"\n',
    "float_for_int": "[parallelism]\ncontext_parallel_degree = 2.0\n",
    "bool_for_int": "[parallelism]\ntensor_parallel_degree = true\n",
    "degree_0": "[parallelism]\ncontext_parallel_degree = 0\n",
    "degree_minus_1": "[parallelism]\ncontext_parallel_degree = -1\n",
    "literal": '[training]\nmixed_precision_param = "fp8"\n',
    "option_value": '[varlen_cp]\nlayout = "zigzag"\n',
    "top_level_key": 'strategy = "a2a"\n',
    "not_utf8": b"[training]\nseq_len = 64\n# caf\xe9\n",
}
# keys of torchtitan's own sections that varlen-cp-plan cannot check without torchtitan
UNCHECKED_WITHOUT_TORCHTITAN = {"unknown_parallelism_key":
                                "[parallelism]\ncontext_paralel_degree = 8\n"}


def launcher_message(path: str) -> str:
    from varlen_cp.integrations.torchtitan.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(["--config", path], cpu=True)
    return str(e.value)


@pytest.mark.parametrize("name", sorted({**BAD_TORCHTITAN, **UNCHECKED_WITHOUT_TORCHTITAN}))
def test_planner_and_launcher_say_the_same(name, tmp_path, capsys):
    pytest.importorskip("torchtitan")
    path = write(tmp_path, {**BAD_TORCHTITAN, **UNCHECKED_WITHOUT_TORCHTITAN}[name])
    message = launcher_message(path)
    assert "Traceback" not in message and "\n" not in message
    rc, out, err = run_cli(capsys, "--config", path, *PLAN_ARGS)
    assert (rc, out, err) == (2, "", f"varlen-cp-plan: error: {message}\n")


@pytest.mark.parametrize("name", sorted(BAD_TORCHTITAN))
def test_without_torchtitan_the_planner_says_the_same(name, tmp_path, capsys, monkeypatch):
    path = write(tmp_path, BAD_TORCHTITAN[name])
    # the launcher's text is the reference where torchtitan is installed to give it
    expected = launcher_message(path) if importlib.util.find_spec("torchtitan") else None
    from varlen_cp.integrations.torchtitan import train

    monkeypatch.setattr(train, "missing_dependency", lambda: "torchtitan")
    rc, out, err = run_cli(capsys, "--config", path, *PLAN_ARGS)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    if expected is not None:
        assert err == f"varlen-cp-plan: error: {expected}\n"


def test_without_torchtitan_unchecked_keys_are_named(tmp_path, capsys, monkeypatch):
    from varlen_cp.integrations.torchtitan import train

    monkeypatch.setattr(train, "missing_dependency", lambda: "torchtitan")
    path = write(tmp_path, UNCHECKED_WITHOUT_TORCHTITAN["unknown_parallelism_key"]
                 + "[training]\nseq_len = 4096\nsteps = 3\n")
    rc, out, err = run_cli(capsys, "--config", path, *PLAN_ARGS)
    assert rc == 0 and "cp 1" in out, err
    assert err == (f"varlen-cp-plan: warning: torchtitan is not installed, so these keys of its "
                   f"sections in {path} were not checked: [parallelism] "
                   f"context_paralel_degree, [training] steps\n")


def test_keys_read_without_torchtitan_have_torchtitans_types():
    pytest.importorskip("torchtitan")
    from torchtitan.config import ParallelismConfig, TrainingConfig

    from varlen_cp.cli.jobs import READ_WITHOUT_TORCHTITAN

    fields = {"parallelism": job_file.fields_of(ParallelismConfig),
              "training": job_file.fields_of(TrainingConfig)}
    for (section, key), tp in READ_WITHOUT_TORCHTITAN.items():
        assert fields[section][key] == tp, (section, key)


def test_a_folder_given_as_an_input_file(tmp_path, capsys):
    for flag in ("--config", "--lengths", "--jsonl"):
        rc, out, err = run_cli(capsys, flag, str(tmp_path), "--cp", "2", "--heads", "4",
                               *(("--mix", "short_4k") if flag == "--config" else ()))
        assert (rc, out) == (2, "") and err == \
            f"varlen-cp-plan: error: {flag}: {str(tmp_path)!r} is a folder; give a file\n"


# ---------------------------------------------------------------- megatron job files
MEGATRON_EDITS = {   # name -> (line of the demo's job file, its replacement)
    "unknown_key": ("context_parallel_size = 2", "context_paralel_size = 2"),
    "unknown_section": ("[data]", "[dataa]"),
    "model_type": ("num_layers = 4", 'num_layers = "four"'),
    "int_for_bool": ("qk_layernorm = true", "qk_layernorm = 1"),
    "float_for_int": ("steps = 40", "steps = 40.0"),
    "not_utf8": None,
}


@pytest.mark.parametrize("name", sorted(MEGATRON_EDITS))
def test_megatron_launcher_and_planner_say_the_same(name, tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from varlen_cp.integrations.megatron import train

    data = (REPO / "configs" / "megatron_llama4_debug.toml").read_bytes()
    if MEGATRON_EDITS[name] is None:
        data += b"# caf\xe9\n"   # a Latin-1 byte
    else:
        old, new = (t.encode() for t in MEGATRON_EDITS[name])
        assert old in data
        data = data.replace(old, new, 1)
    path = write(tmp_path, data)
    assert train.main(["--config", path]) == 2
    launcher = capsys.readouterr().err.strip().splitlines()[-1]
    assert launcher.startswith("config error: ") and path in launcher, launcher
    message = launcher[len("config error: "):]
    rc, out, err = run_cli(capsys, "--config", path, *PLAN_ARGS)
    assert (rc, out) == (2, "") and err.splitlines()[-1] == f"varlen-cp-plan: error: {message}"
