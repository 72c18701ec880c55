"""``dispatch`` across nodes: each node fetches the keys its ranks need from another node
once, and shares them inside the node (the node relay).

Plain dispatch sends a key across the network once per rank that needs it: when the 8
ranks of a node all see one long document of another node, its K/V cross 8 times. With the
plan's ``topology`` spanning nodes (``Topology.placeable``: several nodes, one of them with
more than one CP rank), ``dispatch`` moves the keys in two hops per transfer instead:

1. the union, over the ranks of node N, of the keys they need from owner o of another
   node (``U(N, o)``, listed in (document, position) order) is cut into as many equal
   chunks as N has ranks, the j-th for the j-th rank of N (its *relay* for those keys), and
   each chunk into P equal pieces, one per transfer, which the relay receives straight from
   o (so which rank relays a key does not depend on P). In the same
   collective, keys of an owner in one's own node come straight from it (cut into P equal
   pieces per (rank, owner), as plain dispatch cuts them);
2. every relay forwards to each rank of its node the keys of its chunks that rank needs
   (listed by (owner, place in ``U``)).

So each key crosses the network once per node, the network load spread evenly over the
node's ranks (chunks of equal size), and the second hop stays on NVLink. Backward, the
reverse: each rank returns the dK/dV of relayed keys to their relay (second hop reversed),
the relay sums them with its own in fp32 (fixed rounds, deterministic) and returns one row
per key to the owner in the first hop's reverse, rounded to the input dtype once more than
plain dispatch rounds it. Cross-node bytes per rank fall to the node's union spread over
its ranks (never above plain dispatch's largest, per rank or per link); ``bench/plan.py``
measures it.

Every rank computes every rank's routes from the plan alone (no metadata exchange), as
plain dispatch does: :func:`relay_routes` the counts of both hops ([P, cp, cp], what the
cost model, the memory walk and the traffic report read) and the cut of any runs of keys
(:func:`relay_cut`), from which ``tables`` builds one rank's ``RelayStage``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...masks import AttnMask
from ...plan import CPPlan
from ...plan.runs import STRIDE
from ...plan.spans import span_pieces
from ..cache import host_table, table_key
from ..selected import fetch_count_array, piece_arrays, run_arrays, span_arrays
from .routes import cut_runs, index_in_group


def relay_active(plan: CPPlan) -> bool:
    """Whether ``dispatch`` relays through nodes on this plan (its topology has several
    nodes, one of them with more than one CP rank)."""
    return plan.topology is not None and plan.topology.placeable


@dataclass(frozen=True)
class RelayRoutes:
    """What every rank's tables of one mask share (numpy int64).

    ``hop1`` [P, cp, cp]: rows rank r receives from rank o in transfer p's first hop (its
    chunks of the nodes' unions from owners of other nodes, and its own keys from owners
    of its node); transfers empty on every rank are dropped (``stage_of``: transfer
    before the drop -> after, -1: dropped). The unions, to cut any runs with
    (:func:`relay_cut`): ``key`` (group = node * cp + owner, times ``rows``, plus the
    owner's local row of the piece's first key; sorted), ``coord`` (the piece's first
    key's place in its group's list), ``length``, and per group its ``bounds`` [groups,
    K + 1] (chunk k: relay j = k // P of the node, transfer p = k % P; K = P x the largest
    node). ``direct`` [P0 + 1, cp, cp]: the in-node lists' cut (before the drop)."""

    hop1: np.ndarray
    key: np.ndarray
    coord: np.ndarray
    length: np.ndarray
    bounds: np.ndarray
    rows: int
    parts: int
    stage_of: np.ndarray
    direct: np.ndarray


def node_members(plan: CPPlan) -> tuple[np.ndarray, np.ndarray]:
    """(node of each rank, the ranks of each node by index [nodes, largest node] (-1
    beyond a node's size))."""
    nodes = plan.topology.node_array
    order = np.argsort(nodes, kind="stable")
    size = np.bincount(nodes)
    first = np.cumsum(size) - size
    index = np.empty_like(nodes)
    index[order] = np.arange(nodes.size) - first[nodes[order]]
    members = np.full((size.size, int(size.max())), -1, dtype=np.int64)
    members[nodes, index] = np.arange(nodes.size)
    return nodes, members


