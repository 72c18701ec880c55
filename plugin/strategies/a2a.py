"""Ulysses (all-to-all) context parallelism: trade the sequence split for a head split.

One ``all_to_all_single`` (q, k and v packed per token, so one message per peer) turns each
rank's local tokens x all heads into all tokens x Hq/a heads (a = all-to-all size); a
host-planned permutation puts the tokens in document order (position-sorted, padding last)
and the local varlen call sees whole documents with explicit positions. The output (and the
LSE, only when asked for) goes back the same way. Backward: dout goes to heads, the local
backward runs on the saved head-sharded tensors, and dq/dk/dv (packed) come back in one
all-to-all. The LSE is differentiable: when it was asked for, its gradient travels to the
heads as dout does (one more, fp32 all-to-all). The max logit needs no transfer of its own:
a member holds whole documents for its heads, so its per-head maxes are complete there.

Heads: Hq % a == 0; K/V heads are split when Hkv % a == 0, and replicated (each rank gets
one) when a % Hkv == 0, their gradients summed back over the copies; otherwise ValueError.

The Ulysses transform is generic over the "core" computed on head-sharded tokens: here one
local call; ``a2a_p2p`` plugs a ring across groups in. Limits: every rank holds all tokens
of its Ulysses group for its heads, so activation memory per rank is the same as the
sequence split, but the local call's longest document is the whole document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from ..plan import CPPlan
from ..shape import kv_heads_per_rank
from ..tables.hybrid import heads_fit
from ..tables.ulysses import UlyssesTables, group_call, ulysses_tables
from .base import CallSpec, Resolution, Strategy
from .calls import dlse_or_none, empty_attn, head_max, no_max


def check_head_split(n_heads: int, n_kv_heads: int, parts: int, what: str) -> None:
    """ValueError unless an all-to-all over ``parts`` ranks can split the heads (K/V heads
    split, or replicated when there are fewer than ``parts``)."""
    if n_heads % parts:
        raise ValueError(f"{what}: Hq={n_heads} must be divisible by {parts} (heads are "
                         f"split across the all-to-all ranks)")
    if not heads_fit(n_heads, n_kv_heads, parts):
        raise ValueError(f"{what}: Hkv={n_kv_heads} and the all-to-all size {parts} must "
                         f"divide one another (K/V heads are split, or replicated when fewer)")


# ---------------------------------------------------------------------------- transforms
def to_heads(parts: list[torch.Tensor], size: int, sizes: tuple[int, ...], group: Any
             ) -> torch.Tensor:
    """[T, H_i, E_i] tensors (same T) -> [N, sum_i H_i/size * E_i]: every member's tokens
    for this rank's head slice, in member order (one all-to-all)."""
    t = parts[0].shape[0]
    # Explicit widths (no -1): a rank may hold zero tokens.
    send = torch.cat([p.reshape(t, size, p.shape[1] // size * p.shape[2]) for p in parts],
                     dim=2)
    send = send.transpose(0, 1).contiguous()           # [size, T, W]: block j -> member j
    width = send.shape[2]
    recv = send.new_empty(sum(sizes), width)
    dist.all_to_all_single(recv, send.view(size * t, width), list(sizes), [t] * size,
                           group=group)
    return recv


def to_tokens(x: torch.Tensor, size: int, sizes: tuple[int, ...], n_local: int, group: Any
              ) -> torch.Tensor:
    """Inverse of :func:`to_heads`: [N, W] (member order) -> [T, size, W] (local tokens,
    member j's head slice at [:, j])."""
    recv = x.new_empty(size * n_local, x.shape[1])
    dist.all_to_all_single(recv, x.contiguous(), [n_local] * size, list(sizes), group=group)
    return recv.view(size, n_local, x.shape[1]).transpose(0, 1)


def _split_cols(x: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Split [N, W] columns into contiguous [N, H, E] tensors of ``shapes`` (H, E)."""
    out, at = [], 0
    for h, e in shapes:
        out.append(x[:, at:at + h * e].reshape(x.shape[0], h, e).contiguous())
        at += h * e
    return out


# --------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class UlyssesSpec:
    """Non-tensor arguments of a Ulysses call; subclasses supply the core."""

    call: CallSpec
    group: Any                # the all-to-all group
    size: int                 # its size
    members: tuple[int, ...]  # CP ranks of the group, in group-rank order

    def tables(self, device: torch.device) -> UlyssesTables:
        plan, members = self.call.plan, self.members
        return ulysses_tables(plan, members, device)

    @property
    def index(self) -> int:
        """This rank's place in the group: it holds query-head slice ``index``."""
        return self.members.index(self.call.plan.cp_rank)

    def core_fwd(self, q, k, v, device, need_max):
        """-> (out in q.dtype, lse, per-head max [H_local] or None)"""
        raise NotImplementedError

    def core_bwd(self, dout, q, k, v, out, lse, device, dlse):  # -> (dq, dk, dv)
        raise NotImplementedError


@dataclass(frozen=True)
class LocalSpec(UlyssesSpec):
    """Pure Ulysses: the core is one local call over the merged (whole) documents."""

    def _call(self, device: torch.device):
        plan, mask, block = self.call.plan, self.call.attn.mask, self.call.block
        return group_call(plan, self.members, mask, block, device, self.call.route)

    def core_fwd(self, q, k, v, device, need_max):
        call = self._call(device)
        if call is None:
            out, lse, row_max = empty_attn(q, v.shape[2], need_max)
        else:
            out, lse, row_max = self.call.attn.fwd(q, k, v, call, need_max)
        return out, lse, head_max(row_max, q.shape[1], device) if need_max else None

    def core_bwd(self, dout, q, k, v, out, lse, device, dlse):
        call = self._call(device)
        if call is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self.call.attn.bwd(dout, q, k, v, out, lse, call, dlse)


# ------------------------------------------------------------------------------ function
def _lse_to_heads(dlse: torch.Tensor | None, t: int, hq: int, spec: UlyssesSpec,
                  tab: UlyssesTables, device: torch.device) -> torch.Tensor:
    """The LSE gradient [Hq, T] of the local tokens -> [Hq/size, N] of the group's tokens
    (merged order) for this rank's heads: the way dout travels. Zeros stand in for an
    unused LSE: every member must join the all-to-all."""
    if dlse is None:
        dlse = torch.zeros(hq, t, device=device)
    dlse_h = to_heads([dlse.t().reshape(t, hq, 1)], spec.size, tab.sizes, spec.group)
    return dlse_h.index_select(0, tab.order).t().contiguous()


def _spread_max(max_h: torch.Tensor, hq: int, index: int) -> torch.Tensor:
    """[Hq]: this rank's per-head maxes in its head slice ``index``, -inf elsewhere (the
    other heads' maxes come from the other members through the MAX all-reduce)."""
    full = torch.full((hq,), float("-inf"), device=max_h.device)
    n = max_h.numel()
    full[index * n:(index + 1) * n] = max_h
    return full


class UlyssesAttention(torch.autograd.Function):
    """Sequence -> heads all-to-all, the spec's core, heads -> sequence: (out, lse,
    max_part); lse is differentiable, max_part (or its empty stand-in) is not."""

    @staticmethod
    def forward(ctx, q, k, v, spec: UlyssesSpec):
        need_max = spec.call.need_max
        device, size = q.device, spec.size
        tab = spec.tables(device)
        t, hq, d, hkv, dv = q.shape[0], q.shape[1], q.shape[2], k.shape[1], v.shape[2]
        hk, rep = kv_heads_per_rank(hkv, size)
        if rep > 1:  # fewer K/V heads than ranks: every rank gets a copy of its head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        packed = to_heads([q, k, v], size, tab.sizes, spec.group).index_select(0, tab.order)
        q_h, k_h, v_h = _split_cols(packed, [(hq // size, d), (hk, d), (hk, dv)])
        out_h, lse_h, max_h = spec.core_fwd(q_h, k_h, v_h, device, need_max)
        out = to_tokens(out_h.flatten(1).index_select(0, tab.inverse),
                        size, tab.sizes, t, spec.group).reshape(t, hq, dv)
        if spec.call.need_lse:
            lse = to_tokens(lse_h.t().index_select(0, tab.inverse), size, tab.sizes, t,
                            spec.group).reshape(t, hq).t().contiguous()
        else:  # not asked for: skip its all-to-all (backward uses lse_h); [Hq, 0] stand-in
            lse = torch.empty(hq, 0, device=device)
        # The max logit needs no all-to-all: the heads' maxes are complete on the member
        # holding them, and the caller's MAX all-reduce spreads them.
        max_part = _spread_max(max_h, hq, spec.index) if need_max else no_max(device)
        ctx.save_for_backward(q_h, k_h, v_h, out_h, lse_h)
        ctx.spec, ctx.meta = spec, (t, hq, d, hkv, dv, rep)
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q_h, k_h, v_h, out_h, lse_h = ctx.saved_tensors
        spec, (t, hq, d, hkv, dv, rep) = ctx.spec, ctx.meta
        device, size = q_h.device, spec.size
        tab = spec.tables(device)
        if dout is None:
            dout = torch.zeros(t, hq, dv, dtype=out_h.dtype, device=device)
        dout_h = to_heads([dout.contiguous()], size, tab.sizes, spec.group)
        dout_h = dout_h.index_select(0, tab.order).view(out_h.shape)
        # need_lse is the same on every member, so all or none join the dlse all-to-all.
        dlse_h = (_lse_to_heads(dlse_or_none(dlse), t, hq, spec, tab, device)
                  if spec.call.need_lse else None)
        dq_h, dk_h, dv_h = spec.core_bwd(dout_h, q_h, k_h, v_h, out_h, lse_h, device, dlse_h)
        packed = torch.cat([g.flatten(1) for g in (dq_h, dk_h, dv_h)], dim=1)
        back = to_tokens(packed.index_select(0, tab.inverse), size, tab.sizes, t, spec.group)
        hk = k_h.shape[1]
        w_q, w_k = hq // size * d, hk * d   # column blocks of each member's slice
        dq = back[..., :w_q].reshape(t, hq, d)
        dk = back[..., w_q:w_q + w_k].reshape(t, size * hk, d)
        dv_ = back[..., w_q + w_k:].reshape(t, size * hk, dv)
        if rep > 1:  # sum the gradients of the replicated K/V heads
            dk = dk.view(t, hkv, rep, d).float().sum(2).to(dk.dtype)
            dv_ = dv_.view(t, hkv, rep, dv).float().sum(2).to(dv_.dtype)
        return dq, dk, dv_, None


# ------------------------------------------------------------------------------ strategy
class A2A(Strategy):
    """Ulysses: sequence -> heads all-to-all, whole documents per rank, heads -> sequence."""

    name = "a2a"

    def check_heads(self, n_heads: int, n_kv_heads: int, cp_size: int,
                    a2a_size: int | None = None) -> None:
        """Hq % cp == 0, and Hkv % cp == 0 or cp % Hkv == 0 (ValueError otherwise)."""
        check_head_split(n_heads, n_kv_heads, cp_size, "strategy 'a2a'")

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        spec = LocalSpec(CallSpec(plan, None, None, res), None, plan.cp_size,
                         tuple(range(plan.cp_size)))
        spec.tables(device)
        group_call(plan, spec.members, mask, res.block, device, res.route)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        cp = spec.plan.cp_size
        return UlyssesAttention, (LocalSpec(spec, spec.group, cp, tuple(range(cp))),)
