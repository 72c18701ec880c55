"""The ``dispatch`` CP strategy and ``strategy="auto"``'s rule.

Host tests: the keys dispatch fetches are exactly those some local query sees (a dense
brute force over each document's mask), so its byte count is the lower bound; auto's
choices on clear-cut batches. Multi-process tests (gloo, one launch per cp that loops over
every layout x mask, alternating GQA head splits): forward out / LSE and dq / dk / dv vs the
single-device op on the global batch, padding rows 0 / -inf, every CP call after the first
with host reads of device data forbidden, and the bytes each collective really sends equal
to ``bytes_sent_per_rank``. A cp-2 launch runs fp16 on the Triton interpreter and bf16 on
the torch twin against the fp64 reference.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_cp_strategies import (HEADS, MASKS, _ByteCounter, _check_padding, _compare_fp32,
                                      _cu, _dense, _gather, _global_inputs, _single_device,
                                      forbid_host_reads)
from varlen_cp.attention import cp_varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.schedules import selected
from varlen_cp.strategies import get_strategy

dispatch = get_strategy("dispatch")

DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens, as the other strategies' tests
TINY = [2, 1]
D, DV = 32, 16
LAYOUTS = ("dual_chunk", "te", "balanced", "contiguous")


def _plan(docs, cp, rank, layout, mask=None):
    """Plans that really cut documents at these tiny sizes."""
    if layout == "balanced":
        return CPPlan.build(_cu(docs), cp_size=cp, cp_rank=rank, layout=layout,
                            masks=mask or AttnMask(), chunk_tokens=16)
    return CPPlan.build(_cu(docs), cp_size=cp, cp_rank=rank, layout=layout,
                        min_chunk_tokens=4)


# ------------------------------------------------------------------------ host: the keys
def _brute_needed(plan, mask, rank) -> list[int]:
    """Global indices of the keys some real query of ``rank`` sees, by a dense mask per
    document (independent of the interval union dispatch uses)."""
    cu = plan.cu_seqlens
    glob = plan.token_indices_of(rank)
    pos = plan.positions_of(rank).long()
    needed = []
    for d in range(plan.n_docs):
        length = int(cu[d + 1] - cu[d])
        q = pos[(glob >= cu[d]) & (glob < cu[d + 1])]
        if q.numel() == 0 or length == 0:
            continue
        seen = mask.visible(q, torch.arange(length)).any(0)
        needed += (int(cu[d]) + torch.nonzero(seen).flatten()).tolist()
    return needed


def test_needed_keys_are_exactly_the_visible_ones(one_thread):
    """Per rank: the needed keys (local and fetched), in (doc, position) order, with
    owners and rows that point at those very tokens; bytes = the plan's needed ranges."""
    docs = [300, 17, 1, 90, 0, 5, 411]
    kw = dict(head_dim=64, head_dim_v=32, n_kv_heads=2, n_heads=4, dtype_bytes=2)
    row = 2 * (64 + 32) * 2
    for layout in LAYOUTS:
        for cp in (2, 3, 4):
            for mname, mask in MASKS.items():
                plan = _plan(docs, cp, 0, layout, mask)
                every = torch.cat([plan.token_indices_of(r) for r in range(cp)])
                first = torch.tensor([0] + [plan.num_tokens_of(r) for r in range(cp)]).cumsum(0)
                fetched, sent_to = [], [0] * cp
                for r in range(cp):
                    n = selected.select_keys(plan, mask, r)
                    glob = every[first[n.owner] + n.row]  # the token each (owner, row) is
                    want = _brute_needed(plan, mask, r)
                    assert glob.tolist() == want, (layout, cp, mname, r)
                    doc = torch.searchsorted(plan.cu_seqlens, glob, right=True) - 1
                    assert torch.equal(n.holder.pos.long(), glob - plan.cu_seqlens[doc])
                    counts = torch.bincount(doc, minlength=plan.n_docs)
                    assert torch.equal(n.holder.cu[1:].long(), torch.cumsum(counts, 0))
                    remote = n.owner != r
                    fetched.append(int(remote.sum()))
                    for s in n.owner[remote].tolist():
                        sent_to[s] += 1
                got = dispatch.bytes_sent_per_rank(plan, mask, **kw)
                assert got == {"fwd": [s * row for s in sent_to],
                               "bwd": [f * row for f in fetched]}, (layout, cp, mname)


