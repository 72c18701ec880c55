"""One context-parallel attention call: its checks, and the call itself, in two forms.

``prepare_call`` runs every check of ``cp_varlen_attn`` that involves the plan, the group or
the tensors (local token counts, GQA, the strategy's head rules, the plan agreement), picks
the strategy ("auto" from the plan's costs) and returns it with the call's ``CallSpec``,
all before any communication. The options themselves (``varlen_cp.AttnOptions``) were
checked when they were built; :func:`check_heads` is their one rule that needs the head
counts and cp. Then either:
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
from .kernels import block_sizes_for
from .kernels.api import resolve_backend
from .kernels.sink import check_softmax_args
from .kernels.flash import resolve_flash
from .kernels.validation import check_qkv
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan
from .plan.agreement import agree_on_plan
from .plan.collective import check_group_type
from .schedules.auto import choose_strategy
from .schedules.flash_form import FlashRoute
from .strategies import LOCAL, CallSpec, Strategy, get_strategy
from .strategies.calls import Attn


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


def check_options(options: Any) -> AttnOptions:
    """``options`` if it is a ``varlen_cp.AttnOptions`` (whose fields it checked itself)."""
    if not isinstance(options, AttnOptions):
        raise ValueError(f"options must be a varlen_cp.AttnOptions, got "
                         f"{type(options).__name__}")
    return options


def check_heads(options: AttnOptions, n_heads: int, n_kv_heads: int, cp_size: int) -> None:
    """The strategy's head rule for these options (the Ulysses split of "a2a", and an
    ``a2a_size`` that divides cp and splits the heads for "a2a+p2p"): ValueError
    otherwise. "auto" only considers strategies that fit. Run at every cp, so cp=1
    debugging catches a rule that cp>1 would break."""
    if options.strategy != "auto":
        get_strategy(options.strategy).check_heads(n_heads, n_kv_heads, cp_size,
                                                   options.a2a_size)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                 mask: Any) -> None:
    """Local q/k/v against each other (the kernels' own ``check_qkv``: shapes, dtypes,
    devices, GQA, head dims) and against the plan (local token counts)."""
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    check_qkv(q, k, v)
    n_local = plan.num_tokens_of(plan.cp_rank)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != n_local:
            raise ValueError(f"{name} has {t.shape[0]} local tokens, but the plan gives "
                             f"rank {plan.cp_rank} {n_local} tokens")


def resolve_group(group: Any, plan: CPPlan) -> Any:
    """The CP process group (``group``, else the default group) after checking that it is
    one, that its size is the plan's cp_size and that this process is the plan's rank."""
    check_group_type(group)
    if plan.cp_size == 1 and group is None:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"group: torch.distributed is not initialized, but the plan has "
                         f"cp_size={plan.cp_size} > 1")
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        raise ValueError(f"group: size {size} differs from the plan's cp_size={plan.cp_size}")
    rank = dist.get_rank(group)
    if rank != plan.cp_rank:
        raise ValueError(f"plan: built for cp_rank={plan.cp_rank}, but this process is rank "
                         f"{rank} of the group")
    return group


def flash_route(backend: str, device: torch.device, dtype: torch.dtype, n_heads: int,
                n_kv_heads: int, head_dim: int, head_dim_v: int, need_lse: bool,
                need_max: bool) -> FlashRoute | None:
    """The FlashAttention-class backend of a layer's calls (``kernels.flash.resolve_flash``)
    and the row sizes its tables weigh gathers with; None: our kernels only. The same
    resolution ahead of the step (``prepare_attention``) and per call."""
    name, _ = resolve_flash(backend, device, dtype, head_dim, head_dim_v, need_lse, need_max)
    if name is None:
        return None
    return FlashRoute.of(name, dtype, n_heads, n_kv_heads, head_dim, head_dim_v)


def strategy_for(plan: CPPlan, strategy: str) -> Strategy:
    return LOCAL if plan.cp_size == 1 else get_strategy(strategy)


# ------------------------------------------------------------------------------ the call
def check_flags(return_lse: Any, return_max_logit: Any, softmax_type: Any, sink: Any,
                n_heads: int, device: torch.device) -> None:
    """The call's flags and its sink (metadata only: also traced under torch.compile)."""
    for name, flag in (("return_lse", return_lse), ("return_max_logit", return_max_logit)):
        check_bool(name, flag)
    check_softmax_args(softmax_type, sink, n_heads, device)


def prepare_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, mask: Any,
                 group: Any, options: AttnOptions, softmax_scale: Any, return_lse: bool,
                 need_max: bool, softmax_type: str = "vanilla", sink: Any = None
                 ) -> tuple[Strategy, CallSpec]:
    """Every check of the call (ValueError, before any communication), the plan agreement
    (``options.validate``), and the strategy that will run with its spec. The strategy
    returns the LSE when ``return_lse`` or a sink needs it."""
    check_options(options)
    check_inputs(q, k, v, plan, mask)
    check_scale(softmax_scale)
    check_flags(return_lse, need_max, softmax_type, sink, q.shape[1], q.device)
    need_lse = return_lse or softmax_type != "vanilla"
    backend = resolve_backend(options.backend, q.device)
    block = tuple(block_sizes_for(backend, q.device, q.shape[2], v.shape[2], dtype=q.dtype))
    group = resolve_group(group, plan)
    check_heads(options, q.shape[1], k.shape[1], plan.cp_size)
    strategy = options.strategy
    if plan.cp_size > 1:
        if strategy == "auto":  # closed-form costs, cached in the plan per (mask, shapes)
            strategy = choose_strategy(plan, mask, n_heads=q.shape[1], n_kv_heads=k.shape[1],
                                       head_dim=q.shape[2], head_dim_v=v.shape[2],
                                       dtype_bytes=q.element_size())
        if options.validate:  # on the host, and a no-op when the step's sharding checked it
            agree_on_plan(plan, group)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    route = flash_route(options.backend, q.device, q.dtype, q.shape[1], k.shape[1],
                        q.shape[2], v.shape[2], need_lse, need_max)
    spec = CallSpec(plan, Attn(mask, scale, backend), group, block, need_lse, need_max,
                    options, route)
    return strategy_for(plan, strategy), spec


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
