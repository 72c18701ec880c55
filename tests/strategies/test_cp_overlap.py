"""Staged dispatch and all_gather: ``overlap_stages`` = S (1: one transfer, one call;
S >= 2: the local keys first, the remote K/V in S - 1 transfers under compute).

Host (no processes): every rank's stage tables, run through a simulated exchange of global
token ids, deliver exactly the keys of each call, the union of the transfers is the remote
keys the queries see, and the backward returns land on the owners' rows of those very
keys (also with nothing to fetch anywhere); the transfer counts add up to the fetch counts
in even pieces; the cost model's staged time is the per-stage max(compute, transfer)
formula (by hand on a toy batch), its default S reacts to the transfer/compute ratio and
never exceeds S = 1's peak memory; ``overlap_stages`` is validated everywhere;
``build_tables`` builds the tables the call reads.

Multi-process (gloo, one pytest item per case, ``test_matches_single_device[cp3-dispatch-te-swa]``,
and one launch per cp 2, 3, 4 for the selected ones, ``helpers.launches``): forward out / LSE and
dq / dk / dv vs the single-device op for both strategies x every layout (balanced,
dual_chunk, te) x mask, S cycling 1, 2, 4 so that each (strategy, layout, mask) meets every
S over the three launches; the bytes each collective really posts equal to
``bytes_sent_per_rank`` in every case; every CP call (the first included) under
``forbid_host_reads``; then the softmax extras (LSE gradient, sinks, max logit) per
strategy x S, and one document per rank (nothing to fetch). The cp-2 launch adds the order
of events (collectives posted / waited and kernel calls, recorded by wrappers): the first
kernel call comes before the last transfer is waited on, and transfer s+1 is in flight
while stage s computes, forward and backward; one fp16 case on the Triton interpreter; and
bad ``overlap_stages`` rejected with every collective patched to raise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.launches import GroupLaunches, assert_case_clean
from tests.helpers.cp_grid import (HEADS, MASKS, NAMES, check_padding, compare_fp32, cu, dense,
                                   gather, global_inputs, single_device, small_plan)
from tests.helpers.guards import ByteCounter, forbid_host_reads, no_communication
from tests.helpers.softmax_extras import (EXTRAS_MASKS, SOFTMAX_TYPES, extras_errors,
                                          extras_inputs, extras_loss, extras_padding_errors,
                                          extras_reference, sink_arg)
from varlen_cp import AttnOptions
from varlen_cp.config import CPConfig
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.tables import selected, staged
from varlen_cp.tables.auto import CostModel
from varlen_cp.shape import AttnShape
from varlen_cp.strategies import get_strategy
from tests.staged_reference import select_keys

DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens, as the other CP tests
D, DV = 32, 16
LAYOUTS = ("balanced", "dual_chunk", "te")
STAGES = (1, 2, 4)
STRATS = ("dispatch", "all_gather")


# ------------------------------------------------------------------ host: the stage tables
def _key_ids(call, cu):
    """Global token id of every key of a kernel call (its cu_k / k_pos)."""
    lens = (call.cu_k[1:] - call.cu_k[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    return cu[doc] + call.k_pos.long()


def _simulate(plan, mask, name, stages):
    """Run every rank's staged tables through an exchange of global token ids; check each
    call's keys, the backward return and the union of the transfers."""
    cp, cu = plan.cp_size, plan.cu_seqlens.long()
    ids = [plan.token_indices_of(r).long() for r in range(cp)]     # -1: padding
    tabs = [staged.staged_tables(name, plan, mask, r, (16, 16), stages) for r in range(cp)]
    n_parts = len(tabs[0].stages)
    assert all(len(t.stages) == n_parts for t in tabs)
    assert n_parts <= staged.transfers(stages)
    got = [[] for _ in range(cp)]
    for p in range(n_parts):
        st = [t.stages[p] for t in tabs]
        for d in range(cp):
            if name == "dispatch":  # owner o sends ids[o][in_rows] grouped by destination
                parts = []
                for o in range(cp):
                    at = sum(st[o].in_splits[:d])
                    parts.append(ids[o][st[o].in_rows[at:at + st[o].in_splits[d]]])
                    assert parts[-1].numel() == st[d].back_splits[o]
                recv = torch.cat(parts)
            else:                   # slice [lo, hi) of every rank's padded rows
                lo, hi = st[d].lo, st[d].hi
                recv = torch.cat([torch.cat([ids[o], torch.full((hi,), -2)])[lo:hi]
                                  for o in range(cp)])
            fetched = recv[st[d].gather]
            assert (fetched >= 0).all()
            got[d].append(fetched)
            if st[d].local_slots is None:
                keys = fetched
            else:                   # S = 1: the local keys share the call
                keys = torch.full((st[d].n_keys,), -3, dtype=torch.long)
                keys[st[d].remote_slots] = fetched
                keys[st[d].local_slots] = ids[d][st[d].local_rows]
            assert keys.numel() == st[d].n_keys
            if st[d].call is None:
                assert keys.numel() == 0
            else:
                assert torch.equal(keys, _key_ids(st[d].call, cu)), (name, p, d)
            # backward: d sends keys[back_order] to the owners; each maps them to its rows
            back = keys[st[d].back_order]
            at = 0
            for o in range(cp):
                block = back[at:at + st[d].back_splits[o]]
                at += st[d].back_splits[o]
                start = sum(st[o].in_splits[:d])
                rows = st[o].in_rows[start:start + st[o].in_splits[d]]
                assert torch.equal(ids[o][rows], block), (name, p, d, o)
    for d in range(cp):
        sel = select_keys(plan, mask, d)
        remote = sel.owner != d
        first = torch.tensor([0] + [plan.num_tokens_of(r) for r in range(cp)]).cumsum(0)
        want = torch.cat(ids)[first[sel.owner[remote]] + sel.row[remote]]
        mine = torch.cat(got[d]) if got[d] else torch.zeros(0, dtype=torch.long)
        assert torch.equal(mine.sort().values, want.sort().values), (name, d)
        local = tabs[d].local
        if stages == 1 and n_parts:
            assert local is None
        elif local is not None:
            assert torch.equal(local.k_pos, plan.positions_of(d))


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", ["balanced", "dual_chunk", "te", "contiguous"])
def test_stage_tables_deliver_exactly_the_keys(layout, cp, one_thread):
    docs = [300, 17, 1, 90, 0, 5, 411]
    plan = small_plan(docs, cp, 0, layout)
    for mname, mask in MASKS.items():
        for name in STRATS:
            for stages in (1, 2, 3, 5):
                _simulate(plan, mask, name, stages)


