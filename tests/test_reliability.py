"""Reliability of the CP layer (issue 16): what happens when ranks, peers or inputs go wrong.

- Ranks that build different plans (a data-loader bug) get a ValueError naming the plan on
  every rank, by default, for every strategy; the check is ONE 16-byte all-reduce per
  (plan, group), not per layer or call, and the group stays usable afterwards.
- A stalled rank makes its a2a+p2p Ulysses peers fail after the CP group's own timeout (the
  sub-groups inherit it), not torch's 10-30 minute default.
- Bad arguments at the public entry points (op, module, plan, sharding, prepare) raise a
  ValueError naming the field before anything is computed or communicated; a strategy's own
  option rules hold at cp == 1 exactly as at cp == 2.
- Edge batches: 100K documents, empty batches, ranks that hold only padding, NaN in padding
  rows (never read; zero gradients).

Multi-rank cases run on gloo through ``tests.dist_utils.run_distributed`` (file store in
tmp_path, one thread per worker, every wait bounded, only its own workers killed).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.strategies import STRATEGIES

ALL = tuple(STRATEGIES)                       # every registered strategy
CAUSAL = AttnMask(causal=True)
CHUNK = AttnMask(causal=True, chunk_size=8)
D, DV = 8, 8


def _cu(docs) -> torch.Tensor:
    return torch.tensor([0, *docs], dtype=torch.int64).cumsum(0)


def _inputs(total, hq=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(total, hq, D, generator=g), torch.randn(total, hkv, D, generator=g),
            torch.randn(total, hkv, DV, generator=g), torch.randn(total, hq, DV, generator=g))


def _local(plan, inputs, grad=True):
    q, k, v, dout = (plan.shard(t) for t in inputs)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def _outcome(fn) -> str:
    """'ok', or the exception's type and message (compared by the parent process)."""
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported, the parent asserts on it
        return f"{type(e).__name__}: {e}"


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ======================================================================================
# 1. Ranks that disagree on the batch
# ======================================================================================
# (name, rank 0's build, rank 1's build): every pair differs in a way only the plan's
# fingerprint can see (each rank's q/k/v match its own plan, so every local check passes).
DISAGREE = {
    "same_total": (([40, 20, 90], "contiguous"), ([50, 50, 50], "contiguous")),
    "other_total": (([50, 50, 50], "contiguous"), ([50, 50, 60], "contiguous")),
    "other_layout": (([50, 50, 50], "contiguous"), ([50, 50, 50], "balanced")),
}


def disagree_worker(rank, world):
    """Every strategy x every kind of disagreement, default arguments: the outcome on this
    rank. Then every strategy once more on agreeing plans (the group must still work)."""
    outcomes = {}
    for kind, builds in DISAGREE.items():
        docs, layout = builds[rank]
        for strategy in ALL:
            plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout=layout)
            q, k, v, _ = _local(plan, _inputs(sum(docs)), grad=False)
            outcomes[f"{kind}/{strategy}"] = _outcome(
                lambda: cp_varlen_attn(q, k, v, plan, CAUSAL, None, strategy))
        # The module's default is the function's.
        module = ContextParallelVarlenAttention(CAUSAL, strategy="p2p")
        outcomes[f"{kind}/module"] = _outcome(lambda: module(q, k, v, plan))
    docs = [40, 20, 90]
    inputs = _inputs(sum(docs))
    plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout="contiguous")
    q, k, v, _ = _local(plan, inputs, grad=False)
    want = cp_varlen_attn(q, k, v, plan, CAUSAL, None, "p2p")
    after = {s: bool(torch.allclose(cp_varlen_attn(q, k, v, plan, CAUSAL, None, s), want,
                                    atol=1e-5, rtol=1e-4)) for s in ALL}
    return outcomes, after


