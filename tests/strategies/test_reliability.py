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
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers.guards import AllReduceCounter
from varlen_cp import AttnOptions
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan, DualChunk
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
                lambda: cp_varlen_attn(q, k, v, plan, CAUSAL, None,
                                       AttnOptions(strategy=strategy)))
        # The module's default is the function's.
        module = ContextParallelVarlenAttention(CAUSAL, AttnOptions(strategy="p2p"))
        outcomes[f"{kind}/module"] = _outcome(lambda: module(q, k, v, plan))
    docs = [40, 20, 90]
    inputs = _inputs(sum(docs))
    plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout="contiguous")
    q, k, v, _ = _local(plan, inputs, grad=False)
    want = cp_varlen_attn(q, k, v, plan, CAUSAL, None, AttnOptions(strategy="p2p"))
    after = {s: bool(torch.allclose(cp_varlen_attn(q, k, v, plan, CAUSAL, None,
                                                   AttnOptions(strategy=s)), want,
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
def once_worker(rank, world):
    """Per strategy: a 'model' of 3 layers x 2 masks, forward and backward, on one plan; a
    second step on the same plan; a module on it; then a new plan (checked again) and
    validate=False (never checked). Returns every count."""
    docs = [40, 3, 1, 57, 20]
    inputs = _inputs(sum(docs))
    counts = {}
    for strategy in ALL:
        plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank,
                            layout=DualChunk(min_chunk_tokens=4))
        with AllReduceCounter() as c:
            for _step in range(2):
                q, k, v, dout = _local(plan, inputs)
                x = q
                for mask in (CAUSAL, CHUNK, CAUSAL):   # e.g. Llama 4's chunked : global
                    x = cp_varlen_attn(x, k, v, plan, mask, None,
                                       AttnOptions(strategy=strategy))
                x.backward(dout)
            counts[f"{strategy}/steps"] = list(c.calls)
            module = ContextParallelVarlenAttention(CHUNK, AttnOptions(strategy=strategy))
            module(*_local(plan, inputs, grad=False)[:3], plan)
            counts[f"{strategy}/module"] = len(c.calls)
            fresh = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank,
                                 layout=DualChunk(min_chunk_tokens=4))
            cp_varlen_attn(*_local(fresh, inputs, grad=False)[:3], fresh, CAUSAL, None,
                           AttnOptions(strategy=strategy))
            cp_varlen_attn(*_local(fresh, inputs, grad=False)[:3], fresh, CHUNK, None,
                           AttnOptions(strategy=strategy))
            counts[f"{strategy}/new_plan"] = len(c.calls)
            unchecked = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank)
            cp_varlen_attn(*_local(unchecked, inputs, grad=False)[:3], unchecked, CAUSAL,
                           None, AttnOptions(strategy=strategy, validate=False))
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
        return cp_varlen_attn(q, k, v, plan, CAUSAL, cp,
                              AttnOptions(strategy="a2a+p2p", a2a_size=2))

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


@pytest.mark.slow  # waits out a collective timeout
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


# ======================================================================================
# 3. Bad arguments: a ValueError naming the field, before any computation or collective
# ======================================================================================
def _cp1(docs=(5, 9), hq=4, hkv=2, layout="dual_chunk"):
    plan = CPPlan.build(_cu(list(docs)), cp_size=1, cp_rank=0, layout=layout)
    return plan, _local(plan, _inputs(sum(docs), hq, hkv), grad=False)[:3]


BAD_SCALES = [float("inf"), float("-inf"), float("nan"), 10 ** 400, 1e39, 1e-50, 0.0, -1.0,
              True, "0.1", torch.tensor(0.1)]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=lambda s: repr(s)[:12])
