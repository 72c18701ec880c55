"""Dispatch context parallelism: fetch exactly the K/V each rank's queries can see, in
stages that overlap with compute.

Host plan (once per (plan, mask), cached in the plan): for every rank, the keys its queries
see are, per document, the union of the query tokens' key intervals. The intervals' ends
never decrease with the position, so the union is a few disjoint ranges of positions, found
with one shifted running maximum; keys held locally are used in place, the others are
fetched from their owners. Every rank computes every rank's needs, so each also knows what
to send in each transfer and in which order, with no metadata exchange
(``varlen_cp.tables.staged``: what a rank fetches from each owner, cut into equal
pieces, one per transfer).

``overlap_stages`` = S (default: the cost model's, ``staged.default_stages``). S >= 2
(``selected_keys``' engine): the first ``all_to_all_single`` (uneven splits, K and V packed
per token into one row, nothing sent to oneself, ``async_op=True``) is posted, then the
local keys' call runs on the local K/V in place; each later transfer is posted before the
previous one's keys are computed, so stage s computes while stage s+1 is in flight. Each
stage's keys, listed per document by position (padding never included), make one varlen
call with explicit positions and its own tile schedule; the partials fold by their LSE.
Backward: each fetched stage's dK/dV (in the input dtype, as the kernel returns them) goes
back to its owners in one ``all_to_all_single`` posted while the next stage computes, and
is summed there with the local ones in fp32; the local call runs last. Each call uses the
FINAL out/lse and the same LSE gradient. S = 1: one all-to-all, then one call over the
local and fetched keys (no overlap; what the cost model picks when the transfer is small
next to the extra folds).

Bytes: forward, each rank sends the K/V rows others need from it; backward, the dK/dV rows
of the keys it fetched: the same totals in any number of stages, and the lower bound of any
scheme that moves K/V to the queries (the other ranks' keys that a rank's queries see).

Across nodes (a plan whose topology spans nodes, ``tables.staged.relay``): each transfer
moves in two hops, a node's union of the keys its ranks need from another node's owner to
the node's ranks in equal chunks (each key crosses the network once per node), then from
those relays to the node mates that need them; backward, the reverse, the relay summing its
mates' dK/dV in fp32 before the cross-node return (:class:`RelayPending`,
:class:`RelayReturns`). Each transfer's second hop is posted right after its first (from a
side stream on CUDA, which waits for the first hop's cross-node rows), each part on a
communicator of its own (``relay_group``: cross-node rows on the CP group, rows between
node mates and the second hop on two groups of the node's CP ranks): transfer s + 1's
cross-node rows travel while s's second hop runs on NVLink, and both while s computes.

Limits: the fetched K/V are kept for the backward pass (memory: the remote keys this
rank's queries see; with S = 1 the local ones too). Every rank plans every rank's needs as
runs (a few per document and rank: what travels where is a [P, cp, cp] count table) and
lists only its own keys one by one (the call's positions and index tables): the plan +
tables of one batch are in ``bench/results/host_tables.json``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ..tables.staged import Stage
from ..tables.staged.relay_tables import RelayStage
from .relay_group import node_groups
from .selected_keys import Pending, SelectedKeysStrategy, post_returns

_SIDE: dict[torch.device, Any] = {}


def _side(device: torch.device) -> Any:
    """Where a relay's second hop is prepared: on CUDA a side stream, so that waiting for
    the first hop holds back neither the compute stream nor the host; elsewhere in line."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(_SIDE[device])


def _ready(device: torch.device) -> Any:
    """A CUDA event at this point of the compute stream (None elsewhere)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _a2a(out: torch.Tensor, send: torch.Tensor, out_splits, in_splits, group: Any) -> Any:
    return dist.all_to_all_single(out, send, list(out_splits), list(in_splits), group=group,
                                  async_op=True)


def _in_node(out: torch.Tensor, send: torch.Tensor, out_splits, in_splits, node: Any,
             group: Any, stage: RelayStage) -> Any:
    """An all-to-all among this rank's node mates (``stage.mates``: the splits' order):
    on the node's group ``node``, or (None: ``relay_group.node_groups`` made none) on the
    CP group ``group``, the splits spread over its ranks."""
    if node is not None:
        return _a2a(out, send, out_splits, in_splits, node)
    cp = len(stage.in_splits)
    full_out, full_in = [0] * cp, [0] * cp
    for m, a, b in zip(stage.mates, out_splits, in_splits):
        full_out[m], full_in[m] = a, b
    return _a2a(out, send, full_out, full_in, group)


class RelayPending(Pending):
    """A relayed transfer's K/V, each part on its own group (``relay_group``): hop 1's
    cross-node rows on the CP group and its rows from node mates on the node's direct
    group, posted; then (on the side stream, so the host and the compute stream go on)
    the wait for the cross-node rows and hop 2, the rows node mates need, into the tail of
    the same buffer, on the node's relay group. So transfer s + 1's cross-node rows travel
    beside s's second hop, a relay forwards as soon as its cross-node rows have landed,
    and the compute of transfer s waits only for s's own collectives."""

    def __init__(self, kf: torch.Tensor, vf: torch.Tensor, stage: RelayStage, group: Any
                 ) -> None:
        send = torch.cat([kf.index_select(0, stage.in_rows),
                          vf.index_select(0, stage.in_rows)], dim=1)
        nx, n1, cut = stage.n_cross, stage.n_hop1, sum(stage.in_splits)
        direct, relay = node_groups(group, stage.mates) or (None, None)
        recv = kf.new_empty(n1 + sum(stage.hop2_splits), kf.shape[1] + vf.shape[1])
        super().__init__(recv, _a2a(recv[:nx], send[:cut], stage.back_splits,
                                    stage.in_splits, group), send)
        self.direct = _in_node(recv[nx:n1], send[cut:], stage.direct_back_splits,
                               stage.direct_in_splits, direct, group, stage)
        self.second = self._forward(stage, relay, group)

    def _forward(self, st: RelayStage, relay: Any, group: Any) -> tuple:
        with _side(self.recv.device):
            self.work.wait()
            send = self.recv[:st.n_cross].index_select(0, st.relay_rows)
            return _in_node(self.recv[st.n_hop1:], send, st.hop2_splits, st.relay_splits,
                            relay, group, st), send

    def result(self) -> torch.Tensor:
        work, send = self.second
        self.work.wait()     # (the second hop waited for it on the side stream already)
        self.direct.wait()
        work.wait()
        if send.device.type == "cuda":   # (made on the side stream, read by the collective)
            send.record_stream(torch.cuda.current_stream(send.device))
        return self.recv


