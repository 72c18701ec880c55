"""Join the job's process group from whatever launched us: torchrun, srun, or nothing.

- torchrun (one node or many): RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
- srun with one task per GPU and no torchrun: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID;
  MASTER_ADDR must be exported (the sbatch templates take it from ``scontrol show
  hostnames``), MASTER_PORT defaults to 29500.
- neither: one process (world size 1) on 127.0.0.1.
Backend: NCCL when CUDA is available (device cuda:LOCAL_RANK), gloo otherwise. Every
collective gets ``collective_timeout_s`` so a dead peer raises instead of blocking forever;
the suite's watchdog (harness.Watchdog) is the second line. The suite agrees on results over
a separate gloo group of the same ranks. Limits: tests run on the default group (the world);
tests that need subgroups create them.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class JobContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str
    control: Any = None  # gloo group of the whole job for the suite's own agreement

    def agree(self, status: int) -> int:
        """MAX of ``status`` over all ranks (identity on one process). It runs on its own
        group, so it can never pair with a collective that a test left pending on another
        rank (that rank then times out instead of both reading garbage)."""
        if self.world == 1:
            return status
        t = torch.tensor([status], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t.item())  # a CPU tensor: no device sync

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def describe(self) -> str:
        return (f"world {self.world}, {self.backend}, {self.device.type}, "
                f"launcher {self.launcher}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_env(env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(launcher name, the RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables to use), from
    ``env``. ValueError when a SLURM task has no MASTER_ADDR (it cannot guess the node)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun", {}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        if not env.get("MASTER_ADDR"):
            raise ValueError("MASTER_ADDR is unset under srun without torchrun: export it as "
                             "the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`")
        return "srun", {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
                        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                        "MASTER_PORT": env.get("MASTER_PORT", "29500")}
    return "single", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def init(collective_timeout_s: float) -> JobContext:
    """Join (or create) the default process group; returns this rank's context."""
    if not collective_timeout_s > 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s!r}")
    launcher, extra = launch_env(dict(os.environ))
    os.environ.update(extra)  # env:// reads them; also what torchtitan's init expects
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    control = dist.new_group(backend="gloo") if world > 1 else None
    return JobContext(rank, world, local_rank, device, backend, launcher, control)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def gather_hosts(ctx: JobContext) -> list[Any]:
    """Each rank's host name, in rank order (shows a multi-node job really spans nodes)."""
    names: list[Any] = [None] * ctx.world
    if ctx.world == 1:
        return [socket.gethostname()]
    dist.all_gather_object(names, socket.gethostname())
    return names
