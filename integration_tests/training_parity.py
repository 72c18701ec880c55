"""A short Llama 4 style training at CP = world size whose losses must match a CP=1 run.

Rank 0 first runs the CP=1 reference in a child process (``python -m
varlen_cp.integrations.torchtitan.train``, one process, same config, same data); the other
ranks wait. Then every rank trains the same steps in-process with ``context_parallel_degree
= world`` (torchtitan reuses the suite's process group), and rank 0 compares the per-step
losses that both runs appended to their loss files. Skipped, with the reason, when
torchtitan (0.3.0, torch >= 2.14) is not importable. Limits: data parallel size 1 (CP spans
the job); the config must suit the world size (llama4_debug_cp2: 8 query / 2 K/V heads, p2p
works at any size); the child's output goes to a log file whose tail is shown on failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .dist_env import JobContext
from .harness import Skip, register

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "llama4_debug_cp2.toml"
STEPS, SEQ_LEN = 4, 512
# fp32 on both sides; CP changes only the summation order of attention and of the loss.
LOSS_RTOL = 2e-4
REFERENCE_TIMEOUT_S = 400
# torchrun's variables: the CP=1 child must start its own single-process group.
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
              "TORCHELASTIC_ERROR_FILE")


def _train_args(cp: int, loss_file: Path, dump: Path) -> list[str]:
    return ["--config", str(CONFIG), "--parallelism.context_parallel_degree", str(cp),
            "--training.steps", str(STEPS), "--training.seq_len", str(SEQ_LEN),
            "--metrics.loss_file", str(loss_file), "--job.dump_folder", str(dump)]


def _torchtitan_or_skip() -> None:
    """Skip when torchtitan is missing or cannot import here (e.g. torch too old);
    switch it to CPU first when there is no CUDA (must precede its first import)."""
    if importlib.util.find_spec("torchtitan") is None:
        raise Skip("torchtitan not importable in this interpreter "
                   f"({sys.executable}); install it to run the training parity")
    from varlen_cp.integrations.torchtitan import cpu_mode
    if not cpu_mode.cuda_available():
        cpu_mode.enable_cpu_mode()
    try:
        import torchtitan.trainer  # noqa: F401
    except Exception as e:  # an environment problem, not a varlen-cp failure
        raise Skip(f"torchtitan present but not importable: {type(e).__name__}: {e}") from e


def _reference(work: Path) -> tuple[bool, str]:
    """CP=1 run in a child process (rank 0): (ok, message)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    log = work / "reference.log"
    cmd = [sys.executable, "-m", "varlen_cp.integrations.torchtitan.train",
           *_train_args(1, work / "loss_cp1.jsonl", work / "dump_cp1")]
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                timeout=REFERENCE_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc == 0:
        return True, ""
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return False, f"CP=1 reference run exited {rc}: " + " | ".join(tail)


def _losses(path: Path) -> list[float]:
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def compare_losses(ref: list[float], got: list[float], rtol: float = LOSS_RTOL) -> str:
    """Detail string on success; AssertionError naming the first bad step."""
    if len(ref) != STEPS or len(got) != STEPS:
        raise AssertionError(f"expected {STEPS} logged losses, got {len(ref)} (CP=1) and "
                             f"{len(got)} (CP)")
    worst = 0.0
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        if not rel <= rtol:
            raise AssertionError(f"step {step}: loss {b:.6f} at CP vs {a:.6f} at CP=1 "
                                 f"(rel diff {rel:.2e} > {rtol:g})")
    return f"{STEPS} steps, losses {ref[0]:.4f} -> {ref[-1]:.4f}, max rel diff {worst:.1e}"


def _all_ok(ctx: JobContext, ok: bool) -> bool:
    t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=ctx.device)
    if ctx.world > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item()) == 0


@register("training_parity/llama4_debug", timeout_s=900.0)
def training_parity(ctx: JobContext) -> str:
    """Llama 4 style debug model: losses at CP = world size match a CP=1 run."""
    try:
        _torchtitan_or_skip()
        reason = ""
    except Skip as e:
        reason = str(e)
    # Decided together: a rank that skipped alone would pair its next collective with
    # another rank's collective of this test.
    if not _all_ok(ctx, not reason):
        raise Skip(reason or "torchtitan not importable on another rank")
    if not CONFIG.exists():
        raise AssertionError(f"training config missing: {CONFIG}")
    work = Path(tempfile.mkdtemp(prefix=f"varlen_cp_it_rank{ctx.rank}_"))
    ok, msg = _reference(work) if ctx.rank == 0 else (True, "")
    if not _all_ok(ctx, ok):  # every rank stops here together, nobody waits on a collective
        raise AssertionError(msg or "the CP=1 reference failed on rank 0")

    from torchtitan.tools.logging import init_logger
    from varlen_cp.integrations.torchtitan.config import load_config
    init_logger()
    config = load_config(_train_args(ctx.world, work / "loss_cp.jsonl", work / "dump_cp"),
                         cpu=ctx.device.type == "cpu")
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if ctx.rank != 0:
        return "compared on rank 0"
    return compare_losses(_losses(work / "loss_cp1.jsonl"), _losses(work / "loss_cp.jsonl"))
