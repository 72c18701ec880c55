"""CP strategies vs the single-device op, on real gloo process groups (CPU).

The grid: one pytest item per strategy x cp x layout x mask (re-run one by its id,
``test_matches_single_device[p2p-cp2-te-swa]``, or a few with ``-k``), one launch per
(strategy, cp) for the cases selected (``helpers.launches``); two GQA head splits, fp32, forward output, LSE and all three gradients, compared with ``varlen_attn``
(torch backend) on the global batch after ``plan.unshard``; every strategy (p2p,
all_gather, a2a, a2a+p2p, dispatch) and ``auto`` (which runs what it picks for each plan and
mask), at cp 2, 3 and 4. The document mix has odd lengths, a length-1 document, documents
shorter than cp, an empty document and one much longer than the others; small cut sizes
(``helpers.cp_grid.small_plan``) make dual_chunk and balanced really cut documents across
ranks.
Padding rows (te layout) must come out 0 / -inf with zero gradients. Smaller launches run
a2a+p2p at cp 6 (2 x 3 and 3 x 2), fp16 on the Triton interpreter and bf16 on the torch
twin, bad input, and byte counts against what the collectives really post; cp == 1 and the
host cost model need no processes. Every CP forward + backward after the first of a launch
runs with host reads of device data forbidden (``helpers.guards.forbid_host_reads``).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.lanes import fast_first
from tests.helpers.launches import GroupLaunches, assert_case_clean
from tests.helpers.cp_grid import (DOCS, DV, HEADS, LAYOUTS, MASKS, NAMES, TINY, D,
                                   check_padding, compare_fp32, cp_run, cu, dense, gather,
                                   global_inputs, single_device, small_plan)
from tests.helpers.guards import ByteCounter
from varlen_cp import AttnOptions
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.shape import AttnShape
from varlen_cp.strategies import STRATEGIES as STRATEGY_REGISTRY

STRATEGIES = tuple(STRATEGY_REGISTRY)                   # the catalogue's names, in its order
GRID = (*STRATEGIES, "auto")
HYBRID6_CASES = [(2, "dual_chunk", "causal"), (2, "contiguous", "swa"), (2, "te", "chunk"),
                 (3, "dual_chunk", "chunk_causal"), (3, "contiguous", "full"),
                 (3, "te", "swa2")]


def grid_options(strategy: str, cp: int, **kw) -> AttnOptions:
    """The grid's options: a2a+p2p as a real hybrid at cp 4 (2 x 2: the default would pick
    pure Ulysses) and as the ring through the hybrid path at cp 3."""
    a2a = {4: 2, 3: 1}.get(cp) if strategy == "a2a+p2p" else None
    return AttnOptions(strategy=strategy, backend="torch", a2a_size=a2a, **kw)


def hybrid_worker(rank, world):
    """a2a+p2p at cp 6 as 2 x 3 and 3 x 2 (the ring has more than two holders)."""
    errors, n = [], 0
    for i, (a2a_size, layout, mname) in enumerate(HYBRID6_CASES):
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(DOCS, hq, hkv, seed=50 + i)
        ref = single_device(*inputs, DOCS, MASKS[mname])
        options = AttnOptions(strategy="a2a+p2p", backend="torch", a2a_size=a2a_size,
                              validate=False)
        plan, *local = cp_run(rank, world, DOCS, layout, MASKS[mname], options, inputs,
                              no_host_reads=True)
        check_padding(plan, local[0], local[1], local[2:])
        errors += compare_fp32(gather(plan, local), ref,
                               f"[a2a+p2p {a2a_size}x{world // a2a_size} {layout} {mname}]")
        n += 1
    assert not errors, "\n".join(errors)
    return n


# The grid's cases per (strategy, cp): every layout x mask, then the 3-token batch per layout.
CASES = [(layout, mname) for layout in LAYOUTS for mname in MASKS] + \
    [(layout, "tiny") for layout in LAYOUTS]


def cases_worker(rank, world, strategy, cases):
    """The given (layout, mask name) cases, each with its own GQA head split and seed (the
    two splits alternate over the grid); fp32, torch backend. The first call of the launch
    validates the plans; the ones after it run under ``forbid_host_reads`` (the plan is
    built first). Returns each case's errors."""
    errors = {}
    for n, (layout, mname) in enumerate(cases):
        if mname == "tiny":  # 3 tokens: some ranks hold nothing (contiguous, dual_chunk)
            hq, hkv = HEADS[world][0]
            inputs = global_inputs(TINY, hq, hkv, seed=99)
            ref = single_device(*inputs, TINY, MASKS["causal"])
            plan, *local = cp_run(rank, world, TINY, layout, MASKS["causal"],
                                  grid_options(strategy, world, validate=False), inputs)
            errors[layout, mname] = compare_fp32(
                gather(plan, local), ref, f"[{strategy} cp={world} {layout} tiny {hq}/{hkv}]")
            continue
        i = CASES.index((layout, mname))
        hq, hkv = HEADS[world][i % 2]
        mask = MASKS[mname]
        inputs = global_inputs(DOCS, hq, hkv, seed=i)
        ref = single_device(*inputs, DOCS, mask)
        plan, *local = cp_run(rank, world, DOCS, layout, mask,
                              grid_options(strategy, world, validate=(n == 0)), inputs,
                              no_host_reads=(n > 0))
        what = f"[{strategy} cp={world} {layout} {mname} {hq}/{hkv}]"
        try:
            check_padding(plan, local[0], local[1], local[2:])
            errors[layout, mname] = []
        except AssertionError as e:  # the gather below is collective: every rank goes on
            errors[layout, mname] = [f"{what} {e}"]
        errors[layout, mname] += compare_fp32(gather(plan, local), ref, what)
    return errors