def test_dispatch_never_sends_more_than_all_gather_and_local_masks_send_little(one_thread):
    """One 400-token document over 4 contiguous ranks, causal window 7: each rank fetches
    the 7 keys before its slice, and nothing else."""
    plan = CPPlan.build(_cu([400]), cp_size=4, cp_rank=0, layout="contiguous")
    mask = AttnMask(causal=True, window_size=(7, 0))
    kw = dict(head_dim=128, head_dim_v=128, n_kv_heads=2, n_heads=8, dtype_bytes=2)
    row = 2 * 256 * 2
    got = dispatch.bytes_sent_per_rank(plan, mask, **kw)
    assert got == {"fwd": [7 * row] * 3 + [0], "bwd": [0] + [7 * row] * 3}
    ag = get_strategy("all_gather").bytes_sent_per_rank(plan, mask, **kw)
    assert all(a <= b for a, b in zip(got["fwd"], ag["fwd"]))


def test_compute_counts_every_visible_pair_once(one_thread):
    docs = [300, 17, 1, 90, 5, 411]
    for layout in LAYOUTS:
        for cp in (2, 3):
            for mask in MASKS.values():
                plan = _plan(docs, cp, 0, layout, mask)
                c = dispatch.compute_per_rank(plan, mask, block=(64, 64))
                assert c["visible"] == [float(plan.work_of(r, mask)) for r in range(cp)]
                assert all(a >= b for a, b in zip(c["visited"], c["visible"]))


# ------------------------------------------------------------------ multi-process: numbers
def _run(rank, world, docs, layout, mask, inputs, dtype, backend, strategy="dispatch",
         no_host_reads=False, validate=False):
    q, k, v, dout = inputs
    plan = _plan(docs, world, rank, layout, mask)
    ql, kl, vl = (plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    dout_l = plan.shard(dout).to(dtype)
    with forbid_host_reads() if no_host_reads else contextlib.nullcontext():
        out, lse = cp_varlen_attn(ql, kl, vl, plan, mask, None, strategy, return_lse=True,
                                  backend=backend, validate=validate)
        out.backward(dout_l)
    return plan, out.detach(), lse, ql.grad, kl.grad, vl.grad


def cases_worker(rank, world):
    """Every layout x mask (GQA splits alternating), fp32 on the torch twin; then the
    bytes really posted vs the cost model on a few of them, in fp16."""
    errors, n = [], 0
    for i, (layout, (mname, mask)) in enumerate(
            (l, m) for l in LAYOUTS for m in MASKS.items()):
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS, hq, hkv, seed=i)
        ref = _single_device(*inputs, DOCS, mask)
        plan, *local = _run(rank, world, DOCS, layout, mask, inputs, torch.float32, "torch",
                            no_host_reads=(i > 0), validate=(i == 0))
        _check_padding(plan, local[0], local[1], local[2:])
        errors += _compare_fp32(_gather(plan, local), ref,
                                f"[dispatch cp={world} {layout} {mname} {hq}/{hkv}]")
        n += 1
    for layout in LAYOUTS:  # 3 tokens: some ranks hold nothing at all
        hq, hkv = HEADS[world][0]
        inputs = _global_inputs(TINY, hq, hkv, seed=99)
        ref = _single_device(*inputs, TINY, MASKS["causal"])
        plan, *local = _run(rank, world, TINY, layout, MASKS["causal"], inputs,
                            torch.float32, "torch")
        errors += _compare_fp32(_gather(plan, local), ref,
                                f"[dispatch cp={world} {layout} tiny {hq}/{hkv}]")
        n += 1
    for i, (layout, mname) in enumerate([("balanced", "swa"), ("dual_chunk", "causal"),
                                         ("te", "chunk_causal"), ("contiguous", "full")]):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        q, k, v, dout = _global_inputs(DOCS, hq, hkv, seed=i)
        plan = _plan(DOCS, world, rank, layout, mask)
        ql, kl, vl = (plan.shard(t).half().requires_grad_() for t in (q, k, v))
        with _ByteCounter() as fwd:
            out = cp_varlen_attn(ql, kl, vl, plan, mask, None, "dispatch", backend="torch")
        with _ByteCounter() as bwd:
            out.backward(plan.shard(dout).half())
        want = dispatch.bytes_sent_per_rank(plan, mask, head_dim=D, head_dim_v=DV,
                                            n_heads=hq, n_kv_heads=hkv, dtype_bytes=2)
        if (fwd.total, bwd.total) != (want["fwd"][rank], want["bwd"][rank]):
            errors.append(f"[bytes {layout} {mname}] sent {(fwd.total, bwd.total)}, model "
                          f"{(want['fwd'][rank], want['bwd'][rank])}")
        n += 1
    assert not errors, "\n".join(errors)
    return n


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_matches_single_device(cp, tmp_path):
    n = run_distributed(cases_worker, cp, tmp_path)
    assert n == [len(LAYOUTS) * (len(MASKS) + 2)] * cp


