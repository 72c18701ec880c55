"""The graph-safe mode (``AttnOptions(graph_safe=True)``, ``varlen_cp.strategies.static``)
on gloo, at cp 2 and 4, for every graph-safe strategy x mask x layout of the CP grid:

- (plans as the CP grid builds them, the rows padded by the caller; for two masks, plans
  built at the capacity, ``CPPlan.build(capacity=...)``, as the integrations build them)
- a step (forward and backward, with LSE gradients) on batch A, recorded from the
  dispatcher (``tests.helpers.replay.DeviceWork``), equals the single-device op;
- batch B (other documents) written IN PLACE into the same inputs and buffers, recorded
  again: the identical sequence of ops, on the identical storages, with the identical
  scalar arguments and collective sizes, and no tensor from outside the step; it equals the
  single-device op on B;
- re-running batch A's recording on the refreshed buffers (what a CUDA graph replay does)
  gives batch B's results exactly.

The dynamic strategies fail the same check (their recordings differ between two batches
that give every rank the same token count), so the check can fail; a batch in which a rank
holds more than the capacity is refused on every rank, before any communication.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers.cp_grid import (DV, HEADS, MASKS, D, compare_fp32, cu, global_inputs,
                                   small_plan)
from tests.helpers.replay import DeviceWork
from varlen_cp import AttnOptions, CPPlan, cp_varlen_attn
from varlen_cp.attention import build_layer_tables, refresh_layer_buffers
from varlen_cp.kernels import varlen_attn
from varlen_cp.options import GRAPH_SAFE_STRATEGIES
from varlen_cp.plan import layout_spec
from varlen_cp.plan.agreement import agree_on_plan
from varlen_cp.shape import AttnShape
from varlen_cp.strategies.a2a_p2p import ulysses_subgroup
from varlen_cp.tables.selected import fetch_count_array
from varlen_cp.plan.capacity import default_capacity

BATCH_A = [1, 2, 37, 9, 0, 130, 5, 23]         # 207 tokens (the CP grid's batch)
BATCH_B = [60, 3, 71, 1, 40, 32]               # 207 tokens, other documents
LAYOUTS = ("balanced", "dual_chunk", "te", "contiguous")


def reference(inputs, docs, mask):
    """The single-device op on the whole batch: out, lse, dq, dk, dv, with the LSE's
    gradient too."""
    q, k, v, dout, dlse = inputs
    c = cu(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, c, c, max(docs), max(docs), None, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True,
                           backend="torch")
    torch.autograd.backward((out, lse), (dout, dlse))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def batch_inputs(docs, hq, hkv, seed):
    q, k, v, dout = global_inputs(docs, hq, hkv, seed)
    dlse = torch.randn(hq, sum(docs), generator=torch.Generator().manual_seed(seed + 99))
    return q, k, v, dout, dlse


class Step:
    """One layer's inputs at capacity, allocated once (the graph's static inputs)."""

    def __init__(self, cap: int, hq: int, hkv: int) -> None:
        self.q = torch.zeros(cap, hq, D, requires_grad=True)
        self.k = torch.zeros(cap, hkv, D, requires_grad=True)
        self.v = torch.zeros(cap, hkv, DV, requires_grad=True)
        self.dout = torch.zeros(cap, hq, DV)
        self.dlse = torch.zeros(hq, cap)

    def load(self, plan, inputs) -> None:
        """Batch ``plan``'s rows written in place; unused slots zero."""
        n = plan.num_tokens
        with torch.no_grad():
            for static, full in zip((self.q, self.k, self.v, self.dout), inputs):
                static.zero_()
                static[:n] = plan.shard(full)
            self.dlse.zero_()
            self.dlse[:, :n] = plan.shard(inputs[4].t().contiguous()).t()
        for t in (self.q, self.k, self.v):
            t.grad = None

    def run(self, plan, mask, options):
        out, lse = cp_varlen_attn(self.q, self.k, self.v, plan, mask, None, options,
                                  return_lse=True)
        torch.autograd.backward((out, lse), (self.dout, self.dlse))
        return out, lse, self.q.grad, self.k.grad, self.v.grad