def test_softmax_scale_must_be_finite_and_positive_in_fp32(scale, one_thread):
    """inf passed before (7603d2c); 10**400 raised OverflowError; 1e39 and 1e-50 are inf and
    0 in the kernels' fp32 (NaN / uniform attention)."""
    plan, (q, k, v) = _cp1()
    with pytest.raises(ValueError, match="softmax_scale"):
        cp_varlen_attn(q, k, v, plan, CAUSAL, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        ContextParallelVarlenAttention(CAUSAL, softmax_scale=scale)


@pytest.mark.parametrize("shapes, name", [
    (((0, 4, 8), (0, 2, 8), (0, 2, 8)), None),                # no tokens: fine
    (((14, 0, 8), (14, 2, 8), (14, 2, 8)), "q"),              # Hq = 0 returned [14, 0, 8]
    (((14, 4, 8), (14, 0, 8), (14, 0, 8)), "k"),
    (((14, 4, 0), (14, 2, 0), (14, 2, 8)), "q"),              # D = 0: ZeroDivisionError
    (((14, 4, 8), (14, 2, 8), (14, 2, 0)), "v"),              # Dv = 0 returned [14, 4, 0]
])
def test_empty_heads_and_head_dims_are_rejected(shapes, name, one_thread):
    plan = CPPlan.build(_cu([5, 9] if shapes[0][0] else []), cp_size=1, cp_rank=0)
    q, k, v = (torch.randn(s) for s in shapes)
    if name is None:
        assert cp_varlen_attn(q, k, v, plan, CAUSAL).shape == (0, 4, 8)
        return
    with pytest.raises(ValueError, match=f"^{name} must have at least one head"):
        cp_varlen_attn(q, k, v, plan, CAUSAL)


class DeviceMesh:  # stands in for torch's (whose construction needs a process group)
    pass


BAD_GROUPS = [3, "cp", [0, 1], DeviceMesh()]


@pytest.mark.parametrize("group", BAD_GROUPS, ids=lambda g: type(g).__name__)
def test_group_of_another_type_is_rejected_at_cp1(group, one_thread):
    """Before (7603d2c) plan.unshard(group=3) said 'not initialized' and the module took
    any group until its first forward."""
    plan, (q, k, v) = _cp1()
    match = "^group must be a torch.distributed.ProcessGroup or None, got " + \
        type(group).__name__
    for fn in (lambda: cp_varlen_attn(q, k, v, plan, CAUSAL, group),
               lambda: ContextParallelVarlenAttention(CAUSAL, group=group),
               lambda: plan.unshard(q, group=group)):
        with pytest.raises(ValueError, match=match):
            fn()
    if isinstance(group, DeviceMesh):
        with pytest.raises(ValueError, match=r"get_group\(\)"):
            plan.unshard(q, group=group)


# (strategy, options, Hq, Hkv): options invalid in themselves, whatever the cp; each must
# raise the same ValueError at cp 1 (no process group) as at cp 2.
OPTION_CASES = {
    "a2a_size with p2p": ("p2p", {"a2a_size": 1}, 4, 2),
    "a2a_size with all_gather": ("all_gather", {"a2a_size": 2}, 4, 2),
    "a2a_size with a2a": ("a2a", {"a2a_size": 1}, 4, 2),
    "a2a_size with dispatch": ("dispatch", {"a2a_size": 1}, 4, 2),
    "a2a_size with auto": ("auto", {"a2a_size": 1}, 4, 2),
    "a2a_size 0": ("a2a+p2p", {"a2a_size": 0}, 4, 2),
    "a2a_size True": ("a2a+p2p", {"a2a_size": True}, 4, 2),
    "a2a_size '1'": ("a2a+p2p", {"a2a_size": "1"}, 4, 2),
    "a2a_size 1.0": ("a2a+p2p", {"a2a_size": 1.0}, 4, 2),
    "a2a_size 3 (no divisor)": ("a2a+p2p", {"a2a_size": 3}, 6, 3),
    "GQA 3/2 a2a": ("a2a", {}, 3, 2),
    "ok: a2a+p2p a2a_size 1": ("a2a+p2p", {"a2a_size": 1}, 3, 1),
}


def _option_outcomes(rank, world):
    outcomes = {}
    for name, (strategy, opts, hq, hkv) in OPTION_CASES.items():
        plan = CPPlan.build(_cu([5, 9]), cp_size=world, cp_rank=rank)
        q, k, v, _ = _local(plan, _inputs(14, hq, hkv), grad=False)
        outcome = _outcome(lambda: cp_varlen_attn(q, k, v, plan, CAUSAL, None,
                                                  AttnOptions(strategy=strategy, **opts)))
        outcomes[name] = outcome.replace(f"cp_size={world}", "cp_size=N")
    return outcomes


def group_worker(rank, world):
    """cp = 2: the option cases, then every entry point with a group of a wrong type."""
    from torch.distributed.device_mesh import init_device_mesh

    options = _option_outcomes(rank, world)
    plan = CPPlan.build(_cu([5, 9]), cp_size=world, cp_rank=rank)
    q, k, v, _ = _local(plan, _inputs(14), grad=False)
    groups = {"int": 3, "str": "cp", "list": [0, 1],
              "DeviceMesh": init_device_mesh("cpu", (world,))}
    groups_out = {}
    for name, group in groups.items():
        groups_out[name] = [
            _outcome(lambda: cp_varlen_attn(q, k, v, plan, CAUSAL, group)),
            _outcome(lambda: ContextParallelVarlenAttention(CAUSAL, group=group)),
            _outcome(lambda: plan.unshard(q, group=group)),
            _outcome(lambda: plan.unshard(q.unsqueeze(0), group, dim=1)),
        ]
    # Nothing was half-communicated: the group still works.
    ok = torch.equal(plan.unshard(q), _inputs(14)[0])
    return options, groups_out, ok


def test_options_raise_at_cp1_as_at_cp2_and_groups_are_checked(tmp_path, one_thread):
    """Before (7603d2c) cp == 1 returned before the strategy's checks: a2a_size 0, True,
    '1', 1.0 or 3 ran silently at cp 1 and raised at cp 2."""
    cp1 = _option_outcomes(0, 1)
    results = run_distributed(group_worker, 2, tmp_path, timeout_s=120,
                              collective_timeout_s=20)
    for rank, (cp2, groups, ok) in enumerate(results):
        assert ok, f"rank {rank}: the group is unusable after the rejected calls"
        for name in OPTION_CASES:
            want = "ok" if name.startswith("ok") else "ValueError: "
            assert cp1[name].startswith(want), (name, cp1[name])
            assert cp2[name] == cp1[name], f"{name}: cp 1 -> {cp1[name]}; cp 2 -> {cp2[name]}"
        for name, outcomes in groups.items():
            for outcome in outcomes:
                assert outcome.startswith("ValueError: group must be a torch.distributed."
                                          "ProcessGroup or None, got " + name), outcome


def test_plan_build_rejects_batches_beyond_its_int32_tables(one_thread):
    """Checked before any table is allocated: before, 2**40 tokens tried to allocate 8 TB
    (RuntimeError), and a document of 2**30 + 1 tokens overflowed the kernels' positions."""
    for docs, match in (([1 << 40], "document 0 has"), ([5, (1 << 30) + 1], "document 1 has"),
                        ([1 << 30, 1 << 30], "2147483648 tokens")):
        start = time.monotonic()
        with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
            CPPlan.build(_cu(docs), cp_size=2, cp_rank=0)
        assert time.monotonic() - start < 5
    # te pads every document up to a multiple of 2*cp: the padded total counts.
    with pytest.raises(ValueError, match=r"cu_seqlens \(padded\)"):
        CPPlan.build(_cu([(1 << 30) - 1, (1 << 30) - 1]), cp_size=4, cp_rank=0, layout="te")


def test_module_checks_its_options_when_built(one_thread):
    """Before, these passed the constructor and failed at the first forward."""
    with pytest.raises(ValueError, match="group"):
        ContextParallelVarlenAttention(CAUSAL, group=3)
    for kw, match in (({"backend": "cuda"}, "backend"),
                      ({"strategy": "p2p", "a2a_size": 2}, "a2a_size applies"),
                      ({"strategy": "a2a+p2p", "a2a_size": 0}, "a2a_size"),
                      ({"validate": 1}, "validate"), ({"strategy": "ring"}, "strategy")):
        with pytest.raises(ValueError, match=match):   # the options, checked when built
            ContextParallelVarlenAttention(CAUSAL, AttnOptions(**kw))


def test_plan_and_sharding_reject_bad_arguments(one_thread):
    from varlen_cp.sharding import cu_seqlens_from_positions, shard_packed_batch

    plan = CPPlan.build(_cu([5, 3]), cp_size=2, cp_rank=0, layout="te")
    batch = {"input": torch.zeros(1, 8, dtype=torch.long),
             "labels": torch.zeros(1, 8, dtype=torch.long)}
    # 1.5 became label 1 on padding rows (trained on); 'x' raised TypeError.
    for bad in (1.5, "x", None, True):
        with pytest.raises(ValueError, match="ignore_index"):
            shard_packed_batch(batch, plan, ignore_index=bad)
    # seq_dim beyond every tensor left the whole batch on every rank, silently.
    with pytest.raises(ValueError, match="seq_dim=2"):
        shard_packed_batch(batch, plan, seq_dim=2)
    # A padding marker joined the document before it.
    with pytest.raises(ValueError, match=r"positions\[2\]=-1"):
        cu_seqlens_from_positions(torch.tensor([0, 1, -1, -1, 0, 1]))
    # Parts that differ in dtype were promoted; in other dims, torch.cat's RuntimeError.
    n0, n1 = plan.num_tokens_of(0), plan.num_tokens_of(1)
    for part1 in (torch.zeros(n1, 2, dtype=torch.long), torch.zeros(n1, 3)):
        with pytest.raises(ValueError, match=r"parts\[1\]"):
            plan.unshard_parts([torch.zeros(n0, 2), part1])


def test_prepare_rejects_bad_arguments(one_thread):
    """build_layer_tables / build_tables run ahead of the step (a background thread): a bad
    argument must fail there as the call would, not as an AttributeError or later."""
    from varlen_cp.attention import build_layer_tables
    from varlen_cp.config import CPConfig
    from varlen_cp.prefetch import AttnShape, build_tables

    plan = CPPlan.build(_cu([5, 9]), cp_size=2, cp_rank=0)
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    p2p = AttnOptions()
    cases = [lambda: (plan, CAUSAL, p2p, {"n_heads": 4}, "cpu"), "shape",
             lambda: ("plan", CAUSAL, p2p, shape, "cpu"), "plan",
             lambda: (plan, "causal", p2p, shape, "cpu"), "mask",
             lambda: (plan, CAUSAL, p2p, shape, "gpu:x"), "device",
             lambda: (plan, CAUSAL, "p2p", shape, "cpu"), "options must be",
             lambda: (plan, CAUSAL, AttnOptions(backend="cuda"), shape, "cpu"), "backend",
             lambda: (plan, CAUSAL, AttnOptions(a2a_size=2), shape, "cpu"), "a2a_size applies",
             lambda: (plan, CAUSAL, AttnOptions(strategy="a2a+p2p", a2a_size=3), shape, "cpu"),
             "a2a_size",
             lambda: (plan, CAUSAL, AttnOptions(strategy="a2a"),
                      AttnShape(n_heads=3, n_kv_heads=1, head_dim=8), "cpu"), "Hq=3"]
    if not torch.cuda.is_available():
        cases += [lambda: (plan, CAUSAL, p2p, shape, "cuda"), "CUDA is not available"]
    for args, match in zip(cases[::2], cases[1::2]):
        with pytest.raises(ValueError, match=match):
            build_layer_tables(*args())
    with pytest.raises(ValueError, match="Hq=3"):
        build_tables(plan, CPConfig(strategy="a2a"), [(CAUSAL, 1)],
                     AttnShape(n_heads=3, n_kv_heads=1, head_dim=8), "cpu")


# ======================================================================================
# Edge batches: empty, all padding (with NaN in the padding rows), 100K documents
# ======================================================================================
SWA = AttnMask(causal=False, window_size=(3, 2))


def _reference(inputs, docs, mask):
    """Single-device op on the global batch: out, lse, dq, dk, dv."""
    q, k, v, dout = inputs
    cu = _cu(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    longest = max(docs, default=0)
    out, lse = varlen_attn(q, k, v, cu, cu, longest, longest, None, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True,
                           backend="torch")
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _cp_case(plan, inputs, docs, mask, strategy, group=None, poison=float("nan")):
    """CP forward + backward with ``poison`` in every padding row of q, k, v and dout; the
    problems found (empty when the result is the reference's, padding rows 0 / -inf)."""
    q, k, v, dout = (plan.shard(t) for t in inputs)
    pad = plan.token_indices < 0
    for t in (q, k, v, dout):
        t[pad] = poison
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = cp_varlen_attn(q, k, v, plan, mask, group, AttnOptions(strategy=strategy),
                              return_lse=True)
    out.backward(dout)
    local = (out.detach(), lse.detach(), q.grad, k.grad, v.grad)
    errors = []
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), local):
        if torch.isnan(t).any():
            errors.append(f"{name} has NaN")
        rows = t[:, pad] if name == "lse" else t[pad]
        want = float("-inf") if name == "lse" else 0.0
        if not bool((rows == want).all()):
            errors.append(f"padding rows of {name} are not {want}")
    gather = (lambda t: plan.unshard(t)) if plan.cp_size > 1 else \
        (lambda t: plan.unshard_parts([t]))
    got = [gather(local[0]), gather(local[1].t().contiguous()).t()] + \
        [gather(g) for g in local[2:]]
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, _reference(inputs, docs, mask)):
        try:
            torch.testing.assert_close(g, r, atol=3e-5, rtol=3e-4)
        except AssertionError as e:
            errors.append(f"{name} differs from the single-device op: "
                          f"{str(e).splitlines()[1:3]}")
    return errors


