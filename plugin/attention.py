"""The public context-parallel attention op and module.

``cp_varlen_attn`` takes this rank's local q/k/v (in the plan's local order) and returns the
attention of the local queries over the keys of the whole packed batch, as if the batch sat
on one device. The plan (``varlen_cp.CPPlan``) says which tokens each rank holds; the
options (``varlen_cp.AttnOptions``: strategy, backend, validate, a2a_size, overlap_stages,
checked once when built) say how it runs: the strategy says how K/V (or heads) move, "p2p"
(ring), "all_gather", "a2a" (Ulysses), "a2a+p2p" (Ulysses inside groups, ring across them),
"dispatch" or "auto". The module holds its options; the integrations' adapters (torchtitan's
inner attention, megatron's core attention) subclass it and call :meth:`attend`.

Softmax extras (the same options as ``varlen_attn``): ``return_max_logit`` gives the fp32
[Hq] max of the scaled visible scores over the whole global batch, identical on every rank:
each strategy returns this rank's per-head maxes, folded with ``torch.maximum`` on the
compute stream, and ONE ``all_reduce(MAX)`` on the CP group, issued after the strategy has
returned its results on the current stream, joins them (no host sync). Attention sinks
(``softmax_type`` "off-by-one" or "learnable" with ``sink``) enter ONCE, after the
strategy's partial results are merged, through ``apply_softmax_sink`` on (out, lse); that is
why the strategies' LSE is differentiable.

Every check that needs the call's tensors, plan or group runs once per call
(``varlen_cp.cp_call.resolve_call``), before any communication, so a bad call fails with a
ValueError on every rank instead of hanging a collective; the strategies then run on host
tables built from the plan (``varlen_cp.tables``) and call the kernels without
re-checking per step. ``validate`` (the default): every rank of the group must have
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

from .checks import check_bool
from .cp_call import check_flags, check_scale, check_types, resolve_call, run_eager
from .graph_op import graph_call
from .kernels.sink import SOFTMAX_TYPES, apply_softmax_sink
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan
from .plan.collective import check_group_type
from .resolve import resolve
from .shape import AttnShape

DEFAULT_OPTIONS = AttnOptions()  # one shared instance: the common call builds nothing


def resolve_options(options: Any) -> AttnOptions:
    """The call's ``AttnOptions``: ``options``, or the defaults for None (ValueError for
    anything else: the options are given one way)."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, AttnOptions):
        raise ValueError(f"options must be a varlen_cp.AttnOptions, got "
                         f"{type(options).__name__}")
    return options


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
    if device.type == "cuda" and device.index is None:
        # the index a tensor on it reports, so the call's resolution key matches
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_layer_tables(plan: CPPlan, mask: AttnMask, options: AttnOptions, shape: AttnShape,
                      device: torch.device) -> str:
    """Resolve (``varlen_cp.resolve``) and build, cached in ``plan``, every table
    ``cp_varlen_attn(..., mask, options=options)`` will need for inputs of ``shape``
    (``varlen_cp.AttnShape``) on ``device``; returns the strategy that will run (``auto``
    resolved; the configured name at cp 1). Host work and non-blocking copies only (see
    ``varlen_cp.prefetch``)."""
    check_types(plan, mask, options)
    if not isinstance(shape, AttnShape):
        raise ValueError(f"shape must be a varlen_cp.AttnShape, got {type(shape).__name__}")
    device = _check_device(device)
    res = resolve(plan, mask, options, shape, device)
    res.strategy.build_tables(plan, mask, res, device)
    return res.name


def refresh_layer_buffers(plan: CPPlan, mask: AttnMask, options: AttnOptions,
                          shape: AttnShape, device: torch.device) -> None:
    """The graph-safe mode (``options.graph_safe``): rewrite the layer type's device buffers
    in place for ``plan`` (one device copy each, on the current stream), before the step
    that runs on it, outside any captured region (docs/graph-safe.md); nothing otherwise.
    The tables come from :func:`build_layer_tables` (staged ahead) or are made here."""
    if not options.graph_safe:
        return
    device = _check_device(device)
    res = resolve(plan, mask, options, shape, device)
    res.strategy.refresh(plan, mask, res, device)


