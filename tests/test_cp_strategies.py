"""CP strategies vs the single-device op, on real gloo process groups (CPU).

Each launch runs one (strategy, cp) pair over every mask x layout, two GQA head splits, fp32,
forward output, LSE and all three gradients, compared with ``varlen_attn`` (torch backend)
on the global batch after ``plan.unshard``. The document mix has odd lengths, a length-1
document, documents shorter than cp, an empty document and one much longer than the others;
small cut sizes (``_plan``) make dual_chunk and balanced really cut documents across ranks.
Padding rows (te layout) must come out 0 / -inf with zero gradients. Smaller launches run
a2a+p2p at cp 6 (2 x 3 and 3 x 2), fp16 on the Triton interpreter and bf16 on the torch
twin, bad input, and byte counts against what the collectives really post; cp == 1 and the
host cost model need no processes. Every CP forward + backward after the first of a launch
runs with host reads of device data forbidden (``forbid_host_reads``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan

DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens
TINY = [2, 1]
D, DV = 32, 16
LAYOUTS = ("dual_chunk", "te", "contiguous", "balanced")
MASKS = {
    "causal": AttnMask(causal=True),
    "full": AttnMask(causal=False),
    "swa": AttnMask(causal=True, window_size=(7, 0)),
    "swa2": AttnMask(causal=False, window_size=(5, 3)),
    "chunk": AttnMask(causal=False, chunk_size=16),
    "chunk_causal": AttnMask(causal=True, chunk_size=12),
}
# (Hq, Hkv) per cp: valid for every strategy (a2a needs Hq % cp == 0 and Hkv | cp or cp | Hkv)
HEADS = {2: [(4, 2), (2, 1)], 3: [(6, 3), (3, 1)], 4: [(8, 2), (4, 4)], 6: [(6, 1), (6, 6)]}
HYBRID6_CASES = [(2, "dual_chunk", "causal"), (2, "contiguous", "swa"), (2, "te", "chunk"),
                 (3, "dual_chunk", "chunk_causal"), (3, "contiguous", "full"),
                 (3, "te", "swa2")]
STRATEGY_OPTS = {"p2p": {}, "all_gather": {}, "a2a": {}, "a2a+p2p": {}}


def _cu(docs: list[int]) -> torch.Tensor:
    return torch.tensor([0] + docs).cumsum(0)


def _global_inputs(docs, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(docs)
    return (torch.randn(total, hq, D, generator=g), torch.randn(total, hkv, D, generator=g),
            torch.randn(total, hkv, DV, generator=g), torch.randn(total, hq, DV, generator=g))


def _single_device(q, k, v, dout, docs, mask):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32)."""
    cu = _cu(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, cu, cu, max(docs), max(docs), None, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True,
                           backend="torch")
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _plan(docs, world, rank, layout):
    """Small cut sizes, so that documents of this tiny batch really span ranks."""
    extra = {"chunk_tokens": 8} if layout == "balanced" else {"min_chunk_tokens": 4}
    return CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout=layout, **extra)


