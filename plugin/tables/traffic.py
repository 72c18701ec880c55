"""Who sends how many bytes to whom: each strategy's traffic per layer as [cp, cp] matrices.

Row s, column d: the bytes CP rank s posts to CP rank d in one layer's forward (``"fwd"``)
or backward (``"bwd"``), exactly as the strategies' collectives post them (the strategy
tests count them per peer on gloo). ``tables.cost``'s bytes per rank are their row sums;
with the ranks' nodes the same matrices split into in-node and cross-node bytes, which
move on different links (NVLink inside a node, InfiniBand / RoCE across).

- p2p: the ring of all ranks: K/V to the next rank each step; backward the K/V again,
  and each step's dK/dV partial straight back to the rank that owns those keys.
- a2a+p2p: Ulysses all-to-alls inside groups of ``a2a_size`` consecutive ranks, and a
  ring of the groups in which member m of a group talks to member m of the others.
- a2a: one Ulysses group of all ranks: each rank's q/k/v heads to every peer, the
  outputs back to the tokens' owners (and the reverse backward).
- all_gather: every rank's padded K/V to every other; back only the picked keys' dK/dV.
- dispatch: exactly the keys each rank's queries see, from their owners; dK/dV back. On a
  plan across nodes, relayed: a node's union from each owner to its relays, then from the
  relays to the ranks of the node (``staged.relay``); the reverse backward.
Everything is numpy integer math on the plan's run-level tables (cached there).
``catalogue.bytes_sent`` is the row sums: one count of the bytes, not two.
"""

from __future__ import annotations

import numpy as np

from ..masks import AttnMask
from ..plan import CPPlan
from ..shape import AttnShape, kv_heads_per_rank
from .hybrid import group_visibility, hybrid_size
from .ring import rank_visibility, ring_length
from .selected import fetch_count_array
from .staged.relay import relay_active, relay_link_counts

Traffic = dict[str, np.ndarray]   # {"fwd": int64 [cp, cp], "bwd": int64 [cp, cp]}

__all__ = ["Traffic", "p2p_traffic", "all_gather_traffic", "dispatch_traffic", "a2a_traffic",
           "hybrid_traffic", "ring_traffic", "ulysses_traffic", "cross_node", "split"]


def _local_sizes(plan: CPPlan) -> np.ndarray:
    offsets = plan.arrays.rank_offsets
    return offsets[1:] - offsets[:-1]


def _off_diagonal(m: np.ndarray) -> np.ndarray:
    out = m.astype(np.int64, copy=True)
    np.fill_diagonal(out, 0)
    return out


def ring_traffic(sizes: np.ndarray, vis: np.ndarray, row: int, members: int = 1) -> Traffic:
    """A ring of ``H = sizes.size`` positions (``vis``: int [H, H], position s's queries
    see position o's keys when > 0), each position ``members`` consecutive ranks, member m
    talking to member m of the other positions; ``row``: bytes per K/V token. Position i
    sends the K/V of ring steps 0..n-2 (sources i - t) to position i + 1; backward the same
    again, and the dK/dV partial of each later step whose source it sees to that source."""
    size = sizes.size
    n_steps = ring_length(vis)
    pos = np.arange(size)
    src = (pos[:, None] - np.arange(n_steps)[None, :]) % size          # [H, steps]
    kv = sizes[src[:, :-1]].sum(1)
    fwd = np.zeros((size, size), np.int64)
    np.add.at(fwd, (pos, (pos + 1) % size), kv)
    back = src[:, 1:]
    seen = np.take_along_axis(vis, back, 1) > 0
    grads = np.zeros((size, size), np.int64)
    np.add.at(grads, (np.repeat(pos, back.shape[1]), back.ravel()),
              (sizes[back] * seen).ravel())
    eye = np.eye(members, dtype=np.int64)
    return {"fwd": np.kron(fwd, eye) * row, "bwd": np.kron(fwd + grads, eye) * row}


