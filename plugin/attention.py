"""The public context-parallel attention op and module.

``cp_varlen_attn`` takes this rank's local q/k/v (in the plan's local order) and returns the
attention of the local queries over the keys of the whole packed batch, as if the batch sat
on one device. The plan (``varlen_cp.CPPlan``) says which tokens each rank holds; the
strategy says how K/V (or heads) move: "p2p" (ring), "all_gather", "a2a" (Ulysses) or
"a2a+p2p" (Ulysses inside groups, ring across them).

All argument checks run before any communication, so a bad call fails with a ValueError on
every rank instead of hanging a collective. With cp_size == 1 the call is the local
differentiable op. Limits: self-attention only (q and k share the plan's token layout);
the LSE output is not differentiable (as in flash-attn).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .kernels import varlen_attn
from .masks import AttnMask
from .plan import CPPlan
from .strategies import get_strategy
from .strategies.auto import choose_strategy
from .strategies.common import (Attn, block_for, cached_on, check_fingerprint, check_inputs,
                                check_rank, kernel_call, rank_holder, resolve_group)


def _check_scale(softmax_scale: Any) -> None:
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float))
                                      or not softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive float or None, got "
                         f"{softmax_scale!r}")


def _local_attn(q, k, v, plan: CPPlan, attn: Attn, block: tuple[int, int],
                return_lse: bool):
    """cp == 1: the single-device differentiable op on the plan's (only) rank."""
    holder = rank_holder(plan, plan.cp_rank)
    call = cached_on(plan, ("local", attn.mask, block), q.device,
                     lambda: kernel_call(holder, holder, attn.mask, block))
    m = attn.mask
    return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, attn.scale,
                       m.causal, m.window_size, chunk_size=m.chunk_size,
                       q_positions=call.q_pos, k_positions=call.k_pos,
                       return_lse=return_lse, backend=attn.backend, schedule=call.schedule)


def cp_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                   mask: AttnMask, group: Any = None, strategy: str = "p2p",
                   softmax_scale: float | None = None, return_lse: bool = False,
                   backend: str = "auto", validate: bool = False, *,
                   a2a_size: int | None = None):
    """Context-parallel varlen attention of this rank's local tokens.

    q [T_local, Hq, D], k [T_local, Hkv, D], v [T_local, Hkv, Dv]: this rank's tokens in
    the plan's local order (``plan.shard`` of the global tensors). ``group``: the CP
    process group (default group when None); its size must be ``plan.cp_size``.
    ``mask``: a ``varlen_cp.AttnMask`` (causal / window / chunk), applied on the plan's
    positions within each document. ``strategy``: "p2p", "all_gather", "a2a", "a2a+p2p",
    "dispatch" or "auto" (chosen per (plan, mask) from the plan's cost estimates, see
    ``varlen_cp.strategies.auto``; the same on every rank)
    (``a2a_size``: Ulysses group size for "a2a+p2p"; default the largest divisor of cp
    that divides Hq). ``validate``: check first that all ranks built the same plan (one
    small all-reduce and a host sync).
    Returns out [T_local, Hq, Dv] in q's dtype, and with ``return_lse`` the fp32 LSE
    [Hq, T_local] (natural log; -inf for rows that see nothing, e.g. padding).
    """
    if strategy != "auto":
        get_strategy(strategy)  # validates the name before anything else
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    check_inputs(q, k, v, plan, mask)
    _check_scale(softmax_scale)
    if a2a_size is not None and strategy != "a2a+p2p":
        raise ValueError(f"a2a_size applies to strategy 'a2a+p2p' only, got "
                         f"a2a_size={a2a_size!r} with strategy={strategy!r}")
    block = block_for(backend, q.device, q.shape[2], v.shape[2])  # validates backend
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    attn = Attn(mask, scale, backend)
    if plan.cp_size == 1:
        return _local_attn(q, k, v, plan, attn, block, return_lse)
    group = resolve_group(group, plan.cp_size)
    check_rank(group, plan.cp_rank)
    if strategy == "auto":  # host cost model, cached in the plan per (mask, shapes, dtype)
        strategy = choose_strategy(plan, mask, n_heads=q.shape[1], n_kv_heads=k.shape[1],
                                   head_dim=q.shape[2], head_dim_v=v.shape[2],
                                   dtype_bytes=q.element_size(), block=block)
    strat = get_strategy(strategy)
    opts = {} if a2a_size is None else {"a2a_size": a2a_size}
    strat.check_heads(q.shape[1], k.shape[1], plan.cp_size, **opts)
    if validate:
        check_fingerprint(plan, group, q.device)
    out, lse = strat.attention(q, k, v, plan, attn, group, block, need_lse=return_lse, **opts)
    return (out, lse) if return_lse else out


class ContextParallelVarlenAttention(nn.Module):
    """``cp_varlen_attn`` as a module: the mask and strategy are fixed at construction,
    the plan (shared by all layers of one batch) is passed to ``forward``."""

    def __init__(self, mask: AttnMask, strategy: str = "p2p", group: Any = None,
                 backend: str = "auto", softmax_scale: float | None = None, *,
                 a2a_size: int | None = None) -> None:
        super().__init__()
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
        if strategy != "auto":
            get_strategy(strategy)
        _check_scale(softmax_scale)
        self.mask = mask
        self.strategy = strategy
        self.group = group
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.a2a_size = a2a_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                plan: CPPlan) -> torch.Tensor:
        return cp_varlen_attn(q, k, v, plan, self.mask, self.group, self.strategy,
                              self.softmax_scale, backend=self.backend, a2a_size=self.a2a_size)

    def extra_repr(self) -> str:
        return f"mask={self.mask}, strategy={self.strategy!r}, backend={self.backend!r}"
