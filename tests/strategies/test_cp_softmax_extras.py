"""Softmax extras under CP: max logit and attention sinks, every strategy x mask, gloo.

One pytest item per cp x strategy x mask (``[cp3-p2p-swa]``), one launch per cp (2, 3, 4)
for the selected ones (``helpers.launches``): every strategy x mask (causal, full, SWA,
chunked, chunked + causal) on two layouts (dual_chunk; te, which pads), cycling the softmax
type (vanilla, off-by-one, learnable) and two GQA head splits, and compares with the
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

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.launches import GroupLaunches, assert_case_clean
from tests.helpers.cp_grid import DOCS, HEADS, cu, small_plan
from tests.helpers.guards import forbid_host_reads, no_communication
from tests.helpers.softmax_extras import (EXTRAS_MASKS as MASKS, SOFTMAX_TYPES, extras_errors,
                                          extras_inputs, extras_loss, extras_padding_errors,
                                          extras_reference, sink_arg)
from varlen_cp import AttnOptions
from varlen_cp.attention import ContextParallelVarlenAttention, cp_varlen_attn
from varlen_cp.plan import CPPlan
from varlen_cp.strategies import STRATEGIES as STRATEGY_REGISTRY

DOCS_TRITON = [1, 37, 9, 70, 5]                # interpreter tiles are slow: fewer tokens
STRATEGIES = tuple(STRATEGY_REGISTRY)            # the catalogue's names, in its order
LAYOUTS = ("dual_chunk", "te")


def _cp_run(rank, world, docs, layout, mask, strategy, inputs, softmax_type, return_lse,
            backend="torch", a2a_size=None):
    """CP forward + backward on this rank, host reads of device data forbidden."""
    plan = small_plan(docs, world, rank, layout)
    ql, kl, vl = (plan.shard(t).requires_grad_() for t in inputs[:3])
    dout, w_lse = plan.shard(inputs[3]), plan.shard(inputs[4], dim=1)
    sink = sink_arg(softmax_type, inputs[5])
    options = AttnOptions(strategy=strategy, backend=backend, a2a_size=a2a_size)
    with forbid_host_reads():
        res = cp_varlen_attn(ql, kl, vl, plan, mask, None, options, return_lse=return_lse,
                             return_max_logit=True, softmax_type=softmax_type, sink=sink)
        out, lse, max_logit = res if return_lse else (res[0], None, res[1])
        extras_loss(out, lse, dout, w_lse).backward()
    got = dict(out=out.detach(), lse=None if lse is None else lse.detach(), dq=ql.grad,
               dk=kl.grad, dv=vl.grad, max_logit=max_logit,
               dsink=None if sink is None else sink.grad)
    return plan, got


def _cases():
    """(strategy, mask name, layout, softmax type, return_lse, head split index)."""
    for s, strategy in enumerate(STRATEGIES):
        for j, mname in enumerate(MASKS):
            i = s * len(MASKS) + j
            softmax_type = SOFTMAX_TYPES[i % 3]
            # Vanilla without the LSE: the a2a path that skips its LSE all-to-all.
            return_lse = not (softmax_type == "vanilla" and j % 2)
            yield strategy, mname, LAYOUTS[(s + j) % 2], softmax_type, return_lse, i % 2


def _a2a_size(strategy, world):
    if strategy == "a2a+p2p" and world == 4:
        return 2      # a real hybrid (the default picks pure Ulysses)
    if strategy == "a2a+p2p" and world == 3:
        return 1      # the ring through the hybrid entry point
    return None


def cases_worker(rank, world, names):
    """The named cases (``strategy-mask`` of ``_cases``; at cp 2 also ``triton``,
    ``module``, ``bad_input``); returns each case's errors."""
    cases = {f"{c[0]}-{c[1]}": (i, c) for i, c in enumerate(_cases())}
    errors = {}
    for name in names:
        if name not in cases:
            errors[name] = EXTRA_CASES[name](rank, world) or []
            continue
        c, (strategy, mname, layout, softmax_type, return_lse, h) = cases[name]
        hq, hkv = HEADS[world][h]
        inputs = extras_inputs(DOCS, hq, hkv, seed=c)
        mask = MASKS[mname]
        ref = extras_reference(inputs, DOCS, mask, softmax_type, return_lse)
        plan, got = _cp_run(rank, world, DOCS, layout, mask, strategy, inputs, softmax_type,
                            return_lse, a2a_size=_a2a_size(strategy, world))
        what = f"[{strategy} cp={world} {layout} {mname} {softmax_type} {hq}/{hkv}]"
        errors[name] = [f"{what} {e}"
                        for e in extras_padding_errors(plan, got, softmax_type, inputs[5])]
        errors[name] += extras_errors(plan, got, ref, got["dsink"], world, what)
    return errors


def _triton_case(rank, world):
    """p2p on the Triton interpreter: per-step row maxes from the Triton kernel, folded
    across ring steps; the sink's gradient through the Triton backward's dlse."""
    hq, hkv = HEADS[world][0]
    inputs = extras_inputs(DOCS_TRITON, hq, hkv, seed=77)
    mask = MASKS["chunk_causal"]
    ref = extras_reference(inputs, DOCS_TRITON, mask, "learnable", True)
    plan, got = _cp_run(rank, world, DOCS_TRITON, "dual_chunk", mask, "p2p", inputs,
                        "learnable", True, backend="triton")
    return extras_errors(plan, got, ref, got["dsink"], world, "[triton p2p learnable]",
                    atol=1e-4, rtol=1e-3)