def _prepare(plan, mask, options, step):
    """What the step's planner and sharding do before the step: the tables, the device
    buffers refreshed for the plan and the plan agreement; and what a capture follows,
    one eager step: here the Ulysses sub-groups' creation."""
    shape = AttnShape.of(step.q, step.k, step.v)
    cpu = torch.device("cpu")
    build_layer_tables(plan, mask, options, shape, cpu)
    refresh_layer_buffers(plan, mask, options, shape, cpu)
    agree_on_plan(plan, None)
    if options.strategy == "a2a+p2p" and 1 < HYBRID_SIZE < plan.cp_size:
        ulysses_subgroup(dist.group.WORLD, HYBRID_SIZE)


def _results(plan, res):
    """(out, lse, dq, dk, dv) of the real rows, in global order (every rank)."""
    n = plan.num_tokens
    out, lse, dq, dk, dv = (t.detach() for t in res)
    return (plan.unshard(out[:n]), plan.unshard(lse[:, :n].t().contiguous()).t(),
            plan.unshard(dq[:n]), plan.unshard(dk[:n]), plan.unshard(dv[:n]))


def _unused_slots(plan, res, what):
    """Unused slots (past the plan's rows, and its padding rows): out 0, lse -inf,
    gradients 0."""
    out, lse, dq, dk, dv = (t.detach() for t in res)
    pad = torch.ones(out.shape[0], dtype=torch.bool)
    pad[:plan.num_tokens] = plan.token_indices < 0
    errors = []
    if not (bool((out[pad] == 0).all()) and bool(torch.isneginf(lse[:, pad]).all())):
        errors.append(f"{what}: unused slots' out / lse")
    if not all(bool((g[pad] == 0).all()) for g in (dq, dk, dv)):
        errors.append(f"{what}: unused slots' gradients")
    return errors


ALL_CASES = [(s, lay, m) for s in GRAPH_SAFE_STRATEGIES for lay in LAYOUTS for m in MASKS]
# The Triton row kernels run by the interpreter (slow per tile): every strategy on the two
# layouts whose rows differ most (te: padding rows inside a rank's rows), a mask without
# and one with the tiles of one block reaching into several documents' chunks.
TRITON_CASES = [(s, lay, m) for s in GRAPH_SAFE_STRATEGIES for lay in ("balanced", "te")
                for m in ("chunk_causal", "swa2")]


def graph_safe_worker(rank, world, backend="torch", cases=None):
    errors, n = [], 0
    for i, (name, layout, mname) in enumerate(ALL_CASES if cases is None else cases):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        plans = [small_plan(docs, world, rank, layout, mask) for docs in (BATCH_A, BATCH_B)]
        cap = max(default_capacity(p.padded_total_tokens, world) for p in plans)
        if mname in AT_CAPACITY:   # plans built at the capacity: the integrations' way
            plans = [_at_capacity(docs, world, rank, layout, mask, cap)
                     for docs in (BATCH_A, BATCH_B)]
        extra = {}
        if name == "a2a+p2p":    # groups of 2: Ulysses inside, the ring across (cp 4)
            extra["a2a_size"] = HYBRID_SIZE
        if name == "dispatch":   # the most keys one rank sends another, in either batch
            extra["graph_send_capacity"] = max(_most_sent(p, mask) for p in plans)
        options = AttnOptions(strategy=name, graph_safe=True, graph_capacity=cap,
                              backend=backend, **extra)
        step = Step(cap, hq, hkv)
        what = f"[{name} {layout} {mname} cp {world}]"
        recordings, results = [], []
        for plan, docs, seed in zip(plans, (BATCH_A, BATCH_B), (i, i + 1000)):
            inputs = batch_inputs(docs, hq, hkv, seed)
            step.load(plan, inputs)
            _prepare(plan, mask, options, step)
            with DeviceWork([step.q, step.k, step.v, step.dout, step.dlse] +
                            _buffers(plan, mask, options)) as rec:
                res = step.run(plan, mask, options)
            recordings.append(rec)
            results.append(res)
            errors += compare_fp32(_results(plan, res), reference(inputs, docs, mask),
                                   f"{what} batch {len(results)}")
            errors += _unused_slots(plan, res, what)
        first, second = recordings
        if first.signature() != second.signature():
            errors.append(f"{what}: the two batches' device work differs "
                          f"({_first_difference(first, second)})")
        if first.externs():
            errors.append(f"{what}: tensors from outside the step: {first.externs()[:2]}")
        outs = first.replay()       # batch A's recording on batch B's buffers
        for got, want, label in zip((first.replayed(outs, t) for t in results[0]),
                                    results[1], ("out", "lse", "dq", "dk", "dv")):
            if not torch.equal(got, want.detach()):
                errors.append(f"{what}: replay {label} differs from batch B's step")
        n += 1
    assert not errors, "\n".join(errors[:20])
    return n