DOCS16 = [1, 37, 9, 70, 5]                      # 122 tokens: interpreter tiles are slow
HALF_CASES = [("balanced", "chunk_causal", torch.float16, "triton"),
              ("dual_chunk", "swa2", torch.float16, "triton"),
              ("te", "causal", torch.bfloat16, "torch")]


def half_worker(rank, world):
    """fp16 / bf16 vs the fp64 reference with flash-attn's tolerance rule (2x / 3x the
    error of plain PyTorch in the same dtype, plus a floor)."""
    from tests.reference import assert_close_to_reference
    for i, (layout, mname, dtype, backend) in enumerate(HALF_CASES):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS16, hq, hkv, seed=200 + i)
        ref64 = _dense(inputs, DOCS16, mask, torch.float64, dtype)
        plain = _dense(inputs, DOCS16, mask, dtype, dtype)
        plan, *local = _run(rank, world, DOCS16, layout, mask,
                            [t.to(dtype) for t in inputs], dtype, backend)
        _check_padding(plan, local[0], local[1], local[2:])
        for name, g, r, p in zip(("out", "lse", "dq", "dk", "dv"), _gather(plan, local),
                                 ref64, plain):
            factor, floor = (2, 1e-3) if name in ("out", "lse") else (3, 2e-3)
            assert_close_to_reference(f"[dispatch {dtype} {layout} {mname}] {name}", g, r,
                                      p, factor=factor, floor=floor)
    return len(HALF_CASES)


def test_fp16_bf16(tmp_path):
    assert run_distributed(half_worker, 2, tmp_path, timeout_s=400) == [len(HALF_CASES)] * 2


def test_cp1_is_the_local_op(one_thread):
    mask = MASKS["swa"]
    inputs = _global_inputs(DOCS, 4, 2, seed=7)
    ref = _single_device(*inputs, DOCS, mask)
    plan = CPPlan.build(_cu(DOCS), cp_size=1, cp_rank=0, layout="balanced", masks=mask)
    q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
    out, lse = cp_varlen_attn(q, k, v, plan, mask, strategy="dispatch", return_lse=True)
    out.backward(plan.shard(inputs[3]))
    got = [plan.unshard_parts([out.detach()]), plan.unshard_parts([lse.t()]).t()]
    got += [plan.unshard_parts([g]) for g in (q.grad, k.grad, v.grad)]
    assert not _compare_fp32(got, ref, "[cp1 dispatch]")


# ------------------------------------------------------------------------ strategy="auto"
SHORT = torch.randint(64, 1024, (30,), generator=torch.Generator().manual_seed(0)).tolist()
LONG = [8192, 6144, 2048]


def test_auto_picks_dispatch_for_local_masks_on_short_documents(one_thread):
    from varlen_cp.schedules.auto import choose_strategy
    for mask in (AttnMask(window_size=(256, 0)), AttnMask(chunk_size=512)):
        for layout in ("balanced", "dual_chunk"):
            plan = _plan(SHORT, 4, 0, layout, mask) if layout == "balanced" else \
                CPPlan.build(_cu(SHORT), cp_size=4, cp_rank=0, layout=layout)
            got = choose_strategy(plan, mask, n_heads=32, n_kv_heads=8, head_dim=128)
            assert got == "dispatch", (mask, layout, got)


def test_auto_on_global_masks_on_long_documents(one_thread, monkeypatch):
    """Compute-bound: every overlapping strategy is within the tolerance, so the pick is
    the one that sends the fewest bytes among them (dispatch, now that it overlaps too,
    where it sends less than the ring) and never all_gather."""
    from varlen_cp.schedules import auto
    for mask in (AttnMask(causal=True), AttnMask(causal=False)):
        plan = CPPlan.build(_cu(LONG), cp_size=4, cp_rank=0, layout="dual_chunk")
        for hq, hkv in ((32, 8), (8, 8), (16, 2)):
            got = auto.choose_strategy(plan, mask, n_heads=hq, n_kv_heads=hkv, head_dim=128)
            est = auto.estimates(plan, mask, n_heads=hq, n_kv_heads=hkv, head_dim=128)
            best = min(e.seconds for e in est.values())
            close = {n: e for n, e in est.items() if e.seconds <= best * 1.05}
            assert got in ("a2a", "p2p", "dispatch"), (mask, hq, hkv, got)
            assert got in close and est[got].bytes_sent == min(
                e.bytes_sent for e in close.values()), (mask, hq, hkv, got, est)
            with monkeypatch.context() as m:  # cached in the plan: no second estimate
                m.setattr(auto, "estimates", lambda *a, **k: pytest.fail("recomputed"))
                assert auto.choose_strategy(plan, mask, n_heads=hq, n_kv_heads=hkv,
                                            head_dim=128) == got
        # heads that don't split over cp: a2a is no candidate
        est = auto.estimates(plan, mask, n_heads=6, n_kv_heads=3, head_dim=64)
        assert "a2a" not in est and {"p2p", "dispatch", "all_gather"} <= set(est)


