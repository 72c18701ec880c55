"""The process groups of relayed ``dispatch``'s in-node traffic: two of the CP ranks of one
node.

Relayed ``dispatch`` (``tables.staged.relay``) moves each transfer in two hops: the first
brings a rank its chunk of its node's union from other nodes and its node mates' own keys,
the second forwards what each relay received to the node mates that need it. The
collectives of one communicator run in turn, so each part goes on a communicator (and on
CUDA a stream) of its own: the first hop's cross-node rows on the CP group, its rows
between node mates on the node's *direct* group, the second hop on the node's *relay*
group. Transfer s + 1's cross-node rows then travel while transfer s's second hop runs
on NVLink; a relay forwards once its cross-node rows have landed, whatever its node
mates still send it; and the second hop of s never waits behind the in-node rows of s + 1
(as ``tables.staged.timing`` counts it).

Each rank makes its node's two groups the first time it relays on a CP group
(``new_group(..., use_local_synchronization=True)``: only the node's ranks take part, each
at its first relayed call, which they reach together since they run the same plans, and
each rank makes the same number of groups, so the default group's count of groups stays
equal on all ranks), and keeps them for the process. A process group orders its ranks by
global rank, as the CP group does, so the node's CP ranks in CP order are a node group's
ranks in order, and the splits indexed by ``RelayStage.mates`` index it directly.

Where the default group is bound to a device (``init_process_group(..., device_id=...)``,
NCCL initialized eagerly), torch makes a subgroup by splitting the default group's
communicator, which every rank of the job must join, so a node's ranks cannot make one
alone: the relay's in-node collectives then run on the CP group, after its cross-node
rows, as one communicator runs them (correct, without the overlap).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# (id of the CP group, the node's CP ranks) -> (the CP group, held so that its id stays
# unique; the node's direct group; its relay group)
_GROUPS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any, Any]] = {}


def node_groups(group: Any, mates: tuple[int, ...]) -> tuple[Any, Any] | None:
    """(direct, relay): the two process groups of the CP ranks ``mates`` (this rank's
    node, in CP order) of the CP group ``group``, made on first use (module docstring);
    None where the default group is bound to a device (module docstring: the relay's
    in-node collectives then run on ``group``)."""
    key = (id(group), mates)
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not group:
        if device_bound():
            return None
        ranks = dist.get_process_group_ranks(group)
        members = [ranks[m] for m in mates]
        if members != sorted(members):   # (a process group's ranks are in global order)
            raise ValueError(f"the CP group lists node ranks {list(mates)} out of global "
                             f"rank order ({members}): the relay's node groups need them "
                             f"in order")
        hit = (group, dist.new_group(members, use_local_synchronization=True),
               dist.new_group(members, use_local_synchronization=True))
        _GROUPS[key] = hit
    return hit[1], hit[2]


def device_bound() -> bool:
    """Whether the default process group is bound to a device (``init_process_group(...,
    device_id=...)``: NCCL initialized eagerly). torch then makes a subgroup by splitting
    the default group's communicator, which every rank of the job must join, and a
    group made by a node's ranks alone would wait for the others (or be refused)."""
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id",
                   None) is not None