HYBRID_SIZE = 2
AT_CAPACITY = ("swa", "chunk")   # masks whose cases run on plans built at the capacity


def _at_capacity(docs, world, rank, layout, mask, cap):
    spec = {"dual_chunk": {"min_chunk_tokens": 4},
            "balanced": {"masks": mask, "tile_tokens": 8}}.get(layout, {})
    return CPPlan.build(cu(docs), cp_size=world, cp_rank=rank,
                        layout=layout_spec(layout, **spec), capacity=cap)


def _most_sent(plan, mask):
    counts = fetch_count_array(plan, mask).copy()
    counts.flat[::counts.shape[0] + 1] = 0
    return max(1, int(counts.max()))


def _buffers(plan, mask, options):
    """The step's device buffers (static: refreshed in place)."""
    from varlen_cp.strategies.static import dispatch_buffers, static_buffers
    cap, cpu = options.graph_capacity, torch.device("cpu")
    out = [static_buffers(plan, cap, cpu).table]
    if options.graph_send_capacity is not None:
        sent = dispatch_buffers(plan, mask, cap, options.graph_send_capacity, cpu)
        out += [sent.send, sent.recv]
    return out


def _first_difference(a, b) -> str:
    sa, sb = a.signature(), b.signature()
    if len(sa) != len(sb):
        return f"{len(sa)} vs {len(sb)} ops"
    for i, (x, y) in enumerate(zip(sa, sb)):
        if x != y:
            return f"op {i}: {x[0]} {x[1][:3]} vs {y[0]} {y[1][:3]}"
    return "?"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_graph_safe_steps_replay_with_other_documents(tmp_path, world):
    results = run_distributed(graph_safe_worker, world, tmp_path)
    assert results == [len(ALL_CASES)] * world


@pytest.mark.slow
def test_graph_safe_triton_steps_replay_with_other_documents(tmp_path):
    """The same checks on the Triton row kernels (their launches are custom ops: the
    recording holds them with every host argument, the replay re-runs them)."""
    results = run_distributed(graph_safe_worker, 2, tmp_path, "triton", TRITON_CASES)
    assert results == [len(TRITON_CASES)] * 2


def dynamic_worker(rank, world):
    """The dynamic strategies on two batches that give every rank the same token count
    (``contiguous``): their recordings differ (the check above can fail)."""
    from varlen_cp.options import STRATEGY_CHOICES
    same = []
    mask = MASKS["causal"]
    for name in STRATEGY_CHOICES:
        options = AttnOptions(strategy=name, backend="torch")
        recordings = []
        for docs, seed in ((BATCH_A, 0), (BATCH_B, 1)):
            plan = small_plan(docs, world, rank, "contiguous", mask)
            inputs = batch_inputs(docs, 4, 2, seed)
            step = Step(plan.num_tokens, 4, 2)
            step.load(plan, inputs)
            agree_on_plan(plan, None)
            build_layer_tables(plan, mask, options, AttnShape.of(step.q, step.k, step.v),
                               torch.device("cpu"))
            with DeviceWork([step.q, step.k, step.v, step.dout, step.dlse]) as rec:
                step.run(plan, mask, options)
            recordings.append(rec)
        first, second = recordings
        if first.signature() == second.signature() and not first.externs():
            same.append(name)
    return same


def test_dynamic_strategies_issue_other_work_per_batch(tmp_path):
    assert run_distributed(dynamic_worker, 2, tmp_path) == [[], []]


