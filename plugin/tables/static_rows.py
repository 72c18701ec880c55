"""Host tables of the graph-safe mode: every rank's rows at a fixed capacity.

A captured step (CUDA graphs) replays the device work it recorded, with the shapes and
sizes of its first batch. So in the graph-safe mode (``AttnOptions(graph_safe=True)``)
every rank holds exactly ``capacity`` rows in every batch: its tokens of the plan first,
then unused slots (document and position -1: they see nothing and nothing sees them). What
differs between batches is data only: each row's document and position, which the static
strategies (``varlen_cp.strategies.static``) read from device buffers refreshed in place.

The capacity is the most tokens one rank may hold: the plan's own when it was built at one
(``CPPlan.build(capacity=...)``, ``plan/capacity.py``, what the integrations do: their
sharding then gives every rank capacity rows), else derived from the batch's token count
(fixed for a job: packed sequences of one length) and cp (``default_capacity``: 1.02 x the
mean, rounded up to 64; the ``balanced`` layout keeps every rank within 2% of the mean, the
others within a token or their padding), unless given. A batch in which a
rank holds more is refused (:func:`check_capacity`) before anything is communicated; the
plan is the same on every rank, so every rank raises the same error. Graph-safe
``dispatch`` also has a capacity per pair of ranks: the most keys one rank sends another
(``graph_send_capacity``, default the rows capacity: any batch fits), its send lists and
received keys padded to it (:func:`dispatch_rows`, :func:`check_send_capacity`).
"""

from __future__ import annotations

import numpy as np

from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.capacity import check_capacity as _check_counts, default_capacity
from ..plan.runs import run_rows
from .cache import host_table, table_key
from .selected import fetch_count_array
from .staged.routes import index_in_group
from .staged.tables import given_runs, selection_runs

def capacity_of(plan: CPPlan, capacity: int | None) -> int:
    """The rows per rank of a graph-safe call on ``plan``: the plan's own capacity when it
    was built at one (``CPPlan.build(capacity=...)``; ``capacity`` must then be None or
    equal), else ``capacity``, else the default (``varlen_cp.plan.capacity.default_capacity`` of its
    tokens)."""
    if plan.capacity is not None:
        if capacity is not None and capacity != plan.capacity:
            raise ValueError(f"graph_capacity={capacity} differs from the capacity the plan "
                             f"was built at ({plan.capacity})")
        return plan.capacity
    if capacity is not None:
        return capacity
    return default_capacity(plan.padded_total_tokens, plan.cp_size)


def check_capacity(plan: CPPlan, capacity: int) -> None:
    """ValueError when a rank of ``plan`` holds more than ``capacity`` rows (every rank
    raises it: the plan is the same everywhere)."""
    _check_counts(np.diff(plan.arrays.rank_offsets), capacity, plan.padded_total_tokens,
                  plan.layout)


def static_rows(plan: CPPlan, capacity: int) -> np.ndarray:
    """int32 [2, cp * capacity]: the document (row 0) and position (row 1) of every rank's
    rows at ``capacity`` (rank r's rows at [r * capacity, (r + 1) * capacity): its tokens,
    then -1 for the unused slots), cached per capacity. Checks the capacity first."""
    def build() -> np.ndarray:
        check_capacity(plan, capacity)
        t = plan.arrays
        counts = np.diff(t.rank_offsets)
        rank = np.repeat(np.arange(plan.cp_size, dtype=np.int64), counts)
        slot = np.arange(t.position.size, dtype=np.int64) - t.rank_offsets[rank] \
            + rank * capacity
        out = np.full((2, plan.cp_size * capacity), -1, dtype=np.int32)
        real = t.position >= 0          # padding of the ``te`` layout sees nothing either
        out[0, slot[real]] = t.doc[real]
        out[1, slot[real]] = t.position[real]
        return out
    return host_table(plan, table_key("static_rows", None, None, capacity), build)


def check_send_capacity(plan: CPPlan, mask: AttnMask, send_capacity: int) -> None:
    """ValueError when a rank's queries of ``plan`` need more than ``send_capacity`` keys
    from one other rank under ``mask`` (graph-safe ``dispatch``; every rank raises it)."""
    counts = fetch_count_array(plan, mask).copy()
    np.fill_diagonal(counts, 0)
    dest, owner = np.unravel_index(int(np.argmax(counts)), counts.shape)
    if int(counts[dest, owner]) > send_capacity:
        raise ValueError(
            f"graph_send_capacity={send_capacity} is below what this batch sends: rank "
            f"{dest} needs {int(counts[dest, owner])} keys of rank {owner} ({mask}, cp "
            f"{plan.cp_size}); raise graph_send_capacity (the keys one rank sends another "
            f"in graph-safe dispatch)")


def dispatch_rows(plan: CPPlan, mask: AttnMask, rank: int, capacity: int,
                  send_capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Graph-safe ``dispatch`` of ``rank`` at ``send_capacity`` keys per peer: (int64 [cp,
    K]: the local rows it sends each rank, in that rank's selection order, ``capacity`` (a
    zero row) in the unused slots; int32 [2, cp * K]: the document and position of every
    key it receives, peer-major, -1 in the unused slots), cached. Checks the capacity."""
    def build() -> tuple[np.ndarray, np.ndarray]:
        check_send_capacity(plan, mask, send_capacity)
        cp, k = plan.cp_size, send_capacity
        given = given_runs(plan, mask, rank)
        send = np.full((cp, k), capacity, dtype=np.int64)
        send[np.repeat(given.peer, given.length),
             run_rows(given.slot, given.length)] = run_rows(given.row, given.length)
        sel = selection_runs(plan, mask, rank)
        away = np.flatnonzero(sel.peer != rank)
        owner, length = sel.peer[away], sel.length[away]
        slot = index_in_group(owner, length, cp)    # its place in the owner's list for us
        at = np.repeat(owner * k, length) + run_rows(slot, length)
        recv = np.full((2, cp * k), -1, dtype=np.int32)
        recv[0, at] = np.repeat(sel.doc[away], length)
        recv[1, at] = run_rows(sel.pos[away], length)
        return send, recv
    return host_table(plan, table_key("static_dispatch_rows", mask, None, rank, capacity,
                                      send_capacity), build)
