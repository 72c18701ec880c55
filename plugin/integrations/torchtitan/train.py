"""Launcher: ``[torchrun --nproc_per_node N] python -m varlen_cp.integrations.torchtitan.train
--config FILE.toml [--section.key value ...]`` (installed as ``varlen-cp-train``).

Reads the TOML job file (see ``varlen_cp.integrations.torchtitan.config``), applies the
command-line overrides, and trains with torchtitan 0.3.0's Trainer (the plugin's subclass).
``[model] name`` picks the model: ``llama4_style`` (default, the project's Llama 4 style
model) or one of torchtitan's own (``llama3``, ``qwen3``, ``gpt_oss``, ``deepseek_v3``, ...,
with ``flavor``). Without CUDA it switches torchtitan to CPU first (``cpu_mode``); a plain
``python -m`` launch runs one process. A bad config exits with status 2 and one line naming
the setting and its source, before any process group or model is created; without
torchtitan installed it exits with status 1 and says which extra to install.
"""

from __future__ import annotations

import importlib.util
import sys

USAGE = __doc__
PROG = "varlen_cp.integrations.torchtitan.train"
MISSING = ("{prog}: torchtitan is not installed in this environment ({python}); install "
           'the torchtitan extra: pip install "varlen-cp[torchtitan]"')
TORCHTITAN_DEPS = ("torchtitan", "tyro", "spmd_types", "torchdata")


def missing_dependency() -> str | None:
    """The first of torchtitan's packages this launcher needs that cannot be found."""
    for name in TORCHTITAN_DEPS:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0 if argv else 2
    missing = missing_dependency()
    if missing is not None:
        print(MISSING.format(prog=PROG, python=sys.executable)
              + (f" ({missing} is missing)" if missing != "torchtitan" else ""),
              file=sys.stderr)
        return 1
    from . import cpu_mode

    cpu = not cpu_mode.cuda_available()
    if cpu:
        cpu_mode.enable_cpu_mode()  # before any other torchtitan import
    cpu_mode.ensure_single_process_env()
    from .config import ConfigError, load_config

    try:
        config = load_config(argv, cpu=cpu)
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr)
        return 2

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
