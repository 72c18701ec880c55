"""The one collective the plan itself needs: gather every rank's local tokens (unshard).

Local token counts differ between ranks, and gloo's list ``all_gather`` rejects uneven
sizes, so each rank pads its part to the largest local count and one equal-size
``all_gather_single`` (``all_gather_into_tensor`` on older torch) moves them all. The plan
then picks the global order out of the padded buffer with a host-planned index.
Not differentiable (tests, logits, metrics).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same call).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_timeout(group: Any) -> Any:
    """The timeout ``group``'s collectives run with (a timedelta; None if torch does not
    say)."""
    group = dist.group.WORLD if group is None else group
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or no options on this torch
            continue
    return None


def check_group_type(group: object) -> None:
    """ValueError unless ``group`` is a ProcessGroup or None. A DeviceMesh, a rank list or
    a group name would otherwise reach torch's collectives, which fail with unrelated
    errors (or, for some types, on one rank only)."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return
    hint = ""
    if type(group).__name__ == "DeviceMesh":
        hint = " (for a DeviceMesh, pass its CP dimension's group: mesh['cp'].get_group())"
    raise ValueError(f"group must be a torch.distributed.ProcessGroup or None, got "
                     f"{type(group).__name__}{hint}")


def check_group(group: dist.ProcessGroup | None, cp_size: int, cp_rank: int) -> None:
    """ValueError unless ``group`` has ``cp_size`` ranks and this process is ``cp_rank``."""
    check_group_type(group)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"group: torch.distributed is not initialized, but the plan has "
                         f"cp_size={cp_size} > 1")
    size = dist.get_world_size(group)
    if size != cp_size:
        raise ValueError(f"group: size {size} differs from the plan's cp_size={cp_size}")
    rank = dist.get_rank(group)
    if rank != cp_rank:
        raise ValueError(f"group: this process is rank {rank} of the group but the plan was "
                         f"built for cp_rank={cp_rank}")


def gather_padded(x_local: torch.Tensor, max_local: int, cp_size: int,
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """[cp * max_local, ...]: every rank's dim-0 rows, each padded to ``max_local``.

    Not differentiable: the input is detached (e.g. a CP op's LSE, which requires grad).
    """
    rest = tuple(x_local.shape[1:])
    padded = x_local.new_zeros((max_local, *rest))
    padded[: x_local.shape[0]].copy_(x_local.detach())
    out = x_local.new_empty((cp_size * max_local, *rest))
    all_gather_single(out, padded, group=group)
    return out
