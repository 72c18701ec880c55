"""Node-aware placement of the ``balanced`` layout (``plan/nodes.py``) and the plan's
topology: every rank's share unchanged, the K/V counted against a per-token reference,
cross-node fetches fewer, the grouping from global ranks, a group on other nodes refused,
and CP attention on a placed plan equal to the single-device op."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.cp_grid import compare_fp32, gather, global_inputs, single_device
from varlen_cp import AttnMask, AttnOptions, CPPlan, cp_varlen_attn
from varlen_cp.config import CPConfig
from varlen_cp.mixes import MIXES
from varlen_cp.options import STRATEGY_CHOICES
from varlen_cp.plan import Balanced, Topology, node_of_ranks
from varlen_cp.plan.balanced import balanced_runs, normalize_masks
from varlen_cp.plan.nodes import fetch_matrix, group_mismatch
from varlen_cp.tables.auto import CostModel, estimate
from varlen_cp.tables.selected import fetch_count_array
from varlen_cp.shape import AttnShape

CAUSAL, SWA, CHUNKED = AttnMask(), AttnMask(window_size=(7, 0)), AttnMask(chunk_size=16)
MASK_SETS = {"causal": [(CAUSAL, 1)], "llama4": [(CHUNKED, 3), (CAUSAL, 1)],
             "swa_5to1": [(SWA, 5), (CAUSAL, 1)]}
# A batch on which cp 4 in two nodes of two moves a rank (found by search; asserted below).
MOVED_DOCS, MOVED_MASK = [76, 61, 33, 37, 5, 9, 2, 21], AttnMask(chunk_size=16)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


def _plan(lengths, cp, masks, topology=None, rank=0, tile=8) -> CPPlan:
    return CPPlan.build(_cu(lengths), cp_size=cp, cp_rank=rank,
                        layout=Balanced(masks=masks, tile_tokens=tile), topology=topology)


def _runs_of(plan: CPPlan) -> list[frozenset]:
    r = plan.arrays.runs
    return [frozenset(zip(r.doc[r.rank == k].tolist(), r.start[r.rank == k].tolist(),
                          r.length[r.rank == k].tolist())) for k in range(plan.cp_size)]


def _weighted_bottleneck(plan: CPPlan, masks, ratio: float) -> float:
    """Sum over masks of weight x the slowest rank's fetch time (in-node keys against
    ratio x cross-node keys), from the plan's own fetch counts (tables.selected)."""
    nodes = plan.topology.node_array
    cross = nodes[:, None] != nodes[None, :]
    total = 0.0
    for mask, w in masks:
        c = fetch_count_array(plan, mask).astype(np.float64)
        np.fill_diagonal(c, 0)
        total += w * np.maximum((c * ~cross).sum(1), ratio * (c * cross).sum(1)).max()
    return total