# Kept in the fast lane (scripts/run_tests.sh --fast): one case per strategy (a launch
# costs ~1.7 s on 2 cores), every cp, layout and mask once; a2a+p2p at cp 4 (2 x 2).
FAST_CASES = [(4, "dual_chunk", "causal"), (3, "te", "swa"), (2, "contiguous", "chunk_causal"),
              (4, "balanced", "full"), (3, "dual_chunk", "swa2"), (2, "te", "chunk")]
FAST = {(strategy, cp): (layout, mname)
        for strategy, (cp, layout, mname) in zip(GRID, FAST_CASES)}


def grid_params():
    for strategy in GRID:
        for cp in (2, 3, 4):
            for layout, mname in CASES:
                slow = () if FAST.get((strategy, cp)) == (layout, mname) else (pytest.mark.slow,)
                yield pytest.param(strategy, cp, layout, mname, marks=slow,
                                   id=f"{strategy}-cp{cp}-{layout}-{mname}")


@pytest.fixture(scope="module")
def grid_launches():
    return GroupLaunches(("strategy", "cp"))


@pytest.mark.parametrize("strategy, cp, layout, mname", list(grid_params()))
def test_matches_single_device(strategy, cp, layout, mname, grid_launches, request,
                               tmp_path_factory):
    """One item per case; one launch per (strategy, cp) runs the selected cases."""
    errors = grid_launches.result(request, lambda siblings: run_distributed(
        cases_worker, cp, tmp_path_factory.mktemp("grid"), strategy,
        [(p["layout"], p["mname"]) for p in siblings]))
    assert_case_clean(errors, (layout, mname))


def test_hybrid_cp6(tmp_path):
    assert run_distributed(hybrid_worker, 6, tmp_path) == [len(HYBRID6_CASES)] * 6


# ------------------------------------- fp16 on the Triton interpreter, bf16 on the twin
DOCS16 = [1, 37, 9, 70, 5]                      # 122 tokens: interpreter tiles are slow
# (strategy, layout, mask, dtype, backend). The interpreter computes bf16 wrongly, so bf16
# runs on the torch twin here (and would run on Triton on a GPU).
HALF_CASES = [("p2p", "dual_chunk", "causal", torch.float16, "triton"),
              ("all_gather", "te", "chunk_causal", torch.float16, "triton"),
              ("a2a", "contiguous", "swa2", torch.float16, "triton"),
              ("dispatch", "balanced", "chunk_causal", torch.float16, "triton"),
              ("dispatch", "dual_chunk", "swa2", torch.float16, "triton"),
              ("p2p", "te", "swa", torch.bfloat16, "torch"),
              ("all_gather", "contiguous", "chunk", torch.bfloat16, "torch"),
              ("a2a", "dual_chunk", "full", torch.bfloat16, "torch"),
              ("dispatch", "te", "causal", torch.bfloat16, "torch")]


