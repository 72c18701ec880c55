"""Which CP ranks share a node, and the ``balanced`` layout's ranks placed on the nodes so
that the K/V a rank fetches comes from its own node where it can.

A rank's keys from a rank of its own node move on NVLink (~150 GB/s per GPU), those from
another node on the network (~45 GB/s per GPU: one 400 Gb/s NIC per GPU), both at once.
The ``balanced`` solver makes every rank's tokens and every mask's work equal, but its rank
numbers are only labels: any relabelling keeps every rank's share, so every balance target,
exactly. :func:`place_ranks` picks the relabelling: it groups the ranks that share
documents onto one node, most of all those that bound the layer (the rank whose fetch takes
longest, its in-node bytes at the node rate against its cross-node bytes at the network
rate, for each mask weighted by its layer count).

How: the solver's order first (consecutive ranks share documents, so nodes of consecutive
ranks are a good start), then swaps of two ranks of different nodes, each the best of those
that move the slowest rank to the node of a rank it fetches from or that bring one of its
cross-node sources into its node, while the weighted sum over masks of the slowest rank's
fetch time falls (a tiny weight on the mean breaks ties between equal maxima). A swap's
effect on every rank is O(cp) (only the two ranks' nodes change), so one step over all
candidates is a few numpy ops on [candidates, masks, cp]; a plan takes at most ``4 * cp``
steps (cp 64: typically 5-15). Deterministic (numpy, first index on ties): every rank
derives the same layout. Measurements: ``docs/balanced-layout.md``.

The grouping (:class:`Topology`) comes from the CP group's global ranks and the launch's
GPUs per node (``node_of_ranks``); a plan records it, and a call on a group whose ranks
sit on other nodes is refused (``resolve.check_group``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..checks import check_positive, is_int
from .balanced import MaskWeights
from .spans import key_spans, merge_spans, span_pieces
from .runs import STRIDE

NODE_BYTES_PER_S = 1.5e11        # NVLink, per GPU
CROSS_NODE_BYTES_PER_S = 4.5e10  # one 400 Gb/s NIC per GPU
MEAN_WEIGHT = 1e-3               # tie-break between placements with equal maxima


def _whole(x: Any) -> bool:
    return is_int(x) or (isinstance(x, np.integer) and not isinstance(x, np.bool_))


@dataclass(frozen=True)
class Topology:
    """The node of each CP rank and the two links' rates (bytes per second one rank sends
    to a rank of its own node / of another node).

    ``nodes`` is stored renumbered in order of first appearance ((2, 2, 5, 5) -> (0, 0, 1,
    1)): two groups on different nodes with the same partition are the same topology.
    ``gpus_per_node``: what the nodes were derived with (global rank // it,
    :func:`node_of_ranks`), against which a call's group is checked; None: not checked.
    """

    nodes: tuple[int, ...]
    node_bytes_per_s: float = NODE_BYTES_PER_S
    cross_node_bytes_per_s: float = CROSS_NODE_BYTES_PER_S
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        nodes = self.nodes
        if isinstance(nodes, np.ndarray):
            nodes = nodes.tolist()
        if (not isinstance(nodes, (tuple, list)) or not nodes
                or not all(_whole(n) and n >= 0 for n in nodes)):
            raise ValueError(f"Topology.nodes must be a non-empty sequence of ints >= 0 (the "
                             f"node of each CP rank), got {nodes!r}")
        first: dict[int, int] = {}
        object.__setattr__(self, "nodes",
                           tuple(first.setdefault(int(n), len(first)) for n in nodes))
        for name in ("node_bytes_per_s", "cross_node_bytes_per_s"):
            check_positive(f"Topology.{name}", getattr(self, name))
        g = self.gpus_per_node
        if g is not None and (not _whole(g) or g < 1):
            raise ValueError(f"Topology.gpus_per_node must be None or an int >= 1, got {g!r}")

    @property
    def node_array(self) -> np.ndarray:
        """int64 [cp]: the node of each CP rank."""
        return np.asarray(self.nodes, dtype=np.int64)

    @property
    def n_nodes(self) -> int:
        return max(self.nodes) + 1

    @property
    def placeable(self) -> bool:
        """Whether a placement can change anything: more than one node, and a node with
        more than one rank."""
        return 1 < self.n_nodes < len(self.nodes)


def launch_gpus_per_node() -> int:
    """GPUs per node of this launch: torchrun's ``LOCAL_WORLD_SIZE`` where it is a
    positive int, else 8."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) >= 1 else 8


