"""The softmax-extras cases under CP: sinks, the max logit, a loss on out and LSE, the
reference on the whole batch, and the per-rank error lists (padding rows included)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.cp_grid import DV, MASKS, NAMES, D, cu
from varlen_cp.kernels import varlen_attn

EXTRAS_MASKS = {name: m for name, m in MASKS.items() if name != "swa2"}
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def extras_inputs(docs, hq, hkv, seed):
    """q, k, v, dout, the LSE's loss weights, and a sink (all global, fp32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(docs)
    return (torch.randn(t, hq, D, generator=g), torch.randn(t, hkv, D, generator=g),
            torch.randn(t, hkv, DV, generator=g), torch.randn(t, hq, DV, generator=g),
            torch.randn(hq, t, generator=g), torch.randn(hq, generator=g))


def extras_loss(out, lse, dout, w_lse):
    """A loss on out and, when returned, lse (its finite entries: padding rows of a
    vanilla softmax have lse -inf)."""
    loss = (out.float() * dout).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
                       * w_lse).sum()
    return loss


def sink_arg(softmax_type, sink):
    """The ``sink`` argument of a call with ``softmax_type`` (a fresh leaf, or None)."""
    if softmax_type != "learnable":
        return None
    return sink.clone().requires_grad_()


def extras_reference(inputs, docs, mask, softmax_type, return_lse):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32),
    with the sink, the max logit and a loss on out (and lse)."""
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    dout, w_lse = inputs[3], inputs[4]
    sink = sink_arg(softmax_type, inputs[5])
    c = cu(docs)
    out, lse, max_logit = varlen_attn(q, k, v, c, c, max(docs), max(docs), None,
                                      mask.causal, mask.window_size,
                                      chunk_size=mask.chunk_size, return_lse=True,
                                      return_max_logit=True, softmax_type=softmax_type,
                                      sink=sink, backend="torch")
    extras_loss(out, lse if return_lse else None, dout, w_lse).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                max_logit=max_logit, dsink=None if sink is None else sink.grad)


def extras_padding_errors(plan, got, softmax_type, sink):
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


def extras_errors(plan, got, ref, sink_grad, world, what, atol=3e-5, rtol=3e-4):
    """Errors (strings) of this rank's results, gathered to global order, vs ``ref``: the
    max logit must also be the same on every rank, and the sink's gradient summed over the
    ranks the reference's (collective: every rank calls it)."""
    errors = []
    for name in NAMES:
        if name == "lse" and got["lse"] is None:
            continue
        local = got[name].float()
        g = plan.unshard(local.t().contiguous()).t() if name == "lse" else plan.unshard(local)
        if torch.isnan(g).any():
            errors.append(f"{what} {name}: NaN")
            continue
        try:
            torch.testing.assert_close(g, ref[name].float(), atol=atol, rtol=rtol)
        except AssertionError as e:
            errors.append(f"{what} {name}: {str(e).splitlines()[2:5]}")
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
