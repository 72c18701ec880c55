"""Every rank of the CP group built the same plan: one host-side check per (plan, group).

Ranks that build different plans (a data-loader bug: other documents, another layout)
would get silently wrong attention or a hung collective. :func:`agree_on_plan` compares
the plans' fingerprints with ONE 16-byte MAX all-reduce of [fp, -fp] (max and -min in one
collective) on a HOST tensor, so neither the check nor its read touches the device: no
device sync, nothing waits for queued kernels. The integrations run it in the step's
sharding of the batch, before the model runs (``varlen_cp.sharding``); ``cp_varlen_attn``
runs it at its first call on a plan only when the step has not (direct callers).

The host channel is the CP group itself when its backend takes CPU tensors (gloo, or a
"cuda:nccl,cpu:gloo" group), else a gloo group over the same ranks, made once per CP group
(only its members take part: ``use_local_synchronization``) with the CP group's timeout.
What was checked is remembered beside the plan (a weak map, per group's ranks), so a plan
costs one collective however many layers, steps or modules use it, and the map never keeps
a plan alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .collective import group_timeout
from .cpplan import CPPlan

# plan -> the groups (as global rank tuples) whose ranks were found to agree on it
_AGREED: "weakref.WeakKeyDictionary[CPPlan, set]" = weakref.WeakKeyDictionary()
# (id of the CP group, its ranks) -> (host channel, the CP group: kept alive so its id is
# never reused by another group while cached)
_CHANNELS: dict[tuple, tuple[Any, Any]] = {}


def takes_cpu_tensors(group: Any) -> bool:
    """Whether ``group``'s collectives accept CPU tensors (it has a CPU backend)."""
    try:
        group._get_backend(torch.device("cpu"))
        return True
    except Exception:  # "no backend type associated with device type cpu"
        return False


def host_channel(group: Any) -> Any:
    """A process group over ``group``'s ranks whose collectives take CPU tensors."""
    group = dist.group.WORLD if group is None else group
    if takes_cpu_tensors(group):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(group), ranks)
    if key not in _CHANNELS:
        timeout = group_timeout(group)
        kw = {} if timeout is None else {"timeout": timeout}
        _CHANNELS[key] = (dist.new_group(list(ranks), backend="gloo",
                                         use_local_synchronization=True, **kw), group)
    return _CHANNELS[key][0]


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def plan_agreed(plan: CPPlan, group: Any) -> bool:
    """Whether :func:`agree_on_plan` already checked ``plan`` on ``group``'s ranks."""
    return plan.cp_size == 1 or _ranks(group) in _AGREED.get(plan, ())


def agree_on_plan(plan: CPPlan, group: Any) -> None:
    """ValueError on every rank of ``group`` (the CP group; the default group when None)
    unless all of them built the same plan. Once per (plan, group): later calls return at
    once (every rank makes the same calls, so all skip or all join). Host tensors only."""
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if plan_agreed(plan, group):
        return
    fp = plan.fingerprint()
    both = torch.tensor([fp, -fp], dtype=torch.int64)          # on the host, always
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=host_channel(group))
    hi, neg_lo = both.tolist()
    if hi != -neg_lo:
        raise ValueError(f"plan: ranks built different plans (fingerprints range "
                         f"{-neg_lo}..{hi}); every rank must build the plan from the "
                         f"same global cu_seqlens, cp_size and layout")
    _AGREED.setdefault(plan, set()).add(_ranks(group))
