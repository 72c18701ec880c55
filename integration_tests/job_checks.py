"""The first test: the job itself - every rank reachable, collectives correct, which hosts.

It runs before the CP tests so that a broken network (e.g. gloo bound to 127.0.0.1 on a
multi-node job) shows up as one clear failure, not as parity timeouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dist_env import JobContext, gather_hosts
from .harness import register


@register("job/collectives", timeout_s=120.0)
def collectives(ctx: JobContext) -> str:
    """all_reduce and all_gather over the whole job; reports ranks per host."""
    if ctx.world > 1:
        t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
        dist.all_reduce(t)
        want = ctx.world * (ctx.world + 1) / 2
        if float(t) != want:
            raise AssertionError(f"all_reduce of rank+1 gave {float(t)}, expected {want}")
        g = torch.empty(ctx.world, dtype=torch.int64, device=ctx.device)
        dist.all_gather_into_tensor(g, torch.tensor([ctx.rank], device=ctx.device))
        if g.tolist() != list(range(ctx.world)):
            raise AssertionError(f"all_gather of ranks gave {g.tolist()}")
    hosts = gather_hosts(ctx)
    distinct = sorted(set(hosts))
    return f"{ctx.world} rank(s) on {len(distinct)} host(s): {', '.join(distinct)}"