def test_auto_memory_budget_and_tie_rule(one_thread):
    from varlen_cp.schedules.auto import CostModel, Estimate, choose_strategy, pick
    mask = AttnMask(window_size=(256, 0))
    plan = _plan(SHORT, 4, 0, "balanced", mask)
    kw = dict(n_heads=32, n_kv_heads=8, head_dim=128)
    assert choose_strategy(plan, mask, memory_budget_bytes=0, **kw) == "p2p"
    need = max(selected.select_keys(plan, mask, r).owner.numel()
               for r in range(plan.cp_size)) * 8 * 256 * 2
    assert choose_strategy(plan, mask, memory_budget_bytes=need, **kw) == "dispatch"
    assert choose_strategy(plan, mask, memory_budget_bytes=need - 1, **kw) != "dispatch"
    # Within the tolerance the fewest bytes win; outside it the fastest.
    e = {"p2p": Estimate(1.00, 1.0, 0.0, 300, 0), "a2a": Estimate(1.04, 1.0, 0.04, 100, 9),
         "dispatch": Estimate(1.06, 1.0, 0.06, 50, 9)}
    assert pick(e, CostModel()) == "a2a"
    assert pick(e, CostModel(tolerance=0.1)) == "dispatch"
    assert pick(e, CostModel(tolerance=0.0)) == "p2p"
    assert pick(e, CostModel(), memory_budget_bytes=5) == "p2p"


def test_auto_bad_arguments():
    from varlen_cp.schedules.auto import CostModel, choose_strategy
    plan = CPPlan.build(_cu(LONG), cp_size=2, cp_rank=0)
    mask = AttnMask()
    kw = dict(n_heads=8, n_kv_heads=2, head_dim=64)
    for bad, match in ((dict(n_heads=0), "n_heads"), (dict(n_kv_heads=3), "multiple"),
                       (dict(head_dim_v=1.5), "head_dim_v"), (dict(dtype_bytes=True), "dtype"),
                       (dict(memory_budget_bytes=-1), "memory_budget_bytes"),
                       (dict(model="h100"), "model")):
        with pytest.raises(ValueError, match=match):
            choose_strategy(plan, mask, **{**kw, **bad})
    for field in ("flops_per_s", "bytes_per_s"):
        with pytest.raises(ValueError, match=field):
            CostModel(**{field: 0})
    with pytest.raises(ValueError, match="tolerance"):
        CostModel(tolerance=1.0)


def _auto_supported() -> bool:
    """``strategy="auto"`` reaches the strategies only once attention.py resolves it."""
    plan = CPPlan.build(_cu([3]), cp_size=1, cp_rank=0)
    q = torch.zeros(3, 2, D)
    try:
        cp_varlen_attn(q, q, q, plan, AttnMask(), strategy="auto")
    except ValueError as e:
        if "strategy must be one of" in str(e):
            return False
        raise
    return True


def auto_worker(rank, world):
    """strategy="auto" end to end: runs whatever it picks, and matches the reference."""
    errors = []
    for i, (layout, mname) in enumerate([("balanced", "swa"), ("dual_chunk", "causal")]):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS, hq, hkv, seed=300 + i)
        ref = _single_device(*inputs, DOCS, mask)
        plan, *local = _run(rank, world, DOCS, layout, mask, inputs, torch.float32, "torch",
                            strategy="auto", no_host_reads=True)
        errors += _compare_fp32(_gather(plan, local), ref, f"[auto {layout} {mname}]")
    assert not errors, "\n".join(errors)
    return True


def test_auto_end_to_end(tmp_path):
    if not _auto_supported():
        pytest.skip("varlen_cp.attention does not resolve strategy='auto' yet")
    assert run_distributed(auto_worker, 2, tmp_path) == [True] * 2