def _module_case(rank, world):
    """The module owns the sink parameter and records the max logit; it equals the op."""
    hq, hkv = HEADS[world][0]
    q, k, v, dout, _, sink = extras_inputs(DOCS, hq, hkv, seed=5)
    mask = MASKS["swa"]
    plan = small_plan(DOCS, world, rank, "dual_chunk")
    module = ContextParallelVarlenAttention(mask, AttnOptions(strategy="dispatch"),
                                            softmax_type="learnable",
                                            n_heads=hq, track_max_logit=True)
    assert module.max_logit is None and module.sink.dtype == torch.float32
    with torch.no_grad():
        module.sink.copy_(sink)
    ql, kl, vl = (plan.shard(t) for t in (q, k, v))
    out = module(ql, kl, vl, plan)
    (out * plan.shard(dout)).sum().backward()
    want, max_logit = cp_varlen_attn(ql, kl, vl, plan, mask, None, AttnOptions(),
                                     return_max_logit=True, softmax_type="learnable",
                                     sink=sink)
    torch.testing.assert_close(out.detach(), want, atol=3e-5, rtol=3e-4)
    torch.testing.assert_close(module.max_logit, max_logit)  # p2p vs dispatch: rounding
    assert not module.max_logit.requires_grad
    assert module.sink.grad is not None and module.sink.grad.shape == (hq,)
    plain = ContextParallelVarlenAttention(mask, softmax_type="off-by-one")
    assert plain.sink is None and plain.max_logit is None
    assert not any(True for _ in plain.parameters())


def _bad_input(rank, world):
    hq, hkv = HEADS[world][0]
    q, k, v, *_ = extras_inputs(DOCS, hq, hkv, seed=0)
    plan = small_plan(DOCS, world, rank, "dual_chunk")
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
    with no_communication():
        for strategy in STRATEGIES:
            for kwargs, match in bad_calls:
                with pytest.raises(ValueError, match=match):
                    cp_varlen_attn(ql, kl, vl, plan, mask, None,
                                   AttnOptions(strategy=strategy), **kwargs)
        for kwargs, match in [(dict(softmax_type="learnable"), "n_heads"),
                              (dict(softmax_type="learnable", n_heads=0), "n_heads"),
                              (dict(softmax_type="sink"), "softmax_type"),
                              (dict(track_max_logit=1), "track_max_logit")]:
            with pytest.raises(ValueError, match=match):
                ContextParallelVarlenAttention(mask, **kwargs)


EXTRA_CASES = {"triton": _triton_case, "module": _module_case, "bad_input": _bad_input}
# Kept in the fast lane (scripts/run_tests.sh --fast): at cp 2 every strategy with one mask
# each, the Triton case, the module and bad input; the other cases are marked slow.
FAST = {f"{c[0]}-{c[1]}" for c in _cases() if c[1] == list(MASKS)[STRATEGIES.index(c[0])]}


def extras_params():
    for cp in (2, 3, 4):
        extra = list(EXTRA_CASES) if cp == 2 else []
        for name in [f"{c[0]}-{c[1]}" for c in _cases()] + extra:
            fast = cp == 2 and (name in FAST or name in EXTRA_CASES)
            slow = () if fast else (pytest.mark.slow,)
            yield pytest.param(cp, name, marks=slow, id=f"cp{cp}-{name}")


@pytest.fixture(scope="module")
def extras_launches():
    return GroupLaunches(("cp",))


@pytest.mark.parametrize("cp, name", list(extras_params()))
def test_softmax_extras_match_single_device(cp, name, extras_launches, request,
                                            tmp_path_factory):
    """One item per case; one launch per cp runs the selected cases."""
    errors = extras_launches.result(request, lambda siblings: run_distributed(
        cases_worker, cp, tmp_path_factory.mktemp("extras"), [p["name"] for p in siblings],
        timeout_s=300))
    assert_case_clean(errors, name)


def test_cp1_is_the_local_op():
    """cp == 1 needs no process group: the same options reach the local op."""
    hq, hkv = 4, 2
    inputs = extras_inputs(DOCS, hq, hkv, seed=3)
    mask = MASKS["chunk_causal"]
    ref = extras_reference(inputs, DOCS, mask, "learnable", True)
    plan = CPPlan.build(cu(DOCS), cp_size=1, cp_rank=0)
    q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
    sink = inputs[5].clone().requires_grad_()
    out, lse, max_logit = cp_varlen_attn(q, k, v, plan, mask, return_lse=True,
                                         return_max_logit=True, softmax_type="learnable",
                                         sink=sink)
    extras_loss(out, lse, plan.shard(inputs[3]), plan.shard(inputs[4], dim=1)).backward()
    for name, got in (("out", out.detach()), ("lse", lse.detach().t()), ("dq", q.grad),
                      ("dk", k.grad), ("dv", v.grad)):
        want = ref[name].t() if name == "lse" else ref[name]
        torch.testing.assert_close(plan.unshard_parts([got]), want, atol=3e-5, rtol=3e-4,
                                   msg=name)
    torch.testing.assert_close(max_logit, ref["max_logit"])
    torch.testing.assert_close(sink.grad, ref["dsink"], atol=1e-4, rtol=1e-4)
