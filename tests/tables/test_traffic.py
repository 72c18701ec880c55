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