def test_stage_tables_with_nothing_to_fetch(one_thread):
    """One document per rank: dispatch moves nothing, the local call is the whole
    attention (all_gather still gathers: the collective is what it is)."""
    plan = CPPlan.build(cu([50, 50]), cp_size=2, cp_rank=0, layout="contiguous")
    for stages in (1, 2):
        tab = staged.staged_tables("dispatch", plan, MASKS["causal"], 0, (16, 16), stages)
        assert tab.stages == () and tab.local is not None
        _simulate(plan, MASKS["causal"], "all_gather", stages)


def test_stage_counts(one_thread):
    """Summed over transfers: the fetch counts; dispatch cuts every (rank, owner) list
    evenly; all_gather's slices are equal."""
    plan = small_plan([300, 17, 1, 90, 0, 5, 411], 4, 0, "dual_chunk")
    mask = MASKS["causal"]
    fetch = selected.fetch_counts(plan, mask).clone()
    fetch.fill_diagonal_(0)
    for stages in (1, 2, 3, 4, 7):
        for name in STRATS:
            c = staged.stage_counts(name, plan, mask, stages)
            assert torch.equal(c.sum(0), fetch), (name, stages)
        pieces = staged.dispatch_stage_counts(plan, mask, stages)          # [P, d, o]
        assert (pieces.max(0).values - pieces.min(0).values <= 1).all()
        sizes = [hi - lo for lo, hi in staged.gather_stage_rows(plan, stages)]
        assert max(sizes) - min(sizes) <= 1
    # 1000 rows over 7 stages that no one fills: empty stages are dropped everywhere
    tiny = CPPlan.build(cu([6]), cp_size=2, cp_rank=0, layout="contiguous")
    assert staged.dispatch_stage_counts(tiny, mask, 7).shape[0] == 3


