"""The process groups of relayed ``dispatch``'s in-node traffic: two of the CP ranks of one
node, made at setup by :func:`prepare_node_groups`.

Relayed ``dispatch`` (``tables.staged.relay``) moves each transfer in two hops: the first
brings a rank its chunk of its node's union from other nodes and its node mates' own keys,
the second forwards what each relay received to the node mates that need it. The
collectives of one communicator run in turn, so each part goes on a communicator (and on
CUDA a stream) of its own: the first hop's cross-node rows on the CP group, its rows
between node mates on the node's *direct* group, the second hop on the node's *relay*
group. Transfer s + 1's cross-node rows then travel while transfer s's second hop runs
on NVLink; a relay forwards once its cross-node rows have landed, whatever its node
mates still send it; and the second hop of s never waits behind the in-node rows of s + 1
(as ``tables.staged.timing`` counts it). Every rank posts them in one order (cross-node
rows, in-node rows, second hop; transfer by transfer), each group's in the same order on
all its ranks.

The groups are made once, at setup, where every rank of the job runs the same code:
``new_group(..., use_local_synchronization=True)``, only a node's ranks taking part, two
per rank, always (whether or not the plans will relay), so that torch's count of groups,
which names later groups, stays equal on every rank (made lazily, at a rank's first
relayed call, it would not: some ranks never relay, and a job-wide ``new_group`` after
that waits forever). The torchtitan and megatron integrations call
:func:`prepare_node_groups`; a program calling the op itself calls it on every rank, else
the relay runs its in-node collectives on the CP group, after its cross-node rows, as one
communicator runs them (correct, without the overlap). A process group orders its ranks
by global rank, as the CP group does, so the node's CP ranks in CP order are a node
group's ranks in order, and the splits indexed by ``RelayStage.mates`` index it directly.

Where the default group is bound to a device (``init_process_group(..., device_id=...)``,
NCCL initialized eagerly), torch makes a subgroup by splitting the default group's
communicator, which every rank of the job must join, so a node's ranks cannot make one
alone: none is made, and the relay stays on the CP group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

# (the CP group, the node's CP ranks) -> (the node's direct group, its relay group); the
# key holds the CP group, so its id is never reused while the entry lives
_GROUPS: dict[tuple[Any, tuple[int, ...]], tuple[Any, Any]] = {}


def prepare_node_groups(group: Any, topology: Any) -> bool:
    """Make this rank's two node groups for the CP group ``group`` (None: the default
    group) whose ranks sit on nodes as ``topology`` (a ``plan.Topology``; None, or one CP
    rank: nothing to make) says. Call it on every rank of the job at the same point of
    setup (module docstring); again for the same group and topology: a dict lookup.
    Whether the groups exist (False where the default group is bound to a device)."""
    if topology is None or len(topology.nodes) < 2:
        return False
    group = dist.group.WORLD if group is None else group
    nodes = np.asarray(topology.nodes)
    me = dist.get_rank(group)
    mates = tuple(np.flatnonzero(nodes == nodes[me]).tolist())
    key = (group, mates)
    if key in _GROUPS:
        return True
    if device_bound():
        return False
    ranks = dist.get_process_group_ranks(group)
    members = [ranks[m] for m in mates]
    if members != sorted(members):   # (a process group's ranks are in global order)
        raise ValueError(f"the CP group lists node ranks {list(mates)} out of global rank "
                         f"order ({members}): the relay's node groups need them in order")
    _GROUPS[key] = (dist.new_group(members, use_local_synchronization=True),
                    dist.new_group(members, use_local_synchronization=True))
    return True


def node_groups(group: Any, mates: tuple[int, ...]) -> tuple[Any, Any] | None:
    """(direct, relay): the node groups of the CP ranks ``mates`` (this rank's node, in CP
    order) of the CP group ``group``, as :func:`prepare_node_groups` made them; None where
    it did not (the relay's in-node collectives then run on ``group``)."""
    return _GROUPS.get((group, mates))


def device_bound() -> bool:
    """Whether the default process group is bound to a device (``init_process_group(...,
    device_id=...)``: NCCL initialized eagerly). torch then makes a subgroup by splitting
    the default group's communicator, which every rank of the job must join, and a
    group made by a node's ranks alone would wait for the others (or be refused)."""
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id",
                   None) is not None