def node_of_ranks(global_ranks: Sequence[int], gpus_per_node: int) -> tuple[int, ...]:
    """The node of each CP rank: its global rank // ``gpus_per_node`` (ranks are numbered
    node by node, as torchrun and SLURM launch them)."""
    if not _whole(gpus_per_node) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an int >= 1, got {gpus_per_node!r}")
    return tuple(int(g) // gpus_per_node for g in global_ranks)


def group_mismatch(topology: Topology, global_ranks: Sequence[int]) -> str | None:
    """Why a CP group of ``global_ranks`` cannot run a plan built for ``topology`` (its
    ranks' nodes are partitioned otherwise), or None."""
    if topology.gpus_per_node is None:
        return None
    nodes = Topology(node_of_ranks(global_ranks, topology.gpus_per_node)).nodes
    if nodes == topology.nodes:
        return None
    return (f"group: its ranks {tuple(global_ranks)} sit on nodes {nodes} (global rank // "
            f"gpus_per_node {topology.gpus_per_node}), but the plan was built for nodes "
            f"{topology.nodes}; build the plan with this group's topology "
            f"(CPConfig.topology(dist.get_process_group_ranks(group)))")


def check_topology(topology: Any, cp_size: int) -> Topology | None:
    """``topology`` (a :class:`Topology` with one node per CP rank, or None), else a
    ValueError naming it."""
    if topology is None:
        return None
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a varlen_cp.plan.Topology or None, got "
                         f"{type(topology).__name__}")
    if len(topology.nodes) != cp_size:
        raise ValueError(f"topology: nodes has {len(topology.nodes)} entries, one per CP rank "
                         f"expected (cp_size={cp_size})")
    return topology


def fetch_matrix(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray,
                 lengths: np.ndarray, masks: MaskWeights, cp_size: int) -> np.ndarray:
    """float64 [M, cp, cp]: keys rank s's queries see that rank o holds (o != s; the
    diagonal is 0), per mask, from a layout's runs sorted by (rank, doc, start) (the
    ``balanced`` solver's order)."""
    stop = start + length
    out = np.zeros((len(masks), cp_size * cp_size), dtype=np.float64)
    order = np.argsort(doc * STRIDE + start, kind="stable")
    p_doc, p_start, p_stop, p_rank = doc[order], start[order], stop[order], rank[order]
    for i, (mask, _) in enumerate(masks):
        lo, hi = key_spans(start, stop, lengths[doc], mask)
        holder, s_doc, s_lo, s_hi = merge_spans(rank, doc, lo, hi)
        span, run, _, n = span_pieces(s_doc, s_lo, s_hi, p_doc, p_start, p_stop)
        out[i] = np.bincount(holder[span] * cp_size + p_rank[run], weights=n,
                             minlength=cp_size * cp_size)
    out = out.reshape(len(masks), cp_size, cp_size)
    idx = np.arange(cp_size)
    out[:, idx, idx] = 0.0
    return out


def _times(inside: np.ndarray, total: np.ndarray, ratio: float) -> np.ndarray:
    """Each rank's fetch time in units of an in-node key: max(in-node keys, ratio x
    cross-node keys), from its in-node and total keys (any shape, elementwise)."""
    return np.maximum(inside, ratio * (total - inside))