def test_staged_time_by_hand(one_thread):
    """One 400-token document, contiguous over 4 ranks, causal window 7: ranks 1..3 fetch
    the 7 keys before their slice (28 visible pairs with them), rank 0 nothing. S = 1 is
    transfer + compute; S = 2 overlaps the transfer with the local call."""
    plan = CPPlan.build(cu([400]), cp_size=4, cp_rank=0, layout="contiguous")
    mask = AttnMask(causal=True, window_size=(7, 0))
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=64, head_dim_v=64, dtype=torch.bfloat16)
    model = CostModel(flops_per_s=1e12, bytes_per_s=1e9, stage_latency_s=1e-6,
                      memory_bytes_per_s=1e11)
    row = shape.kv_row
    f_fwd, f_bwd = 2 * 128 * 8, (6 * 64 + 4 * 64) * 8
    local = plan.work_per_rank(mask)[1] - 28          # ranks 1..3: 100 queries, 28 remote pairs
    elems = 100 * 8 * 64
    for name in STRATS:
        x = (7 if name == "dispatch" else 3 * 100) * row / 1e9     # all_gather: all rows
        y = 7 * row / 1e9                                           # dK/dV returns
        one = staged.staged_time(name, plan, mask, shape, model, 1)
        assert one.stages == 1
        assert one.forward_s == pytest.approx(x + (local + 28) * f_fwd / 1e12)
        assert one.backward_s == pytest.approx((local + 28) * f_bwd / 1e12 + y)
        two = staged.staged_time(name, plan, mask, shape, model, 2)
        assert two.stages == 2
        c0 = local * f_fwd / 1e12 + 2 * 6 * elems / 1e11     # + out to fp32 and back
        c1 = 28 * f_fwd / 1e12 + 18 * elems / 1e11 + 1e-6     # + fold + latency
        b0 = local * f_bwd / 1e12 + 2 * 6 * elems / 1e11
        b1 = 28 * f_bwd / 1e12 + 10 * elems / 1e11 + 1e-6
        assert two.forward_s == pytest.approx(max(c0, x) + c1)
        assert two.backward_s == pytest.approx(b1 + max(b0, y))
    # Slow links: stages hide the transfer; fast links: one call, no fold.
    plan = CPPlan.build(cu([4096] * 4), cp_size=4, cp_rank=0, layout="dual_chunk")
    big = AttnShape(n_heads=32, n_kv_heads=8, head_dim=128, head_dim_v=128, dtype=torch.bfloat16)
    causal = AttnMask(causal=True)
    slow = CostModel(flops_per_s=4e14, bytes_per_s=1e10)
    s = staged.default_stages(plan, causal, "dispatch", big, slow)
    assert s > 1
    assert max(staged.staged_memory("dispatch", plan, causal, big, s).peak) <= \
        max(staged.staged_memory("dispatch", plan, causal, big, 1).peak)
    assert staged.staged_time("dispatch", plan, causal, big, slow, s).seconds < \
        staged.staged_time("dispatch", plan, causal, big, slow, 1).seconds
    fast = CostModel(flops_per_s=4e14, bytes_per_s=1e14)
    assert staged.default_stages(plan, causal, "dispatch", big, fast) == 1


def test_overlap_stages_is_validated():
    plan = CPPlan.build(cu([3]), cp_size=1, cp_rank=0)
    q = torch.zeros(3, 2, D)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="overlap_stages"):
            AttnOptions(strategy="dispatch", overlap_stages=bad)
        with pytest.raises(ValueError, match="overlap_stages"):
            CPConfig(strategy="dispatch", overlap_stages=bad)
    for strategy in ("p2p", "a2a", "a2a+p2p"):
        with pytest.raises(ValueError, match="overlap_stages applies"):
            AttnOptions(strategy=strategy, overlap_stages=2)
        with pytest.raises(ValueError, match="overlap_stages applies"):
            CPConfig(strategy=strategy, overlap_stages=2)
    for strategy in ("dispatch", "all_gather", "auto"):
        assert CPConfig(strategy=strategy, overlap_stages=3).attn_options == \
            AttnOptions(strategy=strategy, overlap_stages=3)
        cp_varlen_attn(q, q, q, plan, AttnMask(), None,
                       AttnOptions(strategy=strategy, overlap_stages=3))


