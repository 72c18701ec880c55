"""cp == 1: the single-device differentiable op on the plan's only rank.

Every strategy degenerates to this when the plan has one rank; it still runs through the
same validation, tables (cached in the plan) and sink / max-logit handling as the others,
so a model debugged on one device behaves as it will under CP.
"""

from __future__ import annotations

import torch

from ..kernels.sink import max_logit_of
from ..masks import AttnMask
from ..plan import CPPlan
from ..tables.flash_form import FlashRoute
from ..tables.holders import KernelCall
from ..tables.local import local_call
from .base import CallSpec, Resolution, Strategy
from .calls import dlse_or_none, no_max


def _local_call(plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device, route: FlashRoute | None) -> KernelCall:
    return local_call(plan, mask, block, device, route)


class LocalAttention(torch.autograd.Function):
    """One kernel call over the local tokens: (out, lse, max_part); lse is differentiable,
    max_part (or its empty stand-in) is not."""

    @staticmethod
    def forward(ctx, q, k, v, spec: CallSpec):
        c = _local_call(spec.plan, spec.attn.mask, spec.block, q.device, spec.route)
        out, lse, row_max = spec.attn.fwd(q, k, v, c, spec.need_max)
        max_part = max_logit_of(row_max) if spec.need_max else no_max(q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse = ctx.saved_tensors
        spec = ctx.spec
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        c = _local_call(spec.plan, spec.attn.mask, spec.block, q.device, spec.route)
        dq, dk, dv = spec.attn.bwd(dout, q, k, v, out, lse, c, dlse_or_none(dlse))
        return dq, dk, dv, None


class Local(Strategy):
    """The plan's local tokens attend to themselves: one differentiable kernel call."""

    name = "local"

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        _local_call(plan, mask, res.block, device, res.route)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        return LocalAttention, (spec,)