def _cost(t: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Sum over masks (axis 0) of weight x (the slowest rank's time (axis 1) + a tiny
    weight x the mean)."""
    w = weights.reshape((-1,) + (1,) * (t.ndim - 2))
    return (w * (t.max(1) + MEAN_WEIGHT * t.mean(1))).sum(0)


def _inside(fetch: np.ndarray, node: np.ndarray) -> np.ndarray:
    """[M, cp]: each rank's keys from ranks of its own node (``node``: each rank's)."""
    return (fetch * (node[:, None] == node[None, :])).sum(2)


def placement_cost(fetch: np.ndarray, weights: np.ndarray, node: np.ndarray,
                   ratio: float) -> float:
    """What :func:`place_ranks` minimizes: sum over masks of weight x (the slowest rank's
    fetch time + ``MEAN_WEIGHT`` x the mean)."""
    return float(_cost(_times(_inside(fetch, node), fetch.sum(2), ratio), weights))


def place_ranks(fetch: np.ndarray, weights: np.ndarray, nodes: np.ndarray,
                ratio: float) -> np.ndarray:
    """int64 [cp]: the CP rank each of the layout's ranks becomes (a permutation), so that
    ranks that fetch from each other share nodes (module docstring). ``fetch`` [M, cp, cp]
    (:func:`fetch_matrix`), ``weights`` [M] the masks' layer counts, ``nodes`` [cp] the
    node of each CP rank, ``ratio``: in-node over cross-node rate. A rank's keys of its
    own (the diagonal) are not fetched: they are left out."""
    fetch = fetch.copy()
    idx = np.arange(nodes.size)
    fetch[:, idx, idx] = 0.0   # the swap arithmetic below assumes it
    cp = nodes.size
    slot = np.arange(cp)                      # layout rank v -> CP rank slot[v]
    node = nodes[slot].copy()                 # node of layout rank v
    total = fetch.sum(2)                      # [M, cp]
    m_idx = np.arange(fetch.shape[0])[:, None]
    best = placement_cost(fetch, weights, node, ratio)
    for _ in range(4 * cp):
        inside = _inside(fetch, node)                                    # [M, cp]
        t = _times(inside, total, ratio)
        m, r = np.unravel_index(int(np.argmax(weights[:, None] * t)), t.shape)
        # Candidates: r with any rank of another node; r's three largest cross-node
        # sources with any rank of r's node.
        others = np.flatnonzero(node != node[r])
        src = others[np.argsort(-fetch[m, r, others], kind="stable")[:3]]
        mates = np.flatnonzero((node == node[r]) & (np.arange(cp) != r))
        a = np.concatenate([np.full(others.size, r), np.repeat(src, mates.size)])
        b = np.concatenate([others, np.tile(mates, src.size)])
        if a.size == 0:
            break
        na, nb = node[a], node[b]                                        # [K]
        # In-node keys after swapping a and b: only ranks of a's and b's nodes change.
        diff = fetch[:, :, b] - fetch[:, :, a]                           # [M, cp, K]
        sign = (node[:, None] == na[None, :]).astype(np.float64) \
            - (node[:, None] == nb[None, :])                             # [cp, K]
        new_in = inside[:, :, None] + diff * sign[None]                  # [M, cp, K]
        k = np.arange(a.size)
        on_nb = (fetch[:, a, :] * (node[None, None, :] == nb[None, :, None])).sum(2)
        on_na = (fetch[:, b, :] * (node[None, None, :] == na[None, :, None])).sum(2)
        new_in[:, a, k] = on_nb - fetch[m_idx, a, b]                     # a moved to nb
        new_in[:, b, k] = on_na - fetch[m_idx, b, a]                     # b moved to na
        cost = _cost(_times(new_in, total[:, :, None], ratio), weights)  # [K]
        j = int(np.argmin(cost))
        if not cost[j] < best * (1 - 1e-12):
            break
        best = float(cost[j])
        va, vb = int(a[j]), int(b[j])
        slot[va], slot[vb] = slot[vb], slot[va]
        node[va], node[vb] = node[vb], node[va]
    return slot


def place_on_nodes(rank: np.ndarray, doc: np.ndarray, start: np.ndarray,
                   length: np.ndarray, lengths: np.ndarray, masks: MaskWeights,
                   topology: Topology) -> np.ndarray:
    """The runs' ranks after :func:`place_ranks` (runs sorted by (rank, doc, start));
    unchanged where no placement can matter (one node, or one rank per node)."""
    if not topology.placeable:
        return rank
    cp = len(topology.nodes)
    fetch = fetch_matrix(rank, doc, start, length, lengths, masks, cp)
    weights = np.array([w for _, w in masks], dtype=np.float64)
    ratio = topology.node_bytes_per_s / topology.cross_node_bytes_per_s
    slot = place_ranks(fetch, weights, topology.node_array, ratio)
    return slot[rank]