def node_unions(plan: CPPlan, mask: AttnMask, nodes: np.ndarray) -> tuple[np.ndarray, ...]:
    """The keys each node's ranks need from owners of other nodes, each once: pieces
    (node, owner, owner's row, length) in (node, document, position) order."""
    holder, doc, lo, hi = span_arrays(plan, mask)
    group = nodes[holder] * (plan.n_docs + 1) + doc
    order = np.lexsort((lo, group))
    group, lo, hi = group[order], lo[order], hi[order]
    if group.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    # union per (node, doc): a span starts a new one unless it begins within the running
    # maximum end of the earlier spans of its group (hi is not monotone across ranks)
    reach = np.maximum.accumulate(group * STRIDE + hi) - group * STRIDE
    new = np.ones(group.size, dtype=bool)
    new[1:] = (group[1:] != group[:-1]) | (lo[1:] > reach[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.append(first[1:], group.size) - 1
    u_node, u_doc = group[first] // (plan.n_docs + 1), group[first] % (plan.n_docs + 1)
    part = run_arrays(plan, by_document=True)
    span, run, pos, length = span_pieces(u_doc, lo[first], reach[last], part.doc,
                                         part.start, part.stop)
    owner = part.holder[run]
    away = nodes[owner] != u_node[span]
    row = part.row[run] + pos - part.start[run]
    return u_node[span][away], owner[away], row[away], length[away]


def _counts(parts: int, cp: int, p: np.ndarray, a: np.ndarray, b: np.ndarray,
            n: np.ndarray) -> np.ndarray:
    """int64 [parts, cp, cp]: ``n`` summed per (p, a, b) (a float64 bincount: exact, the
    sums stay far below 2^53)."""
    flat = np.bincount((p * cp + a) * cp + b, weights=n, minlength=parts * cp * cp)
    return flat.astype(np.int64).reshape(parts, cp, cp)


@dataclass(frozen=True)
class _Base:
    """What does not depend on the number of transfers: the unions (sorted by ``key``),
    their totals per group, and every rank's keys from other nodes cut at the relays'
    chunks (``dest``, ``owner``, ``group``, ``at``: the first key's place in the group's
    union, ``n``: length, ``relay``: the relay's index in the node), and what the second
    hops move in all (``hop2``)."""

    rows: int
    key: np.ndarray
    coord: np.ndarray
    length: np.ndarray
    total: np.ndarray
    size: np.ndarray          # ranks of each group's node
    dest: np.ndarray
    owner: np.ndarray
    group: np.ndarray
    at: np.ndarray
    n: np.ndarray
    relay: np.ndarray
    hop2: np.ndarray          # [cp, cp]: rows rank d gets from relay r in all hops 2
    direct: np.ndarray        # [cp, cp]: keys rank d needs from owners of its node


def _base(plan: CPPlan, mask: AttnMask) -> _Base:
    def build() -> _Base:
        cp = plan.cp_size
        nodes, members = node_members(plan)
        n_nodes, widest = members.shape
        offsets = plan.arrays.rank_offsets
        rows = int((offsets[1:] - offsets[:-1]).max()) + 1
        u_node, u_owner, u_row, u_len = node_unions(plan, mask, nodes)
        group = u_node * cp + u_owner
        coord = index_in_group(group, u_len, n_nodes * cp)
        total = np.bincount(group, weights=u_len, minlength=n_nodes * cp).astype(np.int64)
        size = np.repeat(np.bincount(nodes, minlength=n_nodes), cp)
        key = group * rows + u_row
        order = np.argsort(key, kind="stable")
        key, coord, u_len = key[order], coord[order], u_len[order]
        # every rank's keys from other nodes, at their place in their node's union
        holder = span_arrays(plan, mask)[0]
        part = run_arrays(plan, by_document=True)
        span, run, pos, length = piece_arrays(plan, mask)
        dest, owner = holder[span], part.holder[run]
        away = np.flatnonzero(nodes[dest] != nodes[owner])
        dest, owner, length = dest[away], owner[away], length[away]
        row = (part.row[run] + pos - part.start[run])[away]
        g = nodes[dest] * cp + owner
        u = _union_coord(key, coord, rows, g, row)
        # ... cut at the relays' chunks (equal, one per rank of the node)
        piece, relay, _, offset, n = _chunk_cut(_chunk_bounds(total, size, 1, widest), g, u,
                                                length)
        d = dest[piece]
        via = members[nodes[d], relay]
        far = via != d
        hop2 = _counts(1, cp, np.zeros(int(far.sum()), np.int64), d[far], via[far],
                       n[far])[0]
        direct = fetch_count_array(plan, mask) * (nodes[:, None] == nodes[None, :])
        np.fill_diagonal(direct, 0)
        return _Base(rows, key, coord, u_len, total, size, d, owner[piece], g[piece],
                     u[piece] + offset, n, relay, hop2, direct)
    return host_table(plan, table_key("relay_base", mask), build)


def _hop1(plan: CPPlan, b: _Base, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(hop1 [P, cp, cp], the in-node direct cut [P + 1, cp, cp]) before the drop.

    Relay r (the j-th rank of its node) receives from an owner o of another node, in
    transfer p, exactly one chunk of their group (node of r, o): chunk k = j * P + p of
    n = P x the node's ranks, ``[T k // n, T (k + 1) // n)`` of the union's T keys. From an
    owner of its own node, piece p of P of the keys it needs (``b.direct``). The two have
    disjoint support, so both are one gather of equal-cut edges, not a sum over chunks."""
    p = np.arange(parts + 1).reshape(-1, 1, 1)
    edges, cross = _hop1_edges(plan, b, np.full_like(p, parts), p)   # [P + 1, r, o]
    direct = np.where(cross, 0, edges)
    return np.diff(edges, axis=0), direct


def _hop1_edges(plan: CPPlan, b: _Base, per: np.ndarray, p: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(edge p of P = ``per`` of every (r, o) list of hop 1 (:func:`_hop1`), [R, cp, cp]
    for rows (``per``, ``p``) shaped [R, 1, 1]; cross-node pairs [cp, cp])."""
    cp = plan.cp_size
    nodes, members = node_members(plan)
    index = np.empty(cp, dtype=np.int64)             # each rank's place in its node
    on = members >= 0
    index[members[on]] = np.nonzero(on)[1]
    cross = nodes[:, None] != nodes[None, :]
    keys = b.total.reshape(-1, cp)[nodes] + b.direct      # [r, o]: T (cross) or direct
    first = np.where(cross, index[:, None] * per, 0)      # r's first chunk of the list
    n = np.where(cross, per * np.bincount(nodes)[nodes][:, None], per)
    return _equal_edges(keys, first + p, n), cross


def _equal_edges(total: np.ndarray, k: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """``total * k // n`` (int64, broadcast), the k-th edge of ``total`` cut into n equal
    pieces, in float64 (~5x faster than int64 division here): exact while total * k <
    2^53, as the quotient is either an integer or at least 1 / n from one, more than its
    rounding error (q 2^-53 < 1 / n)."""
    return np.floor(total * k.astype(np.float64) / n).astype(np.int64)


def _chunk_bounds(total: np.ndarray, size: np.ndarray, parts: int, widest: int
                  ) -> np.ndarray:
    """The chunks' bounds [groups, K + 1] (K = P x the largest node) of unions of
    ``total`` keys on nodes of ``size`` ranks: relay j of a group's node gets transfer p's
    chunk k = j * P + p, ``[T k // n, T (k + 1) // n)`` for n = P x the node's ranks (k
    beyond n: empty). Made per group, then gathered per run."""
    n_chunks = parts * size
    k = np.arange(parts * widest + 1, dtype=np.int64)
    return total[:, None] * np.minimum(k[None, :], n_chunks[:, None]) \
        // np.maximum(n_chunks, 1)[:, None]


def _union_coord(key: np.ndarray, coord: np.ndarray, rows: int, group: np.ndarray,
                 row: np.ndarray) -> np.ndarray:
    """Place of the owner's row ``row`` in its group's union (``key`` sorted: group x
    ``rows`` + the owner's first row of each union piece, ``coord`` its place)."""
    at = np.searchsorted(key, group * rows + row, side="right") - 1
    return coord[at] + row - key[at] % rows


def _chunk_cut(bounds: np.ndarray, group: np.ndarray, coord: np.ndarray,
               length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs ``[coord, coord + length)`` of their group's union cut at its chunks
    (``bounds`` [groups, K + 1]): (run index, chunk, place in the chunk, offset in the run,
    length) of every piece (``routes.cut_runs``)."""
    edges = bounds[group]
    run, k, offset, n = cut_runs(coord, length, edges[:, :-1], edges[:, 1:])
    return run, k, coord[run] + offset - bounds[group[run], k], offset, n


def relay_link_counts(plan: CPPlan, mask: AttnMask, parts: int) -> tuple[np.ndarray, ...]:
    """(hop1, hop2, keys) [P, cp, cp] for the time model and the memory walk, without
    cutting every rank's keys at the transfers (what made the stage count's choice,
    simulating six counts per mask, cost 60 ms at cp 64): hop 1 exact; hop 2 and the
    keys a rank's calls use, each (rank, peer) total cut into P equal parts (the tables'
    exact split, ``relay_routes``, differs by the keys' places in the relays' chunks; the
    totals over the transfers are exact: what the traffic matrices read) (cached)."""
    return relay_link_counts_of(plan, mask, (parts,))[parts]


def relay_link_counts_of(plan: CPPlan, mask: AttnMask, parts_list: tuple[int, ...]
                         ) -> dict[int, tuple[np.ndarray, ...]]:
    """:func:`relay_link_counts` of every P of ``parts_list``, each cached on its own;
    when any is not cached yet, all are computed together, as one set of [sum (P + 1), cp,
    cp] operations (the time model asks for five P per mask: one pass instead of five)."""
    wanted = tuple(sorted(set(parts_list)))
    batch: dict[int, tuple[np.ndarray, ...]] = {}

    def one(parts: int) -> tuple[np.ndarray, ...]:
        if not batch:
            batch.update(_link_counts(plan, mask, wanted))
        return batch[parts]
    return {p: host_table(plan, table_key("relay_link_counts", mask, None, p),
                          lambda p=p: one(p)) for p in wanted}


def _link_counts(plan: CPPlan, mask: AttnMask, parts_list: tuple[int, ...]
                 ) -> dict[int, tuple[np.ndarray, ...]]:
    """:func:`relay_link_counts_of`'s computation for ``parts_list`` (distinct P >= 1):
    every P's edges stacked (rows (P, p), p = 0..P), the equal cuts of :func:`_hop1` and of
    hop 2's and the keys' totals taken at once, then split per P."""
    b = _base(plan, mask)
    sizes = np.asarray(parts_list, dtype=np.int64)
    per = np.repeat(sizes, sizes + 1).reshape(-1, 1, 1)   # each row's P
    starts = np.cumsum(sizes + 1) - (sizes + 1)
    p = (np.arange(per.size) - np.repeat(starts, sizes + 1)).reshape(-1, 1, 1)
    keys = fetch_count_array(plan, mask).copy()
    np.fill_diagonal(keys, 0)
    hop1 = np.diff(_hop1_edges(plan, b, per, p)[0], axis=0)
    hop2 = np.diff(_equal_edges(b.hop2, p, per), axis=0)
    fetch = np.diff(_equal_edges(keys, p, per), axis=0)
    out = {}
    for parts, at in zip(sizes.tolist(), starts.tolist()):
        rows = slice(at, at + parts)                       # the diffs inside P's block
        keep = hop1[rows].reshape(parts, -1).sum(1) > 0    # (as ``relay_routes`` drops them)
        out[parts] = (hop1[rows][keep], hop2[rows][keep], fetch[rows][keep])
    return out


def relay_routes(plan: CPPlan, mask: AttnMask, parts: int) -> RelayRoutes:
    """Both hops' routes of every rank with ``parts`` transfers, but the cut of each node's
    keys at the transfers (:func:`node_pieces`, per node: a rank needs its own node's)
    (cached). A transfer is dropped when its first hop is empty everywhere (its second
    hop then is too: it forwards what the first brought)."""
    def build() -> RelayRoutes:
        _, members = node_members(plan)
        b = _base(plan, mask)
        hop1, direct = _hop1(plan, b, parts)
        bounds = _chunk_bounds(b.total, b.size, parts, members.shape[1])
        keep = hop1.reshape(parts, -1).sum(1) > 0
        stage_of = np.where(keep, np.cumsum(keep) - 1, -1)
        return RelayRoutes(hop1[keep], b.key, b.coord, b.length, bounds, b.rows, parts,
                           stage_of, direct)
    return host_table(plan, table_key("relay_routes", mask, None, parts), build)


def node_pieces(plan: CPPlan, mask: AttnMask, parts: int, node: int
                ) -> tuple[np.ndarray, ...]:
    """The keys the ranks of ``node`` need from other nodes, cut at the transfers:
    (transfer, rank, owner, relay (a rank of the node), place in the relay's chunk from
    the owner, length) of every piece (cached per node)."""
    def build() -> tuple[np.ndarray, ...]:
        nodes, members = node_members(plan)
        b = _base(plan, mask)
        routes = relay_routes(plan, mask, parts)
        mine = np.flatnonzero(nodes[b.dest] == node)
        relay = b.relay[mine]
        first = (relay * parts)[:, None] + np.arange(parts + 1)[None, :]
        edges = routes.bounds[b.group[mine][:, None], first]        # [pieces, P + 1]
        piece, p, offset, n = cut_runs(b.at[mine], b.n[mine], edges[:, :-1], edges[:, 1:])
        place = b.at[mine][piece] + offset - edges[piece, p]
        return (routes.stage_of[p], b.dest[mine][piece], b.owner[mine][piece],
                members[node, relay[piece]], place, n)
    return host_table(plan, table_key("relay_node_pieces", mask, None, parts, node), build)


def relay_counts(plan: CPPlan, mask: AttnMask, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(hop2, keys) int64 [P, cp, cp], exact: rows rank d receives from relay r in the
    second hop, and keys rank d's calls of each transfer use from owner o (every node's
    :func:`node_pieces`; the tests check ``relay_link_counts`` and the tables against
    them; the tables read only their own node's pieces) (cached)."""
    def build() -> tuple[np.ndarray, np.ndarray]:
        cp = plan.cp_size
        routes = relay_routes(plan, mask, parts)
        n_parts = routes.hop1.shape[0]
        pieces = [node_pieces(plan, mask, parts, n) for n in range(plan.topology.n_nodes)]
        p, d, o, via, _, n = (np.concatenate(x) for x in zip(*pieces))
        far = via != d
        hop2 = _counts(n_parts, cp, p[far], d[far], via[far], n[far])
        direct = routes.direct[1:] - routes.direct[:-1]
        keys = _counts(n_parts, cp, p, d, o, n) + direct[routes.stage_of >= 0]
        return hop2, keys
    return host_table(plan, table_key("relay_counts", mask, None, parts), build)


def relay_cut(routes: RelayRoutes, nodes: np.ndarray, dest: np.ndarray, owner: np.ndarray,
              row: np.ndarray, length: np.ndarray, members: np.ndarray,
              raw: bool = False) -> tuple[np.ndarray, ...]:
    """Runs of keys that ranks ``dest`` need from owners of other nodes (the owner's local
    rows ``[row, row + length)``), cut at their node's chunks: (run index, transfer, relay,
    place in the chunk, offset in the run, length) of every piece, in (run, place) order;
    transfers after the drop (before it with ``raw``)."""
    cp = nodes.size
    group = nodes[dest] * cp + owner
    coord = _union_coord(routes.key, routes.coord, routes.rows, group, row)
    run, k, place, offset, n = _chunk_cut(routes.bounds, group, coord, length)
    j, stage = np.divmod(k, routes.parts)
    relay = members[nodes[dest[run]], j]
    if not raw:
        stage = routes.stage_of[stage]
    return run, stage, relay, place, offset, n


def union_cut(routes: RelayRoutes, nodes: np.ndarray, owner: int, members: np.ndarray
              ) -> tuple[np.ndarray, ...]:
    """What ``owner`` sends in the first hop to the relays of other nodes: (transfer,
    relay, place in the relay's chunk, owner's row, length) of every piece (after the
    drop)."""
    cp = nodes.size
    group = routes.key // routes.rows
    mine = np.flatnonzero(group % cp == owner)
    group = group[mine]
    run, k, place, offset, n = _chunk_cut(routes.bounds, group, routes.coord[mine],
                                          routes.length[mine])
    node = group[run] // cp
    j, stage = np.divmod(k, routes.parts)
    row = routes.key[mine][run] % routes.rows + offset
    return routes.stage_of[stage], members[node, j], place, row, n