EDGE_BATCHES = {
    "empty": ([], "dual_chunk"),
    "empty_docs": ([0, 0, 0], "te"),
    "padding_only_rank": ([1, 1], "te"),     # te at cp 2: rank 1 holds 4 padding rows
    "padded_mix": ([3, 17, 1, 6], "te"),
}


def edge_worker(rank, world):
    errors = []
    for name, (docs, layout) in EDGE_BATCHES.items():
        plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout=layout)
        inputs = _inputs(sum(docs), seed=len(docs))
        for strategy in ALL:
            for mask in (CAUSAL, SWA):
                errors += [f"{name} {strategy} {mask}: {e}"
                           for e in _cp_case(plan, inputs, docs, mask, strategy)]
    return errors


def test_edge_batches(tmp_path, one_thread):
    """Empty batches, a rank that holds only padding, NaN in every padding row of q, k, v
    and dout: the single-device result, padding rows out 0 / lse -inf / gradients 0."""
    errors = []
    for name, (docs, layout) in EDGE_BATCHES.items():   # cp == 1 (te pads to 2 there)
        plan = CPPlan.build(_cu(docs), cp_size=1, cp_rank=0, layout=layout)
        inputs = _inputs(sum(docs), seed=len(docs))
        errors += [f"cp1 {name}: {e}" for e in _cp_case(plan, inputs, docs, CAUSAL, "p2p")]
    for rank, errs in enumerate(run_distributed(edge_worker, 2, tmp_path, timeout_s=150,
                                                collective_timeout_s=30)):
        errors += [f"rank {rank} {e}" for e in errs]
    assert not errors, "\n".join(errors)


N_DOCS = 100_000


def _many_docs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 3, (N_DOCS,), generator=g).tolist()   # ~100K tokens, empties


def many_docs_worker(rank, world):
    docs = _many_docs()
    inputs = _inputs(sum(docs), hq=2, hkv=1, seed=3)
    start = time.monotonic()
    plan = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank)
    times = {"build": time.monotonic() - start}
    errors = []
    for strategy in ALL:
        start = time.monotonic()
        errors += [f"{strategy}: {e}" for e in _cp_case(plan, inputs, docs, CAUSAL, strategy)]
        times[strategy] = time.monotonic() - start
    return errors, times


@pytest.mark.slow
def test_100k_documents(tmp_path, one_thread):
    """100K documents (~100K tokens, a third of them empty) through every strategy at cp 2:
    the single-device result; the plan's build stays a host matter of seconds."""
    results = run_distributed(many_docs_worker, 2, tmp_path, timeout_s=300,
                              collective_timeout_s=120)
    errors = [f"rank {r} {e}" for r, (errs, _) in enumerate(results) for e in errs]
    assert not errors, "\n".join(errors)
    for rank, (_, times) in enumerate(results):
        assert times["build"] < 30, f"rank {rank}: plan build took {times['build']:.1f} s"