def half_worker(rank, world):
    """fp16 / bf16 CP vs the fp64 reference, with flash-attn's tolerance rule: at most 2x
    (out, lse) or 3x (grads) the error of plain PyTorch in the same dtype, plus a floor."""
    from tests.reference import assert_close_to_reference
    for i, (strategy, layout, mname, dtype, backend) in enumerate(HALF_CASES):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(DOCS16, hq, hkv, seed=100 + i)
        ref64 = dense(inputs, DOCS16, mask, torch.float64, dtype)
        plain = dense(inputs, DOCS16, mask, dtype, dtype)
        plan, *local = cp_run(rank, world, DOCS16, layout, mask,
                              AttnOptions(strategy=strategy, backend=backend),
                              [t.to(dtype) for t in inputs], dtype)
        check_padding(plan, local[0], local[1], local[2:])
        got = gather(plan, local)
        for name, g, r, p in zip(NAMES, got, ref64, plain):
            factor, floor = (2, 1e-3) if name in ("out", "lse") else (3, 2e-3)
            assert_close_to_reference(f"[{strategy} {dtype} {layout} {mname}] {name}", g, r,
                                      p, factor=factor, floor=floor)
    return len(HALF_CASES)


@pytest.mark.slow  # fp16 on the Triton interpreter
def test_fp16_bf16(tmp_path):
    assert run_distributed(half_worker, 2, tmp_path, timeout_s=400) == [len(HALF_CASES)] * 2


# ------------------------------------------------------------------ bytes really posted
BYTE_CASES = [("contiguous", "swa"), ("dual_chunk", "causal"), ("te", "chunk_causal"),
              ("balanced", "chunk")]


def bytes_worker(rank, world):
    """fp16 forward + backward of every strategy; the bytes each collective really sends
    must equal the strategy's ``bytes_sent_per_rank``."""
    from varlen_cp.strategies import get_strategy
    from varlen_cp.tables import catalogue
    mismatches, n = [], 0
    for strategy in STRATEGIES:
        options = AttnOptions(strategy=strategy, backend="torch",
                              a2a_size=2 if strategy == "a2a+p2p" else None)
        for i, (layout, mname) in enumerate(BYTE_CASES):
            mask = MASKS[mname]
            hq, hkv = HEADS[world][i % 2]
            q, k, v, dout = global_inputs(DOCS, hq, hkv, seed=i)
            plan = small_plan(DOCS, world, rank, layout)
            ql, kl, vl = (plan.shard(t).half().requires_grad_() for t in (q, k, v))
            with ByteCounter() as fwd:
                out = cp_varlen_attn(ql, kl, vl, plan, mask, None, options)
            with ByteCounter() as bwd:
                out.backward(plan.shard(dout).half())
            shape = AttnShape(n_heads=hq, n_kv_heads=hkv, head_dim=D, head_dim_v=DV,
                              dtype=torch.float16)
            want = get_strategy(strategy).bytes_sent_per_rank(
                plan, mask, shape, a2a_size=options.a2a_size)
            got = (fwd.total, bwd.total)
            if got != (want["fwd"][rank], want["bwd"][rank]):
                mismatches.append(f"{strategy} {layout} {mname}: sent {got}, model "
                                  f"{(want['fwd'][rank], want['bwd'][rank])}")
            # and to whom: the traffic matrix's row of this rank (the group is the world)
            matrix = catalogue.traffic_of(strategy, plan, mask, shape, options.a2a_size)
            for phase, counter in (("fwd", fwd), ("bwd", bwd)):
                row = {d: int(b) for d, b in enumerate(matrix[phase][rank]) if b}
                sent = {d: b for d, b in counter.by_peer.items() if b}
                if sent != row:
                    mismatches.append(f"{strategy} {layout} {mname} {phase}: sent to peers "
                                      f"{sent}, traffic matrix {row}")
            n += 1
    assert not mismatches, "\n".join(mismatches)
    return n


def test_bytes_sent_match_the_cost_model(tmp_path):
    assert run_distributed(bytes_worker, 4, tmp_path) == \
        [len(STRATEGIES) * len(BYTE_CASES)] * 4


