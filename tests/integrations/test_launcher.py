"""The torchtitan launcher's errors and help (issue 23, item 5): a config error is printed
once (rank 0) and exits 2, under torchrun too; a world size that cannot hold the parallel
degrees is a config error naming the degree, the world size and the fix; ``--help`` lists
every section and key with its default. The launcher switches torchtitan to CPU before it
imports it, so its commands run in processes of their own: four side by side (~45 s on 2
busy cores); the rest runs in-process (~5 s)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from varlen_cp.integrations.torchtitan import train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "llama4_debug_cp2.toml")
BAD = ["--config", DEMO, "--varlen_cp.strategy", "ring"]
MESSAGE = "config error: [varlen_cp] ("


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """{name: (exit status, stdout, stderr)} of the launcher's commands."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    launcher = [sys.executable, "-m", train.PROG]
    commands = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node", "2", "-m", train.PROG, *BAD],
        "nproc": launcher + ["--nproc_per_node", "2", *BAD],
        "one_process": launcher + ["--config", DEMO],
        "help": launcher + ["--help"],
    }
    cwd = tmp_path_factory.mktemp("launcher")
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, cwd=cwd)
             for name, cmd in commands.items()}
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
        out[name] = (p.returncode, stdout, stderr)
    return out


@pytest.mark.slow  # the launches fixture: torchrun processes side by side
def test_torchrun_prints_a_config_error_once(launches):
    rc, out, err = launches["torchrun"]
    text = out + err
    # rank 0 prints it and exits 2 (the root cause in torchrun's report), the other rank
    # waits to be stopped; torchrun itself always exits 1 when a worker fails
    assert text.count(MESSAGE) == 1, text
    root = text.split("Root Cause")[1]
    assert "rank      : 0" in root and "exitcode  : 2" in root, text
    assert rc == 1


@pytest.mark.slow
def test_nproc_launch_checks_the_config_first(launches):
    rc, out, err = launches["nproc"]  # --nproc_per_node: checked before any process starts
    assert rc == 2 and err.count(MESSAGE) == 1, err
    assert "ChildFailedError" not in out + err


@pytest.mark.slow
def test_world_size_too_small_is_a_config_error(launches):
    rc, _, err = launches["one_process"]
    lines = [x for x in err.splitlines() if "config error" in x]
    assert rc == 2 and len(lines) == 1, err
    for part in ("context_parallel_degree (2)", "1 process was started",
                 "torchrun --nproc_per_node 2", "--parallelism.context_parallel_degree 1"):
        assert part in lines[0], lines[0]


def test_other_ranks_stay_quiet(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no torchrun: no wait
    assert train.config_error("x") == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert train.config_error("x") == 2
    assert capsys.readouterr().err == f"{train.PROG}: config error: x\n"


def test_world_size_rule(capsys):
    from varlen_cp.integrations.torchtitan.config import (ConfigError, check_world_size,
                                                          load_config)

    config = load_config(["--config", DEMO], cpu=True)
    check_world_size(config, 2)
    check_world_size(config, 4)  # dp_shard = -1 takes the rest
    with pytest.raises(ConfigError, match="needs a world size that is a multiple of 2, but "
                       "3 processes were started"):
        check_world_size(config, 3)
    sharded = load_config(["--config", DEMO, "--parallelism.data_parallel_shard_degree", "2"],
                          cpu=True)
    check_world_size(sharded, 4)
    with pytest.raises(ConfigError, match=r"context_parallel_degree \(2\) x "
                       r"data_parallel_shard_degree \(2\) need a world size that is exactly "
                       r"4, but 2 processes were started"):
        check_world_size(sharded, 2)
    # --nproc_per_node 3 with cp 2: refused before torchrun starts anything
    assert train.launch(3, ["--config", DEMO], cpu=True) == 2
    assert "3 processes were started" in capsys.readouterr().err


def test_nproc_flag_parsing(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert train.pop_nproc(["--nproc_per_node", "4", "--config", "x"]) == (4, ["--config", "x"])
    assert train.pop_nproc(["--config", "x", "--nproc-per-node=2"]) == (2, ["--config", "x"])
    assert train.pop_nproc(["--config", "x"]) == (None, ["--config", "x"])
    with pytest.raises(ValueError, match="--nproc_per_node must be an int >= 1, got 'x'"):
        train.pop_nproc(["--nproc_per_node", "x"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    with pytest.raises(ValueError, match="under torchrun give it to torchrun"):
        train.pop_nproc(["--nproc-per-node=2"])


@pytest.mark.slow
def test_help_lists_every_section_and_key_with_defaults(launches):
    from varlen_cp.integrations.torchtitan.config import (GENERIC_SECTIONS, JOB_KEYS,
                                                          MAPPED_SECTIONS, OPTIMIZER_KEYS,
                                                          default_trainer_config)
    from varlen_cp.job_file import fields_of as _fields
    from varlen_cp.integrations.torchtitan.help import toml_value

    rc, out, err = launches["help"]
    assert rc == 0, err
    assert out.startswith(train.USAGE.rstrip())
    lines = out.splitlines()
    for section in GENERIC_SECTIONS + MAPPED_SECTIONS:
        assert f"[{section}]" in lines, section
    config = default_trainer_config()

    def keys_of(section: str) -> list[str]:
        start = lines.index(f"[{section}]") + 1
        end = next(i for i in range(start, len(lines)) if not lines[i].startswith("  "))
        return [line.split(" = ")[0].strip() + " = " + line.split(" = ")[1].split("    #")[0]
                for line in lines[start:end] if " = " in line]

    for section in GENERIC_SECTIONS:
        obj = getattr(config, section)
        want = [f"{k} = {toml_value(getattr(obj, k))}" for k in _fields(obj)
                if not dataclasses.is_dataclass(getattr(obj, k))]
        assert keys_of(section) == want, section
    assert [k.split(" = ")[0] for k in keys_of("optimizer")] == list(OPTIMIZER_KEYS)
    assert {k.split(" = ")[0] for k in keys_of("job")} == set(JOB_KEYS)
    assert 'strategy = "p2p"' in keys_of("varlen_cp") and "report = true" in keys_of("varlen_cp")
