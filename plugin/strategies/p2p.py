"""Ring (P2P) context parallelism: K/V travel around the ring while each step computes.

Rank r at step t holds the K/V of holder (r - t) % R and attends its queries to them; the
send/recv for step t+1 is posted before step t computes, so the transfer overlaps compute
(NCCL runs P2P on its own stream). Partial results are folded with ``merge_attn_partials_``
in fp32. The host decides, from the plan, which steps see anything (exact visible-pair
counts): such steps are skipped, and the ring stops after the last step at which ANY rank
still needs K/V, so with sliding windows and chunks distant K/V is never sent. The decision
is identical on every rank, so no rank waits on a message that is never sent.

Backward runs the ring again: K/V travel as in forward; each step's dK/dV partial (already
in the input dtype, as the kernel returns it) is sent straight home to the K/V's owner and
summed there in fp32. Compared with an accumulator travelling with K/V this sends one
buffer fewer per ring, sends nothing for skipped steps (both sides know them from the host
tables), and rounds each partial once instead of once per hop. ``out`` and ``lse`` handed to
the kernels are the final merged ones (ring-attention rule), and so is the LSE's gradient:
the LSE output is differentiable (attention sinks compose on it), every step adding its
P_t * dlse term. The max logit (``need_max``) is the max of the steps' per-head maxes.

The engine (``ring_forward`` / ``ring_backward``) works on any ring of token holders, so the
hybrid a2a+p2p strategy reuses it with Ulysses groups as holders.

Limits: the ring is one-directional, as the contract fixes it; with dual_chunk layouts and
local masks a rank's nearest neighbours sit on both sides, so the early stop saves little
there (it pays off on contiguous layouts). Backward sends K/V again rather than keeping
every rank's K/V from the forward (memory stays one local K/V plus one in flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..kernels.merge import merge_attn_partials_
from ..masks import AttnMask
from ..plan import CPPlan
from ..tables.ring import RingTables, p2p_tables
from .base import CallSpec, Resolution, Strategy
from .calls import (Attn, dlse_or_none, global_rank, head_max, no_max, pack_flat,
                    unpack_flat)

_TAG_KV, _TAG_ACC = 0, 1


# --------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class Ring:
    """A ring at run time: device tables, this rank's index, global rank of each index."""

    tables: RingTables
    index: int
    peers: tuple[int, ...]
    group: Any

    @property
    def next(self) -> int:
        return self.peers[(self.index + 1) % len(self.peers)]

    @property
    def prev(self) -> int:
        return self.peers[(self.index - 1) % len(self.peers)]