# -------------------------------------------------------------------------- bad input
def _expect(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def bad_input_worker(rank, world):
    """Every bad call raises ValueError on every rank before any collective (a collective
    reached by one rank only would hang the others until the test's timeout); bad options
    fail when the AttnOptions is built, before any call."""
    mask = MASKS["causal"]
    plan = small_plan(DOCS, world, rank, "dual_chunk")
    q, k, v, _ = (plan.shard(t) for t in global_inputs(DOCS, 4, 2, seed=0))

    def call(*a, **kw):
        args = dict(q=q, k=k, v=v, plan=plan, mask=mask)
        args.update(kw)
        return lambda: cp_varlen_attn(args.pop("q"), args.pop("k"), args.pop("v"),
                                      args.pop("plan"), args.pop("mask"), *a, **args)

    def opts(**kw):
        return {"options": AttnOptions(**kw)}

    _expect(call(q=q[:-1]), "local tokens")
    _expect(call(v=v[:, :1]), "head counts differ")
    _expect(call(k=k.half()), "dtypes differ")
    _expect(call(mask="causal"), "AttnMask")
    _expect(lambda: AttnOptions(strategy="ring"), "strategy must be one of")
    _expect(call(None, "ring"), "options must be a varlen_cp.AttnOptions")   # one way only
    _expect(call(options="p2p"), "options must be a varlen_cp.AttnOptions")
    _expect(call(options={"strategy": "p2p"}), "options must be a varlen_cp.AttnOptions")
    _expect(call(softmax_scale=-1.0), "softmax_scale")
    _expect(lambda: AttnOptions(backend="cuda"), "backend")
    _expect(call(plan="plan"), "CPPlan")
    _expect(lambda: AttnOptions(strategy="p2p", a2a_size=2), "a2a_size applies")
    other = small_plan(DOCS, world, 1 - rank, "dual_chunk")
    if other.num_tokens_of(1 - rank) == plan.num_tokens:
        _expect(call(plan=other), "cp_rank")
    big = small_plan(DOCS, world + 1, rank, "dual_chunk")
    qb, kb, vb, _ = (big.shard(t) for t in global_inputs(DOCS, 4, 2, seed=0))
    _expect(call(q=qb, k=kb, v=vb, plan=big), "size 2 differs")
    q3 = torch.randn(q.shape[0], 3, D)
    k3, v3 = torch.randn(q.shape[0], 3, D), torch.randn(q.shape[0], 3, DV)
    _expect(call(q=q3, k=k3, v=v3, **opts(strategy="a2a")), "Hq=3 must be divisible")
    q6 = torch.randn(q.shape[0], 6, D)
    _expect(call(q=q6, k=k3, v=v3, **opts(strategy="a2a")), "Hkv=3")
    _expect(call(q=q6, k=k3, v=v3, **opts(strategy="a2a+p2p", a2a_size=2)), "Hkv=3")
    _expect(call(**opts(strategy="a2a+p2p", a2a_size=3)), "divisor")
    # Different plans with equal local sizes: only the fingerprint check can tell.
    docs = [40, 20, 90] if rank == 0 else [50, 50, 50]
    odd = CPPlan.build(cu(docs), cp_size=world, cp_rank=rank, layout="contiguous")
    qo, ko, vo, _ = (odd.shard(t) for t in global_inputs(docs, 4, 2, seed=0))
    _expect(call(q=qo, k=ko, v=vo, plan=odd, **opts(validate=True)), "different plans")
    # The module equals the function; the good call still works after all of the above.
    want = cp_varlen_attn(q, k, v, plan, mask, None, AttnOptions(strategy="p2p"))
    module = ContextParallelVarlenAttention(mask, AttnOptions(strategy="all_gather"))
    assert module.options == AttnOptions(strategy="all_gather")
    torch.testing.assert_close(module(q, k, v, plan), want)
    torch.testing.assert_close(cp_varlen_attn(q, k, v, plan, mask, None, AttnOptions(
        strategy="dispatch", backend="torch", validate=False)), want)
    return True


def test_bad_input_raises_before_communicating(tmp_path):
    assert run_distributed(bad_input_worker, 2, tmp_path, collective_timeout_s=30) == [True] * 2


# ------------------------------------------------------------------------------ cp == 1
@pytest.mark.parametrize("layout", ["dual_chunk", "te", "balanced"])
def test_cp1_is_the_local_op(layout, one_thread):
    """cp == 1 needs no process group; every strategy (and auto) is the single-device op
    (te pads)."""
    mask = MASKS["chunk_causal"]
    inputs = global_inputs(DOCS, 4, 2, seed=7)
    ref = single_device(*inputs, DOCS, mask)
    plan = CPPlan.build(cu(DOCS), cp_size=1, cp_rank=0, layout=layout)
    for strategy in GRID:
        q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
        out, lse = cp_varlen_attn(q, k, v, plan, mask, options=AttnOptions(strategy=strategy),
                                  return_lse=True)
        out.backward(plan.shard(inputs[3]))
        local = (out.detach(), lse, q.grad, k.grad, v.grad)
        check_padding(plan, local[0], local[1], local[2:])
        got = [plan.unshard_parts([local[0]]), plan.unshard_parts([local[1].t()]).t()]
        got += [plan.unshard_parts([g]) for g in local[2:]]
        assert not compare_fp32(got, ref, f"[cp1 {layout} {strategy}]")
    module = ContextParallelVarlenAttention(mask)
    out = plan.unshard_parts([module(*(plan.shard(t) for t in inputs[:3]), plan)])
    torch.testing.assert_close(out, ref[0], atol=3e-5, rtol=3e-4)


# -------------------------------------------------------------------- host cost model
@pytest.mark.parametrize("mname", fast_first(list(MASKS)))
@pytest.mark.parametrize("layout", fast_first(LAYOUTS))
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "dispatch"])  # its own
def test_cost_model_counts_every_visible_pair_once(strategy, layout, mname, one_thread):
    """Summed over ranks, each strategy's visible pairs are the batch's (plan.work_per_rank);
    dispatch: tests/tables/test_cp_dispatch.py."""
    from varlen_cp.strategies import get_strategy
    docs = [300, 17, 1, 90, 5, 411]
    mask = MASKS[mname]
    for cp in (2, 3, 4):
        plan = small_plan(docs, cp, 0, layout)
        total = sum(plan.work_per_rank(mask))
        c = get_strategy(strategy).compute_per_rank(
            plan, mask, AttnShape(n_heads=12, n_kv_heads=cp, head_dim=1), block=(64, 64))
        assert sum(c["visible"]) == pytest.approx(total), (strategy, layout, cp)
        assert all(a >= b for a, b in zip(c["visited"], c["visible"]))