def over_capacity_worker(rank, world, cap, extra):
    """A capacity below what the batch needs: ValueError on every rank, nothing
    communicated."""
    from tests.helpers.guards import no_communication
    mask = MASKS["causal"]
    plan = small_plan(BATCH_A, world, rank, "contiguous", mask)
    options = AttnOptions(graph_safe=True, graph_capacity=cap, **extra)
    step = Step(cap, 4, 2)
    with no_communication():
        try:
            cp_varlen_attn(step.q, step.k, step.v, plan, mask, None, options)
        except ValueError as e:
            return str(e)
    return None


@pytest.mark.parametrize("cap, extra, message", [
    (64, {"strategy": "all_gather"}, ("graph_capacity=64", "rank 1 holds 104")),
    (128, {"strategy": "dispatch", "graph_send_capacity": 8},
     ("graph_send_capacity=8", "rank 1 needs 54 keys of rank 0")),
])
def test_a_batch_over_capacity_is_refused_on_every_rank(tmp_path, cap, extra, message):
    """Every rank holds 103 or 104 tokens; rank 1 needs 54 keys of rank 0."""
    for e in run_distributed(over_capacity_worker, 2, tmp_path, cap, extra):
        assert e is not None and all(m in e for m in message), e


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "p2p", "graph_safe": True, "graph_send_capacity": 8},
     "graph_send_capacity applies to strategy 'dispatch' only"),
    ({"strategy": "dispatch", "graph_send_capacity": 8}, "graph_send_capacity applies with"),
    ({"strategy": "auto", "graph_safe": True}, "graph_safe=True runs strategy"),
    ({"strategy": "all_gather", "graph_capacity": 64}, "graph_capacity applies with"),
    ({"strategy": "all_gather", "graph_safe": True, "graph_capacity": 0}, "graph_capacity"),
    ({"strategy": "all_gather", "graph_safe": True, "overlap_stages": 2}, "overlap_stages"),
    ({"strategy": "a2a", "graph_safe": "yes"}, "graph_safe"),
    ({"strategy": "p2p", "graph_safe": True, "backend": "flash"}, "graph_safe=True runs backend"),
    ({"strategy": "p2p", "graph_safe": True, "backend": "fa4"}, "graph_safe=True runs backend"),
])
def test_graph_safe_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttnOptions(**kwargs)


def test_graph_safe_backends_and_wrong_row_counts():
    """"auto" runs the Triton row kernels on CUDA and the dense kernel elsewhere; "triton"
    on a CPU needs the interpreter (on in the tests); a call of other rows than the
    capacity is refused."""
    from varlen_cp.resolve import resolve
    mask = MASKS["causal"]
    plan = small_plan(BATCH_A, 1, 0, "contiguous", mask)
    options = AttnOptions(strategy="all_gather", graph_safe=True, graph_capacity=256)
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=D, head_dim_v=DV,
                      dtype=torch.float32)
    assert resolve(plan, mask, options, shape, torch.device("cuda", 0)).backend == "triton"
    assert resolve(plan, mask, options, shape, torch.device("cpu")).backend == "torch"
    triton_options = AttnOptions(strategy="all_gather", graph_safe=True, backend="triton")
    assert resolve(plan, mask, triton_options, shape, torch.device("cpu")).backend == "triton"
    step = Step(plan.num_tokens, 4, 2)     # the batch's rows, not the capacity's
    with pytest.raises(ValueError, match="graph_capacity gives rank 0 256 tokens"):
        cp_varlen_attn(step.q, step.k, step.v, plan, mask, None, options)


def test_buffers_are_refreshed_in_place():
    from varlen_cp.strategies.static import static_buffers
    from varlen_cp.tables.static_rows import static_rows
    mask = MASKS["causal"]
    rows = []
    for docs in (BATCH_A, BATCH_B):
        plan = small_plan(docs, 1, 0, "contiguous", mask)
        buf = static_buffers(plan, 256, torch.device("cpu"))
        rows.append((buf.table.untyped_storage().data_ptr(), buf.table.clone()))
        assert torch.equal(buf.table, torch.from_numpy(static_rows(plan, 256)))
    assert rows[0][0] == rows[1][0] and not torch.equal(rows[0][1], rows[1][1])


