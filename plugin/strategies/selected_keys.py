"""What all_gather and dispatch share: attention over the keys the local queries see, the
remote ones brought in stages that overlap with compute.

Both strategies run on ``varlen_cp.tables.staged`` tables (S = ``overlap_stages``):
with S >= 2, stage 0 is the local keys, read in place, and stages 1..S-1 the remote keys,
one collective each; with S = 1, one collective brings every remote key and one call
covers them and the local ones (no overlap, no partial results). The strategies differ
only in how a transfer's K/V travel (``dispatch``: an ``all_to_all_single`` of exactly the
needed rows; ``all_gather``: an all-gather of a slice of every rank's padded K/V), which
each supplies as an *exchange*; this module holds the engine and the autograd.Function.

Forward: post transfer 1 (``async_op=True``), compute the local call, then for each
transfer s: post s+1, wait for s, pick its keys (``gather``), compute, fold the partial
(out, lse) into the accumulator (``fold_``: ``varlen_cp.kernels.merge.merge_attn_partials_``, in
place, without out-sized fp32 temporaries; fp32 from the first fold on). The picked K/V are kept for
the backward (the remote keys the queries see; with S = 1 the local ones too, as one call needs them
in one tensor). Backward, with the FINAL out/lse and the same dlse in every call (ring-attention
rule): each fetched stage's dK/dV is computed and posted home while the next stage
computes (its arrivals folded one stage later, which bounds the returns in flight to two;
a row several ranks return is summed in one fixed order, ``tables.rounds``, so dK/dV are
bitwise deterministic on CUDA too),
the local call runs last, under the last return; dQ (fp32 when the rank makes more than one
call) and the local dK/dV (fp32) accumulate here. No host sync anywhere: every size comes
from the host tables.

Limits: with short remote stages the backward's earlier returns are waited on before the
next fetched stage computes, so only the last return hides under the local call (folding
all of them at the end would hide them all, holding every return at once); each fold is an
unfused pass over the fp32 output (the cost model counts its memory traffic).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..kernels.merge import merge_attn_partials_
from ..masks import AttnMask
from ..plan import CPPlan
from ..tables.flash_form import FlashRoute
from ..tables.staged import Stage, StagedTables, staged_tables
from .base import CallSpec, Resolution, Strategy
from .calls import Attn, dlse_or_none, head_max, no_max


def unpack_key_grads(acc: torch.Tensor, k_shape: torch.Size, k_dtype: torch.dtype,
                     v_dtype: torch.dtype, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the fp32 accumulator of packed dK|dV rows into dk, dv in the local K layout."""
    n, hkv, d = k_shape
    dk = acc[:, :hkv * d].reshape(n, hkv, d).to(k_dtype)
    dv = acc[:, hkv * d:].reshape(n, hkv, head_dim_v).to(v_dtype)
    return dk, dv


