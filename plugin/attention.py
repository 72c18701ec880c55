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

All argument checks run once per call (``varlen_cp.cp_call.prepare_call``), before any
communication, so a bad call fails with a ValueError on every rank instead of hanging a
collective; the strategies then
run on host tables built from the plan (``varlen_cp.schedules``) and call the kernels
without re-checking per step. ``validate`` (the default): every rank of the group must have
built the same plan (ranks that disagree would otherwise get silently wrong results or a
hung collective): ``varlen_cp.plan.agreement``, one 16-byte all-reduce of host tensors per
(plan, group), no device sync. The integrations run it in the step's sharding of the batch,
before the model runs; a call on a plan the step did not check runs it itself, on the
host, at the first layer (later layers find it done). With cp_size == 1
the call is the local differentiable op, after the same checks (a strategy's option and
head rules included). Under torch.compile the whole call (checks included, at run time) is
one opaque custom op (``varlen_cp.graph_op``): no graph break, and a new plan is new data for
the graph, not a recompile. Limits: self-attention only (q and k share the plan's token
layout).
A learnable sink is replicated on the CP ranks: each rank's ``sink.grad`` is its own
queries' share, summed by the usual gradient all-reduce over the CP (and data) ranks, as
for every other replicated parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checks import check_bool, check_choice
from .config import AttnShape, check_overlap_stages
from .cp_call import (check_a2a_size, check_flags, check_inputs, check_scale,  # noqa: F401
                      prepare_call, resolve_group, run_eager, strategy_for)
from .graph_op import graph_call
from .kernels import SOFTMAX_TYPES, apply_softmax_sink, block_sizes_for
from .kernels.validation import BACKENDS
from .masks import AttnMask
from .plan import CPPlan
from .plan.collective import check_group_type
from .schedules.auto import choose_strategy
from .schedules.shape import make_shape
from .strategies import get_strategy

def _results(out: torch.Tensor, lse: torch.Tensor, max_logit: torch.Tensor | None,
             return_lse: bool):
    """``varlen_attn``'s return convention: out, then lse, then max_logit, as asked."""
    res = (out,) + ((lse,) if return_lse else ()) + \
        ((max_logit,) if max_logit is not None else ())
    return res if len(res) > 1 else out


