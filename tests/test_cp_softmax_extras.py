"""Softmax extras under CP: max logit and attention sinks, every strategy x mask, gloo.

One launch per cp (2, 3, 4) runs every strategy x mask (causal, full, SWA, chunked,
chunked + causal) on two layouts (dual_chunk; te, which pads), cycling the softmax type
(vanilla, off-by-one, learnable) and two GQA head splits, and compares with the
single-device op (``varlen_attn``, torch backend, same softmax type and sink; itself
checked against the dense reference in the kernel tests):
- forward: out, lse (differentiable, sink included), max_logit (identical on every rank);
- backward of a loss on out AND lse (so the LSE's gradient path of every strategy runs):
  dq, dk, dv, and the learnable sink's gradient summed over the ranks (each rank holds a
  replica and gets its own queries' share, as the usual CP gradient all-reduce expects).
Every CP forward + backward runs with host reads of device data forbidden. The cp 2 launch
also runs one Triton (interpreter) case, the module, and bad input with every collective
patched to raise, so a ValueError proves that validation came before any communication.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_cp_strategies import HEADS, forbid_host_reads
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan

DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens, as the other CP tests
DOCS_TRITON = [1, 37, 9, 70, 5]                # interpreter tiles are slow: fewer tokens
D, DV = 32, 16
MASKS = {
    "causal": AttnMask(causal=True),
    "full": AttnMask(causal=False),
    "swa": AttnMask(causal=True, window_size=(7, 0)),
    "chunk": AttnMask(causal=False, chunk_size=16),
    "chunk_causal": AttnMask(causal=True, chunk_size=12),
}
STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch")
LAYOUTS = ("dual_chunk", "te")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
NAMES = ("out", "lse", "dq", "dk", "dv")


def _cu(docs: list[int]) -> torch.Tensor:
    return torch.tensor([0] + docs).cumsum(0)


def _plan(docs, world, rank, layout):
    """Small cut sizes, so that documents of this tiny batch really span ranks."""
    return CPPlan.build(_cu(docs), cp_size=world, cp_rank=rank, layout=layout,
                        min_chunk_tokens=4)


def _inputs(docs, hq, hkv, seed):
    """q, k, v, dout, the LSE's loss weights, and a sink (all global, fp32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(docs)
    return (torch.randn(t, hq, D, generator=g), torch.randn(t, hkv, D, generator=g),
            torch.randn(t, hkv, DV, generator=g), torch.randn(t, hq, DV, generator=g),
            torch.randn(hq, t, generator=g), torch.randn(hq, generator=g))


def _loss(out, lse, dout, w_lse):
    """A loss on out and, when returned, lse (its finite entries: padding rows of a
    vanilla softmax have lse -inf)."""
    loss = (out.float() * dout).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
                       * w_lse).sum()
    return loss


def _sink_arg(softmax_type, sink):
    if softmax_type != "learnable":
        return None
    return sink.clone().requires_grad_()


def _single_device(inputs, docs, mask, softmax_type, return_lse):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32)."""
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    dout, w_lse = inputs[3], inputs[4]
    sink = _sink_arg(softmax_type, inputs[5])
    cu = _cu(docs)
    out, lse, max_logit = varlen_attn(q, k, v, cu, cu, max(docs), max(docs), None,
                                      mask.causal, mask.window_size,
                                      chunk_size=mask.chunk_size, return_lse=True,
                                      return_max_logit=True, softmax_type=softmax_type,
                                      sink=sink, backend="torch")
    _loss(out, lse if return_lse else None, dout, w_lse).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                max_logit=max_logit, dsink=None if sink is None else sink.grad)


def _cp_run(rank, world, docs, layout, mask, strategy, inputs, softmax_type, return_lse,
            backend="torch", opts=None):
    """CP forward + backward on this rank, host reads of device data forbidden."""
    plan = _plan(docs, world, rank, layout)
    ql, kl, vl = (plan.shard(t).requires_grad_() for t in inputs[:3])
    dout, w_lse = plan.shard(inputs[3]), plan.shard(inputs[4], dim=1)
    sink = _sink_arg(softmax_type, inputs[5])
    with forbid_host_reads():
        res = cp_varlen_attn(ql, kl, vl, plan, mask, None, strategy, return_lse=return_lse,
                             backend=backend, return_max_logit=True,
                             softmax_type=softmax_type, sink=sink, **(opts or {}))
        out, lse, max_logit = res if return_lse else (res[0], None, res[1])
        _loss(out, lse, dout, w_lse).backward()
    got = dict(out=out.detach(), lse=None if lse is None else lse.detach(), dq=ql.grad,
               dk=kl.grad, dv=vl.grad, max_logit=max_logit,
               dsink=None if sink is None else sink.grad)
    return plan, got


def _check_padding(plan, got, softmax_type, sink):
    """Padding rows: out 0, lse -inf (the sink logit with a sink), zero gradients."""
    pad = plan.token_indices < 0
    if not bool(pad.any()):
        return []
    errors = []
    if not bool((got["out"][pad] == 0).all()):
        errors.append("padding out != 0")
    if got["lse"] is not None:
        want = {"vanilla": float("-inf"), "off-by-one": 0.0}.get(softmax_type)
        expect = (sink[:, None] if want is None else torch.full((sink.numel(), 1), want))
        if not torch.equal(got["lse"][:, pad], expect.expand(-1, int(pad.sum()))):
            errors.append("padding lse != sink logit / -inf")
    for name in ("dq", "dk", "dv"):
        if not bool((got[name][pad] == 0).all()):
            errors.append(f"padding {name} != 0")
    return errors


def _compare(plan, got, ref, sink_grad, world, what, atol=3e-5, rtol=3e-4):
    """Errors (strings) of this rank's results, gathered to global order, vs ``ref``."""
    import torch.distributed as dist
    errors = []
    for name in NAMES:
        if name == "lse" and got["lse"] is None:
            continue
        local = got[name].float()
        if name == "lse":
            g = plan.unshard(local.t().contiguous()).t()
        else:
            g = plan.unshard(local)
        if torch.isnan(g).any():
            errors.append(f"{what} {name}: NaN")
            continue
        try:
            torch.testing.assert_close(g, ref[name].float(), atol=atol, rtol=rtol)
        except AssertionError as e:
            errors.append(f"{what} {name}: {str(e).splitlines()[2:5]}")
    # max logit: the reference's value, bit-identical on every rank
    m = got["max_logit"]
    if m.dtype != torch.float32 or m.shape != ref["max_logit"].shape:
        errors.append(f"{what} max_logit: {m.dtype} {tuple(m.shape)}")
    else:
        every = [torch.empty_like(m) for _ in range(world)]
        dist.all_gather(every, m)
        if not all(torch.equal(e, m) for e in every):
            errors.append(f"{what} max_logit differs across ranks: {every}")
        if not torch.allclose(m, ref["max_logit"], atol=1e-5, rtol=1e-5):
            errors.append(f"{what} max_logit {m} vs {ref['max_logit']}")
    if ref["dsink"] is not None:
        total = sink_grad.clone()
        dist.all_reduce(total)
        if not torch.allclose(total, ref["dsink"], atol=1e-4, rtol=1e-4):
            errors.append(f"{what} dsink {total} vs {ref['dsink']}")
    return errors


