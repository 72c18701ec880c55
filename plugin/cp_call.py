"""One context-parallel attention call: its per-call checks, and the call itself, in two
forms.

``resolve_call`` checks what only the call's tensors can tell (shapes, dtypes, devices,
GQA, the local token count against the plan; the scale, the group), reads the call's
``AttnShape`` off them and looks its resolution up (``varlen_cp.resolve.resolve``: strategy,
backend, tiles, FlashAttention route, stages; computed ahead of the step by
``build_tables``, or here at the first call of a plan), all before any communication; the
plan agreement (``options.validate``) follows. Its arguments' types (``CPPlan``,
``AttnMask``, ``AttnOptions``) were checked at the public entry (``cp_varlen_attn``) and
their fields when they were built. Then either:
- ``run_eager``: the strategy's autograd.Function, as every eager call has run it;
- ``varlen_cp.graph_op``: the same Function's forward and backward inside ONE opaque custom
  op, which is what torch.compile sees (no plan, group or table ever reaches a graph).
``global_max`` is the one MAX all-reduce that makes a max logit global, in both forms.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.distributed as dist

from .checks import check_bool
from .kernels.sink import check_softmax_args
from .kernels.validation import check_qkv
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan
from .plan.agreement import agree_on_plan
from .resolve import check_group, resolve
from .shape import AttnShape
from .strategies import CallSpec, Strategy
from .strategies.calls import Attn
from .tables.static_rows import check_capacity, check_send_capacity


# ------------------------------------------------------------------------------- checks
def check_scale(softmax_scale: Any) -> None:
    """None, or a positive float that stays finite and non-zero in fp32 (what the kernels
    scale scores in: 1e39 is inf there, 1e-50 is 0)."""
    if softmax_scale is None:
        return
    ok = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if ok:
        try:
            fp32 = struct.unpack("f", struct.pack("f", float(softmax_scale)))[0]
        except OverflowError:  # beyond fp32 (or a float), e.g. 1e39 or 10**400
            fp32 = math.inf
        ok = math.isfinite(fp32) and fp32 > 0
    if not ok:
        raise ValueError(f"softmax_scale must be a finite positive float (in fp32) or None, "
                         f"got {softmax_scale!r}")


# ------------------------------------------------------------------------------ the call
def check_flags(return_lse: Any, return_max_logit: Any, softmax_type: Any, sink: Any,
                n_heads: int, device: torch.device) -> None:
    """The call's flags and its sink (metadata only: also traced under torch.compile)."""
    for name, flag in (("return_lse", return_lse), ("return_max_logit", return_max_logit)):
        check_bool(name, flag)
    check_softmax_args(softmax_type, sink, n_heads, device)


def check_types(plan: Any, mask: Any, options: Any) -> None:
    """The public entry's check of the call's description objects (their fields were
    checked when they were built)."""
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    if not isinstance(options, AttnOptions):
        raise ValueError(f"options must be a varlen_cp.AttnOptions, got "
                         f"{type(options).__name__}")


def resolve_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                 mask: AttnMask, group: Any, options: AttnOptions, softmax_scale: Any,
                 need_lse: bool, need_max: bool) -> tuple[Strategy, CallSpec]:
    """The per-call checks (module docstring; ValueError, before any communication), the
    call's resolution, the plan agreement (``options.validate``), and the strategy that
    will run with its spec. ``need_lse``: the caller wants the LSE (returned, or for a
    sink's rescaling), which is also its gradient's input."""
    check_qkv(q, k, v)
    check_scale(softmax_scale)
    res = resolve(plan, mask, options, AttnShape.of(q, k, v, lse_grad=need_lse,
                                                    row_max=need_max), q.device)
    n_local, what = plan.num_tokens_of(plan.cp_rank), "the plan gives"
    if res.capacity is not None:   # graph-safe: capacity rows, the tokens first
        check_capacity(plan, res.capacity)
        if res.send_capacity is not None:
            check_send_capacity(plan, mask, res.send_capacity)
        n_local, what = res.capacity, "graph_capacity gives"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != n_local:
            raise ValueError(f"{name} has {t.shape[0]} local tokens, but {what} rank "
                             f"{plan.cp_rank} {n_local} tokens")
    group = check_group(group, plan)
    if plan.cp_size > 1 and options.validate:
        agree_on_plan(plan, group)  # on the host; a no-op when the step's sharding did it
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return res.strategy, CallSpec(plan, Attn(mask, scale, res.backend), group, res, need_lse,
                                  need_max)


def global_max(max_part: torch.Tensor | None, n_heads: int, device: torch.device,
               group: Any, cp_size: int) -> torch.Tensor:
    """One MAX all-reduce of this rank's per-head maxes over the CP group. Issued on the
    current stream after the strategy returned, i.e. after every kernel that wrote
    ``max_part`` was enqueued there (the strategies compute on the current stream)."""
    if max_part is None:  # a rank that computed nothing still joins the collective
        max_part = torch.full((n_heads,), float("-inf"), device=device)
    if cp_size == 1:
        return max_part.detach().float()
    # A copy: the all-reduce writes in place, and the strategy's tensor is its own.
    max_part = max_part.detach().to(torch.float32, copy=True)
    dist.all_reduce(max_part, op=dist.ReduceOp.MAX, group=group)
    return max_part


def run_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, strategy: Strategy,
              spec: CallSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, global max logit or None): the strategy's autograd.Function."""
    out, lse, max_part = strategy.attention(q, k, v, spec)
    max_logit = None
    if spec.need_max:
        max_logit = global_max(max_part, q.shape[1], q.device, spec.group,
                               spec.plan.cp_size)
    return out, lse, max_logit
