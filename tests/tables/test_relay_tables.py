"""Relayed dispatch tables (``tables.staged.relay``) run through on the host for every rank
at once: the two hops (the first's rows from other nodes on the CP group, its rows from
node mates and the second hop inside each node, on the node's own group) and their reverse
simulated with the tables' splits and rows, against
the per-key reference (``tests/staged_reference.select_keys``): every rank's calls get
exactly the keys its queries see, in selection order, and every owner gets each key's
gradient summed over exactly the ranks that see it. Also the routes' counts: the first
hop's cross-node rows equal, per node, the union of the keys its ranks need from other
nodes (a per-key set reference), spread evenly over its ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests import staged_reference as ref
from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan import Topology
from varlen_cp.tables import staged
from varlen_cp.tables.staged.relay import (relay_active, relay_counts, relay_link_counts,
                                           relay_link_counts_of, relay_routes)

MASKS = (AttnMask(), AttnMask(causal=False), AttnMask(window_size=(7, 0)),
         AttnMask(chunk_size=16), AttnMask(chunk_size=12, window_size=(4, 0)))
NODES = ((0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 0, 0, 1, 1, 1, 1), (0, 0, 1, 1, 2, 2, 2, 2),
         (0, 1, 1, 1, 2, 2, 2, 0))


def _plan(rng: random.Random, nodes) -> CPPlan:
    docs = [rng.choice([1, 2, 3, 5, 9, 17, 30, 64, 100]) for _ in range(rng.randint(1, 9))]
    docs.append(rng.randint(1, 60))
    cu = torch.tensor([0] + docs).cumsum(0)
    layout = rng.choice(("balanced", "te", "contiguous"))
    return CPPlan.build(cu, cp_size=len(nodes), cp_rank=0, layout=layout,
                        topology=Topology(nodes))


def _keys(plan: CPPlan) -> list[torch.Tensor]:
    """Per rank: (owner, row) of each local row, as float64 [T, 2]."""
    offsets = plan.arrays.rank_offsets
    return [torch.stack([torch.full((int(n),), r, dtype=torch.float64),
                         torch.arange(int(n), dtype=torch.float64)], 1)
            for r, n in enumerate(offsets[1:] - offsets[:-1])]


def _alltoall(sends: list[torch.Tensor], send_splits: list, recv_splits: list
              ) -> list[torch.Tensor]:
    """``all_to_all_single`` of every rank, on the host; checks both sides' sizes."""
    cp = len(sends)
    pieces = [list(torch.split(s, list(sp))) for s, sp in zip(sends, send_splits)]
    out = []
    for d in range(cp):
        got = [pieces[o][d] for o in range(cp)]
        assert [g.shape[0] for g in got] == list(recv_splits[d])
        out.append(torch.cat(got) if got else sends[d][:0])
    return out


def _in_nodes(sends: list[torch.Tensor], send_splits: list, recv_splits: list, st: list
              ) -> list[torch.Tensor]:
    """Hop 2 (or its reverse) on each node's own group: splits indexed by ``mates``, the
    node's CP ranks in CP order, the same list on every rank of the node."""
    cp = len(sends)
    for s in st:
        assert all(st[m].mates == s.mates for m in s.mates)

    def full(splits, mates):
        out = [0] * cp
        for m, n in zip(mates, splits):
            out[m] = n
        return out
    return _alltoall(sends, [full(sp, s.mates) for sp, s in zip(send_splits, st)],
                     [full(sp, s.mates) for sp, s in zip(recv_splits, st)])


