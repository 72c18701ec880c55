"""cp == 1: the single-device differentiable op on the plan's only rank.

Every strategy degenerates to this when the plan has one rank; it still runs through the
same validation, tables (cached in the plan) and sink / max-logit handling as the others,
so a model debugged on one device behaves as it will under CP.
"""

from __future__ import annotations

import torch

from ..kernels import max_logit_of, varlen_attn_unchecked
from ..masks import AttnMask
from ..plan import CPPlan
from ..schedules.shape import Shape
from ..schedules.holders import KernelCall, kernel_call, rank_holder
from ..schedules.keys import device_table, table_key
from .base import CallSpec, Strategy


def _local_call(plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device) -> KernelCall:
    def build() -> KernelCall:
        holder = rank_holder(plan, plan.cp_rank)
        return kernel_call(holder, holder, mask, block)
    return device_table(plan, table_key("local", mask, block), device, build)


class Local(Strategy):
    """The plan's local tokens attend to themselves: one differentiable kernel call."""

    name = "local"

    def prepare(self, plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device, shape: Shape, a2a_size: int | None = None,
                overlap_stages: int | None = None) -> None:
        _local_call(plan, mask, block, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        c = _local_call(spec.plan, spec.attn.mask, spec.block, q.device)
        causal, wl, wr, chunk = spec.attn.mask.params
        out, lse, row_max = varlen_attn_unchecked(
            q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, spec.attn.scale, causal, wl, wr, chunk,
            c.q_pos, c.k_pos, spec.attn.backend, c.schedule, spec.need_max)
        return out, lse, None if row_max is None else max_logit_of(row_max)