# -------------------------------------------------------------------------- ahead of time
def _check_device(device: Any) -> torch.device:
    """``device`` as a torch.device that this process can use (ValueError otherwise)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a device string, got "
                         f"{device!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested, but CUDA is not available")
    return device


def prepare_attention(plan: CPPlan, mask: AttnMask, strategy: str, shape: Any,
                      device: torch.device, *, backend: str = "auto",
                      a2a_size: int | None = None, overlap_stages: int | None = None) -> str:
    """Build and cache in ``plan`` every table ``cp_varlen_attn(..., mask, strategy=...)``
    will need for inputs of ``shape`` (``varlen_cp.config.AttnShape``) on ``device``;
    returns the strategy that will run (``auto`` resolved). Host work and non-blocking
    copies only (see ``varlen_cp.prepare``)."""
    if strategy != "auto":
        get_strategy(strategy)
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    if not isinstance(shape, AttnShape):
        raise ValueError(f"shape must be a varlen_cp.config.AttnShape, got "
                         f"{type(shape).__name__}")
    device = _check_device(device)
    check_choice("backend", backend, BACKENDS)
    check_a2a_size(strategy, a2a_size)
    check_overlap_stages(overlap_stages, strategy)
    if strategy != "auto":  # the call's own rule, so a bad option fails ahead of the step
        get_strategy(strategy).check_heads(shape.n_heads, shape.n_kv_heads, plan.cp_size,
                                           a2a_size)
    block = tuple(block_sizes_for(backend, device, shape.head_dim, shape.value_dim,
                                  dtype=shape.dtype))
    cost_shape = make_shape(shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.value_dim,
                            shape.dtype.itemsize)
    if strategy == "auto" and plan.cp_size > 1:
        strategy = choose_strategy(plan, mask, n_heads=shape.n_heads,
                                   n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                                   head_dim_v=shape.value_dim,
                                   dtype_bytes=shape.dtype.itemsize)
    chosen = strategy_for(plan, strategy)
    chosen.prepare(plan, mask, block, device, cost_shape, a2a_size,
                   overlap_stages if chosen.staged else None)
    return "p2p" if strategy == "auto" else strategy


# ------------------------------------------------------------------------------ the op
def cp_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                   mask: AttnMask, group: Any = None, strategy: str = "p2p",
                   softmax_scale: float | None = None, return_lse: bool = False,
                   backend: str = "auto", validate: bool = True, *,
                   a2a_size: int | None = None, return_max_logit: bool = False,
                   softmax_type: str = "vanilla", sink: torch.Tensor | None = None,
                   overlap_stages: int | None = None):
    """Context-parallel varlen attention of this rank's local tokens.

    q [T_local, Hq, D], k [T_local, Hkv, D], v [T_local, Hkv, Dv]: this rank's tokens in
    the plan's local order (``plan.shard`` of the global tensors). ``group``: the CP
    process group (default group when None); its size must be ``plan.cp_size``.
    ``mask``: a ``varlen_cp.AttnMask`` (causal / window / chunk), applied on the plan's
    positions within each document. ``strategy``: "p2p", "all_gather", "a2a", "a2a+p2p",
    "dispatch" or "auto" (chosen per (plan, mask) from closed-form costs on the plan, see
    ``varlen_cp.schedules.auto``; the same on every rank)
    (``a2a_size``: Ulysses group size for "a2a+p2p"; default the largest divisor of cp
    that divides Hq). ``overlap_stages``: "dispatch" / "all_gather" (or "auto" when it
    picks one of them): S kernel stages, the local keys first and the remote K/V in S - 1
    transfers, each in flight while the previous stage computes (1: one transfer, then one
    call; None: the cost model's choice, cached in the plan per mask and head shape; see
    ``varlen_cp.schedules.staged``). ``validate`` (default True): all ranks must have built
    the same plan; checked once per plan on the host (``varlen_cp.plan.agreement``: one
    16-byte all-reduce of host tensors, no device sync), nothing to do when the step's
    sharding already checked it; False skips it.
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
    if torch.compiler.is_compiling():  # one opaque custom op: no break, no recompile
        check_flags(return_lse, return_max_logit, validate, softmax_type, sink, q.shape[1],
                    q.device)
        # The sink rescales by the merged LSE, so the op must hand it back.
        need_lse = return_lse or softmax_type != "vanilla"
        out, lse, max_logit = graph_call(q, k, v, plan, mask, group, strategy, softmax_scale,
                                         backend, validate, a2a_size, need_lse,
                                         return_max_logit, overlap_stages)
    else:
        chosen, spec = prepare_call(q, k, v, plan, mask, group, strategy, softmax_scale,
                                    backend, validate, a2a_size, return_lse,
                                    return_max_logit, overlap_stages, softmax_type, sink)
        out, lse, max_logit = run_eager(q, k, v, chosen, spec)
    out, lse = apply_softmax_sink(out, lse, softmax_type, sink)
    return _results(out, lse, max_logit, return_lse)


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
                 n_heads: int | None = None, track_max_logit: bool = False,
                 validate: bool = True, overlap_stages: int | None = None) -> None:
        super().__init__()
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
        if strategy != "auto":
            get_strategy(strategy)
        # Everything that does not depend on the inputs is checked here, so a bad option
        # fails when the model is built, not at its first forward.
        check_group_type(group)
        check_choice("backend", backend, BACKENDS)
        check_scale(softmax_scale)
        check_a2a_size(strategy, a2a_size)
        check_bool("track_max_logit", track_max_logit)
        check_bool("validate", validate)
        check_overlap_stages(overlap_stages, strategy)
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
        self.overlap_stages = overlap_stages
        self.softmax_type = softmax_type
        self.track_max_logit = track_max_logit
        self.validate = validate
        self.sink = sink
        self.max_logit: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                plan: CPPlan) -> torch.Tensor:
        # A model cast to bf16 casts the sink too; the op wants fp32 (the cast is
        # differentiable, so the parameter still gets its gradient).
        sink = None if self.sink is None else self.sink.float()
        res = cp_varlen_attn(q, k, v, plan, self.mask, self.group, self.strategy,
                             self.softmax_scale, backend=self.backend, validate=self.validate,
                             a2a_size=self.a2a_size, overlap_stages=self.overlap_stages,
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