def test_ranks_that_disagree_get_a_value_error(tmp_path):
    """Before (validate=False by default, 7603d2c) p2p / all_gather returned wrong results
    without error, and dispatch returned garbage on one rank and died in gloo on the other."""
    results = run_distributed(disagree_worker, 2, tmp_path, timeout_s=150,
                              collective_timeout_s=20)
    bad = []
    for rank, (outcomes, after) in enumerate(results):
        for case, outcome in outcomes.items():
            if not (outcome.startswith("ValueError: plan:") and "different plans" in outcome):
                bad.append(f"rank {rank} {case}: {outcome[:200]}")
        assert all(after.values()), f"rank {rank}: group unusable after the check: {after}"
    assert not bad, "\n".join(bad)
    assert set(results[0][0]) == {f"{k}/{s}" for k in DISAGREE for s in (*ALL, "module")}


# ---------------------------------------------------------------- once per (plan, group)
class _AllReduceCounter:
    """Counts dist.all_reduce calls (and their bytes) while active."""

    def __init__(self):
        self.saved, self.calls = dist.all_reduce, []

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.calls.append(tensor.numel() * tensor.element_size())
            return self.saved(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


def once_worker(rank, world):
    """Per strategy: a 'model' of 3 layers x 2 masks, forward and backward, on one plan; a
    second step on the same plan; a module on it; then a new plan (checked again) and
    validate=False (never checked). Returns every count."""
    docs = [40, 3, 1, 57, 20]
    inputs = _inputs(sum(docs))
    counts = {}
    for strategy in ALL:
        plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, min_chunk_tokens=4)
        with _AllReduceCounter() as c:
            for _step in range(2):
                q, k, v, dout = _local(plan, inputs)
                x = q
                for mask in (CAUSAL, CHUNK, CAUSAL):   # e.g. Llama 4's chunked : global
                    x = cp_varlen_attn(x, k, v, plan, mask, None, strategy)
                x.backward(dout)
            counts[f"{strategy}/steps"] = list(c.calls)
            module = ContextParallelVarlenAttention(CHUNK, strategy=strategy)
            module(*_local(plan, inputs, grad=False)[:3], plan)
            counts[f"{strategy}/module"] = len(c.calls)
            fresh = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, min_chunk_tokens=4)
            cp_varlen_attn(*_local(fresh, inputs, grad=False)[:3], fresh, CAUSAL, None,
                           strategy)
            cp_varlen_attn(*_local(fresh, inputs, grad=False)[:3], fresh, CHUNK, None,
                           strategy)
            counts[f"{strategy}/new_plan"] = len(c.calls)
            unchecked = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank)
            cp_varlen_attn(*_local(unchecked, inputs, grad=False)[:3], unchecked, CAUSAL,
                           None, strategy, validate=False)
            counts[f"{strategy}/validate_false"] = len(c.calls)
    # What the check remembers does not keep a plan (and its tables) alive once the step's
    # tensors are gone (an output's autograd graph refers to its plan).
    ref = weakref.ref(plan)
    del plan, fresh, unchecked, module, q, k, v, dout, x
    gc.collect()
    counts["plan_freed"] = ref() is None
    return counts


def test_plan_agreement_is_checked_once_per_plan(tmp_path):
    """One 16-byte all-reduce per plan, whatever the number of layers, masks, steps or
    modules using it; a new plan is checked again; validate=False never checks."""
    results = run_distributed(once_worker, 2, tmp_path, timeout_s=150,
                              collective_timeout_s=30)
    for counts in results:
        for s in ALL:
            assert counts[f"{s}/steps"] == [16], (s, counts)
            assert counts[f"{s}/module"] == 1, (s, counts)
            assert counts[f"{s}/new_plan"] == 2, (s, counts)
            assert counts[f"{s}/validate_false"] == 2, (s, counts)
        assert counts["plan_freed"], "the agreement check keeps the plan alive"