def _cp_run(rank, world, docs, layout, mask, strategy, inputs, dtype, backend, opts,
            validate=True, no_host_reads=False):
    """CP forward + backward on this rank; returns the plan and local results."""
    q, k, v, dout = inputs
    plan = _plan(docs, world, rank, layout)
    ql, kl, vl = (plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    dout_l = plan.shard(dout).to(dtype)
    with forbid_host_reads() if no_host_reads else contextlib.nullcontext():
        out, lse = cp_varlen_attn(ql, kl, vl, plan, mask, None, strategy, return_lse=True,
                                  backend=backend, validate=validate, **opts)
        out.backward(dout_l)
    return plan, out.detach(), lse, ql.grad, kl.grad, vl.grad


def _check_padding(plan, out, lse, grads):
    pad = plan.token_indices < 0
    if not bool(pad.any()):
        return
    assert bool((out[pad] == 0).all()), "padding rows: out must be 0"
    assert bool(torch.isneginf(lse[:, pad]).all()), "padding rows: lse must be -inf"
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool((g[pad] == 0).all()), f"padding rows: {name} must be 0"


def _gather(plan, local):
    out, lse, dq, dk, dv = local
    return (plan.unshard(out.float()), plan.unshard(lse.t().contiguous()).t(),
            plan.unshard(dq.float()), plan.unshard(dk.float()), plan.unshard(dv.float()))


NAMES = ("out", "lse", "dq", "dk", "dv")


def _compare_fp32(got, ref, what):
    errors = []
    for name, g, r in zip(NAMES, got, ref):
        if torch.isnan(g).any():
            errors.append(f"{what} {name}: NaN")
            continue
        try:
            torch.testing.assert_close(g, r.float(), atol=3e-5, rtol=3e-4)
        except AssertionError as e:
            errors.append(f"{what} {name}: {str(e).splitlines()[2:5]}")
    return errors


@contextlib.contextmanager
def forbid_host_reads():
    """Make Tensor.item/tolist/cpu/numpy (and bool/int/float conversions) raise on device
    data. On a CPU-only machine "device data" is every floating tensor (activations, LSE,
    gradients) and anything not on the CPU; host metadata (CPU int tensors) stays
    readable, as the plan's tables must be."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def guard(name):
        orig = saved[name]

        def check(self, *args, **kwargs):
            if self.is_floating_point() or self.device.type != "cpu":
                raise AssertionError(f"host read of device data: Tensor.{name} on "
                                     f"{self.dtype} {self.device} {tuple(self.shape)}")
            return orig(self, *args, **kwargs)
        return check

    for n in names:
        setattr(torch.Tensor, n, guard(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def hybrid_worker(rank, world):
    """a2a+p2p at cp 6 as 2 x 3 and 3 x 2 (the ring has more than two holders)."""
    errors, n = [], 0
    for i, (a2a_size, layout, mname) in enumerate(HYBRID6_CASES):
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS, hq, hkv, seed=50 + i)
        ref = _single_device(*inputs, DOCS, MASKS[mname])
        plan, *local = _cp_run(rank, world, DOCS, layout, MASKS[mname], "a2a+p2p", inputs,
                               torch.float32, "torch", {"a2a_size": a2a_size},
                               validate=False, no_host_reads=True)
        _check_padding(plan, local[0], local[1], local[2:])
        errors += _compare_fp32(_gather(plan, local), ref,
                                f"[a2a+p2p {a2a_size}x{world // a2a_size} {layout} {mname}]")
        n += 1
    assert not errors, "\n".join(errors)
    return n


def cases_worker(rank, world, strategy, opts):
    """Every layout x mask, alternating the two GQA head splits; fp32, torch backend.
    The CP forward + backward run under ``forbid_host_reads`` (the plan is built first)."""
    errors, n = [], 0
    for i, (layout, (mname, mask)) in enumerate(
            (l, m) for l in LAYOUTS for m in MASKS.items()):
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS, hq, hkv, seed=i)
        ref = _single_device(*inputs, DOCS, mask)
        plan, *local = _cp_run(rank, world, DOCS, layout, mask, strategy, inputs,
                               torch.float32, "torch", opts, validate=(i == 0),
                               no_host_reads=(i > 0))
        _check_padding(plan, local[0], local[1], local[2:])
        errors += _compare_fp32(_gather(plan, local), ref,
                                f"[{strategy} cp={world} {layout} {mname} {hq}/{hkv}]")
        n += 1
    # 3 tokens: some ranks hold nothing at all (contiguous, dual_chunk at cp >= 3).
    for layout in LAYOUTS:
        hq, hkv = HEADS[world][0]
        inputs = _global_inputs(TINY, hq, hkv, seed=99)
        ref = _single_device(*inputs, TINY, MASKS["causal"])
        plan, *local = _cp_run(rank, world, TINY, layout, MASKS["causal"], strategy, inputs,
                               torch.float32, "torch", opts, validate=False)
        errors += _compare_fp32(_gather(plan, local), ref,
                                f"[{strategy} cp={world} {layout} tiny {hq}/{hkv}]")
        n += 1
    assert not errors, "\n".join(errors)
    return n


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["p2p", "all_gather", "a2a", "a2a+p2p"])
def test_matches_single_device(strategy, cp, tmp_path):
    opts = dict(STRATEGY_OPTS[strategy])
    if strategy == "a2a+p2p" and cp == 4:
        opts["a2a_size"] = 2  # 2 x 2: a real hybrid (the default would pick pure Ulysses)
    if strategy == "a2a+p2p" and cp == 3:
        opts["a2a_size"] = 1  # pure ring through the hybrid path
    n = run_distributed(cases_worker, cp, tmp_path, strategy, opts)
    assert n == [len(LAYOUTS) * (len(MASKS) + 1)] * cp


def test_hybrid_cp6(tmp_path):
    assert run_distributed(hybrid_worker, 6, tmp_path) == [len(HYBRID6_CASES)] * 6


# ------------------------------------- fp16 on the Triton interpreter, bf16 on the twin
DOCS16 = [1, 37, 9, 70, 5]                      # 122 tokens: interpreter tiles are slow
# (strategy, layout, mask, dtype, backend). The interpreter computes bf16 wrongly, so bf16
# runs on the torch twin here (and would run on Triton on a GPU).
HALF_CASES = [("p2p", "dual_chunk", "causal", torch.float16, "triton"),
              ("all_gather", "te", "chunk_causal", torch.float16, "triton"),
              ("a2a", "contiguous", "swa2", torch.float16, "triton"),
              ("p2p", "te", "swa", torch.bfloat16, "torch"),
              ("all_gather", "contiguous", "chunk", torch.bfloat16, "torch"),
              ("a2a", "dual_chunk", "full", torch.bfloat16, "torch")]


def _dense(inputs, docs, mask, dtype, low):
    """tests.reference attention in ``dtype`` (fp64: the truth; ``low``: plain PyTorch),
    from the same ``low``-rounded inputs; returns out, lse, dq, dk, dv."""
    from tests.reference import reference_attn
    cu = _cu(docs)
    q, k, v = (t.to(low).to(dtype).requires_grad_() for t in inputs[:3])
    out, lse = reference_attn(q, k, v, cu, cu, causal=mask.causal,
                              window_size=mask.window_size, chunk_size=mask.chunk_size,
                              dtype=dtype)
    out.backward(inputs[3].to(low).to(dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


def half_worker(rank, world):
    """fp16 / bf16 CP vs the fp64 reference, with flash-attn's tolerance rule: at most 2x
    (out, lse) or 3x (grads) the error of plain PyTorch in the same dtype, plus a floor."""
    from tests.reference import assert_close_to_reference
    for i, (strategy, layout, mname, dtype, backend) in enumerate(HALF_CASES):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = _global_inputs(DOCS16, hq, hkv, seed=100 + i)
        ref64 = _dense(inputs, DOCS16, mask, torch.float64, dtype)
        plain = _dense(inputs, DOCS16, mask, dtype, dtype)
        plan, *local = _cp_run(rank, world, DOCS16, layout, mask, strategy,
                               [t.to(dtype) for t in inputs], dtype, backend, {})
        _check_padding(plan, local[0], local[1], local[2:])
        got = _gather(plan, local)
        for name, g, r, p in zip(NAMES, got, ref64, plain):
            factor, floor = (2, 1e-3) if name in ("out", "lse") else (3, 2e-3)
            assert_close_to_reference(f"[{strategy} {dtype} {layout} {mname}] {name}", g, r,
                                      p, factor=factor, floor=floor)
    return len(HALF_CASES)


def test_fp16_bf16(tmp_path):
    assert run_distributed(half_worker, 2, tmp_path, timeout_s=400) == [len(HALF_CASES)] * 2


# ------------------------------------------------------------------ bytes really posted
class _ByteCounter:
    """Counts bytes each rank sends through the collectives the strategies call."""

    def __init__(self):
        import torch.distributed as dist
        from varlen_cp.strategies import all_gather
        self.total = 0
        self._dist, self._ag = dist, all_gather
        self._saved = (dist.batch_isend_irecv, dist.all_to_all_single,
                       all_gather._all_gather_single)

    def __enter__(self):
        dist, (p2p_fn, a2a_fn, ag_fn) = self._dist, self._saved

        def p2p(ops):
            self.total += sum(op.tensor.numel() * op.tensor.element_size()
                              for op in ops if op.op is dist.isend)
            return p2p_fn(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kw):
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            me = dist.get_rank(group)
            self.total += row * (sum(input_split_sizes) - input_split_sizes[me])
            return a2a_fn(output, input, output_split_sizes, input_split_sizes, group=group,
                          **kw)

        def ag(output, input, group=None, **kw):
            self.total += (dist.get_world_size(group) - 1) * input.numel() * input.element_size()
            return ag_fn(output, input, group=group, **kw)

        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
        self._ag._all_gather_single = ag
        return self

    def __exit__(self, *exc):
        dist = self._dist
        dist.batch_isend_irecv, dist.all_to_all_single, self._ag._all_gather_single = \
            self._saved


BYTE_CASES = [("contiguous", "swa"), ("dual_chunk", "causal"), ("te", "chunk_causal"),
              ("balanced", "chunk")]


def bytes_worker(rank, world):
    """fp16 forward + backward of every strategy; the bytes each collective really sends
    must equal the strategy's ``bytes_sent_per_rank``."""
    from varlen_cp.strategies import get_strategy
    mismatches, n = [], 0
    for strategy in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        opts = {"a2a_size": 2} if strategy == "a2a+p2p" else {}
        for i, (layout, mname) in enumerate(BYTE_CASES):
            mask = MASKS[mname]
            hq, hkv = HEADS[world][i % 2]
            q, k, v, dout = _global_inputs(DOCS, hq, hkv, seed=i)
            plan = _plan(DOCS, world, rank, layout)
            ql, kl, vl = (plan.shard(t).half().requires_grad_() for t in (q, k, v))
            with _ByteCounter() as fwd:
                out = cp_varlen_attn(ql, kl, vl, plan, mask, None, strategy, backend="torch",
                                     **opts)
            with _ByteCounter() as bwd:
                out.backward(plan.shard(dout).half())
            want = get_strategy(strategy).bytes_sent_per_rank(
                plan, mask, head_dim=D, head_dim_v=DV, n_heads=hq, n_kv_heads=hkv,
                dtype_bytes=2, **opts)
            got = (fwd.total, bwd.total)
            if got != (want["fwd"][rank], want["bwd"][rank]):
                mismatches.append(f"{strategy} {layout} {mname}: sent {got}, model "
                                  f"{(want['fwd'][rank], want['bwd'][rank])}")
            n += 1
    assert not mismatches, "\n".join(mismatches)
    return n


def test_bytes_sent_match_the_cost_model(tmp_path):
    assert run_distributed(bytes_worker, 4, tmp_path) == [4 * len(BYTE_CASES)] * 4


# -------------------------------------------------------------------------- bad input
def _expect(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def bad_input_worker(rank, world):
    """Every bad call raises ValueError on every rank before any collective (a collective
    reached by one rank only would hang the others until the test's timeout)."""
    mask = MASKS["causal"]
    plan = CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=rank, min_chunk_tokens=4)
    q, k, v, _ = (plan.shard(t) for t in _global_inputs(DOCS, 4, 2, seed=0))

    def call(*a, **kw):
        args = dict(q=q, k=k, v=v, plan=plan, mask=mask)
        args.update(kw)
        return lambda: cp_varlen_attn(args.pop("q"), args.pop("k"), args.pop("v"),
                                      args.pop("plan"), args.pop("mask"), *a, **args)

    _expect(call(q=q[:-1]), "local tokens")
    _expect(call(v=v[:, :1]), "head counts differ")
    _expect(call(k=k.half()), "dtypes differ")
    _expect(call(mask="causal"), "AttnMask")
    _expect(call(strategy="ring"), "strategy must be one of")
    _expect(call(softmax_scale=-1.0), "softmax_scale")
    _expect(call(backend="cuda"), "backend")
    _expect(call(plan="plan"), "CPPlan")
    _expect(call(strategy="p2p", a2a_size=2), "a2a_size applies")
    other = CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=1 - rank, min_chunk_tokens=4)
    if other.num_tokens_of(1 - rank) == plan.num_tokens:
        _expect(call(plan=other), "cp_rank")
    big = CPPlan.build(_cu(DOCS), cp_size=world + 1, cp_rank=rank, min_chunk_tokens=4)
    qb, kb, vb, _ = (big.shard(t) for t in _global_inputs(DOCS, 4, 2, seed=0))
    _expect(call(q=qb, k=kb, v=vb, plan=big), "size 2 differs")
    q3 = torch.randn(q.shape[0], 3, D)
    k3, v3 = torch.randn(q.shape[0], 3, D), torch.randn(q.shape[0], 3, DV)
    _expect(call(q=q3, k=k3, v=v3, strategy="a2a"), "Hq=3 must be divisible")
    q6 = torch.randn(q.shape[0], 6, D)
    _expect(call(q=q6, k=k3, v=v3, strategy="a2a"), "Hkv=3")
    _expect(call(q=q6, k=k3, v=v3, strategy="a2a+p2p", a2a_size=2), "Hkv=3")
    _expect(call(strategy="a2a+p2p", a2a_size=3), "divisor")
    # Different plans with equal local sizes: only the fingerprint check can tell.
    docs = [40, 20, 90] if rank == 0 else [50, 50, 50]
    odd = CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout="contiguous")
    qo, ko, vo, _ = (odd.shard(t) for t in _global_inputs(docs, 4, 2, seed=0))
    _expect(call(q=qo, k=ko, v=vo, plan=odd, validate=True), "different plans")
    # The module equals the function; the good call still works after all of the above.
    module = ContextParallelVarlenAttention(mask, strategy="all_gather")
    torch.testing.assert_close(module(q, k, v, plan),
                               cp_varlen_attn(q, k, v, plan, mask, None, "p2p"))
    return True