def fold_(acc: torch.Tensor | None, lse: torch.Tensor | None, out_i: torch.Tensor,
          lse_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the partial (out_i, lse_i) into the accumulator (acc, lse) in place
    (``merge_attn_partials_``). The first partial becomes the accumulator as it is
    (``out_i`` must be fresh: a kernel output); the first fold makes it fp32."""
    if acc is None:
        return out_i, lse_i
    return merge_attn_partials_(acc, lse, out_i, lse_i)


class Pending:
    """One posted collective: its receive buffer and what must live until it completes."""

    def __init__(self, recv: torch.Tensor, work: Any, *keep: torch.Tensor) -> None:
        self.recv, self.work, self.keep = recv, work, keep

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.recv


def post_returns(grads: torch.Tensor, stage: Stage, group: Any) -> Pending:
    """Post the dK/dV rows of a stage's keys to their owners; receive ours."""
    send = grads.index_select(0, stage.back_order)
    recv = grads.new_empty(sum(stage.in_splits), grads.shape[1])
    work = dist.all_to_all_single(recv, send, list(stage.in_splits), list(stage.back_splits),
                                  group=group, async_op=True)
    return Pending(recv, work, send)


def staged_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tab: StagedTables,
                   exchange: Callable[..., Pending], group: Any, attn: Attn,
                   need_max: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(out in q.dtype, lse, max_part [Hq] (the empty stand-in unless ``need_max``),
    the picked K/V k_1, v_1, k_2, v_2, ... of each transfer in call order, kept for the
    backward). ``exchange(kf, vf, stage, group)`` posts one transfer."""
    hq, hkv, d, dv = q.shape[1], k.shape[1], k.shape[2], v.shape[2]
    kf, vf = k.reshape(k.shape[0], hkv * d), v.reshape(v.shape[0], hkv * dv)
    stages = tab.stages
    pending = exchange(kf, vf, stages[0], group) if stages else None
    acc = lse = None
    max_part = head_max(None, hq, q.device) if need_max else no_max(q.device)
    if tab.local is not None:
        o, l, m = attn.fwd(q, k, v, tab.local, need_max)
        acc, lse = fold_(None, None, o, l)
        if need_max:
            max_part = torch.maximum(max_part, head_max(m, hq, q.device))
        del o
    fetched: list[torch.Tensor] = []
    for s, stage in enumerate(stages):
        nxt = exchange(kf, vf, stages[s + 1], group) if s + 1 < len(stages) else None
        recv = pending.result()
        pending = nxt           # (the arrived transfer's send buffer goes now)
        k_s = _pick(recv[:, :hkv * d], kf, stage).view(stage.n_keys, hkv, d)
        v_s = _pick(recv[:, hkv * d:], vf, stage).view(stage.n_keys, hkv, dv)
        del recv
        fetched += [k_s, v_s]
        if stage.call is None:
            continue
        o, l, m = attn.fwd(q, k_s, v_s, stage.call, need_max)
        acc, lse = fold_(acc, lse, o, l)
        if need_max:
            max_part = torch.maximum(max_part, head_max(m, hq, q.device))
        del o
    if acc is None:  # nothing visible: empty rows
        acc = q.new_zeros(q.shape[0], hq, dv)
        lse = torch.full((hq, q.shape[0]), float("-inf"), device=q.device)
    return acc.to(q.dtype), lse, max_part, fetched


def _pick(recv: torch.Tensor, local: torch.Tensor, stage: Stage) -> torch.Tensor:
    """A stage's keys in call order: fetched rows from the receive buffer and, with S = 1,
    local rows in their slots."""
    fetched = recv.index_select(0, stage.gather)
    if stage.local_slots is None:
        return fetched
    out = recv.new_empty(stage.n_keys, recv.shape[1])
    out.index_copy_(0, stage.remote_slots, fetched)
    del fetched
    out.index_copy_(0, stage.local_slots, local.index_select(0, stage.local_rows))
    return out


def staged_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                    v: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                    fetched: list[torch.Tensor], tab: StagedTables, group: Any, attn: Attn,
                    dlse: torch.Tensor | None, kv: tuple,
                    returns: Callable[..., Pending] | None = None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in the input dtypes; ``fetched`` as ``staged_forward`` returned it;
    ``k``, ``v`` (None unless ``tab.local``) and ``kv`` = (k.shape, k.dtype, Dv, v.dtype)
    of the local K/V; ``returns(grads, stage, group)`` posts a stage's dK/dV home
    (default :func:`post_returns`: one all-to-all)."""
    returns = post_returns if returns is None else returns
    k_shape, k_dtype, dv, v_dtype = kv
    t, hkv, d = k_shape
    width = hkv * (d + dv)
    acc = None    # fp32 dK|dV of the local keys, made when first needed
    dq, several = None, tab.n_calls > 1
    pending: Pending | None = None
    rows = None
    stats = attn.bwd_stats(dout, out, lse, dlse)  # one delta pass per layer, not per stage

    def fold(acc, pending, rounds):
        # the returns of a row fetched by several ranks, summed in one fixed order
        # (``UniqueRounds``): no index_add_ with duplicate rows, deterministic on CUDA
        return rounds.add_(_zeros(acc, t, width, q.device), pending.result().float())

    for s, stage in enumerate(tab.stages):
        k_s, v_s = fetched[2 * s], fetched[2 * s + 1]
        if stage.call is None:  # no key of ours in this stage: nothing to return
            grads = k_s.new_zeros(stage.n_keys, width)
        else:
            dq_s, dk_s, dv_s = attn.bwd(dout, q, k_s, v_s, out, lse, stage.call, dlse, stats)
            dq = _add(dq, dq_s, several)
            del dq_s
            grads = torch.cat([dk_s.reshape(stage.n_keys, -1), dv_s.reshape(stage.n_keys, -1)],
                              dim=1)
            del dk_s, dv_s
        if stage.local_slots is not None:  # S = 1: the local keys' dK/dV stay here
            acc = _zeros(acc, t, width, q.device)
            acc.index_add_(0, stage.local_rows, grads.index_select(0, stage.local_slots).float())
        posted = returns(grads, stage, group)
        del grads
        if pending is not None:  # the previous stage's returns travelled meanwhile
            acc = fold(acc, pending, rows)
        pending, rows = posted, stage.rounds
        del posted   # (else the last transfer's buffers live to the end of the backward)
    if tab.local is not None:
        dq_0, dk_0, dv_0 = attn.bwd(dout, q, k, v, out, lse, tab.local, dlse, stats)
        dq = _add(dq, dq_0, several)
        del dq_0
        acc = _zeros(acc, t, width, q.device)
        acc[:, :hkv * d].add_(dk_0.reshape(t, -1))
        acc[:, hkv * d:].add_(dv_0.reshape(t, -1))
        del dk_0, dv_0
    if pending is not None:
        acc = fold(acc, pending, rows)
        del pending
    dq = torch.zeros_like(q) if dq is None else dq.to(q.dtype)
    acc = _zeros(acc, t, width, q.device)   # (nothing visible anywhere: zeros)
    dk, dv_out = unpack_key_grads(acc, k_shape, k_dtype, v_dtype, dv)
    return dq, dk, dv_out


def _zeros(acc: torch.Tensor | None, t: int, width: int, device: torch.device
           ) -> torch.Tensor:
    return torch.zeros(t, width, dtype=torch.float32, device=device) if acc is None else acc


def _add(acc: torch.Tensor | None, x: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Accumulate the fresh kernel output ``x``; the first one becomes the accumulator, in
    fp32 when more will come (``fp32``; converted at once, while only it is alive)."""
    if acc is None:
        return x.float() if fp32 else x
    return acc.add_(x)


class StagedKeysAttention(torch.autograd.Function):
    """(out, lse, max_part) of the local queries vs the keys they see; lse is
    differentiable, max_part (or its empty stand-in) is not. ``engine``: the strategy
    (``name`` and ``exchange``)."""

    @staticmethod
    def forward(ctx, q, k, v, spec: CallSpec, engine: Any, stages: int):
        tab = tables(spec.plan, spec.attn.mask, spec.block, engine.name, stages, q.device,
                     spec.route)
        out, lse, max_part, fetched = staged_forward(q, k, v, tab, engine.exchange,
                                                     spec.group, spec.attn, spec.need_max)
        # k, v are kept only for the local call (S = 1 keeps its own copy of the local keys)
        local = tab.local is not None
        ctx.save_for_backward(q, k if local else None, v if local else None, out, lse,
                              *fetched)
        ctx.spec, ctx.name, ctx.stages = spec, engine.name, stages
        ctx.returns = engine.returns
        ctx.kv = (k.shape, k.dtype, v.shape[2], v.dtype)
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse, *fetched = ctx.saved_tensors
        spec = ctx.spec
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = staged_backward(dout, q, k, v, out, lse, fetched,
                                     tables(spec.plan, spec.attn.mask, spec.block, ctx.name,
                                            ctx.stages, q.device, spec.route),
                                     spec.group, spec.attn, dlse_or_none(dlse), ctx.kv,
                                     ctx.returns)
        return dq, dk, dv, None, None, None


def tables(plan: CPPlan, mask: AttnMask, block: tuple[int, int], name: str, stages: int,
           device: torch.device, route: FlashRoute | None = None) -> StagedTables:
    """This rank's staged tables of strategy ``name`` on ``device`` (built once per plan)."""
    return staged_tables(name, plan, mask, plan.cp_rank, block, stages, device, route)


class SelectedKeysStrategy(Strategy):
    """A strategy that brings the keys a rank's queries see in ``overlap_stages`` stages;
    subclasses name it and supply ``exchange(kf, vf, stage, group) -> Pending`` (how one
    stage's K/V travel) and may supply ``returns(grads, stage, group) -> Pending`` (how
    its dK/dV go home; default one all-to-all)."""

    exchange: Callable[..., Pending]
    returns: Callable[..., Pending] = staticmethod(post_returns)

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        """Build and cache this rank's staged tables (``res.stages`` stages) and their
        ``device`` copy."""
        tables(plan, mask, res.block, self.name, res.stages, device, res.route)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        return StagedKeysAttention, (spec, self, spec.res.stages)