def test_build_tables_builds_what_attention_reads(one_thread):
    """build_tables (config.overlap_stages, or the default) fills exactly the staged
    tables the call then reads: the call builds nothing."""
    from varlen_cp.prefetch import AttnShape, build_tables
    mask = MASKS["swa"]
    for stages in (None, 3):
        for name in STRATS:
            plan = small_plan(DOCS, 2, 0, "balanced")
            build_tables(plan, CPConfig(strategy=name, overlap_stages=stages), [(mask, 1)],
                         AttnShape(n_heads=4, n_kv_heads=2, head_dim=D, head_dim_v=DV,
                                   dtype=torch.float32), "cpu")
            want = stages or staged.default_stages(plan, mask, name,
                                                   AttnShape(n_heads=4, n_kv_heads=2, head_dim=D, head_dim_v=DV, dtype=torch.float32))
            keys = [k for k in plan._cache if getattr(k, "kind", None) == f"{name}_staged"]
            assert keys and all(k.extra[-1] == want for k in keys), keys


# ----------------------------------------------------------------- multi-process: numbers
def _run(rank, world, layout, mask, strategy, stages, inputs, dtype=torch.float32,
         backend="torch", no_host_reads=True, docs=DOCS):
    q, k, v, dout = inputs
    plan = small_plan(docs, world, rank, layout)
    ql, kl, vl = (plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    def guard():
        return forbid_host_reads() if no_host_reads else contextlib.nullcontext()
    with guard(), ByteCounter() as fwd:
        out, lse = cp_varlen_attn(ql, kl, vl, plan, mask, None, AttnOptions(
            strategy=strategy, backend=backend, validate=False, overlap_stages=stages),
            return_lse=True)
    with guard(), ByteCounter() as bwd:
        out.backward(plan.shard(dout).to(dtype))
    return plan, (out.detach(), lse, ql.grad, kl.grad, vl.grad), (fwd.total, bwd.total)


def _extras_case(rank, world, strategy, stages, c):
    """LSE gradient, sink (cycling the softmax types) and max logit under staging."""
    mname = list(EXTRAS_MASKS)[c % len(EXTRAS_MASKS)]
    mask = EXTRAS_MASKS[mname]
    softmax_type = SOFTMAX_TYPES[c % 3]
    layout = LAYOUTS[c % 3]
    hq, hkv = HEADS[world][c % 2]
    inputs = extras_inputs(DOCS, hq, hkv, seed=400 + c)
    ref = extras_reference(inputs, DOCS, mask, softmax_type, True)
    plan = small_plan(DOCS, world, rank, layout)
    ql, kl, vl = (plan.shard(t).requires_grad_() for t in inputs[:3])
    sink = sink_arg(softmax_type, inputs[5])
    with forbid_host_reads():
        out, lse, max_logit = cp_varlen_attn(
            ql, kl, vl, plan, mask, None, AttnOptions(strategy=strategy, backend="torch",
                                                      overlap_stages=stages, validate=False),
            return_lse=True, return_max_logit=True, softmax_type=softmax_type, sink=sink)
        extras_loss(out, lse, plan.shard(inputs[3]), plan.shard(inputs[4], dim=1)).backward()
    got = dict(out=out.detach(), lse=lse.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
               max_logit=max_logit, dsink=None if sink is None else sink.grad)
    what = f"[extras {strategy} S={stages} cp={world} {layout} {mname} {softmax_type}]"
    return ([f"{what} {e}" for e in extras_padding_errors(plan, got, softmax_type,
                                                             inputs[5])]
            + extras_errors(plan, got, ref, got["dsink"], world, what))


def _grid_case(rank, world, strategy, layout, mname):
    si = STRATS.index(strategy)
    mod = get_strategy(strategy)
    mask = MASKS[mname]
    i = LAYOUTS.index(layout) * len(MASKS) + list(MASKS).index(mname)
    stages = STAGES[(i + si + world) % 3]
    hq, hkv = HEADS[world][i % 2]
    inputs = global_inputs(DOCS, hq, hkv, seed=i)
    ref = single_device(*inputs, DOCS, mask)
    plan, local, sent = _run(rank, world, layout, mask, strategy, stages, inputs)
    what = f"[{strategy} S={stages} cp={world} {layout} {mname} {hq}/{hkv}]"
    try:
        check_padding(plan, local[0], local[1], local[2:])
        errors = []
    except AssertionError as e:  # the gather below is collective: every rank goes on
        errors = [f"{what} {e}"]
    errors += compare_fp32(gather(plan, local), ref, what)
    want = mod.bytes_sent_per_rank(plan, mask, AttnShape(
        n_heads=hq, n_kv_heads=hkv, head_dim=D, head_dim_v=DV, dtype=torch.float32))
    if sent != (want["fwd"][rank], want["bwd"][rank]):
        errors.append(f"{what} bytes sent {sent}, model "
                      f"{(want['fwd'][rank], want['bwd'][rank])}")
    return errors


def _nothing_remote_case(rank, world, strategy, stages):
    """One document per rank: nothing to fetch anywhere (the local call is all)."""
    errors = []
    docs = [48] * world
    inputs = global_inputs(docs, *HEADS[world][0], seed=700 + stages)
    ref = single_device(*inputs, docs, MASKS["causal"])
    plan, local, sent = _run(rank, world, "contiguous", MASKS["causal"], strategy,
                             stages, inputs, docs=docs)
    want = get_strategy(strategy).bytes_sent_per_rank(
        plan, MASKS["causal"], AttnShape(n_heads=HEADS[world][0][0],
                                         n_kv_heads=HEADS[world][0][1], head_dim=D,
                                         head_dim_v=DV, dtype=torch.float32))
    if sent != (want["fwd"][rank], want["bwd"][rank]):
        errors.append(f"[{strategy} S={stages} nothing remote] sent {sent}")
    errors += compare_fp32(gather(plan, local), ref, f"[{strategy} S={stages} "
                            f"nothing remote]")
    if strategy == "dispatch" and sent != (0, 0):
        errors.append(f"[{strategy} S={stages} nothing remote] sent {sent}")
    return errors


def _bad_stages_case(rank, world):
    plan = small_plan(DOCS, world, rank, "dual_chunk")
    q = plan.shard(global_inputs(DOCS, 2, 1, seed=0)[0])
    with no_communication():   # rejected before any collective
        for bad in (0, 1.5):
            with pytest.raises(ValueError, match="overlap_stages"):
                cp_varlen_attn(q, q[:, :1], q[:, :1], plan, MASKS["causal"], None,
                               AttnOptions(strategy="dispatch", overlap_stages=bad))
        with pytest.raises(ValueError, match="overlap_stages applies"):
            cp_varlen_attn(q, q[:, :1], q[:, :1], plan, MASKS["causal"], None,
                           AttnOptions(strategy="p2p", overlap_stages=2))
    return []


def case_names(world):
    """Per strategy: every layout x mask (S cycling over the grid and the launches), the
    softmax extras at each S, one document per rank at S 1 and 2; at cp 2 also the Triton
    case, the order of events and bad ``overlap_stages``."""
    names = []
    for strategy in STRATS:
        names += [f"{strategy}-{layout}-{mname}" for layout in LAYOUTS for mname in MASKS]
        names += [f"{strategy}-extras-S{stages}" for stages in STAGES]
        names += [f"{strategy}-nothing_remote-S{stages}" for stages in (1, 2)]
    return names + (["triton", "order", "bad_stages"] if world == 2 else [])


def _one_case(rank, world, name):
    if name in ("triton", "order", "bad_stages"):
        return {"triton": _triton_case, "order": _order_case,
                "bad_stages": _bad_stages_case}[name](rank, world)
    strategy, kind, arg = name.split("-")
    if kind == "extras":
        stages = int(arg[1:])
        return _extras_case(rank, world, strategy, stages,
                            3 * STRATS.index(strategy) + STAGES.index(stages) + world)
    if kind == "nothing_remote":
        return _nothing_remote_case(rank, world, strategy, int(arg[1:]))
    return _grid_case(rank, world, strategy, kind, arg)


def cases_worker(rank, world, names):
    """The named cases (``case_names``); returns each case's errors."""
    return {name: _one_case(rank, world, name) for name in names}


# Kept in the fast lane (scripts/run_tests.sh --fast): cp 2 with one layout x mask, S = 2
# extras and the one-document case per strategy, the Triton case, the order of events and
# bad input; every other case is marked slow.
FAST = {"dispatch-balanced-swa", "all_gather-te-chunk_causal", "dispatch-extras-S2",
        "all_gather-extras-S4", "dispatch-nothing_remote-S2", "all_gather-nothing_remote-S1",
        "triton", "order", "bad_stages"}


def overlap_params():
    for cp in (2, 3, 4):
        for name in case_names(cp):
            slow = () if cp == 2 and name in FAST else (pytest.mark.slow,)
            yield pytest.param(cp, name, marks=slow, id=f"cp{cp}-{name}")


@pytest.fixture(scope="module")
def overlap_launches():
    return GroupLaunches(("cp",))


@pytest.mark.parametrize("cp, name", list(overlap_params()))
def test_matches_single_device(cp, name, overlap_launches, request, tmp_path_factory):
    """One item per case; one launch per cp runs the selected cases."""
    errors = overlap_launches.result(request, lambda siblings: run_distributed(
        cases_worker, cp, tmp_path_factory.mktemp("overlap"), [p["name"] for p in siblings],
        timeout_s=400))
    assert_case_clean(errors, name)


DOCS16 = [1, 37, 9, 70, 5]                      # interpreter tiles are slow: fewer tokens


def _triton_case(rank, world):
    """fp16 on the Triton interpreter, 2 stages, vs the fp64 reference (flash-attn's rule:
    2x / 3x the error of plain PyTorch in fp16, plus a floor)."""
    from tests.reference import assert_close_to_reference
    mask = MASKS["chunk_causal"]
    hq, hkv = HEADS[world][1]
    inputs = global_inputs(DOCS16, hq, hkv, seed=500)
    ref64 = dense(inputs, DOCS16, mask, torch.float64, torch.float16)
    plain = dense(inputs, DOCS16, mask, torch.float16, torch.float16)
    plan, local, _ = _run(rank, world, "dual_chunk", mask, "dispatch", 2,
                          [t.half() for t in inputs], torch.float16, "triton",
                          no_host_reads=False, docs=DOCS16)
    errors = []
    for name, g, r, p in zip(NAMES, gather(plan, local), ref64, plain):
        factor, floor = (2, 1e-3) if name in ("out", "lse") else (3, 2e-3)
        try:
            assert_close_to_reference(f"[triton dispatch S=2] {name}", g, r, p,
                                      factor=factor, floor=floor)
        except AssertionError as e:
            errors.append(str(e))
    return errors


# ------------------------------------------------------------------------ order of events
class _Recorder:
    """Records, in order: ("post", i) when collective i is issued, ("wait", i) when it is
    waited on, ("fwd" | "bwd", n_keys) for every kernel call."""

    def __init__(self):
        import torch.distributed as dist
        from varlen_cp.strategies import all_gather, calls
        self.events, self._dist, self._ag, self._calls = [], dist, all_gather, calls
        self._saved = (dist.all_to_all_single, all_gather._all_gather_single,
                       calls.varlen_fwd_unchecked, calls.varlen_bwd_unchecked)

    def __enter__(self):
        a2a, ag, fwd, bwd = self._saved
        events = self.events

        def posted(fn):
            def call(*args, **kwargs):
                work = fn(*args, **kwargs)
                i = sum(1 for e in events if e[0] == "post")
                events.append(("post", i))
                return _Work(work, events, i)
            return call

        def kernel(kind, fn, k_arg):
            def call(*args, **kwargs):
                events.append((kind, args[k_arg].shape[0]))
                return fn(*args, **kwargs)
            return call

        self._dist.all_to_all_single = posted(a2a)
        self._ag._all_gather_single = posted(ag)
        self._calls.varlen_fwd_unchecked = kernel("fwd", fwd, 1)
        self._calls.varlen_bwd_unchecked = kernel("bwd", bwd, 2)
        return self

    def __exit__(self, *exc):
        (self._dist.all_to_all_single, self._ag._all_gather_single,
         self._calls.varlen_fwd_unchecked, self._calls.varlen_bwd_unchecked) = self._saved


class _Work:
    def __init__(self, work, events, i):
        self._work, self._events, self._i = work, events, i

    def wait(self, *args, **kwargs):
        self._events.append(("wait", self._i))
        return self._work.wait(*args, **kwargs)


def _check_order(events, kind, n_stages, what):
    """The first kernel call before the last transfer is waited on; stage s+1 is posted
    before stage s computes and waited on after it (forward: calls are local, 1..S;
    backward: 1..S, local; a return is posted after its stage's call)."""
    errors = []
    posts = [i for i, e in enumerate(events) if e[0] == "post"]
    waits: dict[int, int] = {}
    for i, e in enumerate(events):
        if e[0] == "wait":
            waits.setdefault(e[1], i)   # the first wait: when the rank blocked on it
    calls = [i for i, e in enumerate(events) if e[0] == kind]
    if len(posts) != n_stages or len(waits) != n_stages or len(calls) != n_stages + 1:
        return [f"{what}: {len(posts)} posts, {len(waits)} waits, {len(calls)} calls for "
                f"{n_stages} stages: {events}"]
    if not calls[0] < waits[n_stages - 1]:
        errors.append(f"{what}: the first kernel call after the last wait: {events}")
    remote = calls[1:] if kind == "fwd" else calls[:-1]
    for s in range(n_stages):
        if kind == "fwd":  # in flight during the local call (s = 0) / stage s's call
            before = calls[0] if s == 0 else remote[s - 1]
            if not posts[s] < before < waits[s] < remote[s]:
                errors.append(f"{what}: stage {s + 1} not in flight while stage {s} "
                              f"computed: {events}")
        else:              # posted right after its call, waited after the next call
            if not remote[s] < posts[s] < calls[s + 1] < waits[s]:
                errors.append(f"{what}: return {s + 1} not overlapped: {events}")
    return errors


def _order_case(rank, world):
    errors = []
    mask = MASKS["causal"]                      # dual_chunk, causal: every rank fetches
    hq, hkv = HEADS[world][0]
    q, k, v, dout = global_inputs(DOCS, hq, hkv, seed=600)
    for strategy in STRATS:
        for stages in (2, 3):
            plan = small_plan(DOCS, world, rank, "dual_chunk")
            ql, kl, vl = (plan.shard(t).requires_grad_() for t in (q, k, v))
            with _Recorder() as fwd:
                out = cp_varlen_attn(ql, kl, vl, plan, mask, None, AttnOptions(
                    strategy=strategy, backend="torch", validate=False,
                    overlap_stages=stages))
            with _Recorder() as bwd:
                out.backward(plan.shard(dout))
            tab = staged.staged_tables(strategy, plan, mask, rank, (64, 64), stages)
            n = len(tab.stages)
            assert n == stages - 1 and all(s.call is not None for s in tab.stages)
            what = f"[order {strategy} S={stages} rank {rank}]"
            errors += _check_order(fwd.events, "fwd", n, what + " forward")
            errors += _check_order(bwd.events, "bwd", n, what + " backward")
    return errors


def test_fold_is_merge_attn_partials():
    """The in-place fold equals merge_attn_partials, empty rows (-inf) included, for an
    fp32 accumulator and for a first partial in half precision (promoted to fp32)."""
    from varlen_cp.kernels import merge_attn_partials
    from varlen_cp.strategies.selected_keys import fold_
    g = torch.Generator().manual_seed(0)
    t, h, dv = 7, 3, 5
    parts = [(torch.randn(t, h, dv, generator=g), torch.randn(h, t, generator=g))
             for _ in range(3)]
    for lse in (parts[0][1], parts[1][1]):
        lse[0, 1] = float("-inf")            # row 1, head 0: empty in the first two parts
    parts[2][1][:, 4] = float("-inf")        # row 4: empty in the last part
    for first_dtype in (torch.float32, torch.float16):
        # fold_ takes fresh tensors (kernel outputs) and updates them in place: copies
        acc, lse = fold_(None, None, parts[0][0].to(first_dtype, copy=True), parts[0][1])
        ref, ref_lse = parts[0][0].to(first_dtype).float(), parts[0][1]
        for out_i, lse_i in parts[1:]:
            acc, lse = fold_(acc, lse, out_i.half(), lse_i)
            ref, ref_lse = merge_attn_partials(ref, ref_lse, out_i.half(), lse_i)
        assert acc.dtype == torch.float32 and not torch.isnan(acc).any()
        torch.testing.assert_close(acc, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse)