class RelayReturns(Pending):
    """A relayed transfer's dK/dV going home: hop 2 reversed posted on the node's relay
    group (the relayed keys' rows to their relays), then (side stream) what the node mates
    returned summed with our own rows onto the hop-1 buffer, in fp32 and fixed rounds,
    and hop 1 reversed posted: its cross-node part on the CP group, its in-node part on
    the node's direct group."""

    def __init__(self, grads: torch.Tensor, stage: RelayStage, group: Any) -> None:
        node, relay = node_groups(group, stage.mates) or (None, None)
        send = grads.index_select(0, stage.hop2_order)
        recv = grads.new_empty(sum(stage.relay_splits), grads.shape[1])
        super().__init__(recv, _in_node(recv, send, stage.relay_splits, stage.hop2_splits,
                                        relay, group, stage), send)
        own = grads.index_select(0, stage.own_slots)
        ready = _ready(grads.device)
        with _side(grads.device):
            if ready is not None:
                torch.cuda.current_stream(grads.device).wait_event(ready)
            self.work.wait()
            rows = own.new_zeros(stage.n_hop1, own.shape[1], dtype=torch.float32)
            rows.index_copy_(0, stage.own_rows, own.float())
            stage.relay_rounds.add_(rows, recv.float())
            send = rows.to(own.dtype)
            out = send.new_empty(sum(stage.in_splits) + sum(stage.direct_in_splits),
                                 send.shape[1])
            nx, cut = stage.n_cross, sum(stage.in_splits)
            self.second = (_a2a(out[:cut], send[:nx], stage.in_splits, stage.back_splits,
                                group),
                           _in_node(out[cut:], send[nx:], stage.direct_in_splits,
                                    stage.direct_back_splits, node, group, stage), out, send)
            if send.device.type == "cuda":   # made on the compute stream, read here
                own.record_stream(torch.cuda.current_stream(send.device))
                recv.record_stream(torch.cuda.current_stream(send.device))
        self.recv = None

    def result(self) -> torch.Tensor:
        far, near, out, send = self.second
        far.wait()
        near.wait()
        if out.device.type == "cuda":    # (made on the side stream, read here)
            stream = torch.cuda.current_stream(out.device)
            out.record_stream(stream)
            send.record_stream(stream)
        return out


def dispatch_exchange(kf: torch.Tensor, vf: torch.Tensor, stage: Stage | RelayStage,
                      group: Any) -> Pending:
    """Post one stage: our rows that others take in it, theirs that we take (K|V rows);
    relayed (:class:`RelayPending`) on a plan across nodes."""
    if isinstance(stage, RelayStage):
        return RelayPending(kf, vf, stage, group)
    send = torch.cat([kf.index_select(0, stage.in_rows), vf.index_select(0, stage.in_rows)],
                     dim=1)
    recv = kf.new_empty(sum(stage.back_splits), kf.shape[1] + vf.shape[1])
    work = dist.all_to_all_single(recv, send, list(stage.back_splits), list(stage.in_splits),
                                  group=group, async_op=True)
    return Pending(recv, work, send)


def dispatch_returns(grads: torch.Tensor, stage: Stage | RelayStage, group: Any) -> Pending:
    """Post a stage's dK/dV home: one all-to-all, or relayed (:class:`RelayReturns`)."""
    if isinstance(stage, RelayStage):
        return RelayReturns(grads, stage, group)
    return post_returns(grads, stage, group)


class Dispatch(SelectedKeysStrategy):
    """Exactly the K/V ranges each rank's queries see, fetched in overlapped stages
    (relayed through nodes on a plan across nodes)."""

    name = "dispatch"
    exchange = staticmethod(dispatch_exchange)
    returns = staticmethod(dispatch_returns)
