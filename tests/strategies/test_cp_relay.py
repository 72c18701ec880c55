"""``dispatch`` relayed through nodes (``tables.staged.relay``) on gloo: 4 ranks on 2 nodes
(2 + 2 and 3 + 1), every layout x mask of the CP grid and S = 1, 2, 3, 5: out, lse, dq, dk, dv
equal the single-device op (fp32), and in fp16 the bytes each rank posts to each peer equal
the traffic matrix (both hops, forward and backward), each transfer's cross-node rows on
the CP group and its in-node rows (the first hop's and the second hop) on the node groups
made at setup; without them (none prepared, or a default group bound to a device) all on
the CP group. Some cases must relay keys from one
rank to another inside a node (else the second hop went untested)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.cp_grid import (DOCS, DV, HEADS, MASKS, D, compare_fp32, cu, gather,
                                   global_inputs, single_device)
from tests.helpers.guards import ByteCounter
from varlen_cp import AttnOptions, cp_varlen_attn
from varlen_cp.plan import CPPlan, Topology, layout_spec
from varlen_cp.shape import AttnShape
from varlen_cp.tables import catalogue
from varlen_cp.tables.staged.relay import relay_active, relay_counts

NODES = ((0, 0, 1, 1), (0, 0, 0, 1))
LAYOUTS = ("balanced", "dual_chunk", "contiguous")
STAGES = (1, 2, 3, 5)


def _plan(rank, world, layout, mask, nodes):
    spec = {"dual_chunk": {"min_chunk_tokens": 4},
            "balanced": {"masks": mask, "tile_tokens": 8}}.get(layout, {})
    return CPPlan.build(cu(DOCS), cp_size=world, cp_rank=rank,
                        layout=layout_spec(layout, **spec), topology=Topology(nodes))


def relay_worker(rank, world):
    import torch.distributed as dist
    from varlen_cp.strategies.relay_group import prepare_node_groups
    for nodes in NODES:   # at setup, on every rank (as the integrations do)
        assert prepare_node_groups(None, Topology(nodes))
    errors, relayed, n = [], 0, 0
    for i, (nodes, layout, mname) in enumerate(
            (nodes, layout, mname) for nodes in NODES for layout in LAYOUTS
            for mname in MASKS):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(DOCS, hq, hkv, seed=i)
        ref = single_device(*inputs, DOCS, mask)
        plan = _plan(rank, world, layout, mask, nodes)
        assert relay_active(plan)
        relayed += int(relay_counts(plan, mask, 1)[0].sum())
        for stages in STAGES:
            options = AttnOptions(strategy="dispatch", backend="torch",
                                  overlap_stages=stages)
            what = f"[{nodes} {layout} {mname} S={stages}]"
            q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
            out, lse = cp_varlen_attn(q, k, v, plan, mask, None, options, return_lse=True)
            out.backward(plan.shard(inputs[3]))
            errors += compare_fp32(gather(plan, (out.detach(), lse, q.grad, k.grad,
                                                 v.grad)), ref, what)
            # fp16: the bytes posted to each peer are the traffic matrix's
            q, k, v = (plan.shard(t).half().requires_grad_() for t in inputs[:3])
            with ByteCounter() as fwd:
                out = cp_varlen_attn(q, k, v, plan, mask, None, options)
            with ByteCounter() as bwd:
                out.backward(plan.shard(inputs[3]).half())
            shape = AttnShape(n_heads=hq, n_kv_heads=hkv, head_dim=D, head_dim_v=DV,
                              dtype=torch.float16)
            matrix = catalogue.traffic_of("dispatch", plan, mask, shape, None)
            mates = nodes.count(nodes[rank])
            for phase, counter in (("fwd", fwd), ("bwd", bwd)):
                row = {d: int(b) for d, b in enumerate(matrix[phase][rank]) if b}
                sent = {d: b for d, b in counter.by_peer.items() if b}
                if sent != row:
                    errors.append(f"{what} {phase}: sent {sent}, traffic matrix {row}")
                # each transfer: hop 1's cross-node rows on the CP group, its in-node rows
                # and hop 2 on the node's own group
                sizes = counter.a2a_sizes
                if not sizes or sizes.count(mates) != 2 * sizes.count(world) \
                        or len(sizes) != 3 * sizes.count(world):
                    errors.append(f"{what} {phase}: all-to-all group sizes {sizes}, "
                                  f"node of {mates}")
            n += 1
    assert not errors, "\n".join(errors)
    # torch's count of groups (which names the next ones) is equal on every rank, and a
    # job-wide group made after the relayed calls works
    counts = [None] * world
    dist.all_gather_object(counts, dist.distributed_c10d._world.group_count)
    assert len(set(counts)) == 1, counts
    after = torch.ones(1)
    dist.all_reduce(after, group=dist.new_group(list(range(world))))
    assert after.item() == world
    return n, relayed


def test_relayed_dispatch_equals_the_single_device_op(tmp_path):
    results = run_distributed(relay_worker, 4, tmp_path)
    n = len(NODES) * len(LAYOUTS) * len(MASKS) * len(STAGES)
    assert [r[0] for r in results] == [n] * 4
    assert results[0][1] > 0   # some keys went through a relay to a node mate


def shared_worker(rank, world, bound):
    """Without node groups the relay keeps its in-node collectives on the CP group:
    where none were prepared, or (``bound``) where the default group is bound to a device
    (as ``init_process_group(device_id=...)`` binds it: torch would split its
    communicator for a node group, which every rank of the job must join)."""
    import torch.distributed as dist
    from varlen_cp.strategies import relay_group
    if bound:
        dist.distributed_c10d._get_default_group().bound_device_id = torch.device("cpu", 0)
        assert relay_group.device_bound()
        assert not relay_group.prepare_node_groups(None, Topology(NODES[0]))
    errors = []
    for i, mname in enumerate(("causal", "chunk_causal")):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(DOCS, hq, hkv, seed=50 + i)
        ref = single_device(*inputs, DOCS, mask)
        plan = _plan(rank, world, "balanced", mask, NODES[0])
        for stages in (1, 3):
            options = AttnOptions(strategy="dispatch", backend="torch",
                                  overlap_stages=stages)
            q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
            with ByteCounter() as counter:
                out, lse = cp_varlen_attn(q, k, v, plan, mask, None, options,
                                          return_lse=True)
                out.backward(plan.shard(inputs[3]))
            errors += compare_fp32(gather(plan, (out.detach(), lse, q.grad, k.grad,
                                                 v.grad)), ref, f"[{bound} {mname} S={stages}]")
            if set(counter.a2a_sizes) != {world}:
                errors.append(f"[{bound} {mname} S={stages}] group sizes {counter.a2a_sizes}")
    assert not errors, "\n".join(errors)
    return len(relay_group._GROUPS)


@pytest.mark.parametrize("bound", [False, True])
def test_relay_without_node_groups_stays_on_the_cp_group(tmp_path, bound):
    assert run_distributed(shared_worker, 4, tmp_path, bound) == [0] * 4
