"""One rank's tables of ``dispatch`` relayed through nodes (``relay``: the routes).

Per transfer, a rank plays three parts, each a list of runs of keys from the routes that
every rank computes alike:

- owner: its rows each other rank receives in the first hop (a node mate's own list, or a
  relay's chunk of its node's union), grouped by receiver, each in the receiver's order;
- relay: the rows of its first-hop buffer each node mate needs (grouped by mate, in buffer
  order: by owner, then place in the union);
- receiver: where each key its call uses lies in ``[first-hop buffer; second-hop buffer]``,
  in call order (the selection's), and for the backward which call slots go back to which
  relay and which it sums itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ...kernels.host_copy import to_device
from ...masks import AttnMask
from ...plan import CPPlan
from ...plan.runs import run_rows
from ..flash_form import FlashRoute
from ..holders import KernelCall
from ..rounds import UniqueRounds
from .relay import node_members, node_pieces, relay_cut, relay_routes, union_cut
from .routes import cut_runs, index_in_group, transfers
from .tables import (KeyRuns, StagedTables, _holder, _tensor, given_runs, selection_runs,
                     with_calls)

_BIG = 1 << 40


@dataclass(frozen=True)
class RelayStage:
    """One transfer of relayed ``dispatch`` for one rank (host tensors, or device copies).

    Forward, hop 1: send local rows ``in_rows`` (``in_splits`` to each rank of other nodes
    on the CP group, then ``direct_in_splits`` to each node mate on the node's group) and
    receive ``back_splits`` rows from each rank of other nodes and ``direct_back_splits``
    from each mate, into one buffer in that order (``n_cross`` rows, then the mates');
    hop 2, on the node's group: forward rows ``relay_rows`` of the cross-node part
    (``relay_splits`` to each mate) and receive ``hop2_splits`` from each relay. The
    node's lists are indexed by ``mates``, the CP ranks of this rank's node in CP order,
    itself included. ``gather`` picks the call's fetched keys from the two buffers laid
    back to back (S = 1: into ``remote_slots``, local rows ``local_rows`` into
    ``local_slots``). Backward: call slots ``hop2_order`` go back to the relays (hop 2
    reversed); the rows the node mates return are summed onto hop-1 rows in
    ``relay_rounds`` (rows ``relay_rows``), with our own slots ``own_slots`` at hop-1 rows
    ``own_rows``; the hop-1 buffer goes back to the senders (its two parts on their two
    groups), and what we receive lands on local rows ``in_rows`` in ``rounds`` (as plain
    dispatch's returns)."""

    call: KernelCall | None
    n_keys: int
    gather: torch.Tensor
    in_rows: torch.Tensor
    in_splits: tuple[int, ...]
    back_splits: tuple[int, ...]
    relay_rows: torch.Tensor
    relay_splits: tuple[int, ...]
    hop2_splits: tuple[int, ...]
    hop2_order: torch.Tensor
    own_slots: torch.Tensor
    own_rows: torch.Tensor
    relay_rounds: UniqueRounds
    rounds: UniqueRounds
    mates: tuple[int, ...]
    direct_in_splits: tuple[int, ...]
    direct_back_splits: tuple[int, ...]
    remote_slots: torch.Tensor | None = None
    local_slots: torch.Tensor | None = None
    local_rows: torch.Tensor | None = None

    @property
    def n_cross(self) -> int:
        """Rows of hop 1's buffer from other nodes (its first part)."""
        return sum(self.back_splits)

    @property
    def n_hop1(self) -> int:
        return self.n_cross + sum(self.direct_back_splits)

    def to(self, device: torch.device) -> "RelayStage":
        names = ("gather", "in_rows", "relay_rows", "hop2_order", "own_slots", "own_rows",
                 "remote_slots", "local_slots", "local_rows")
        moved = to_device([getattr(self, n) for n in names], device)
        return replace(self, **dict(zip(names, moved)),
                       relay_rounds=self.relay_rounds.to(device),
                       rounds=self.rounds.to(device),
                       call=None if self.call is None else self.call.to(device))


def _cat(*parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(x) for x in zip(*parts))


def _places(group: np.ndarray, order_key: np.ndarray, length: np.ndarray,
            n_groups: int) -> np.ndarray:
    """Place of each run's first key in its group's list, the group's runs ordered by
    ``order_key``."""
    order = np.lexsort((order_key, group))
    out = np.empty_like(length)
    out[order] = index_in_group(group[order], length[order], n_groups)
    return out


def _fetched(plan: CPPlan, mask: AttnMask, rank: int, routes, nodes, members
             ) -> tuple[KeyRuns, np.ndarray, np.ndarray, np.ndarray]:
    """``rank``'s remote keys cut at the transfers: runs (selection order within each
    part), their transfer, the rank they come from in hop 1 or 2 (``via``: the owner's
    relay, or the rank itself for keys read from its hop-1 buffer), and their place in
    the block that rank's hop-1 buffer holds from the owner."""
    cp = plan.cp_size
    sel = selection_runs(plan, mask, rank)
    remote = sel.take(np.flatnonzero(sel.peer != rank))
    near = nodes[remote.peer] == nodes[rank]
    mate = remote.take(np.flatnonzero(near))
    index = index_in_group(mate.peer, mate.length, cp)
    begins = routes.direct[:-1, rank, :].T
    ends = routes.direct[1:, rank, :].T
    run, p0, offset, n = cut_runs(index, mate.length, begins[mate.peer], ends[mate.peer])
    direct = mate.take(run, offset, n)
    d_place = index[run] + offset - begins[mate.peer[run], p0]
    far = remote.take(np.flatnonzero(~near))
    run, stage, via, place, offset, n = relay_cut(
        routes, nodes, np.full(far.length.size, rank), far.peer, far.row, far.length, members)
    relayed = far.take(run, offset, n)
    runs = KeyRuns(*_cat(*((a.doc, a.pos, a.row, a.slot, a.length, a.peer)
                           for a in (direct, relayed))))
    return (runs, np.concatenate([routes.stage_of[p0], stage]),
            np.concatenate([np.full(direct.length.size, rank), via]),
            np.concatenate([d_place, place]))


def _relayed_for_mates(plan: CPPlan, mask: AttnMask, rank: int, parts: int, nodes
                       ) -> tuple[np.ndarray, ...]:
    """What ``rank`` forwards in hop 2: (transfer, mate, owner, place in our chunk from
    the owner, length) of every piece of its node mates' keys it relays."""
    stage, mate, owner, via, place, length = node_pieces(plan, mask, parts, nodes[rank])
    mine = (via == rank) & (mate != rank)
    return stage[mine], mate[mine], owner[mine], place[mine], length[mine]


def _hop2_in(plan: CPPlan, mask: AttnMask, rank: int, parts: int, nodes, n_parts: int
             ) -> np.ndarray:
    """int64 [P, cp]: rows ``rank`` receives from each relay in each transfer's hop 2."""
    stage, dest, _, via, _, length = node_pieces(plan, mask, parts, nodes[rank])
    mine = (dest == rank) & (via != rank)
    cp = plan.cp_size
    flat = np.bincount(stage[mine] * cp + via[mine], weights=length[mine],
                       minlength=n_parts * cp)
    return flat.astype(np.int64).reshape(n_parts, cp)


def _sent(plan: CPPlan, mask: AttnMask, rank: int, routes, nodes, members
          ) -> tuple[np.ndarray, ...]:
    """What ``rank`` sends in hop 1 as an owner: (transfer, receiver, place in the
    receiver's block from us, our row, length) of every piece."""
    given = given_runs(plan, mask, rank)
    mate = given.take(np.flatnonzero(nodes[given.peer] == nodes[rank]))
    begins = routes.direct[:-1, :, rank].T     # [d, P0]
    ends = routes.direct[1:, :, rank].T
    run, p0, offset, n = cut_runs(mate.slot, mate.length, begins[mate.peer], ends[mate.peer])
    dest = mate.peer[run]
    direct = (routes.stage_of[p0], dest, mate.slot[run] + offset - begins[dest, p0],
              mate.row[run] + offset, n)
    return _cat(direct, union_cut(routes, nodes, rank, members))


def relay_tables(plan: CPPlan, mask: AttnMask, rank: int, block: tuple[int, int],
                 stages: int, route: FlashRoute | None) -> StagedTables:
    """``rank``'s relayed dispatch tables with ``stages`` stages (uncached: through
    ``tables.staged_tables``)."""
    cp = plan.cp_size
    routes = relay_routes(plan, mask, transfers(stages))
    nodes, members = node_members(plan)
    fetched, f_stage, f_via, f_place = _fetched(plan, mask, rank, routes, nodes, members)
    s_stage, s_dest, s_place, s_row, s_len = _sent(plan, mask, rank, routes, nodes, members)
    parts_in = transfers(stages)
    r_stage, r_mate, r_owner, r_place, r_len = _relayed_for_mates(plan, mask, rank, parts_in,
                                                                  nodes)
    n_parts = routes.hop1.shape[0]
    hop2_all = _hop2_in(plan, mask, rank, parts_in, nodes, n_parts)
    one = stages == 1
    sel = selection_runs(plan, mask, rank) if one else None
    mates = members[nodes[rank]]
    mates = mates[mates >= 0]   # this rank's node, in CP order: hop 2's group
    mate = np.zeros(cp, dtype=bool)
    mate[mates] = True
    # hop 1's buffer: the rows from other nodes' ranks (CP group), then the mates' (node
    # group), each part in CP order
    by_part = np.argsort(np.where(mate, cp, 0) + np.arange(cp), kind="stable")
    parts, keys = [], []
    for p in range(n_parts):
        hop1_in, hop2_in = routes.hop1[p, rank], hop2_all[p]
        blk1 = np.empty(cp, dtype=np.int64)
        blk1[by_part] = np.cumsum(hop1_in[by_part]) - hop1_in[by_part]
        blk2 = np.cumsum(hop2_in) - hop2_in
        n1 = int(hop1_in.sum())
        # owner: our rows per receiver (other nodes first), in the receiver's order
        here = np.flatnonzero(s_stage == p)
        order = here[np.lexsort((s_place[here], s_dest[here], mate[s_dest[here]]))]
        in_start, in_len = s_row[order], s_len[order]
        in_rows = run_rows(in_start, in_len)
        in_splits = np.bincount(s_dest[order], weights=s_len[order],
                                minlength=cp).astype(np.int64)
        # relay: hop-1 rows per mate, in buffer order
        here = np.flatnonzero(r_stage == p)
        r_buf = blk1[r_owner[here]] + r_place[here]
        order = np.lexsort((r_buf, r_mate[here]))
        relay_start, relay_len = r_buf[order], r_len[here][order]
        relay_rows = run_rows(relay_start, relay_len)
        relay_splits = np.bincount(r_mate[here], weights=r_len[here], minlength=cp)
        # receiver: the call's keys in selection order, and where each lies
        here = np.flatnonzero(f_stage == p)
        here = here[np.argsort(fetched.slot[here], kind="stable")]
        mine = fetched.take(here)
        via, place = f_via[here], f_place[here]
        two = via != rank
        buf = np.where(two, 0, blk1[mine.peer] + place)
        if two.any():
            hop2_place = _places(via[two], mine.peer[two] * _BIG + place[two],
                                 mine.length[two], cp)
            buf[two] = n1 + blk2[via[two]] + hop2_place
        slots = mine.slot if one else np.cumsum(mine.length) - mine.length
        order2 = np.flatnonzero(two)[np.argsort(buf[two], kind="stable")]
        fields = dict(
            gather=_tensor(run_rows(buf, mine.length)),
            in_rows=_tensor(in_rows), in_splits=tuple(np.where(mate, 0, in_splits).tolist()),
            back_splits=tuple(np.where(mate, 0, hop1_in).tolist()),
            direct_in_splits=tuple(in_splits[mates].tolist()),
            direct_back_splits=tuple(hop1_in[mates].tolist()),
            relay_rows=_tensor(relay_rows),
            relay_splits=tuple(relay_splits[mates].astype(np.int64).tolist()),
            hop2_splits=tuple(hop2_in[mates].tolist()), mates=tuple(mates.tolist()),
            hop2_order=_tensor(run_rows(slots[order2], mine.length[order2])),
            own_slots=_tensor(run_rows(slots[~two], mine.length[~two])),
            own_rows=_tensor(run_rows(buf[~two], mine.length[~two])),
            relay_rounds=UniqueRounds.of_runs(relay_start, relay_len, relay_rows),
            rounds=UniqueRounds.of_runs(in_start, in_len, in_rows))
        if one:
            local = sel.take(np.flatnonzero(sel.peer == rank))
            fields["remote_slots"] = _tensor(run_rows(mine.slot, mine.length))
            fields["local_slots"] = _tensor(run_rows(local.slot, local.length))
            fields["local_rows"] = _tensor(run_rows(local.row, local.length))
            mine = sel
        fields["n_keys"] = int(mine.length.sum())
        parts.append(fields)
        keys.append(_holder(mine, plan.n_docs) if mine.length.size else None)
    return with_calls(plan, mask, rank, block, stages, route, keys, parts, RelayStage)