def test_bad_input_raises_before_communicating(tmp_path):
    assert run_distributed(bad_input_worker, 2, tmp_path, collective_timeout_s=30) == [True] * 2


# ------------------------------------------------------------------------------ cp == 1
@pytest.mark.parametrize("layout", ["dual_chunk", "te"])
def test_cp1_is_the_local_op(layout, one_thread):
    """cp == 1 needs no process group; every strategy is the single-device op (te pads)."""
    mask = MASKS["chunk_causal"]
    inputs = _global_inputs(DOCS, 4, 2, seed=7)
    ref = _single_device(*inputs, DOCS, mask)
    plan = CPPlan.build(_cu(DOCS), cp_size=1, cp_rank=0, layout=layout)
    for strategy in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
        out, lse = cp_varlen_attn(q, k, v, plan, mask, strategy=strategy, return_lse=True)
        out.backward(plan.shard(inputs[3]))
        local = (out.detach(), lse, q.grad, k.grad, v.grad)
        _check_padding(plan, local[0], local[1], local[2:])
        got = [plan.unshard_parts([local[0]]), plan.unshard_parts([local[1].t()]).t()]
        got += [plan.unshard_parts([g]) for g in local[2:]]
        assert not _compare_fp32(got, ref, f"[cp1 {layout} {strategy}]")
    module = ContextParallelVarlenAttention(mask)
    torch.testing.assert_close(module(*(plan.shard(t) for t in inputs[:3]), plan),
                               ref[0] if layout == "dual_chunk" else module(
                                   *(plan.shard(t) for t in inputs[:3]), plan))


