"""How long the path of one CP call is: Python frames from the module's forward to the
kernel, and varlen-cp's Python calls per layer call (host overhead that runs every layer).

Two gloo ranks on CPU (cp 2) and one (cp 1), the plan built and prepared ahead of the step as
the integrations do (``build_tables``), one warm-up call, then one forward (and backward)
call traced with ``sys.setprofile``:
- ``depth``: varlen-cp frames on the stack when the kernel (the PyTorch twin's forward,
  ``kernels/torch_attn.py``) is first entered, from ``ContextParallelVarlenAttention.forward``
  down: the hops a reader follows from the trainer's call to a kernel launch;
- ``calls``: varlen-cp Python functions called during the forward / backward of that call,
  and ``host_calls``, those outside the PyTorch twin (``kernels/torch_attn.py`` and the mask
  math it runs, ``kernels/mask_math.py``: on a GPU that is the Triton kernel): the per-call
  host path, i.e. checks, resolution lookup, strategy, table lookups, kernel entry points;
- ``forward_us``: the fastest of 200 forward calls (no grad) on 64 tokens, twin included.

    python bench/call_path.py [--json bench/results/call_path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _package_dirs() -> tuple[str, ...]:
    import varlen_cp
    import varlen_cp.kernels
    return (os.path.dirname(varlen_cp.__file__) + os.sep,
            os.path.dirname(varlen_cp.kernels.__file__) + os.sep)


class _Tracer:
    """Counts varlen-cp calls and the varlen-cp depth at the first kernel entry."""

    def __init__(self) -> None:
        self.dirs = _package_dirs()
        self.kernel = os.path.join(self.dirs[1], "torch_attn.py")
        self.twin = (self.kernel, os.path.join(self.dirs[1], "mask_math.py"))
        self.calls = self.host_calls = 0
        self.depth: int | None = None
        self.path: list[str] = []

    def _ours(self, frame) -> bool:
        return frame.f_code.co_filename.startswith(self.dirs)

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or not self._ours(frame):
            return
        self.calls += 1
        self.host_calls += frame.f_code.co_filename not in self.twin
        if self.depth is None and frame.f_code.co_filename == self.kernel:
            stack, f = [], frame
            while f is not None:
                if self._ours(f):
                    stack.append(f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_name}")
                f = f.f_back
            self.depth, self.path = len(stack), stack[::-1]


def _measure(rank: int, world: int, store: str, out: dict) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    from varlen_cp import AttnMask, AttnOptions, ContextParallelVarlenAttention
    from varlen_cp.config import AttnShape, CPConfig
    from varlen_cp.prefetch import build_plan, build_tables

    mask = AttnMask(causal=True)
    config = CPConfig(strategy="p2p", backend="torch")
    cu = torch.tensor([0, 20, 24, 50, 64])
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=16, dtype=torch.float32)
    attn = ContextParallelVarlenAttention(mask, AttnOptions(strategy="p2p", backend="torch"))
    plan = build_plan(cu, config, cp_size=world, cp_rank=rank, layer_masks=[(mask, 1)])
    build_tables(plan, config, [(mask, 1)], shape, "cpu")
    n = plan.num_tokens
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, h, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    attn(q, k, v, plan).sum().backward()          # warm: the plan agreement, lazy imports
    fwd, bwd = _Tracer(), _Tracer()
    sys.setprofile(fwd)
    o = attn(q, k, v, plan)
    sys.setprofile(None)
    loss = o.sum()
    sys.setprofile(bwd)
    loss.backward()
    sys.setprofile(None)
    best = float("inf")
    with torch.no_grad():
        for _ in range(200):
            start = time.perf_counter()
            attn(q, k, v, plan)
            best = min(best, time.perf_counter() - start)
    if rank == 0:
        out.update({"cp": world, "depth": fwd.depth, "path": fwd.path,
                    "forward_calls": fwd.calls, "backward_calls": bwd.calls,
                    "forward_host_calls": fwd.host_calls,
                    "backward_host_calls": bwd.host_calls, "forward_us": best * 1e6})
    if world > 1:
        dist.destroy_process_group()


def _worker(rank: int, world: int, store: str, result: str) -> None:
    out: dict = {}
    _measure(rank, world, store, out)
    if out:
        Path(result).write_text(json.dumps(out))


def measure(world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, store, result), nprocs=world, join=True)
        return json.loads(Path(result).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = [measure(world) for world in (1, 2)]
    for r in rows:
        print(f"cp {r['cp']}: {r['depth']} varlen-cp frames from the module to the kernel, "
              f"{r['forward_calls']} varlen-cp calls in the forward, "
              f"{r['backward_calls']} in the backward; outside the twin "
              f"{r['forward_host_calls']} / {r['backward_host_calls']}; "
              f"forward {r['forward_us']:.0f} us")
        print("  " + " -> ".join(r["path"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
