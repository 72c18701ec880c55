"""Traffic matrices (``tables.traffic``): who sends how many bytes to whom per layer.

The per-peer sends are checked against what the collectives really post on gloo in
``tests/strategies/test_cp_strategies.py`` (``bytes_worker``); here: their structure on
random batches (no rank sends to itself, the row sums are ``bytes_sent``, a ring talks only
to its neighbour forward), and the in-node / cross-node split against a loop over pairs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varlen_cp import AttnMask
from varlen_cp.config import CPConfig
from varlen_cp.prefetch import build_plan
from varlen_cp.shape import AttnShape
from varlen_cp.tables import catalogue, traffic
from varlen_cp.tables.catalogue import STRATEGY_NAMES

MASKS = [AttnMask(), AttnMask(causal=False), AttnMask(chunk_size=96),
         AttnMask(window_size=(40, 0))]


def random_plan(rng, cp: int, mask: AttnMask):
    docs = rng.integers(1, 700, size=int(rng.integers(1, 10)))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]))
    layout = str(rng.choice(["balanced", "dual_chunk", "contiguous", "te"]))
    return build_plan(cu, CPConfig(layout=layout), cp_size=cp, cp_rank=0,
                      layer_masks=[(mask, 1)])


@pytest.mark.parametrize("seed", range(6))
def test_matrices_are_the_bytes_each_rank_sends(seed):
    rng = np.random.default_rng(seed)
    cp = (2, 4, 8)[seed % 3]
    mask = MASKS[seed % 4]
    plan = random_plan(rng, cp, mask)
    shape = AttnShape(n_heads=8, n_kv_heads=(1, 2, 8)[seed % 3], head_dim=16, head_dim_v=24)
    for name in STRATEGY_NAMES:
        options = catalogue.traits(name).options(shape, cp)
        if options is None:
            continue
        a2a = options.get("a2a_size")
        m = catalogue.traffic_of(name, plan, mask, shape, a2a)
        sent = catalogue.bytes_sent(name, plan, mask, shape, a2a)
        for phase in ("fwd", "bwd"):
            assert m[phase].shape == (cp, cp) and m[phase].dtype == np.int64
            assert (m[phase] >= 0).all() and not np.diagonal(m[phase]).any(), name
            assert m[phase].sum(1).tolist() == sent[phase], (name, phase)
        if name == "p2p":   # the ring's K/V only go to the next rank
            nxt = np.roll(np.eye(cp, dtype=bool), 1, axis=1)
            assert not m["fwd"][~nxt].any()


@pytest.mark.parametrize("seed", range(4))
def test_split_into_in_node_and_cross_node(seed):
    rng = np.random.default_rng(seed)
    cp = 8
    nodes = np.sort(rng.integers(0, 3, size=cp))
    m = {"fwd": rng.integers(0, 100, (cp, cp)), "bwd": rng.integers(0, 100, (cp, cp))}
    got = traffic.split(m, nodes)
    for phase in ("fwd", "bwd"):
        for s in range(cp):
            cross = sum(int(m[phase][s, d]) for d in range(cp) if nodes[d] != nodes[s])
            inside = sum(int(m[phase][s, d]) for d in range(cp) if nodes[d] == nodes[s])
            assert (got[f"{phase}_cross"][s], got[f"{phase}_in"][s]) == (cross, inside)


# ---------------------------------------------------------------- the cost model's two links
def _estimates(plan, mask, shape, model):
    from varlen_cp.tables.auto import estimates
    return estimates(plan, mask, shape, model=model)


def _timing(e):
    return {k: (v.seconds, v.compute_s, v.comm_s, v.bytes_sent) for k, v in e.items()}


@pytest.mark.parametrize("seed", range(4))
def test_one_rank_per_node_is_the_cross_node_link_alone(seed):
    """Every rank its own node: every byte crosses, so the estimates are those of one node
    whose only link is the cross-node one; a node holding every rank is the default."""
    from varlen_cp.tables.auto import CostModel

    rng = np.random.default_rng(seed)
    cp, mask = (4, 8)[seed % 2], MASKS[seed % 4]
    plan = random_plan(rng, cp, mask)
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=32)
    base = dict(flops_per_s=1e12, stage_latency_s=1e-6)
    apart = _estimates(plan, mask, shape, CostModel(**base, bytes_per_s=1e10,
                                                    cross_node_bytes_per_s=2e9,
                                                    ranks_per_node=1))
    slow_node = _estimates(plan, mask, shape, CostModel(**base, bytes_per_s=2e9))
    assert _timing(apart) == _timing(slow_node)
    assert all(e.cross_node_bytes == e.bytes_sent for e in apart.values())
    together = _estimates(plan, mask, shape, CostModel(**base, bytes_per_s=1e10,
                                                       ranks_per_node=cp))
    alone = _estimates(plan, mask, shape, CostModel(**base, bytes_per_s=1e10))
    assert _timing(together) == _timing(alone)
    assert all(e.cross_node_bytes == 0 for e in together.values())


@pytest.mark.parametrize("seed", range(4))
def test_links_run_side_by_side(seed):
    """Two nodes: a waiting strategy's transfer time is, per rank, the longer of its bytes
    to its own node at one rate and to the other node at the other (a loop over peers)."""
    from varlen_cp.tables.auto import CostModel

    rng = np.random.default_rng(10 + seed)
    cp, mask = 8, MASKS[seed % 4]
    plan = random_plan(rng, cp, mask)
    shape = AttnShape(n_heads=8, n_kv_heads=8, head_dim=32)
    model = CostModel(flops_per_s=1e12, bytes_per_s=1e10, cross_node_bytes_per_s=3e9,
                      ranks_per_node=4)
    got = _estimates(plan, mask, shape, model)
    for name in ("a2a", "p2p"):
        m = catalogue.traffic_of(name, plan, mask, shape)
        comm = []
        for phase in ("fwd", "bwd"):
            worst = 0.0
            for s in range(cp):
                inside = sum(int(m[phase][s, d]) for d in range(cp) if d // 4 == s // 4)
                cross = sum(int(m[phase][s, d]) for d in range(cp) if d // 4 != s // 4)
                worst = max(worst, inside / 1e10, cross / 3e9)
            comm.append(worst)
        assert got[name].comm_s == pytest.approx(sum(comm), rel=1e-12), name


@pytest.mark.parametrize("kwargs,message", [
    ({"cross_node_bytes_per_s": 0}, "cross_node_bytes_per_s must be a finite number > 0"),
    ({"ranks_per_node": 0}, "ranks_per_node must be None or an int >= 1, got 0"),
    ({"ranks_per_node": True}, "ranks_per_node must be None or an int >= 1, got True")])
def test_cost_model_links_are_checked(kwargs, message):
    from varlen_cp.tables.auto import CostModel

    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)
