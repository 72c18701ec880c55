"""``cp_varlen_attn`` under torch.compile: the whole CP call as ONE opaque custom op.

Dynamo traced into the eager call and broke the graph wherever it met host work (the plan
agreement's host read, hashing, ``nonzero``, P2P ops): 86 graph breaks and 120 compiled
graphs for a 2-layer model over 8 document mixes with p2p (140 / 171 with dispatch,
``bench/compile_graphs.py``), and every new plan recompiled. Here the call is the custom
op ``varlen_cp::cp_attention`` with a fake implementation (output shapes from q, k, v
alone) and a registered autograd formula whose backward is ``varlen_cp::cp_attention_bwd``.
What the graph sees: q, k, v, the plan's ``handle`` (a 1-element CPU int64 tensor that names
the plan in a weak registry, ``CPPlan.handle``: a graph input like any tensor, so a new
plan is new data, never a guard or a constant) and the call's constants (the
``AttnOptions``' key, the mask's fields, scale, flags, group name). At run time the op looks
the plan and the options up, runs the eager call's per-call checks and resolution
(``cp_call.resolve_call``, before any communication) and the
strategy's own autograd.Function ``forward`` with a stand-in ctx; the max logit's
all-reduce runs inside too. The sink (``apply_softmax_sink``) is plain differentiable
tensor math outside the op, traced by dynamo.

Backward state: the Function's ctx (e.g. the K/V a staged strategy fetched, Ulysses'
head-sharded tensors) is kept in a registry under a token (a 1-element tensor output of
the forward op, saved for the backward op: on the host, its value names the state; in the
graph-safe mode it is on q's device and its address does, so no device value is read); a finalizer on the token drops the entry when
autograd frees the token (after the backward, or with the graph when no backward runs), so
nothing leaks and ``retain_graph`` works. Tensors the compiled graph owns (q, k, v, out,
lse) are never kept in that registry: the forward op's autograd saves them, and the
backward op receives them as inputs (inductor may reuse a buffer of its own once its last
use in the graph has passed; the ctx gets the backward op's copies instead).

Limits: a compiled call on a CUDA device outside the graph-safe mode keeps its token on
the host (a CPU output), which CUDA graphs ("reduce-overhead") refuse; the per-call Python work inside the op is the eager
call's (the strategy's host tables are cached in the plan either way).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from .cp_call import global_max, resolve_call
from .masks import AttnMask
from .options import AttnOptions
from .plan.cpplan import plan_of_handle

# token's key -> the stand-in ctx of one forward, until autograd frees the token
_STATE: dict[int, "_SavedCall"] = {}
_TOKENS = itertools.count(1)


class _SavedCall:
    """Stands in for an autograd ctx while a strategy's Function runs inside the op."""

    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


class _GraphOwned:
    """Placeholder for the i-th tensor the graph owns (q, k, v, out, lse) in a saved ctx."""

    def __init__(self, index: int) -> None:
        self.index = index


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _detach_graph_owned(ctx: _SavedCall, owned: list[torch.Tensor]) -> None:
    """Replace the graph's tensors in ``ctx.saved_tensors`` by placeholders; anything else
    saved must be the strategy's own memory (a view of a graph tensor would be a bug)."""
    ids = {id(t): i for i, t in enumerate(owned)}
    ptrs = {_storage(t) for t in owned if t.numel()}
    saved = []
    for t in ctx.saved_tensors:
        if isinstance(t, torch.Tensor) and id(t) in ids:
            saved.append(_GraphOwned(ids[id(t)]))
            continue
        if isinstance(t, torch.Tensor) and t.numel() and _storage(t) in ptrs:
            raise RuntimeError("varlen_cp: a strategy saved a view of a graph tensor")
        saved.append(t)
    ctx.saved_tensors = tuple(saved)


