"""No host sync inside the step: the plan-agreement check runs in the step's sharding, on
host tensors, and the attention calls of the model find it done.

The whole step (``shard_packed_batch`` with ``validate=True``, then every layer's
``cp_varlen_attn`` forward and backward with the default ``validate=True``) runs under
``forbid_host_reads`` (tests/helpers/guards.py: a host read of device data raises), with
the collectives counted: the sharding makes exactly the one 16-byte all-reduce, the
attention calls none beyond their strategy's own (p2p, a2a, all_gather and dispatch make no
all-reduce at all). Before, the check ran inside the first attention call, with a host read
of its result. Ranks that disagree get the ValueError from the sharding, before the model
runs; a CP group without a CPU backend (NCCL) gets a gloo channel over its ranks, made once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers.guards import AllReduceCounter, forbid_host_reads
from varlen_cp import AttnOptions
from varlen_cp.attention import cp_varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan, DualChunk
from varlen_cp.plan import agreement
from varlen_cp.sharding import shard_packed_batch

DOCS = [40, 3, 1, 57, 20]
MASKS = (AttnMask(causal=True, chunk_size=8), AttnMask(causal=True))
STRATEGIES = ("p2p", "all_gather", "a2a", "dispatch")


def _cu(docs):
    return torch.tensor([0] + docs).cumsum(0)


def _batch(total, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(1, total, 2, 8, generator=g),
            "k": torch.randn(1, total, 2, 8, generator=g),
            "v": torch.randn(1, total, 2, 8, generator=g),
            "dout": torch.randn(1, total, 2, 8, generator=g)}


def step_worker(rank, world):
    counts = {}
    for strategy in STRATEGIES:
        plan = CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=rank,
                            layout=DualChunk(min_chunk_tokens=4))
        with forbid_host_reads():
            with AllReduceCounter() as sharding:
                local = shard_packed_batch(_batch(sum(DOCS)), plan, validate=True)
            q, k, v = (local[n][0].requires_grad_() for n in ("q", "k", "v"))
            with AllReduceCounter() as layers:
                x = q
                for mask in MASKS + MASKS:        # 4 layers, 2 masks, default validate
                    x = cp_varlen_attn(x, k, v, plan, mask, None,
                                       AttnOptions(strategy=strategy))
                x.backward(local["dout"][0])
        counts[strategy] = (list(sharding.calls), list(layers.calls))
    return counts


def test_the_step_checks_the_plan_in_the_sharding_and_nowhere_else(tmp_path):
    for counts in run_distributed(step_worker, 2, tmp_path, timeout_s=150):
        for strategy, (sharding, layers) in counts.items():
            assert sharding == [16], (strategy, sharding)
            assert layers == [], (strategy, layers)


def disagree_worker(rank, world, device_only):
    if device_only:   # a CP group whose backend takes no CPU tensors (NCCL): gloo channel
        agreement.takes_cpu_tensors = lambda group: False
    made = []
    new_group = dist.new_group

    def counted(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    dist.new_group = counted
    try:
        docs = DOCS if rank == 0 else DOCS[:-1] + [19, 1]     # same total, other documents
        plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank)
        try:
            with forbid_host_reads():
                shard_packed_batch(_batch(sum(docs)), plan, validate=True)
            outcome = "no error"
        except ValueError as e:
            outcome = f"ValueError: {e}"
        # an agreeing plan afterwards, twice: the channel is made once and still works
        for _ in range(2):
            good = CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=rank)
            shard_packed_batch(_batch(sum(DOCS)), good, validate=True)
        return outcome, made
    finally:
        dist.new_group = new_group


def test_ranks_that_disagree_fail_in_the_sharding(tmp_path):
    for device_only in (False, True):
        for outcome, made in run_distributed(disagree_worker, 2, tmp_path, device_only,
                                             timeout_s=120, collective_timeout_s=20):
            assert outcome.startswith("ValueError: plan:") and "different plans" in outcome, \
                outcome
            assert made == (["gloo"] if device_only else []), made
