"""The torchtitan launcher's errors and help (issue 23, item 5): a config error is printed
once (rank 0) and exits 2, under torchrun too; a world size that cannot hold the parallel
degrees is a config error naming the degree, the world size and the fix; ``--help`` lists
every section and key with its default. Two torchrun launches run side by side (~20 s), the
rest in-process (~10 s)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from varlen_cp.integrations.torchtitan import train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "llama4_debug_cp2.toml")
BAD = ["--config", DEMO, "--varlen_cp.strategy", "ring"]
MESSAGE = "config error: [varlen_cp] ("


@pytest.fixture
def single_process(monkeypatch):
    """The environment of a plain one-process launch (restored afterwards)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "SIZE" in name else "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_torchrun_prints_a_config_error_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node", "2", "-m", train.PROG, *BAD],
        "launcher": [sys.executable, "-m", train.PROG, "--nproc_per_node", "2", *BAD],
    }
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env, cwd=tmp_path)
             for name, cmd in launches.items()}
    out = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    # torchrun: rank 0 prints it and exits 2 (the root cause in torchrun's report), the
    # other rank waits to be stopped; torchrun itself always exits 1 when a worker fails
    assert out["torchrun"].count(MESSAGE) == 1, out["torchrun"]
    root = out["torchrun"].split("Root Cause")[1]
    assert "rank      : 0" in root and "exitcode  : 2" in root, out["torchrun"]
    assert procs["torchrun"].returncode == 1
    # this launcher's --nproc_per_node: checked before any process starts, exit 2
    assert out["launcher"].count(MESSAGE) == 1, out["launcher"]
    assert procs["launcher"].returncode == 2, out["launcher"]
    assert "ChildFailedError" not in out["launcher"]


def test_other_ranks_stay_quiet(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert train.config_error("x") == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert train.config_error("x") == 2
    assert capsys.readouterr().err == f"{train.PROG}: config error: x\n"


def test_world_size_too_small_is_a_config_error(single_process, capsys):
    assert train.main(["--config", DEMO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for part in ("context_parallel_degree (2)", "1 process was started",
                 "torchrun --nproc_per_node 2", "--parallelism.context_parallel_degree 1"):
        assert part in err, err


def test_world_size_not_a_multiple(single_process, capsys):
    # this launcher's --nproc_per_node 3 with cp 2: refused before any process starts
    assert train.main(["--nproc_per_node", "3", "--config", DEMO]) == 2
    err = capsys.readouterr().err
    assert "needs a world size that is a multiple of 2, but 3 processes were started" in err
    assert train.main(["--nproc_per_node", "3", "--config", DEMO,
                       "--parallelism.data_parallel_shard_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert "context_parallel_degree (2) x data_parallel_shard_degree (2) need a world size " \
        "that is exactly 4" in err


def test_nproc_flag_errors(single_process, monkeypatch, capsys):
    assert train.main(["--nproc_per_node", "x", "--config", DEMO]) == 2
    assert "--nproc_per_node must be an int >= 1, got 'x'" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert train.main(["--nproc-per-node=2", "--config", DEMO]) == 2
    assert "under torchrun give it to torchrun" in capsys.readouterr().err


def test_help_lists_every_section_and_key_with_defaults(capsys):
    from varlen_cp.integrations.torchtitan.config import (GENERIC_SECTIONS, JOB_KEYS,
                                                          MAPPED_SECTIONS, OPTIMIZER_KEYS,
                                                          _fields, default_trainer_config)
    from varlen_cp.integrations.torchtitan.help import toml_value

    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
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