@pytest.mark.parametrize("name", sorted(MASK_SETS))
def test_placement_keeps_every_rank_share(name):
    """With a topology, every rank of the placed plan holds exactly the runs of one rank
    of the plan without it (a relabelling): tokens and each mask's work per rank are the
    same multiset, so every balance target holds as before."""
    masks = MASK_SETS[name]
    rng = np.random.default_rng(7)
    moved = 0
    for trial in range(6):
        cp = (8, 16)[trial % 2]
        lengths = rng.integers(1, 400, rng.integers(5, 40)).tolist()
        nodes = tuple(np.arange(cp) // 4)
        plain, placed = _plan(lengths, cp, masks), _plan(lengths, cp, masks, Topology(nodes))
        a, b = _runs_of(plain), _runs_of(placed)
        assert sorted(map(sorted, a)) == sorted(map(sorted, b))
        assert len(set(b)) == cp
        moved += a != b
        for mask, _ in masks:
            assert sorted(plain.work_per_rank(mask)) == sorted(placed.work_per_rank(mask))
            assert placed.work_imbalance(mask) == plain.work_imbalance(mask)
        assert placed.token_imbalance() == plain.token_imbalance()
    assert moved, "no case moved a rank: the test would not see a placement"


def _token_fetch(lengths, rank, doc, start, length, mask, cp) -> np.ndarray:
    """Per-token reference: for each rank, the set of (doc, key) its tokens see, counted
    by the key's owner."""
    owner = {}
    for r, d, a, n in zip(rank, doc, start, length):
        for p in range(a, a + n):
            owner[(d, p)] = r
    out = np.zeros((cp, cp))
    for s in range(cp):
        seen = set()
        for (d, p), r in owner.items():
            if r != s:
                continue
            lo, hi = mask.key_interval(np.array([p]))
            for key in range(max(int(lo[0]), 0), min(int(hi[0]), lengths[d] - 1) + 1):
                seen.add((d, key))
        for key in seen:
            if owner[key] != s:
                out[s, owner[key]] += 1
    return out


@pytest.mark.parametrize("mask", [CAUSAL, SWA, CHUNKED, AttnMask(causal=False),
                                  AttnMask(causal=False, window_size=(5, 3))],
                         ids=repr)
def test_fetch_matrix_matches_a_token_reference(mask):
    rng = np.random.default_rng(3)
    for _ in range(3):
        lengths = np.array(rng.integers(1, 90, rng.integers(2, 7)))
        cp = int(rng.integers(2, 6))
        masks = normalize_masks([(mask, 1)])
        rank, doc, start, length = balanced_runs(lengths, cp, masks, 8)
        got = fetch_matrix(rank, doc, start, length, lengths, masks, cp)[0]
        ref = _token_fetch(lengths.tolist(), rank.tolist(), doc.tolist(), start.tolist(),
                           length.tolist(), mask, cp)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("mix,cp,name", [("lognormal_1k", 16, "causal"),
                                         ("lognormal_1k", 64, "llama4"),
                                         ("lognormal_long", 32, "swa_5to1")])
def test_placement_cuts_the_slowest_fetch(mix, cp, name):
    """On bench mixes (8K tokens per rank, nodes of 8) where the solver's rank order puts
    ranks that share documents on different nodes, the placement lowers the slowest rank's
    fetch time (what bounds the layer) and the most cross-node keys a rank fetches."""
    masks = [(m if m is CAUSAL else AttnMask(**({"window_size": (4096, 0)} if m is SWA
                                                   else {"chunk_size": 8192})), w)
             for m, w in MASK_SETS[name]]
    lengths = MIXES[mix](8192 * cp)
    topo = Topology(tuple(np.arange(cp) // 8))
    ratio = topo.node_bytes_per_s / topo.cross_node_bytes_per_s
    plain = _plan(lengths, cp, masks, tile=64)
    plain.topology = topo   # the same nodes, solver's order: what a node-blind layout gets
    placed = _plan(lengths, cp, masks, topo, tile=64)
    before = _weighted_bottleneck(plain, masks, ratio)
    after = _weighted_bottleneck(placed, masks, ratio)
    assert after < 0.8 * before, (before, after)
    cross = topo.node_array[:, None] != topo.node_array[None, :]
    most = [max((fetch_count_array(p, m) * cross).sum(1).max() for m, _ in masks)
            for p in (plain, placed)]
    assert most[1] < most[0], most


def test_no_placement_where_it_cannot_matter():
    """One node, or one rank per node: the plan's tables are those without a topology;
    the topology still enters the fingerprint (ranks that disagree on it disagree)."""
    masks = [(MOVED_MASK, 1)]
    plain = _plan(MOVED_DOCS, 4, masks)
    for nodes in ((0, 0, 0, 0), (0, 1, 2, 3), (3, 1, 0, 2)):
        placed = _plan(MOVED_DOCS, 4, masks, Topology(nodes))
        for name in ("token_index", "position", "local_cu", "rank_offsets"):
            np.testing.assert_array_equal(getattr(plain.arrays, name),
                                          getattr(placed.arrays, name))
        assert placed.fingerprint() != plain.fingerprint()
    moved = _plan(MOVED_DOCS, 4, masks, Topology((0, 0, 1, 1)))
    assert _runs_of(moved) != _runs_of(plain)
    same = [_plan(MOVED_DOCS, 4, masks, Topology((5, 5, 2, 2)), rank=r) for r in range(4)]
    assert len({p.fingerprint() for p in same}) == 1 and same[0].topology == moved.topology
    assert all(_runs_of(p) == _runs_of(moved) for p in same)


def test_topology_from_ranks_and_config(monkeypatch):
    assert node_of_ranks([0, 2, 4, 6, 8, 10, 12, 14], 8) == (0, 0, 0, 0, 1, 1, 1, 1)
    assert Topology((7, 7, 3, 3, 7)).nodes == (0, 0, 1, 1, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topo = CPConfig().topology([4, 5, 6, 7])
    assert topo.nodes == (0, 0, 1, 1) and topo.gpus_per_node == 2
    assert CPConfig(gpus_per_node=4).topology([4, 5, 6, 7]).nodes == (0, 0, 0, 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert CPConfig().topology(list(range(16))).nodes == (0,) * 8 + (1,) * 8
    cfg = CPConfig(gpus_per_node=1, node_bandwidth=2e11, cross_node_bandwidth=2.5e10)
    topo = cfg.topology([0, 1])
    assert (topo.node_bytes_per_s, topo.cross_node_bytes_per_s) == (2e11, 2.5e10)


@pytest.mark.parametrize("make,match", [
    (lambda: Topology(()), "Topology.nodes"),
    (lambda: Topology((0, -1)), "Topology.nodes"),
    (lambda: Topology((0, True)), "Topology.nodes"),
    (lambda: Topology((0, 1), node_bytes_per_s=0), "Topology.node_bytes_per_s"),
    (lambda: Topology((0, 1), cross_node_bytes_per_s=float("inf")),
     "Topology.cross_node_bytes_per_s"),
    (lambda: Topology((0, 1), gpus_per_node=0), "Topology.gpus_per_node"),
    (lambda: node_of_ranks([0, 1], 0), "gpus_per_node"),
    (lambda: CPConfig(gpus_per_node=0), "gpus_per_node"),
    (lambda: CPConfig(node_bandwidth=-1.0), "node_bandwidth"),
    (lambda: CPConfig(cross_node_bandwidth="fast"), "cross_node_bandwidth"),
    (lambda: CPConfig(node_bandwidth=10 ** 400), "node_bandwidth must be a finite number"),
    (lambda: Topology((0, 1), node_bytes_per_s=float("nan")), "Topology.node_bytes_per_s"),
    (lambda: _plan([5, 9], 2, [(CAUSAL, 1)], Topology((0, 0, 1))), "topology: nodes has 3"),
    (lambda: _plan([5, 9], 2, [(CAUSAL, 1)], (0, 1)), "topology must be"),
])
def test_bad_topology_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_group_mismatch_names_both_groupings():
    topo = Topology((0, 0, 1, 1), gpus_per_node=2)
    assert group_mismatch(topo, [0, 1, 2, 3]) is None
    assert group_mismatch(topo, [6, 7, 2, 3]) is None       # the same partition
    why = group_mismatch(topo, [0, 2, 1, 3])
    assert "(0, 1, 0, 1)" in why and "(0, 0, 1, 1)" in why
    assert group_mismatch(Topology((0, 0, 1, 1)), [0, 2, 1, 3]) is None  # not derived


def test_cost_model_reads_the_plan_topology():
    """auto's estimate on a plan with a topology uses its nodes and rates: the same as a
    CostModel with those nodes and rates on the same layout."""
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=64)
    lengths = [300, 41, 180, 77, 500, 12]
    topo = Topology((0, 0, 1, 1), node_bytes_per_s=1e11, cross_node_bytes_per_s=2e10)
    plan = _plan(lengths, 4, [(CAUSAL, 1)], topo)
    for name in ("p2p", "dispatch"):
        got = estimate(plan, CAUSAL, name, shape, CostModel(bytes_per_s=1e11,
                                                             cross_node_bytes_per_s=2e10,
                                                             ranks_per_node=2))
        default = estimate(plan, CAUSAL, name, shape,
                           CostModel(bytes_per_s=1e11, cross_node_bytes_per_s=2e10))
        assert got.cross_node_bytes > 0
        assert (got.seconds, got.cross_node_bytes) == (default.seconds,
                                                       default.cross_node_bytes)
    plain = _plan(lengths, 4, [(CAUSAL, 1)])
    assert estimate(plain, CAUSAL, "p2p", shape, CostModel()).cross_node_bytes == 0


def _placed_attention(rank, world, docs, mask):
    """CP attention on the placed plan against the single-device op, every strategy; then
    a call with a plan built for other nodes is refused on every rank."""
    torch.manual_seed(0)
    errors = []
    inputs = global_inputs(docs, 4, 2, seed=1)
    ref = single_device(*inputs, docs, mask)
    topo = CPConfig(gpus_per_node=2).topology(list(range(world)))
    plan = _plan(docs, world, [(mask, 1)], topo, rank=rank)
    for strategy in STRATEGY_CHOICES:
        q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
        out, lse = cp_varlen_attn(q, k, v, plan, mask, None,
                                  AttnOptions(strategy=strategy, backend="torch"),
                                  return_lse=True)
        out.backward(plan.shard(inputs[3]))
        errors += compare_fp32(gather(plan, (out, lse, q.grad, k.grad, v.grad)), ref,
                               strategy)
    other = _plan(docs, world, [(mask, 1)], Topology((0, 1, 0, 1), gpus_per_node=2),
                  rank=rank)
    q, k, v = (other.shard(t) for t in inputs[:3])
    try:
        cp_varlen_attn(q, k, v, other, mask, None, AttnOptions(backend="torch"))
        errors.append("a plan for nodes (0, 1, 0, 1) ran on nodes (0, 0, 1, 1)")
    except ValueError as e:
        if "sit on nodes (0, 0, 1, 1)" not in str(e):
            errors.append(f"wrong error: {e}")
    return errors


def test_attention_on_a_placed_plan(tmp_path):
    moved = _plan(MOVED_DOCS, 4, [(MOVED_MASK, 1)], Topology((0, 0, 1, 1)))
    assert _runs_of(moved) != _runs_of(_plan(MOVED_DOCS, 4, [(MOVED_MASK, 1)]))
    results = run_distributed(_placed_attention, 4, tmp_path, MOVED_DOCS, MOVED_MASK)
    assert results == [[]] * 4, results
