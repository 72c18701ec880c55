"""What both launchers check from the config and the world size before they build a model
(issue 29): the parallelism degrees, the strategy's head rule at cp 1 too, the backend on
this machine's device, and ``VARLEN_CP_MALLOC_TUNING``. Each was a ``[rank0]`` traceback
with exit 1 after the model was built; now one line, exit 2, nothing started.

torchtitan: ``load_config`` + ``check_world_size`` (what the launcher runs before
``config.build()``), and two launches of the launcher itself; megatron: its ``main``
in-process (no process group is made).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from varlen_cp.host_memory import ENV, malloc_tuning
from varlen_cp.job_file import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "llama4_debug_cp2.toml")
MEGATRON_DEMO = REPO / "configs" / "megatron_llama4_debug.toml"
CP1 = ("--parallelism.context_parallel_degree", "1")


@pytest.fixture
def no_interpreter(monkeypatch):
    """As on a CPU machine without TRITON_INTERPRET=1 (the tests set it)."""
    from varlen_cp.kernels import api

    monkeypatch.setattr(api, "_TRITON_INTERPRETED", False)


@pytest.fixture
def no_flash_kernel(monkeypatch):
    """As on a CPU where no flash implementation was registered (some tests register one)."""
    from varlen_cp.kernels import flash

    monkeypatch.setattr(flash, "has_flash_kernel", lambda device: False)


def test_malloc_tuning_setting(monkeypatch):
    for value, on in (("1", True), ("on", True), (" TRUE ", True), ("0", False),
                      ("off", False), ("False", False)):
        monkeypatch.setenv(ENV, value)
        assert malloc_tuning() is on
    monkeypatch.delenv(ENV)
    assert malloc_tuning() is True
    for value in ("garbage", "", "2"):
        monkeypatch.setenv(ENV, value)
        with pytest.raises(ValueError) as e:
            malloc_tuning()
        assert str(e.value) == (f"environment variable {ENV} must be one of 1, true, on, 0, "
                                f"false, off (unset: 1), got {value!r}")


# ---------------------------------------------------------------- torchtitan
def torchtitan_error(*cli: str, world_size: int = 1) -> str:
    pytest.importorskip("torchtitan")
    from varlen_cp.integrations.torchtitan.config import check_world_size, load_config

    with pytest.raises(ConfigError) as e:
        check_world_size(load_config(["--config", DEMO, *cli], cpu=True), world_size)
    return str(e.value)


@pytest.mark.parametrize("key,value,rule", [
    ("context_parallel_degree", "0", ">= 1"), ("context_parallel_degree", "-1", ">= 1"),
    ("tensor_parallel_degree", "0", ">= 1"),
    ("data_parallel_replicate_degree", "0", ">= 1"),
    ("data_parallel_shard_degree", "0", "-1 (the rest of the world) or >= 1"),
    ("data_parallel_shard_degree", "-2", "-1 (the rest of the world) or >= 1")])
def test_torchtitan_degrees_below_one(key, value, rule):
    msg = torchtitan_error(f"--parallelism.{key}", value)
    assert msg == (f"--parallelism.{key} (command line): parallelism.{key} must be {rule}, "
                   f"got {value}")


def test_torchtitan_a2a_size_at_cp_1():
    msg = torchtitan_error(*CP1, "--varlen_cp.strategy", "a2a+p2p", "--varlen_cp.a2a_size",
                           "3")
    assert msg.endswith("varlen_cp.strategy 'a2a+p2p' with the model's heads and "
                        "context_parallel_degree 1: a2a_size must be a positive divisor of "
                        "cp_size=1, got 3"), msg


def test_torchtitan_layout_rule_at_cp():
    msg = torchtitan_error(*CP1, "--varlen_cp.layout", "te", "--varlen_cp.pad_multiple", "3")
    assert msg.endswith("varlen_cp on cpu: pad_multiple must be a positive multiple of "
                        "2*cp_size=2, got 3"), msg


def test_torchtitan_backend_on_this_machine(no_interpreter, no_flash_kernel, monkeypatch):
    from varlen_cp.integrations.torchtitan import cpu_mode
    from varlen_cp.kernels import flash

    monkeypatch.setattr(cpu_mode, "cuda_available", lambda: False)
    msg = torchtitan_error(*CP1, "--varlen_cp.backend", "triton")
    assert "varlen_cp on cpu: backend='triton' on a CPU tensor needs TRITON_INTERPRET=1" in msg
    msg = torchtitan_error(*CP1, "--varlen_cp.backend", "flash")
    assert "varlen_cp on cpu: backend='flash' on cpu: torch has no flash attention" in msg
    if flash.fa4_interface() is None:
        msg = torchtitan_error("--varlen_cp.backend", "fa4")
        assert "varlen_cp on cpu: backend='fa4' needs the flash-attn-4 package" in msg


@pytest.mark.parametrize("value", ["garbage", ""])
def test_torchtitan_malloc_variable(value, monkeypatch):
    monkeypatch.setenv(ENV, value)
    assert torchtitan_error(*CP1).startswith(f"environment variable {ENV} must be one of")


def test_torchtitan_job_that_is_only_read_skips_the_machine_checks(no_interpreter,
                                                                  monkeypatch):
    """varlen-cp-plan reads a GPU job on a laptop: the backend is not checked here."""
    pytest.importorskip("torchtitan")
    from varlen_cp.integrations.torchtitan.config import load_config

    monkeypatch.setenv(ENV, "garbage")
    config = load_config(["--config", DEMO, "--varlen_cp.backend", "triton"], run_here=False)
    assert config.varlen_cp.backend == "triton"


@pytest.mark.slow  # two launches of the launcher, side by side (~15 s)
def test_torchtitan_launcher_exits_2_before_building(tmp_path):
    pytest.importorskip("torchtitan")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    launcher = [sys.executable, "-m", "varlen_cp.integrations.torchtitan.train", "--config",
                DEMO, "--training.steps", "1"]
    runs = {"degree": (launcher + ["--parallelism.context_parallel_degree", "0"], env),
            "env": (launcher + list(CP1), {**env, ENV: "garbage"})}
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=e, cwd=tmp_path) for k, (cmd, e) in runs.items()}
    want = {"degree": "--parallelism.context_parallel_degree (command line): parallelism."
                      "context_parallel_degree must be >= 1, got 0",
            "env": f"environment variable {ENV} must be one of"}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in err.splitlines() if "config error" in ln]
        assert p.returncode == 2 and "Traceback" not in err and len(lines) == 1, err
        assert want[name] in lines[0], err
        assert "step" not in out, out   # no training step: nothing was built


# ---------------------------------------------------------------- megatron
def megatron_main(tmp_path: Path, *argv: str, **replace: str) -> tuple[int, str]:
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from varlen_cp.integrations.megatron import train

    text = MEGATRON_DEMO.read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp_path / "job.toml"
    path.write_text(text)
    rc = train.main(["--config", str(path), "--steps", "1", *argv])
    assert not dist.is_initialized()   # refused before any process group
    return rc


def last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_megatron_cp_below_one(tmp_path, capsys):
    assert megatron_main(tmp_path, "--context-parallel-size", "0") == 2
    assert last_error(capsys) == "config error: --context-parallel-size must be an int >= 1, " \
                                 "got 0"


def test_megatron_a2a_size_at_cp_1(tmp_path, capsys):
    rc = megatron_main(tmp_path, "--context-parallel-size", "1",
                       **{'cp_comm_type = "p2p"': 'cp_comm_type = "a2a+p2p"',
                          "[varlen_cp]\n": "[varlen_cp]\na2a_size = 3\n"})
    msg = last_error(capsys)
    assert rc == 2 and msg.startswith("config error: [varlen_cp] on cpu, "
                                      "context_parallel_size 1, layers of strategy 'a2a+p2p'")
    assert msg.endswith("a2a_size must be a positive divisor of cp_size=1, got 3"), msg


def test_megatron_layout_rule_at_cp(tmp_path, capsys):
    rc = megatron_main(tmp_path, **{'layout = "balanced"': 'layout = "te"\npad_multiple = 6'})
    msg = last_error(capsys)
    assert rc == 2 and msg.endswith("pad_multiple must be a positive multiple of "
                                    "2*cp_size=4, got 6"), msg


def test_megatron_backend_on_this_machine(tmp_path, capsys, no_interpreter):
    rc = megatron_main(tmp_path, "--context-parallel-size", "1",
                       **{'backend = "auto"': 'backend = "triton"'})
    msg = last_error(capsys)
    assert rc == 2 and "backend='triton' on a CPU tensor needs TRITON_INTERPRET=1" in msg, msg


def test_megatron_malloc_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV, "garbage")
    assert megatron_main(tmp_path, "--context-parallel-size", "1") == 2
    assert last_error(capsys) == (f"config error: environment variable {ENV} must be one of "
                                  f"1, true, on, 0, false, off (unset: 1), got 'garbage'")


# ---------------------------------------------------------------- outputs
def test_torchtitan_dump_folder_that_is_a_file(tmp_path):
    blocker = tmp_path / "outputs"
    blocker.write_text("")
    msg = torchtitan_error(*CP1, "--job.dump_folder", str(blocker))
    assert msg == f"job.dump_folder: {blocker} exists and is not a folder"
    msg = torchtitan_error(*CP1, "--job.dump_folder", str(blocker / "run"))
    assert msg == f"job.dump_folder: cannot make the folder {blocker / 'run'}: {blocker} is a file"


def test_megatron_log_json_that_is_a_folder(tmp_path, capsys):
    assert megatron_main(tmp_path, "--context-parallel-size", "1", "--log-json",
                         str(tmp_path)) == 2
    assert last_error(capsys) == f"config error: --log-json: {tmp_path} is a folder; give a " \
                                 "file name"
