"""Launcher: ``[torchrun --nproc_per_node N] python -m varlen_cp.integrations.torchtitan.train
--config FILE.toml [--section.key value ...]`` (installed as ``varlen-cp-train``), or
``python -m varlen_cp.integrations.torchtitan.train --nproc_per_node N --config FILE.toml
...`` to start the N processes itself (one node; torchrun's ``--standalone`` rendezvous).

Reads the TOML job file (see ``varlen_cp.integrations.torchtitan.config``), applies the
command-line overrides, and trains with torchtitan 0.3.0's Trainer (the plugin's subclass).
``[model] name`` picks the model: ``llama4_style`` (default, the project's Llama 4 style
model) or one of torchtitan's own (``llama3``, ``qwen3``, ``gpt_oss``, ``deepseek_v3``, ...,
with ``flavor``). Without CUDA it switches torchtitan to CPU first (``cpu_mode``); a plain
``python -m`` launch runs one process. ``--help`` lists every section and key with its
default.

Errors: a bad config (a key, a value, or parallelism degrees the world size cannot hold)
prints one line naming the setting and its source and exits with status 2, before any
process group or model is created. Under torchrun every process finds it; rank 0 prints it
and exits 2, the others wait until torchrun stops them (``config_error``); torchrun itself
then exits 1 whatever its workers' status (it raises ``ChildFailedError``; torch 2.14.1)
after its failure report, whose root cause shows "exitcode: 2". With ``--nproc_per_node N`` this
launcher checks the config once before any process starts (status 2), then runs torchrun
in-process and returns the first failed worker's status. Without torchtitan installed it
exits with status 1 and says which extra to install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

USAGE = __doc__
PROG = "varlen_cp.integrations.torchtitan.train"
MISSING = ("{prog}: torchtitan is not installed in this environment ({python}); install "
           'the torchtitan extra: pip install "varlen-cp[torchtitan]"')
TORCHTITAN_DEPS = ("torchtitan", "tyro", "spmd_types", "torchdata")
NPROC_FLAGS = ("--nproc_per_node", "--nproc-per-node")
QUIET_RANK_WAIT_S = 60.0


def missing_dependency() -> str | None:
    """The first of torchtitan's packages this launcher needs that cannot be found."""
    for name in TORCHTITAN_DEPS:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def config_error(message: object) -> int:
    """Print a config error once (rank 0 of a torchrun job, or the only process): 2.

    Under torchrun the other ranks, which found the same error, wait (at most
    ``QUIET_RANK_WAIT_S``) instead of exiting: torchrun stops every worker as soon as one
    exits, so a rank that exited first could stop rank 0 before it printed (seen: the
    message lost). When rank 0 exits, torchrun stops them at once."""
    if os.environ.get("RANK", "0") in ("0", ""):
        print(f"{PROG}: config error: {message}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(QUIET_RANK_WAIT_S)
    return 2


def pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--nproc_per_node N`` (or ``--nproc-per-node``, ``=N``) taken out of ``argv``;
    ValueError on a bad value, or under torchrun (which starts the processes itself)."""
    rest, nproc, i = [], None, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in NPROC_FLAGS:
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            nproc = int(value)
        else:
            rest.append(argv[i])
        i += 1
    if nproc is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError("--nproc_per_node is this launcher's way to start the processes "
                         "itself; under torchrun give it to torchrun instead")
    return nproc, rest


def launch(nproc: int, argv: list[str], cpu: bool) -> int:
    """Check the config for ``nproc`` processes, then run torchrun (in this process) with
    ``nproc`` copies of this launcher; the first failed worker's exit status."""
    from .config import ConfigError, check_world_size, load_config

    try:
        check_world_size(load_config(argv, cpu=cpu), nproc)
    except ConfigError as e:
        return config_error(e)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(["--standalone", f"--nproc_per_node={nproc}", "-m", PROG, *argv])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"{PROG}: rank {rank} exited with status {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    missing = missing_dependency()
    help_asked = "-h" in argv or "--help" in argv
    if missing is not None:
        if help_asked:
            print(USAGE + "\n(install the torchtitan extra to list the sections and keys)")
            return 0
        print(MISSING.format(prog=PROG, python=sys.executable)
              + (f" ({missing} is missing)" if missing != "torchtitan" else ""),
              file=sys.stderr)
        return 1
    from . import cpu_mode

    cpu = not cpu_mode.cuda_available()
    if cpu:
        cpu_mode.enable_cpu_mode()  # before any other torchtitan import
    if help_asked:
        from .help import help_text

        print(help_text(USAGE))
        return 0
    try:
        nproc, argv = pop_nproc(argv)
    except ValueError as e:
        return config_error(e)
    if nproc is not None:
        return launch(nproc, argv, cpu)
    cpu_mode.ensure_single_process_env()
    from .config import ConfigError, check_world_size, load_config

    try:
        config = load_config(argv, cpu=cpu)
        check_world_size(config, int(os.environ["WORLD_SIZE"]))
    except ConfigError as e:
        return config_error(e)

    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
