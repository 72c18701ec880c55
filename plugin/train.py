"""Launcher: ``[torchrun --nproc_per_node N] python -m varlen_cp.train --config FILE.toml
[--section.key value ...]``.

Reads the TOML job file (see ``varlen_cp.integrations.torchtitan.config``), applies the
command-line overrides, and trains with torchtitan 0.3.0's Trainer (the plugin's subclass).
Without CUDA it switches torchtitan to CPU first (``cpu_mode``); a plain ``python -m`` launch
runs one process. A bad config exits with status 2 and one line naming the setting and its
source, before any process group or model is created.
"""

from __future__ import annotations

import sys

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0 if argv else 2
    from .integrations.torchtitan import cpu_mode

    cpu = not cpu_mode.cuda_available()
    if cpu:
        cpu_mode.enable_cpu_mode()  # before any other torchtitan import
    cpu_mode.ensure_single_process_env()
    from .integrations.torchtitan.config import ConfigError, load_config

    try:
        config = load_config(argv, cpu=cpu)
    except ConfigError as e:
        print(f"varlen_cp.train: config error: {e}", file=sys.stderr)
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
