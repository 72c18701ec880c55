"""Checks run INSIDE the virtualenv that holds the built wheel (tests/package/test_packaging.py copies
this file out of the source tree and runs it there, so nothing here can come from the tree).

    python wheel_smoke.py imports SITE_PACKAGES   every module of the installed varlen_cp
        imports, from SITE_PACKAGES (integrations only where their framework is installed);
        prints one JSON line {"imported": [...], "skipped": [...]}
    python wheel_smoke.py cp STORE_DIR            a 2-rank gloo cp_varlen_attn (p2p, causal,
        forward and backward) equals the single-process varlen_attn; prints "cp ok ..."
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

# integration subpackage -> the framework that its modules import
EXTRAS = {"varlen_cp.integrations.torchtitan": "torchtitan",
          "varlen_cp.integrations.megatron": "megatron.core"}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def import_every_module(site_packages: str) -> None:
    root = Path(site_packages) / "varlen_cp"
    imported, skipped = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        extra = next((fw for pkg, fw in EXTRAS.items() if name.startswith(pkg)), None)
        if extra is not None and not _installed(extra):
            skipped.append(name)
            continue
        module = importlib.import_module(name)
        where = Path(module.__file__).resolve()
        if not where.is_relative_to(root.resolve()):
            raise SystemExit(f"{name} was imported from {where}, not from the wheel in {root}")
        imported.append(name)
    print(json.dumps({"imported": imported, "skipped": skipped}))


def _cp_worker(rank: int, store: str) -> None:
    import torch
    torch.set_num_threads(1)  # first: two ranks share the machine's cores
    import torch.distributed as dist

    from varlen_cp import AttnMask, AttnOptions, CPPlan, cp_varlen_attn
    from varlen_cp.kernels import varlen_attn

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(0)  # the same global batch on both ranks
        cu = torch.tensor([0, 37, 40, 101, 128], dtype=torch.int32)
        q, k, v, dout = (torch.randn(128, h, 16, generator=gen)
                         for h in (4, 2, 2, 4))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = varlen_attn(*leaves, cu, cu, 61, 61, causal=True)
        ref.backward(dout)

        plan = CPPlan.build(cu, cp_size=2, cp_rank=rank)
        local = [plan.shard(x).detach().requires_grad_() for x in (q, k, v)]
        out = cp_varlen_attn(*local, plan, AttnMask(causal=True),
                             options=AttnOptions(strategy="p2p"))
        out.backward(plan.shard(dout))
        err = max((plan.unshard(out.detach(), group=None) - ref).abs().max().item(),
                  *((g.grad - plan.shard(r.grad)).abs().max().item()
                    for g, r in zip(local, leaves)))
        if err > 1e-5:  # fp32: only the summation order differs (measured ~5e-7)
            raise SystemExit(f"rank {rank}: CP=2 differs from the local op by {err:.3e}")
        print(f"cp ok rank {rank}: max |CP=2 - local| = {err:.1e} (out, dq, dk, dv)")
    finally:
        dist.destroy_process_group()


def cp_call(store_dir: str) -> None:
    import torch.multiprocessing as mp

    # fork before this process has run any torch op (no OpenMP pool to inherit)
    mp.start_processes(_cp_worker, args=(os.path.join(store_dir, "store"),), nprocs=2,
                       start_method="fork", join=True)


if __name__ == "__main__":
    {"imports": import_every_module, "cp": cp_call}[sys.argv[1]](sys.argv[2])