@pytest.mark.parametrize("seed", range(24))
def test_relay_moves_every_key_once_each_way(seed):
    rng = random.Random(seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    stages = (1, 2, 3, 5)[seed % 4]
    assert relay_active(plan)
    cp = plan.cp_size
    tabs = [staged.staged_tables("dispatch", plan, mask, r, (16, 16), stages)
            for r in range(cp)]
    n_stages = {len(t.stages) for t in tabs}
    assert len(n_stages) == 1
    keys = _keys(plan)
    width = 2
    got = [[] for _ in range(cp)]
    acc = [torch.zeros(k.shape[0], dtype=torch.float64) for k in keys]
    for p in range(n_stages.pop()):
        st = [t.stages[p] for t in tabs]
        # hop 1: rows from other nodes on the CP group, then from node mates on the node's
        sends = [keys[r][s.in_rows] for r, s in enumerate(st)]
        cut = [sum(s.in_splits) for s in st]
        far = _alltoall([x[:c] for x, c in zip(sends, cut)], [s.in_splits for s in st],
                        [s.back_splits for s in st])
        near = _in_nodes([x[c:] for x, c in zip(sends, cut)],
                         [s.direct_in_splits for s in st], [s.direct_back_splits for s in st],
                         st)
        recv1 = [torch.cat([a, b]) for a, b in zip(far, near)]
        for r, s in enumerate(st):
            assert not any(s.in_splits[m] or s.back_splits[m] for m in s.mates)
            assert recv1[r].shape[0] == s.n_hop1 and far[r].shape[0] == s.n_cross
        recv2 = _in_nodes([recv1[r][s.relay_rows] for r, s in enumerate(st)],
                          [s.relay_splits for s in st], [s.hop2_splits for s in st], st)
        calls = []
        for r, s in enumerate(st):
            fetched = torch.cat([recv1[r], recv2[r]])[s.gather]
            if s.local_slots is not None:   # S = 1: one call over every key
                call = torch.empty(s.n_keys, width, dtype=torch.float64)
                call[s.remote_slots] = fetched
                call[s.local_slots] = keys[r][s.local_rows]
            else:
                call = fetched
            assert call.shape[0] == s.n_keys
            calls.append(call)
            got[r].append(call)
        # backward: each call slot's gradient is a function of (rank, owner, row)
        grads = [c[:, 0] * 1000 + c[:, 1] + r * 1e6 for r, c in enumerate(calls)]
        back2 = _in_nodes([g[s.hop2_order] for g, s in zip(grads, st)],
                          [s.hop2_splits for s in st], [s.relay_splits for s in st], st)
        g1 = []
        for r, s in enumerate(st):
            buf = torch.zeros(s.n_hop1, dtype=torch.float64)
            buf[s.own_rows] = grads[r][s.own_slots]
            g1.append(s.relay_rounds.add_(buf, back2[r]))
        far = _alltoall([g[:s.n_cross] for g, s in zip(g1, st)], [s.back_splits for s in st],
                        [s.in_splits for s in st])
        near = _in_nodes([g[s.n_cross:] for g, s in zip(g1, st)],
                         [s.direct_back_splits for s in st], [s.direct_in_splits for s in st],
                         st)
        back1 = [torch.cat([a, b]) for a, b in zip(far, near)]
        for r, s in enumerate(st):
            s.rounds.add_(acc[r], back1[r])
            if s.local_slots is not None:
                acc[r].index_add_(0, s.local_rows, grads[r][s.local_slots])
    want = [torch.zeros_like(a) for a in acc]
    for r in range(cp):
        sel = ref.select_keys(plan, mask, r)
        expect = torch.stack([sel.owner.double(), sel.row.double()], 1)
        mine = torch.cat(got[r]) if got[r] else expect[:0]
        if stages == 1:
            assert torch.equal(mine, expect)
        else:   # the local keys are the local call's; each stage's keys in selection order
            remote = expect[sel.owner != r]
            where = {tuple(x): i for i, x in enumerate(remote.tolist())}
            order = [[where[tuple(x)] for x in c.tolist()] for c in got[r]]
            assert sorted(sum(order, [])) == list(range(remote.shape[0]))
            assert all(o == sorted(o) for o in order)
        for o, row in (expect if stages == 1 else expect[sel.owner != r]).long().tolist():
            want[o][row] += o * 1000 + row + r * 1e6
    for a, w in zip(acc, want):
        assert torch.allclose(a, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_each_key_crosses_once_per_node_spread_over_its_ranks(seed):
    rng = random.Random(100 + seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    parts = (1, 2, 4)[seed % 3]
    routes = relay_routes(plan, mask, parts)
    node = np.asarray(nodes)
    cross = node[:, None] != node[None, :]
    hop1 = routes.hop1                                  # [P, receiver, sender]
    union, plain = {}, np.zeros(len(nodes), np.int64)
    for r in range(len(nodes)):
        sel = ref.select_keys(plan, mask, r)
        far = node[sel.owner.numpy()] != node[r]
        plain[r] = int(far.sum())
        for o, row in zip(sel.owner[far].tolist(), sel.row[far].tolist()):
            union.setdefault((node[r], o), set()).add(row)
    for n in set(nodes):
        got = (hop1 * cross[None])[:, node == n].sum(0)         # [ranks of n, sender]
        for o in range(len(nodes)):
            want = len(union.get((n, o), ()))
            assert got[:, o].sum() == want
            # the union from one owner, cut into P x (ranks of n) equal chunks
            assert got[:, o].max() - got[:, o].min() <= parts
    per_rank = (hop1 * cross[None]).sum((0, 2))
    assert per_rank.sum() <= plain.sum()
    assert per_rank.max() <= plain.max() + parts * len(nodes)
    # every rank's calls use exactly its remote keys (the counts the cost model reads)
    fetch = relay_counts(plan, mask, parts)[1].sum(0)
    for r in range(len(nodes)):
        owners = ref.select_keys(plan, mask, r).owner
        want = torch.bincount(owners[owners != r], minlength=len(nodes)).numpy()
        assert np.array_equal(fetch[r], want)


def test_relay_only_on_plans_across_nodes_with_shared_nodes():
    cu = torch.tensor([0, 40, 90])
    assert not relay_active(CPPlan.build(cu, cp_size=4, cp_rank=0))
    assert not relay_active(CPPlan.build(cu, cp_size=4, cp_rank=0, topology=Topology((0, 1, 2, 3))))
    assert not relay_active(CPPlan.build(cu, cp_size=4, cp_rank=0, topology=Topology((0, 0, 0, 0))))
    assert relay_active(CPPlan.build(cu, cp_size=4, cp_rank=0, topology=Topology((0, 0, 1, 1))))


@pytest.mark.parametrize("seed", range(6))
def test_timing_counts_both_hops_on_their_links(seed):
    """The staged time model's communication for relayed dispatch: per transfer, the first
    hop's cross-node rows and its in-node rows, and the second hop, each timed on its
    links (the slowest rank's rows in or out), the two on the node's group one more
    collective's latency each, forward and backward (a loop over ranks and hops)."""
    from varlen_cp.shape import AttnShape
    from varlen_cp.tables.cost_model import CostModel
    from varlen_cp.tables.staged import staged_time
    rng = random.Random(200 + seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    stages = (2, 3, 4)[seed % 3]
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=32)
    model = CostModel(bytes_per_s=1e11, cross_node_bytes_per_s=1e10)
    got = staged_time("dispatch", plan, mask, shape, model, stages)
    chains = _chains(relay_link_counts(plan, mask, stages - 1)[:2], nodes, shape.kv_row,
                     1e11, 1e10)
    want = 2 * sum(map(sum, chains))                        # forward and backward
    want += 2 * 2 * len(chains[0]) * model.stage_latency_s  # the node group's collectives
    assert got.comm_s == pytest.approx(want, rel=1e-9)


def _chains(hops, nodes, row: int, bw: float, bw_cross: float) -> list[list[float]]:
    """Per transfer, the seconds of relayed dispatch's three collectives: the first hop's
    cross-node rows, its in-node rows, the second hop; each the slowest rank's rows in or
    out on its link (a loop over ranks)."""
    cp = len(nodes)

    def worst(rows, keep) -> float:
        out = 0.0
        for r in range(cp):
            peers = [o for o in range(cp) if keep(nodes[o] == nodes[r])]
            n = max(rows[r, peers].sum(), rows[peers, r].sum()) * row
            out = max(out, n / (bw if keep(True) else bw_cross))
        return out
    hop1, hop2 = hops
    return [[worst(x, lambda same: not same) for x in hop1],
            [worst(x, lambda same: same) for x in hop1],
            [worst(x, lambda same: True) for x in hop2]]


@pytest.mark.parametrize("seed", range(6))
def test_timing_runs_the_second_hop_beside_the_next_first(seed):
    """With compute free, the staged time of relayed dispatch is its three groups' chains
    of collectives: forward, transfer p's cross-node rows (CP group) and its in-node rows
    (direct group) each after its group's previous one and stage p - 2's call (its post),
    its second hop (relay group) after the previous one and its cross-node rows (not after
    the next transfer's); backward, the second hop reversed, then the cross-node rows and
    the in-node rows, each after its group's previous collective, stage p's after return
    p - 2 has landed (a loop over transfers on the collectives' seconds). Shorter than
    the collectives in turn wherever two groups move. S = 1 likewise, with one transfer."""
    from varlen_cp.shape import AttnShape
    from varlen_cp.tables.cost_model import CostModel
    from varlen_cp.tables.staged import staged_time
    rng = random.Random(500 + seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    stages = (3, 4, 6)[seed % 3]
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=32)
    model = CostModel(flops_per_s=1e30, memory_bytes_per_s=1e30, bytes_per_s=1e9,
                      cross_node_bytes_per_s=1e8, stage_latency_s=0.0)
    far, near, two = _chains(relay_link_counts(plan, mask, stages - 1)[:2], nodes,
                             shape.kv_row, 1e9, 1e8)
    end_cp = end_direct = end_relay = posted = done = 0.0
    serial = 0.0
    for x, d, h2 in zip(far, near, two):
        end_cp = max(end_cp, posted) + x
        end_direct = max(end_direct, posted) + d
        end_relay = max(end_relay, end_cp) + h2
        posted = done                    # the next transfer goes out after this call
        done = max(done, end_direct, end_relay)
        serial += x + d + h2
    ret = [0.0, 0.0, 0.0]  # the previous ends: CP, direct, relay group
    landed = [0.0, 0.0]    # return p - 1 landed, then p's
    for x, d, h2 in zip(far, near, two):
        # stage p computes once return p - 2 has landed (its fold), then posts its return
        ret[2] = max(ret[2], landed[-2]) + h2
        ret[0] = max(ret[0], ret[2]) + x
        ret[1] = max(ret[1], ret[2]) + d
        landed.append(max(landed[-1], ret[0], ret[1]))
    ret_cp, ret_node = ret[0], ret[1]
    got = staged_time("dispatch", plan, mask, shape, model, stages)
    assert got.forward_s == pytest.approx(done, rel=1e-6, abs=1e-12)
    assert got.backward_s == pytest.approx(max(ret_cp, ret_node), rel=1e-6, abs=1e-12)
    if sum(far) > 0 and sum(two) > 0 and len(far) > 1:
        assert got.forward_s < serial
    # S = 1: one transfer, its in-node rows beside the cross-node rows and the second hop
    (x,), (d,), (h2,) = _chains(relay_link_counts(plan, mask, 1)[:2], nodes, shape.kv_row,
                                1e9, 1e8)
    one = staged_time("dispatch", plan, mask, shape, model, 1)
    assert one.forward_s == pytest.approx(max(x + h2, d), rel=1e-6, abs=1e-12)
    assert one.backward_s == pytest.approx(h2 + max(x, d), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_link_counts_of_the_time_model(seed):
    """The time model's counts (``relay_link_counts``: no per-key cut) against the exact
    routes: hop 1 equal transfer by transfer; hop 2 and the keys per (rank, peer) equal
    in total, each transfer's an equal part of it."""
    rng = random.Random(300 + seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    parts = (1, 2, 3, 5)[seed % 4]
    exact = relay_routes(plan, mask, parts)
    exact_hop2, exact_keys = relay_counts(plan, mask, parts)
    hop1, hop2, keys = relay_link_counts(plan, mask, parts)
    if hop1.shape == exact.hop1.shape:
        assert np.array_equal(hop1, exact.hop1)
    assert np.array_equal(hop1.sum(0), exact.hop1.sum(0))
    assert np.array_equal(hop2.sum(0), exact_hop2.sum(0))
    assert np.array_equal(keys.sum(0), exact_keys.sum(0))
    for c in (hop2, keys):
        assert (c.max(0) - c.min(0) <= 1).all() or c.shape[0] < parts


@pytest.mark.parametrize("seed", range(6))
def test_link_counts_computed_together(seed):
    """The time model's counts of several transfer counts computed in one pass
    (``relay_link_counts_of``, what the stage-count search asks for) equal each one
    computed alone on a fresh plan, bit for bit; one already cached keeps its entry."""
    rng = random.Random(400 + seed)
    nodes = NODES[seed % len(NODES)]
    plan, mask = _plan(rng, nodes), MASKS[seed % len(MASKS)]
    wanted = (1, 2, 3, 5, 7, 2)

    def fresh() -> CPPlan:
        return CPPlan.build(plan.cu_seqlens, cp_size=plan.cp_size, cp_rank=0,
                            layout=plan.layout_spec, topology=plan.topology)
    together = fresh()
    early = relay_link_counts(together, mask, 3)        # cached before the batch
    batch = relay_link_counts_of(together, mask, wanted)
    assert sorted(batch) == [1, 2, 3, 5, 7]
    assert all(a is b for a, b in zip(batch[3], early))
    for parts, counts in batch.items():
        alone = relay_link_counts(fresh(), mask, parts)
        assert len(counts) == len(alone) == 3
        for got, want in zip(counts, alone):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        assert all(a is b for a, b in zip(relay_link_counts(together, mask, parts), counts))