def test_no_buffer_refresh_inside_a_capture(monkeypatch):
    """A refresh for a new plan during a CUDA graph capture would be baked into the graph
    (every replay rewriting the capture's rows): refused; outside a capture, or on the
    CPU, or for the plan the buffers hold, nothing is refused."""
    from varlen_cp.strategies.static import buffers
    mask = MASKS["causal"]
    plan_a = small_plan(BATCH_A, 1, 0, "contiguous", mask)
    plan_b = small_plan(BATCH_B, 1, 0, "contiguous", mask)
    held = buffers.StaticRows(torch.device("cpu"), 1, 256)   # (not the shared buffers)
    held.refresh(plan_a)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buffers.check_not_capturing(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        buffers.check_not_capturing(torch.device("cuda", 0))
    monkeypatch.setattr(buffers, "check_not_capturing", lambda device: (_ for _ in ()).throw(
        RuntimeError(f"refresh during capture on {device}")))
    held.refresh(plan_a)                              # the plan it holds: no copy, no check
    with pytest.raises(RuntimeError, match="refresh during capture"):
        held.refresh(plan_b)


@pytest.mark.parametrize("name", GRAPH_SAFE_STRATEGIES)
def test_compiled_graph_safe_call_equals_eager_without_recompiling(name):
    """Under torch.compile (aot_eager, fullgraph) the graph-safe call is the custom op with
    its token on q's device: two batches of other documents on plans at one capacity run
    one compiled graph and give the eager results."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    mask = MASKS["chunk_causal"]
    options = AttnOptions(strategy=name, graph_safe=True, graph_capacity=256)
    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, plan):
        out, lse = cp_varlen_attn(q, k, v, plan, mask, None, options, return_lse=True)
        return out, lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for docs, seed in ((BATCH_A, 0), (BATCH_B, 1)):
        plan = CPPlan.build(cu(docs), cp_size=1, cp_rank=0, layout="contiguous",
                            capacity=256)
        q, k, v, dout, dlse = (plan.shard(t) if t.dim() == 3 else t
                               for t in batch_inputs(docs, 4, 2, seed))
        dlse = plan.shard(dlse.t().contiguous()).t().contiguous()
        results = []
        for fn in (step, compiled):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = fn(*leaves, plan)
            torch.autograd.backward((out, lse), (dout, dlse))
            results.append([out.detach(), lse.detach()] + [t.grad for t in leaves])
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def micro_batches_worker(rank, world):
    """Two micro-batches' forwards before either backward (a pipeline schedule): each
    backward reads the rows of its own plan, not the buffers' (refreshed for the second)."""
    errors = []
    mask = MASKS["swa"]
    for name in GRAPH_SAFE_STRATEGIES:
        extra = {"a2a_size": 1} if name == "a2a+p2p" else {}
        options = AttnOptions(strategy=name, graph_safe=True, graph_capacity=128, **extra)
        runs = []
        for docs, seed in ((BATCH_A, 0), (BATCH_B, 1)):
            plan = _at_capacity(docs, world, rank, "contiguous", mask, 128)
            inputs = batch_inputs(docs, 4, 2, seed)
            q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
            out = cp_varlen_attn(q, k, v, plan, mask, None, options)
            runs.append((plan, docs, inputs, out, (q, k, v)))
        for plan, docs, inputs, out, leaves in runs:
            out.backward(plan.shard(inputs[3]))
            ref = reference(inputs[:4] + (torch.zeros_like(inputs[4]),), docs, mask)
            got = (plan.unshard(out.detach()), ref[1]) + tuple(
                plan.unshard(t.grad) for t in leaves)
            errors += compare_fp32(got, ref, f"[{name} {docs[:2]}]")
    assert not errors, "\n".join(errors[:10])
    return len(GRAPH_SAFE_STRATEGIES)


def test_micro_batches_forward_before_backward(tmp_path):
    assert run_distributed(micro_batches_worker, 2, tmp_path) == \
        [len(GRAPH_SAFE_STRATEGIES)] * 2
