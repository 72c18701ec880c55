"""The CP grid every strategy test runs: the batch (odd lengths, a length-1 and an empty
document, one much longer than the others), the masks, the layouts, the head splits per cp,
small cut sizes that make documents span ranks, the single-device and dense references, a
CP call on one rank, the padding check, the gather to global order and fp32 comparisons."""

from __future__ import annotations

import contextlib

import torch

from tests.helpers.guards import forbid_host_reads
from tests.reference import reference_attn
from varlen_cp import AttnMask, AttnOptions, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.plan import CPPlan, layout_spec

DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens
TINY = [2, 1]                                  # 3 tokens: some ranks hold nothing
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
NAMES = ("out", "lse", "dq", "dk", "dv")


def cu(docs: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(docs), dtype=torch.int64).cumsum(0)


def small_plan(docs, world, rank, layout, mask=None, tile_tokens=8):
    """Small cut sizes, so that documents of a tiny batch really span ranks: dual_chunk
    cuts documents of >= 2*cp*4 tokens, balanced (for ``mask``, default causal) cuts on a
    grid of ``tile_tokens``."""
    spec = {"dual_chunk": {"min_chunk_tokens": 4},
            "balanced": {"masks": mask, "tile_tokens": tile_tokens}}.get(layout, {})
    return CPPlan.build(cu(docs), cp_size=world, cp_rank=rank,
                        layout=layout_spec(layout, **spec))


def global_inputs(docs, hq, hkv, seed, d=D, dv=DV):
    """q, k, v and dout of the global batch (fp32); head dims ``d`` (q, k) and ``dv``."""
    g = torch.Generator().manual_seed(seed)
    total = sum(docs)
    return (torch.randn(total, hq, d, generator=g), torch.randn(total, hkv, d, generator=g),
            torch.randn(total, hkv, dv, generator=g), torch.randn(total, hq, dv, generator=g))


def single_device(q, k, v, dout, docs, mask):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32);
    out, lse, dq, dk, dv."""
    c = cu(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, c, c, max(docs), max(docs), None, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True,
                           backend="torch")
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def dense(inputs, docs, mask, dtype, low):
    """tests.reference attention in ``dtype`` (fp64: the truth; ``low``: plain PyTorch),
    from the same ``low``-rounded inputs; returns out, lse, dq, dk, dv."""
    c = cu(docs)
    q, k, v = (t.to(low).to(dtype).requires_grad_() for t in inputs[:3])
    out, lse = reference_attn(q, k, v, c, c, causal=mask.causal,
                              window_size=mask.window_size, chunk_size=mask.chunk_size,
                              dtype=dtype)
    out.backward(inputs[3].to(low).to(dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


def cp_run(rank, world, docs, layout, mask, options: AttnOptions, inputs,
           dtype=torch.float32, no_host_reads=False, return_lse=True):
    """CP forward + backward on this rank with ``options`` (an ``AttnOptions``); returns
    the plan and (out, lse, dq, dk, dv) of the local tokens (lse None without
    ``return_lse``)."""
    q, k, v, dout = inputs
    plan = small_plan(docs, world, rank, layout, mask)
    ql, kl, vl = (plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    dout_l = plan.shard(dout).to(dtype)
    with forbid_host_reads() if no_host_reads else contextlib.nullcontext():
        res = cp_varlen_attn(ql, kl, vl, plan, mask, None, options, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out.backward(dout_l)
    return plan, out.detach(), lse, ql.grad, kl.grad, vl.grad


def check_padding(plan, out, lse, grads):
    """Padding rows (te layout): out 0, lse -inf, zero gradients."""
    pad = plan.token_indices < 0
    if not bool(pad.any()):
        return
    assert bool((out[pad] == 0).all()), "padding rows: out must be 0"
    assert lse is None or bool(torch.isneginf(lse[:, pad]).all()), \
        "padding rows: lse must be -inf"
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool((g[pad] == 0).all()), f"padding rows: {name} must be 0"


def gather(plan, local):
    """This rank's (out, lse, dq, dk, dv) gathered to the global order on every rank."""
    out, lse, dq, dk, dv = local
    return (plan.unshard(out.float()),
            None if lse is None else plan.unshard(lse.t().contiguous()).t(),
            plan.unshard(dq.float()), plan.unshard(dk.float()), plan.unshard(dv.float()))


def compare_fp32(got, ref, what):
    """Errors (strings) of (out, lse, dq, dk, dv) vs the reference, fp32 tolerances."""
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