def _own(t: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``t`` contiguous (the strides the fake implementations promise), copied when it
    shares memory with one of ``others`` (a custom op's outputs may not alias its inputs
    or each other)."""
    if t.numel() and any(o.numel() and _storage(o) == _storage(t) for o in others):
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


# ------------------------------------------------------------------------------ the op
@torch.library.custom_op("varlen_cp::cp_attention", mutates_args=())
def _cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor,
                  options_key: int, causal: bool, window_left: int, window_right: int,
                  chunk_size: int, softmax_scale: Optional[float], need_lse: bool,
                  need_max: bool, group_name: str, save: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = plan_of_handle(handle)
    group = None
    if group_name:
        from torch.distributed.distributed_c10d import _resolve_process_group
        group = _resolve_process_group(group_name)
    mask = AttnMask(causal=causal, window_size=(window_left, window_right),
                    chunk_size=chunk_size or None)
    options = AttnOptions.of_key(options_key)
    chosen, spec = resolve_call(q, k, v, plan, mask, group, options, softmax_scale, need_lse,
                                need_max)
    # (the sink, if any, was checked while tracing and is applied outside the op)
    fn, args = chosen.function(q, k, v, spec)
    ctx = _SavedCall()
    with torch.no_grad():
        out, lse, max_part = fn.forward(ctx, q, k, v, *args)
        max_logit = (global_max(max_part if max_part.numel() else None, q.shape[1],
                                q.device, spec.group, plan.cp_size)
                     if need_max else q.new_empty(0, dtype=torch.float32))
    out = _own(out, [q, k, v])
    lse_out = _own(lse, [q, k, v, out]) if need_lse else q.new_empty(q.shape[1], 0,
                                                                      dtype=torch.float32)
    token = _token(q, options)
    if save:
        _detach_graph_owned(ctx, [q, k, v, out] + ([lse_out] if need_lse else []))
        ctx.function = fn
        if token.is_cpu:   # a host token carries its key (its address may be copied)
            token[0] = next(_TOKENS)
        key = _key(token)
        _STATE[key] = ctx
        weakref.finalize(token, _STATE.pop, key, None)
    return out, lse_out, max_logit, token


@_cp_attention.register_fake
def _(q, k, v, handle, options_key, causal, window_left, window_right, chunk_size,
      softmax_scale, need_lse, need_max, group_name, save):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0] if need_lse else 0, dtype=torch.float32)
    max_logit = q.new_empty(q.shape[1] if need_max else 0, dtype=torch.float32)
    return out, lse, max_logit, _token(q, AttnOptions.of_key(options_key))


def _token(q: torch.Tensor, options: AttnOptions) -> torch.Tensor:
    """The forward's token: a 1-element int64 tensor on the host (the dynamic mode), or in
    the graph-safe mode on q's device (a CUDA graph takes no host tensor)."""
    device = q.device if options.graph_safe else torch.device("cpu")
    return torch.zeros(1, dtype=torch.int64, device=device)


def _key(token: torch.Tensor) -> int:
    """The saved state's key: a host token's value; a device token's address (host
    metadata: no device read; unique while the token lives, and the entry goes with it)."""
    return int(token[0]) if token.is_cpu else token.data_ptr()


@torch.library.custom_op("varlen_cp::cp_attention_bwd", mutates_args=())
def _cp_attention_bwd(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      token: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ctx = _STATE.get(_key(token))
    if ctx is None:
        raise RuntimeError("varlen_cp: backward of a compiled cp_varlen_attn call whose "
                           "forward ran without grad (or whose graph was freed)")
    owned = (q, k, v, out, lse)
    saved = ctx.saved_tensors
    ctx.saved_tensors = tuple(owned[t.index] if isinstance(t, _GraphOwned) else t
                              for t in saved)
    try:
        with torch.no_grad():
            dq, dk, dv = ctx.function.backward(ctx, dout, dlse, None)[:3]
    finally:
        ctx.saved_tensors = saved   # a retained graph may run the backward again
    inputs = [dout, q, k, v, out, lse] + ([] if dlse is None else [dlse])
    dq = _own(dq, inputs)
    dk = _own(dk, inputs + [dq])
    dv = _own(dv, inputs + [dq, dk])
    return dq, dk, dv


@_cp_attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, token):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, _max_logit, token = output
    ctx.save_for_backward(q, k, v, out, lse, token)
    ctx.set_materialize_grads(False)  # an unused output gets None, not zeros


def _backward(ctx, dout, dlse, _dmax, _dtoken):
    q, k, v, out, lse, token = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    if dlse is not None and dlse.numel() == 0:
        dlse = None
    dq, dk, dv = _cp_attention_bwd(dout, None if dlse is None else dlse.contiguous(), q, k,
                                   v, out, lse, token)
    return (dq, dk, dv) + (None,) * 11


_cp_attention.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- the entry
def graph_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, mask: AttnMask,
               group: Any, options: AttnOptions, softmax_scale: Any, need_lse: bool,
               need_max: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, global max logit or None) of one CP call as the custom op; what dynamo
    traces here reads only the plan's handle, the options' key, the mask's fields and the
    group's name (the op looks the options up by their key)."""
    save = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                        or v.requires_grad)
    causal, window_left, window_right, chunk_size = mask.params
    out, lse, max_logit, _token = _cp_attention(
        q, k, v, plan.handle, options.key, causal, window_left, window_right, chunk_size,
        softmax_scale, need_lse, need_max, "" if group is None else group.group_name, save)
    return out, lse, (max_logit if need_max else None)