def test_cost_model_bytes_by_hand(one_thread):
    """One 400-token document, contiguous over 4 ranks (100 each), causal window 7: the
    ring stops after one hop; all_gather picks 7 keys from the left neighbour."""
    from varlen_cp.strategies import get_strategy
    plan = CPPlan.build(cu([400]), cp_size=4, cp_rank=0, layout="contiguous")
    mask = AttnMask(causal=True, window_size=(7, 0))
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=128, head_dim_v=128)
    kv_row = 2 * 256 * 2
    p2p = get_strategy("p2p").bytes_sent_per_rank(plan, mask, shape)
    assert p2p["fwd"] == [100 * kv_row] * 4
    # Backward: K/V again, plus the partial dK/dV of the left neighbour's keys (rank 0's
    # queries see nothing of rank 3, so it sends no partial).
    assert p2p["bwd"] == [100 * kv_row] + [200 * kv_row] * 3
    ag = get_strategy("all_gather").bytes_sent_per_rank(plan, mask, shape)
    assert ag["fwd"] == [3 * 100 * kv_row] * 4
    assert ag["bwd"] == [0, 7 * kv_row, 7 * kv_row, 7 * kv_row]
    a2a = get_strategy("a2a").bytes_sent_per_rank(plan, mask, shape)
    qkv_row = (2 * 128 + 1 * 256) * 2      # per member: 2 q heads, 1 K/V head (replicated)
    out_row = 2 * 128 * 2
    assert a2a["fwd"] == [3 * 100 * qkv_row + 300 * out_row] * 4
    assert a2a["bwd"] == [3 * 100 * out_row + 300 * qkv_row] * 4