def _post(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
          group: Any, tag: int) -> list:
    ops = [dist.P2POp(dist.isend, t, p, group, tag) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, p, group, tag) for t, p in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _kv_shapes(n: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple[int, ...]]:
    return [(n, k.shape[1], k.shape[2]), (n, v.shape[1], v.shape[2])]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, attn: Attn,
                 need_max: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Ring attention forward: (out fp32 [Tq, Hq, Dv], lse fp32 [Hq, Tq], max_part):
    max_part fp32 [Hq] is the max logit over every step's visible pairs (``need_max``;
    else None). Per-step maxes fold with ``torch.maximum`` on the compute stream, so no
    step's value is read before the kernel that made it."""
    tab = ring.tables
    cur = pack_flat(k, v)
    out = lse = None
    max_part = head_max(None, q.shape[1], q.device) if need_max else None
    for t in range(tab.n_steps):
        works, nxt = [], None
        if t + 1 < tab.n_steps:
            n_next = tab.sizes[tab.source(ring.index, t + 1)]
            nxt = cur.new_empty(n_next * (k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2]))
            works = _post([(cur, ring.next)], [(nxt, ring.prev)], ring.group, _TAG_KV)
        call = tab.calls[t]
        if call is not None:
            n_src = tab.sizes[tab.source(ring.index, t)]
            k_t, v_t = unpack_flat(cur, _kv_shapes(n_src, k, v))
            o, l, m = attn.fwd(q, k_t, v_t, call, need_max)
            if need_max:
                max_part = torch.maximum(max_part, head_max(m, q.shape[1], q.device))
            if out is None:
                out, lse = o.float(), l
            else:
                out, lse = merge_attn_partials_(out, lse, o, l)
        _wait(works)
        if nxt is not None:
            cur = nxt
    if out is None:  # nothing visible anywhere: empty rows
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    return out, lse, max_part


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ring: Ring, attn: Attn,
                  dlse: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward with the FINAL out/lse (and the final LSE's gradient
    ``dlse``, or None): (dq, dk, dv) in input dtypes. Every step gets the same dlse: its
    term P_t * dlse sums over the steps to the whole row's, as P_t uses the final lse."""
    tab, size, me = ring.tables, len(ring.peers), ring.index
    row = k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2]
    cur = pack_flat(k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc = torch.zeros(cur.numel(), dtype=torch.float32, device=q.device)  # our dK/dV
    pending: tuple[list, list[torch.Tensor], torch.Tensor | None] = ([], [], None)
    stats = attn.bwd_stats(dout, out, lse, dlse)  # one delta pass per layer, not per step
    for t in range(tab.n_steps):
        kv_works, nxt = [], None
        if t + 1 < tab.n_steps:
            nxt = cur.new_empty(tab.sizes[tab.source(me, t + 1)] * row)
            kv_works = _post([(cur, ring.next)], [(nxt, ring.prev)], ring.group, _TAG_KV)
        call, sends = tab.calls[t], []
        if call is not None:
            src = tab.source(me, t)
            k_t, v_t = unpack_flat(cur, _kv_shapes(tab.sizes[src], k, v))
            dq_t, dk_t, dv_t = attn.bwd(dout, q, k_t, v_t, out, lse, call, dlse, stats)
            dq += dq_t
            if t == 0:
                acc += pack_flat(dk_t, dv_t, dtype=torch.float32)
            else:
                sends.append((pack_flat(dk_t, dv_t), ring.peers[src]))
        incoming = cur.new_empty(tab.sizes[me] * row) if tab.incoming[t] else None
        recvs = [] if incoming is None else [(incoming, ring.peers[(me + t) % size])]
        works = _post(sends, recvs, ring.group, _TAG_ACC)
        # Fold the previous step's partial now: it travelled while this step computed.
        _wait(pending[0])
        if pending[2] is not None:
            acc += pending[2].float()
        pending = (works, [b for b, _ in sends], incoming)  # keep send buffers alive
        _wait(kv_works)
        if nxt is not None:
            cur = nxt
    _wait(pending[0])
    if pending[2] is not None:
        acc += pending[2].float()
    dk, dv = unpack_flat(acc, _kv_shapes(k.shape[0], k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------ strategy
def _ring(spec: CallSpec, device: torch.device) -> Ring:
    plan, rank, mask = spec.plan, spec.plan.cp_rank, spec.attn.mask
    tables = p2p_tables(plan, mask, spec.block, rank, device, spec.route)
    peers = tuple(global_rank(spec.group, r) for r in range(plan.cp_size))
    return Ring(tables, rank, peers, spec.group)


class P2PAttention(torch.autograd.Function):
    """Ring attention over a CP group: (out, lse, max_part) of the local queries vs all
    keys; lse is differentiable, max_part (or its empty stand-in) is not."""

    @staticmethod
    def forward(ctx, q, k, v, spec: CallSpec):
        ring = _ring(spec, q.device)
        out, lse, max_part = ring_forward(q, k, v, ring, spec.attn, spec.need_max)
        out = out.to(q.dtype)
        max_part = max_part if spec.need_max else no_max(q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        ring = _ring(ctx.spec, q.device)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ring, ctx.spec.attn,
                                   dlse_or_none(dlse))
        return dq, dk, dv, None


class P2P(Strategy):
    """Ring attention: K/V around the ring, transfers overlapped with each step's compute."""

    name = "p2p"

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        p2p_tables(plan, mask, res.block, plan.cp_rank, device, res.route)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        return P2PAttention, (spec,)