def ulysses_traffic(sizes: np.ndarray, size: int, shape: AttnShape) -> Traffic:
    """Ulysses all-to-alls inside groups of ``size`` consecutive ranks (zeros for size 1):
    forward, rank s sends its tokens' q/k/v head slice for d and d's tokens' output slice
    it computed; backward, the output gradient's slice and the q/k/v gradients back."""
    cp = sizes.size
    if size == 1:
        zero = np.zeros((cp, cp), np.int64)
        return {"fwd": zero, "bwd": zero.copy()}
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    hq = shape.n_heads // size
    qkv_row = (hq * shape.head_dim + hk * (shape.head_dim + shape.value_dim)) \
        * shape.dtype_bytes
    out_row = hq * shape.value_dim * shape.dtype_bytes
    group = np.arange(cp) // size
    peers = (group[:, None] == group[None, :]) & ~np.eye(cp, dtype=bool)
    mine, theirs = sizes[:, None], sizes[None, :]
    return {"fwd": np.where(peers, mine * qkv_row + theirs * out_row, 0).astype(np.int64),
            "bwd": np.where(peers, mine * out_row + theirs * qkv_row, 0).astype(np.int64)}


def p2p_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                ) -> Traffic:
    return ring_traffic(_local_sizes(plan), rank_visibility(plan, mask), shape.kv_row)


def all_gather_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape,
                       a2a_size: int | None = None) -> Traffic:
    cp, row = plan.cp_size, shape.kv_row
    stride = int(_local_sizes(plan).max())
    counts = fetch_count_array(plan, mask)       # [s, o]: keys s's queries need from o
    return {"fwd": _off_diagonal(np.full((cp, cp), stride * row, np.int64)),
            "bwd": _off_diagonal(counts) * row}


def dispatch_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape,
                     a2a_size: int | None = None) -> Traffic:
    if relay_active(plan):   # both hops (which rank relays a key does not depend on S)
        hop1, hop2, _ = relay_link_counts(plan, mask, 1)   # (totals: exact)
        counts = (hop1 + hop2).sum(0)
    else:
        counts = _off_diagonal(fetch_count_array(plan, mask))
    return {"fwd": counts.T * shape.kv_row, "bwd": counts * shape.kv_row}


def _group_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape, size: int) -> Traffic:
    sizes = _local_sizes(plan)
    out = ulysses_traffic(sizes, size, shape)
    if size < plan.cp_size:  # a ring across the groups, on this rank's head slice
        hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
        ring_row = hk * (shape.head_dim + shape.value_dim) * shape.dtype_bytes
        ring = ring_traffic(sizes.reshape(-1, size).sum(1),
                            group_visibility(plan, mask, size), ring_row, members=size)
        out = {k: out[k] + ring[k] for k in out}
    return out


def a2a_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                ) -> Traffic:
    return _group_traffic(plan, mask, shape, plan.cp_size)


def hybrid_traffic(plan: CPPlan, mask: AttnMask, shape: AttnShape,
                   a2a_size: int | None = None) -> Traffic:
    return _group_traffic(plan, mask, shape, hybrid_size(plan, shape, a2a_size))


# ---- in-node / cross-node --------------------------------------------------------------------
def cross_node(nodes: np.ndarray) -> np.ndarray:
    """bool [cp, cp]: ranks s and d run on different nodes (``nodes``: each CP rank's node)."""
    nodes = np.asarray(nodes)
    return nodes[:, None] != nodes[None, :]


def split(traffic: Traffic, nodes: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank, the bytes it sends inside its node and to other nodes: ``{"fwd_in",
    "fwd_cross", "bwd_in", "bwd_cross"}``, int64 [cp] each."""
    nodes = np.asarray(nodes)
    one_node = not nodes.size or (nodes == nodes[0]).all()   # the common case: no masking
    cross = None if one_node else cross_node(nodes)
    out = {}
    for phase, m in traffic.items():
        total = m.sum(1)
        out[f"{phase}_cross"] = total * 0 if one_node else np.where(cross, m, 0).sum(1)
        out[f"{phase}_in"] = total - out[f"{phase}_cross"]
    return out
