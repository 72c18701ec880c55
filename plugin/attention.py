"""The public context-parallel attention op and module.

``cp_varlen_attn`` takes this rank's local q/k/v (in the plan's local order) and returns the
attention of the local queries over the keys of the whole packed batch, as if the batch sat
on one device. The plan (``varlen_cp.CPPlan``) says which tokens each rank holds; the
strategy says how K/V (or heads) move: "p2p" (ring), "all_gather", "a2a" (Ulysses) or
"a2a+p2p" (Ulysses inside groups, ring across them).

Softmax extras (the same options as ``varlen_attn``): ``return_max_logit`` gives the fp32
[Hq] max of the scaled visible scores over the whole global batch, identical on every rank:
each strategy returns this rank's per-head maxes, folded with ``torch.maximum`` on the
compute stream, and ONE ``all_reduce(MAX)`` on the CP group, issued after the strategy has
returned its results on the current stream, joins them (no host sync). Attention sinks
(``softmax_type`` "off-by-one" or "learnable" with ``sink``) enter ONCE, after the
strategy's partial results are merged, through ``apply_softmax_sink`` on (out, lse); that is
why the strategies' LSE is differentiable.

All argument checks run before any communication, so a bad call fails with a ValueError on
every rank instead of hanging a collective. With cp_size == 1 the call is the local
differentiable op. Limits: self-attention only (q and k share the plan's token layout).
A learnable sink is replicated on the CP ranks: each rank's ``sink.grad`` is its own
queries' share, summed by the usual gradient all-reduce over the CP (and data) ranks, as
for every other replicated parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .kernels import SOFTMAX_TYPES, apply_softmax_sink, check_softmax_args, varlen_attn
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


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _results(out: torch.Tensor, lse: torch.Tensor, max_logit: torch.Tensor | None,
             return_lse: bool):
    """``varlen_attn``'s return convention: out, then lse, then max_logit, as asked."""
    res = (out,) + ((lse,) if return_lse else ()) + \
        ((max_logit,) if max_logit is not None else ())
    return res if len(res) > 1 else out


def _local_attn(q, k, v, plan: CPPlan, attn: Attn, block: tuple[int, int],
                return_lse: bool, return_max_logit: bool, softmax_type: str,
                sink: torch.Tensor | None):
    """cp == 1: the single-device differentiable op on the plan's (only) rank."""
    holder = rank_holder(plan, plan.cp_rank)
    call = cached_on(plan, ("local", attn.mask, block), q.device,
                     lambda: kernel_call(holder, holder, attn.mask, block))
    m = attn.mask
    return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, attn.scale,
                       m.causal, m.window_size, chunk_size=m.chunk_size,
                       q_positions=call.q_pos, k_positions=call.k_pos,
                       return_lse=return_lse, backend=attn.backend, schedule=call.schedule,
                       return_max_logit=return_max_logit, softmax_type=softmax_type,
                       sink=sink)


def prepare_attention(plan: CPPlan, mask: AttnMask, strategy: str, shape: Any,
                      device: torch.device, *, backend: str = "auto",
                      a2a_size: int | None = None) -> str:
    """Build and cache in ``plan`` every table ``cp_varlen_attn(..., mask, strategy=...)``
    will need for inputs of ``shape`` (``varlen_cp.prepare.AttnShape``) on ``device``;
    returns the strategy that will run (``auto`` resolved). Host work and non-blocking
    copies only (see ``varlen_cp.prepare``)."""
    if strategy != "auto":
        get_strategy(strategy)
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    block = block_for(backend, device, shape.head_dim, shape.value_dim)
    if plan.cp_size == 1:
        holder = rank_holder(plan, plan.cp_rank)
        cached_on(plan, ("local", mask, block), device,
                  lambda: kernel_call(holder, holder, mask, block))
        return "p2p" if strategy == "auto" else strategy
    if strategy == "auto":
        strategy = choose_strategy(plan, mask, n_heads=shape.n_heads,
                                   n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                                   head_dim_v=shape.value_dim,
                                   dtype_bytes=shape.dtype.itemsize, block=block)
    get_strategy(strategy).prepare(plan, mask, block, device, n_heads=shape.n_heads,
                                   n_kv_heads=shape.n_kv_heads, a2a_size=a2a_size)
    return strategy