# -------------------------------------------------------------------- host cost model
def test_cost_model_counts_every_visible_pair_once(one_thread):
    """Summed over ranks, each strategy's visible pairs are the batch's (plan.work_of)."""
    from varlen_cp.strategies import get_strategy
    docs = [300, 17, 1, 90, 5, 411]
    for layout in LAYOUTS:
        for cp in (2, 3, 4):
            plan = _plan(docs, cp, 0, layout)
            for mask in MASKS.values():
                total = sum(plan.work_of(r, mask) for r in range(cp))
                for strategy in ("p2p", "all_gather", "a2a", "a2a+p2p"):
                    c = get_strategy(strategy).compute_per_rank(
                        plan, mask, block=(64, 64), n_heads=12, n_kv_heads=cp)
                    assert sum(c["visible"]) == pytest.approx(total), (strategy, layout, cp)
                    assert all(a >= b for a, b in zip(c["visited"], c["visible"]))


def test_cost_model_bytes_by_hand(one_thread):
    """One 400-token document, contiguous over 4 ranks (100 each), causal window 7: the
    ring stops after one hop; all_gather picks 7 keys from the left neighbour."""
    from varlen_cp.strategies import get_strategy
    plan = CPPlan.build(_cu([400]), cp_size=4, cp_rank=0, layout="contiguous")
    mask = AttnMask(causal=True, window_size=(7, 0))
    kw = dict(head_dim=128, head_dim_v=128, n_kv_heads=2, n_heads=8, dtype_bytes=2)
    kv_row = 2 * 256 * 2
    p2p = get_strategy("p2p").bytes_sent_per_rank(plan, mask, **kw)
    assert p2p["fwd"] == [100 * kv_row] * 4
    # Backward: K/V again, plus the partial dK/dV of the left neighbour's keys (rank 0's
    # queries see nothing of rank 3, so it sends no partial).
    assert p2p["bwd"] == [100 * kv_row] + [200 * kv_row] * 3
    ag = get_strategy("all_gather").bytes_sent_per_rank(plan, mask, **kw)
    assert ag["fwd"] == [3 * 100 * kv_row] * 4
    assert ag["bwd"] == [0, 7 * kv_row, 7 * kv_row, 7 * kv_row]
    a2a = get_strategy("a2a").bytes_sent_per_rank(plan, mask, **kw)
    qkv_row = (2 * 128 + 1 * 256) * 2      # per member: 2 q heads, 1 K/V head (replicated)
    out_row = 2 * 128 * 2
    assert a2a["fwd"] == [3 * 100 * qkv_row + 300 * out_row] * 4
    assert a2a["bwd"] == [3 * 100 * out_row + 300 * qkv_row] * 4