def _cases():
    """(strategy, mask name, layout, softmax type, return_lse, head split index)."""
    for s, strategy in enumerate(STRATEGIES):
        for j, mname in enumerate(MASKS):
            i = s * len(MASKS) + j
            softmax_type = SOFTMAX_TYPES[i % 3]
            # Vanilla without the LSE: the a2a path that skips its LSE all-to-all.
            return_lse = not (softmax_type == "vanilla" and j % 2)
            yield strategy, mname, LAYOUTS[(s + j) % 2], softmax_type, return_lse, i % 2


def _opts(strategy, world):
    if strategy == "a2a+p2p" and world == 4:
        return {"a2a_size": 2}      # a real hybrid (the default picks pure Ulysses)
    if strategy == "a2a+p2p" and world == 3:
        return {"a2a_size": 1}      # the ring through the hybrid entry point
    return {}


def cases_worker(rank, world):
    errors, n = [], 0
    for c, (strategy, mname, layout, softmax_type, return_lse, h) in enumerate(_cases()):
        hq, hkv = HEADS[world][h]
        inputs = _inputs(DOCS, hq, hkv, seed=c)
        mask = MASKS[mname]
        ref = _single_device(inputs, DOCS, mask, softmax_type, return_lse)
        plan, got = _cp_run(rank, world, DOCS, layout, mask, strategy, inputs, softmax_type,
                            return_lse, opts=_opts(strategy, world))
        what = f"[{strategy} cp={world} {layout} {mname} {softmax_type} {hq}/{hkv}]"
        errors += [f"{what} {e}" for e in _check_padding(plan, got, softmax_type, inputs[5])]
        errors += _compare(plan, got, ref, got["dsink"], world, what)
        n += 1
    if world == 2:
        errors += _triton_case(rank, world)
        _module_case(rank, world)
        _bad_input(rank, world)
    assert not errors, "\n".join(errors)
    return n


def _triton_case(rank, world):
    """p2p on the Triton interpreter: per-step row maxes from the Triton kernel, folded
    across ring steps; the sink's gradient through the Triton backward's dlse."""
    hq, hkv = HEADS[world][0]
    inputs = _inputs(DOCS_TRITON, hq, hkv, seed=77)
    mask = MASKS["chunk_causal"]
    ref = _single_device(inputs, DOCS_TRITON, mask, "learnable", True)
    plan, got = _cp_run(rank, world, DOCS_TRITON, "dual_chunk", mask, "p2p", inputs,
                        "learnable", True, backend="triton")
    return _compare(plan, got, ref, got["dsink"], world, "[triton p2p learnable]",
                    atol=1e-4, rtol=1e-3)