def cp_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                   mask: AttnMask, group: Any = None, strategy: str = "p2p",
                   softmax_scale: float | None = None, return_lse: bool = False,
                   backend: str = "auto", validate: bool = False, *,
                   a2a_size: int | None = None, return_max_logit: bool = False,
                   softmax_type: str = "vanilla", sink: torch.Tensor | None = None):
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
    ``softmax_type``: "vanilla", "off-by-one" (a zero sink logit per head) or "learnable"
    (``sink``: fp32 [Hq] logits on q's device, usually an ``nn.Parameter``; it gets this
    rank's share of the gradient).
    Returns out [T_local, Hq, Dv] in q's dtype; then with ``return_lse`` the fp32 LSE
    [Hq, T_local] (natural log, differentiable, including the sink when there is one; -inf
    for rows that see nothing, e.g. padding, or the sink logit); then with
    ``return_max_logit`` the fp32 [Hq] max of the scaled visible scores of the whole global
    batch (the same on every rank; -inf for a head that sees nothing; not differentiable).
    A tuple when more than one.
    """
    if strategy != "auto":
        get_strategy(strategy)  # validates the name before anything else
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    check_inputs(q, k, v, plan, mask)
    _check_scale(softmax_scale)
    _check_flag("return_lse", return_lse)
    _check_flag("return_max_logit", return_max_logit)
    check_softmax_args(softmax_type, sink, q.shape[1], q.device)
    if a2a_size is not None and strategy != "a2a+p2p":
        raise ValueError(f"a2a_size applies to strategy 'a2a+p2p' only, got "
                         f"a2a_size={a2a_size!r} with strategy={strategy!r}")
    block = block_for(backend, q.device, q.shape[2], v.shape[2])  # validates backend
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    attn = Attn(mask, scale, backend)
    if plan.cp_size == 1:
        return _local_attn(q, k, v, plan, attn, block, return_lse, return_max_logit,
                           softmax_type, sink)
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
    # The sink rescales by the merged LSE, so the strategy must hand it back.
    need_lse = return_lse or softmax_type != "vanilla"
    out, lse, max_part = strat.attention(q, k, v, plan, attn, group, block,
                                         need_lse=need_lse, need_max=return_max_logit, **opts)
    out, lse = apply_softmax_sink(out, lse, softmax_type, sink)
    max_logit = None
    if return_max_logit:
        max_logit = _global_max(max_part, q.shape[1], q.device, group)
    return _results(out, lse, max_logit, return_lse)


def _global_max(max_part: torch.Tensor | None, n_heads: int, device: torch.device,
                group: Any) -> torch.Tensor:
    """One MAX all-reduce of this rank's per-head maxes over the CP group. Issued on the
    current stream after the strategy returned, i.e. after every kernel that wrote
    ``max_part`` was enqueued there (the strategies compute on the current stream)."""
    if max_part is None:  # a rank that computed nothing still joins the collective
        max_part = torch.full((n_heads,), float("-inf"), device=device)
    # A copy: the all-reduce writes in place, and the strategy's tensor is its own.
    max_part = max_part.detach().to(torch.float32, copy=True)
    dist.all_reduce(max_part, op=dist.ReduceOp.MAX, group=group)
    return max_part


class ContextParallelVarlenAttention(nn.Module):
    """``cp_varlen_attn`` as a module: the mask and strategy are fixed at construction,
    the plan (shared by all layers of one batch) is passed to ``forward``.

    ``softmax_type="learnable"`` creates ``self.sink = nn.Parameter(zeros(n_heads))``
    (fp32; ``n_heads`` required); otherwise ``self.sink`` is None. With
    ``track_max_logit`` every forward stores the global per-head max logit in
    ``self.max_logit`` (detached fp32 [Hq]) for metrics or a QK-clip step; else it stays
    None.
    """

    def __init__(self, mask: AttnMask, strategy: str = "p2p", group: Any = None,
                 backend: str = "auto", softmax_scale: float | None = None, *,
                 a2a_size: int | None = None, softmax_type: str = "vanilla",
                 n_heads: int | None = None, track_max_logit: bool = False) -> None:
        super().__init__()
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
        if strategy != "auto":
            get_strategy(strategy)
        _check_scale(softmax_scale)
        _check_flag("track_max_logit", track_max_logit)
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got "
                             f"{softmax_type!r}")
        sink = None
        if softmax_type == "learnable":
            if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
                raise ValueError(f"n_heads must be a positive int with "
                                 f"softmax_type='learnable' (one sink per head), got "
                                 f"{n_heads!r}")
            sink = nn.Parameter(torch.zeros(n_heads, dtype=torch.float32))
        self.mask = mask
        self.strategy = strategy
        self.group = group
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.a2a_size = a2a_size
        self.softmax_type = softmax_type
        self.track_max_logit = track_max_logit
        self.sink = sink
        self.max_logit: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                plan: CPPlan) -> torch.Tensor:
        # A model cast to bf16 casts the sink too; the op wants fp32 (the cast is
        # differentiable, so the parameter still gets its gradient).
        sink = None if self.sink is None else self.sink.float()
        res = cp_varlen_attn(q, k, v, plan, self.mask, self.group, self.strategy,
                             self.softmax_scale, backend=self.backend, a2a_size=self.a2a_size,
                             return_max_logit=self.track_max_logit,
                             softmax_type=self.softmax_type, sink=sink)
        if not self.track_max_logit:
            return res
        out, self.max_logit = res[0], res[1].detach()
        return out

    def extra_repr(self) -> str:
        extra = "" if self.softmax_type == "vanilla" else f", softmax_type={self.softmax_type!r}"
        return (f"mask={self.mask}, strategy={self.strategy!r}, backend={self.backend!r}"
                + extra)