# ======================================================================================
# 2. A stalled rank under a2a+p2p: the CP group's timeout governs the Ulysses sub-groups
# ======================================================================================
INIT_TIMEOUT_S = 8.0        # the CP group's timeout when the sub-groups are created
TRAIN_TIMEOUT_S = 4.0       # ... and after the first step (torchtitan's two timeouts)
WORLD_TIMEOUT_S = 120.0     # the default group's; a sub-group must not fall back to it
FAIL_BOUND_S = 45.0         # << WORLD_TIMEOUT_S and gloo's default (30 min)
STALLED = 1


def _group_timeout(group):
    """The timeout (s) a gloo group's collectives run with (torch's backend options)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def stall_worker(rank, world, flag_dir):
    """As torchtitan does: the CP group starts with its init timeout, the first step
    creates the Ulysses sub-groups, then every rank shortens the CP group's timeout and runs
    a second step. Then rank STALLED hangs; the others time their failing third step."""
    from varlen_cp.strategies.a2a_p2p import ulysses_subgroup

    cp = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    docs = [30, 17, 40, 9]
    plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout="contiguous")
    q, k, v, _ = _local(plan, _inputs(sum(docs)), grad=False)

    def step():
        return cp_varlen_attn(q, k, v, plan, CAUSAL, cp, "a2a+p2p", a2a_size=2)

    step()                                # builds the sub-groups {0, 1} and {2, 3}
    sub, _ = ulysses_subgroup(cp, 2)
    timeouts = [(_group_timeout(cp), _group_timeout(sub))]
    setter = getattr(dist, "set_timeout", None) or dist._set_pg_timeout  # torch < 2.14
    setter(datetime.timedelta(seconds=TRAIN_TIMEOUT_S), cp)
    step()
    timeouts.append((_group_timeout(cp), _group_timeout(sub)))
    if rank == STALLED:
        # Stays alive (a hung rank, not a dead one: a closed connection would fail the peers
        # at once and prove nothing) until the others have reported, at most ~90 s.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(flag_dir, f"done_{r}"))
                for r in range(world) if r != STALLED):
            time.sleep(0.2)
        return "stalled", 0.0, timeouts
    start = time.monotonic()
    try:
        step()
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the stuck collective's error, reported
        outcome = f"{type(e).__name__}: {str(e)[:200]}"
    elapsed = time.monotonic() - start
    open(os.path.join(flag_dir, f"done_{rank}"), "w").close()
    return outcome, elapsed, timeouts


def test_stalled_rank_fails_its_ulysses_peers_within_the_cp_timeout(tmp_path):
    """Rank 1 stalls after the sub-groups exist; rank 0 (its Ulysses peer, stuck in the
    sub-group's all-to-all) and ranks 2, 3 (stuck in the ring on the CP group) fail within
    seconds, not after gloo's 30-minute default (which the sub-groups had at 7603d2c: rank 0
    then waited until the stalled rank exited). The sub-groups have the CP group's timeout
    when created and follow it when it changes."""
    flags = tmp_path / "flags"
    flags.mkdir()
    results = run_distributed(stall_worker, 4, tmp_path, str(flags), timeout_s=200,
                              collective_timeout_s=WORLD_TIMEOUT_S)
    errors = []
    want = [(INIT_TIMEOUT_S, INIT_TIMEOUT_S), (TRAIN_TIMEOUT_S, TRAIN_TIMEOUT_S)]
    for rank, (outcome, elapsed, timeouts) in enumerate(results):
        if timeouts != want:
            errors.append(f"rank {rank}: (CP group, Ulysses sub-group) timeouts after step 1 "
                          f"and step 2: {timeouts}, want {want}")
        if rank == STALLED:
            continue
        if outcome == "no error":
            errors.append(f"rank {rank} completed without its stalled peer")
        elif elapsed >= FAIL_BOUND_S:
            errors.append(f"rank {rank} failed only after {elapsed:.0f} s: {outcome}")
    assert not errors, "\n".join(errors)
