"""Graph-safe ``a2a+p2p``: Ulysses inside groups of ``a2a_size`` ranks, a ring across the
groups. One equal-split ``all_to_all_single`` inside the group gives each member the
group's capacity rows (a x capacity) for Hq / a heads (K/V heads repeated up to a, as in
graph-safe ``a2a``); member i of every group then runs the static ring (``p2p``) with the
members i of the other groups, each group's rows one block; out | lse go back through the
group's all-to-all. Backward: dout | dlse to heads, the ring with fp32 dK|dV accumulators
that end at their owner group, dq | dk | dv back. Every size is a constant of (cp, a,
capacity); which group's block a ring step holds, of (rank, step). The Ulysses sub-groups
are the dynamic strategy's (``strategies.a2a_p2p.ulysses_subgroup``)."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.rows import RowsKernel, RowsSide
from ..a2a_p2p import ulysses_subgroup
from ..calls import global_rank, head_max, no_max
from . import all_gather
from .a2a import _bytes_as, _kv_repeat, _to_heads, _to_rows, grads_to_heads
from .buffers import Rows, StaticRows
from .common import pair
from .p2p import fold, pass_to, wait_all


class _Ring:
    """Member ``i`` of group ``g`` in a ring of ``n`` groups of ``a`` CP ranks."""

    def __init__(self, rank: int, cp: int, a: int, group: Any) -> None:
        self.g, self.i, self.n, self.a = rank // a, rank % a, cp // a, a
        self.group = group
        self.next = global_rank(group, (self.g + 1) % self.n * a + self.i)
        self.prev = global_rank(group, (self.g - 1) % self.n * a + self.i)

    def rows(self, rows: Rows, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc, pos) of every row of ``group`` (its members' rows, rank-major)."""
        span = slice(group * self.a * rows.capacity, (group + 1) * self.a * rows.capacity)
        return rows.doc[span], rows.pos[span]

    def call(self, kernel: RowsKernel, qs: torch.Tensor, v_b: torch.Tensor, rows: Rows,
             q_side: RowsSide, step: int):
        """The kernel call of this group's rows (``q_side``, prepared once per layer)
        against the block held at ring ``step`` (each side several ranks' rows: sorted on
        the device unless the group is one rank; at step 0 both sides are the group's)."""
        k_rows = q_side if step == 0 else self.rows(rows, (self.g - step) % self.n)
        return kernel.call(qs, v_b, q_side, k_rows, q_sorted=self.a == 1,
                           k_sorted=self.a == 1)

    def pass_on(self, send: list[torch.Tensor]) -> tuple[list, list]:
        return pass_to(send, self.next, self.prev, self.group)


class _StaticHybrid(torch.autograd.Function):
    strategy = "a2a+p2p"

    @staticmethod
    def forward(ctx, q, k, v, rows: StaticRows, rank: int, cp: int, group: Any,
                kernel: RowsKernel, scale: float, need_max: bool, a2a_size: int):
        cap, hq, d = q.shape
        dv, a = v.shape[2], a2a_size
        sub, _ = ulysses_subgroup(group, a)
        ring = _Ring(rank, cp, a, group)
        rep = _kv_repeat(k.shape[1], a)
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        hs, hk = hq // a, kr.shape[1] // a
        packed = torch.cat([q.reshape(cap, a, hs * d), kr.reshape(cap, a, hk * d),
                            vr.reshape(cap, a, hk * dv)], 2)
        mine = _to_heads(packed, a, sub).reshape(a * cap, -1)
        qs, kv = pair(mine, hs * d)
        qs, kv = qs.reshape(a * cap, hs, d), kv.contiguous()   # (kv: sent round the ring)
        q_side = kernel.side(ring.rows(rows, ring.g), in_order=a == 1)
        cur, out, lse, row_max, calls = kv, None, None, None, []
        for s in range(ring.n):
            works = []
            if s + 1 < ring.n:
                (nxt,), works = ring.pass_on([cur])
            k_b, v_b = pair(cur, hk * d)
            k_b, v_b = k_b.reshape(-1, hk, d), v_b.reshape(-1, hk, dv)
            call = ring.call(kernel, qs, v_b, rows, q_side, s)
            o, l, m = call.fwd(qs, k_b, v_b, scale, need_max)
            out, lse, row_max = fold(out, lse, row_max, o, l, m)
            calls.append(call)   # (the backward's)
            wait_all(works)
            if s + 1 < ring.n:
                cur = nxt
        ctx.save_for_backward(qs, kv, out, lse)
        ctx.meta = (calls, ring, sub, scale, rep, (hk, d, dv), q.dtype, k.dtype)
        ctx.set_materialize_grads(False)
        back = torch.cat([out.reshape(a * cap, -1).to(q.dtype),
                          _bytes_as(lse.t().contiguous(), q.dtype)], 1).unsqueeze(1)
        back = _to_rows(back, a, sub).reshape(cap, a, -1)
        o, l = pair(back, hs * dv)
        part = no_max(q.device)
        if need_max:   # this group's rows on this slice's heads; the caller joins groups
            part = head_max(row_max, hs, q.device)
            if a > 1:
                gathered = part.new_empty(a * hs)
                all_gather._all_gather_single(gathered, part, group=sub)
                part = gathered
        return (o.reshape(cap, hq, dv),
                l.contiguous().view(torch.float32).reshape(cap, hq).t().contiguous(), part)

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        qs, kv, out, lse = ctx.saved_tensors
        calls, ring, sub, scale, rep, (hk, d, dv), qdtype, kdtype = ctx.meta
        n, hs, _ = out.shape
        a = ring.a
        cap = n // a
        dout_s, dlse_s = grads_to_heads(dout, dlse, out, a, sub)
        dq = torch.zeros(qs.shape, dtype=torch.float32, device=qs.device)
        cur, acc = kv, torch.zeros(n, hk * (d + dv), dtype=torch.float32, device=qs.device)
        for s, call in enumerate(calls):
            k_b, v_b = pair(cur, hk * d)
            k_b, v_b = k_b.reshape(-1, hk, d), v_b.reshape(-1, hk, dv)
            dq_s, dk_s, dv_s = call.bwd(dout_s, qs, k_b, v_b, out, lse, dlse_s, scale)
            dq += dq_s
            acc = acc + torch.cat([dk_s.reshape(n, -1), dv_s.reshape(n, -1)], 1)
            if ring.n > 1:   # as the static ring: the accumulator ends at its owner group
                recv, works = ring.pass_on([acc] if s + 1 == ring.n else [acc, cur])
                wait_all(works)
                acc = recv[0]
                if s + 1 < ring.n:
                    cur = recv[1]
        back = torch.cat([dq.reshape(n, -1), acc], 1).unsqueeze(1)
        mine = _to_rows(back, a, sub).reshape(cap, a, -1)
        g_q, g_kv = pair(mine, hs * qs.shape[2])
        g_k, g_v = pair(g_kv, hk * d)
        dq_rows = g_q.reshape(cap, a * hs, qs.shape[2])
        dk_rows = g_k.reshape(cap, a * hk, d)
        dv_rows = g_v.reshape(cap, a * hk, dv)
        if rep > 1:   # a repeated head's gradient is the sum over its copies
            dk_rows = dk_rows.reshape(cap, -1, rep, d).sum(2)
            dv_rows = dv_rows.reshape(cap, -1, rep, dv).sum(2)
        return (dq_rows.to(qdtype), dk_rows.to(kdtype), dv_rows.to(kdtype)) + (None,) * 8