# ------------------------------------------------------------------------------ the op
def cp_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                   mask: AttnMask, group: Any = None, options: AttnOptions | None = None,
                   softmax_scale: float | None = None, return_lse: bool = False, *,
                   return_max_logit: bool = False, softmax_type: str = "vanilla",
                   sink: torch.Tensor | None = None):
    """Context-parallel varlen attention of this rank's local tokens.

    q [T_local, Hq, D], k [T_local, Hkv, D], v [T_local, Hkv, Dv]: this rank's tokens in
    the plan's local order (``plan.shard`` of the global tensors). ``group``: the CP
    process group (default group when None); its size must be ``plan.cp_size``.
    ``mask``: a ``varlen_cp.AttnMask`` (causal / window / chunk), applied on the plan's
    positions within each document. ``options``: a ``varlen_cp.AttnOptions`` (default
    ``AttnOptions()``: "p2p", backend "auto", validate): the strategy ("p2p",
    "all_gather", "a2a", "a2a+p2p", "dispatch" or "auto", chosen per (plan, mask) from
    closed-form costs on the plan, the same on every rank; ``varlen_cp.tables.auto``),
    the kernels' backend, ``a2a_size`` ("a2a+p2p"), ``overlap_stages`` ("dispatch" /
    "all_gather": S kernel stages, the remote K/V in S - 1 transfers each in flight while
    the previous stage computes; None: the cost model's choice, cached in the plan) and
    ``validate``: all ranks must have built the same plan, checked once per plan on the
    host (``varlen_cp.plan.agreement``: one 16-byte all-reduce of host tensors, no device
    sync), nothing to do when the step's sharding already checked it.
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
    options = resolve_options(options)
    check_types(plan, mask, options)
    check_flags(return_lse, return_max_logit, softmax_type, sink, q.shape[1], q.device)
    need_lse = return_lse or softmax_type != "vanilla"  # a sink rescales by the merged LSE
    if torch.compiler.is_compiling():  # one opaque custom op: no break, no recompile
        out, lse, max_logit = graph_call(q, k, v, plan, mask, group, options, softmax_scale,
                                         need_lse, return_max_logit)
    else:
        chosen, spec = resolve_call(q, k, v, plan, mask, group, options, softmax_scale,
                                    need_lse, return_max_logit)
        out, lse, max_logit = run_eager(q, k, v, chosen, spec)
    out, lse = apply_softmax_sink(out, lse, softmax_type, sink)
    return _results(out, lse, max_logit, return_lse)


class ContextParallelVarlenAttention(nn.Module):
    """``cp_varlen_attn`` as a module: the mask and the options are fixed at construction,
    the plan (shared by all layers of one batch) is passed to ``forward``.

    ``options``: a ``varlen_cp.AttnOptions`` (default ``AttnOptions()``). ``softmax_scale``: None
    for 1/sqrt(head_dim). ``softmax_type="learnable"`` creates ``self.sink =
    nn.Parameter(zeros(n_heads))`` (fp32; ``n_heads`` required); otherwise ``self.sink``
    is None. With ``track_max_logit`` every forward stores the global per-head max logit in
    ``self.max_logit`` (detached fp32 [Hq]) for metrics or a QK-clip step; else it stays
    None.

    Adapters (torchtitan's ``VarlenCPInnerAttention``, megatron's
    ``VarlenCPCoreAttention``) subclass it: their forward unpacks the framework's inputs
    and calls :meth:`attend`; ``sink_tensor`` and ``record_max_logit`` are where they plug
    in their own parameter and running max.
    """

    def __init__(self, mask: AttnMask, options: AttnOptions | None = None,
                 group: Any = None, *, softmax_scale: float | None = None,
                 softmax_type: str = "vanilla", n_heads: int | None = None,
                 track_max_logit: bool = False) -> None:
        super().__init__()
        # Everything that does not depend on the inputs is checked here, so a bad option
        # fails when the model is built, not at its first forward.
        options = resolve_options(options)
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
        check_group_type(group)
        check_scale(softmax_scale)
        check_bool("track_max_logit", track_max_logit)
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
        self.options = options
        self.group = group
        self.softmax_scale = softmax_scale
        self.softmax_type = softmax_type
        self.track_max_logit = track_max_logit
        self.sink = sink
        self.max_logit: torch.Tensor | None = None

    @property
    def strategy(self) -> str:
        """The configured strategy (``options.strategy``; "auto" resolves per plan)."""
        return self.options.strategy

    def sink_tensor(self) -> torch.Tensor | None:
        """The sink as the op wants it, fp32: a model cast to bf16 casts the parameter too
        (the cast is differentiable, so the parameter still gets its gradient)."""
        return None if self.sink is None else self.sink.float()

    def record_max_logit(self, max_logit: torch.Tensor) -> None:
        """Keep the last forward's global max logit per head (``track_max_logit``)."""
        self.max_logit = max_logit.detach()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, *,
               mask: AttnMask | None = None, softmax_scale: float | None = None,
               return_lse: bool = False, softmax_type: str | None = None,
               sink: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse or None) of this module's CP call; per call, an adapter may give
        another ``mask`` or ``softmax_scale`` (None: the module's) and another softmax
        (``softmax_type`` with its ``sink``; None: the module's own)."""
        if softmax_type is None:
            softmax_type, sink = self.softmax_type, self.sink_tensor()
        scale = self.softmax_scale if softmax_scale is None else softmax_scale
        res = cp_varlen_attn(q, k, v, plan, self.mask if mask is None else mask, self.group,
                             self.options, scale, return_lse,
                             return_max_logit=self.track_max_logit,
                             softmax_type=softmax_type, sink=sink)
        res = res if isinstance(res, tuple) else (res,)
        if self.track_max_logit:
            self.record_max_logit(res[-1])
        return res[0], (res[1] if return_lse else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                plan: CPPlan) -> torch.Tensor:
        return self.attend(q, k, v, plan)[0]

    def extra_repr(self) -> str:
        extra = "" if self.softmax_type == "vanilla" else f", softmax_type={self.softmax_type!r}"
        return f"mask={self.mask}, options={self.options}" + extra