def _module_case(rank, world):
    """The module owns the sink parameter and records the max logit; it equals the op."""
    hq, hkv = HEADS[world][0]
    q, k, v, dout, _, sink = _inputs(DOCS, hq, hkv, seed=5)
    mask = MASKS["swa"]
    plan = _plan(DOCS, world, rank, "dual_chunk")
    module = ContextParallelVarlenAttention(mask, "dispatch", softmax_type="learnable",
                                            n_heads=hq, track_max_logit=True)
    assert module.max_logit is None and module.sink.dtype == torch.float32
    with torch.no_grad():
        module.sink.copy_(sink)
    ql, kl, vl = (plan.shard(t) for t in (q, k, v))
    out = module(ql, kl, vl, plan)
    (out * plan.shard(dout)).sum().backward()
    want, max_logit = cp_varlen_attn(ql, kl, vl, plan, mask, None, "p2p",
                                     return_max_logit=True, softmax_type="learnable",
                                     sink=sink)
    torch.testing.assert_close(out.detach(), want, atol=3e-5, rtol=3e-4)
    torch.testing.assert_close(module.max_logit, max_logit)  # p2p vs dispatch: rounding
    assert not module.max_logit.requires_grad
    assert module.sink.grad is not None and module.sink.grad.shape == (hq,)
    plain = ContextParallelVarlenAttention(mask, softmax_type="off-by-one")
    assert plain.sink is None and plain.max_logit is None
    assert not any(True for _ in plain.parameters())


@contextlib.contextmanager
def _no_communication():
    """Every collective and P2P call the strategies (and plan checks) use raises."""
    import torch.distributed as dist
    from varlen_cp.strategies import all_gather
    names = ("all_reduce", "all_to_all_single", "batch_isend_irecv", "all_gather",
             "all_gather_into_tensor", "new_group", "broadcast", "barrier")
    saved = {n: getattr(dist, n) for n in names}
    saved_ag = all_gather._all_gather_single

    def refuse(*_a, **_k):
        raise RuntimeError("communication before validation")

    for n in names:
        setattr(dist, n, refuse)
    all_gather._all_gather_single = refuse
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        all_gather._all_gather_single = saved_ag


def _bad_input(rank, world):
    hq, hkv = HEADS[world][0]
    q, k, v, *_ = _inputs(DOCS, hq, hkv, seed=0)
    plan = _plan(DOCS, world, rank, "dual_chunk")
    ql, kl, vl = (plan.shard(t) for t in (q, k, v))
    mask = MASKS["causal"]
    good = torch.zeros(hq)
    bad_calls = [
        (dict(softmax_type="softmax1"), "softmax_type"),
        (dict(softmax_type="learnable"), "sink"),
        (dict(softmax_type="learnable", sink=torch.zeros(hq + 1)), "sink"),
        (dict(softmax_type="learnable", sink=torch.zeros(hq, 1)), "sink"),
        (dict(softmax_type="learnable", sink=good.half()), "sink"),
        (dict(softmax_type="learnable", sink=[0.0] * hq), "sink"),
        (dict(softmax_type="vanilla", sink=good), "sink"),
        (dict(softmax_type="off-by-one", sink=good), "sink"),
        (dict(return_max_logit="yes"), "return_max_logit"),
    ]
    with _no_communication():
        for strategy in STRATEGIES:
            for kwargs, match in bad_calls:
                with pytest.raises(ValueError, match=match):
                    cp_varlen_attn(ql, kl, vl, plan, mask, None, strategy, **kwargs)
        for kwargs, match in [(dict(softmax_type="learnable"), "n_heads"),
                              (dict(softmax_type="learnable", n_heads=0), "n_heads"),
                              (dict(softmax_type="sink"), "softmax_type"),
                              (dict(track_max_logit=1), "track_max_logit")]:
            with pytest.raises(ValueError, match=match):
                ContextParallelVarlenAttention(mask, **kwargs)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_softmax_extras_match_single_device(cp, tmp_path):
    n = run_distributed(cases_worker, cp, tmp_path, timeout_s=300)
    assert n == [len(STRATEGIES) * len(MASKS)] * cp


def test_cp1_is_the_local_op():
    """cp == 1 needs no process group: the same options reach the local op."""
    hq, hkv = 4, 2
    inputs = _inputs(DOCS, hq, hkv, seed=3)
    mask = MASKS["chunk_causal"]
    ref = _single_device(inputs, DOCS, mask, "learnable", True)
    plan = CPPlan.build(_cu(DOCS), cp_size=1, cp_rank=0)
    q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
    sink = inputs[5].clone().requires_grad_()
    out, lse, max_logit = cp_varlen_attn(q, k, v, plan, mask, return_lse=True,
                                         return_max_logit=True, softmax_type="learnable",
                                         sink=sink)
    _loss(out, lse, plan.shard(inputs[3]), plan.shard(inputs[4], dim=1)).backward()
    for name, got in (("out", out.detach()), ("lse", lse.detach().t()), ("dq", q.grad),
                      ("dk", k.grad), ("dv", v.grad)):
        want = ref[name].t() if name == "lse" else ref[name]
        torch.testing.assert_close(plan.unshard_parts([got]), want, atol=3e-5, rtol=3e-4,
                                   msg=name)
    torch.testing.assert_close(max_logit, ref["max_logit"])
    torch.testing.assert_close(sink.grad, ref["dsink"], atol=1e-4, rtol=1e-4)
