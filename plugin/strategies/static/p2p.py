"""Graph-safe ``p2p`` (ring): cp steps; at step s the rank holds the K|V rows of rank
(rank - s) mod cp (capacity rows, fixed size), posts them to the next rank while it
computes its queries against them, and folds the partial by its LSE. Backward: the K|V
blocks go round again, each with an fp32 dK|dV accumulator that every rank adds its share
to; after cp steps each accumulator is back at its owner (no reduction collective, the
sum in ring order: deterministic). Which block a step holds is a constant of (rank, s),
never of the batch."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.rows import RowsKernel
from ...kernels.merge import merge_attn_partials_
from ..calls import global_rank
from ..p2p import _post, _wait as wait_all
from .buffers import StaticRows
from .common import max_part, pack_kv, unpack_kv


def _pass(send: list[torch.Tensor], rank: int, cp: int, group: Any) -> tuple[list, list]:
    """Post ``send`` to the next rank and receive as much from the previous one: (the
    receive buffers, the works to wait for)."""
    return pass_to(send, global_rank(group, (rank + 1) % cp),
                   global_rank(group, (rank - 1) % cp), group)


def pass_to(send: list[torch.Tensor], nxt: int, prv: int, group: Any) -> tuple[list, list]:
    """Post ``send`` to global rank ``nxt`` and receive as much from ``prv``: (the receive
    buffers, the works to wait for)."""
    recv = [torch.empty_like(t) for t in send]
    return recv, _post([(t, nxt) for t in send], [(t, prv) for t in recv], group, 0)


def fold(out: torch.Tensor | None, lse: torch.Tensor | None, row_max: torch.Tensor | None,
         o: torch.Tensor, l: torch.Tensor, m: torch.Tensor | None) -> tuple:
    """(out, lse, row max) with the partial (o, l, m) folded in by its LSE (the first
    partial as it is; the row max where asked for: m not None)."""
    if out is None:
        return o, l, m
    out, lse = merge_attn_partials_(out, lse, o, l)
    return out, lse, (None if m is None else torch.maximum(row_max, m))


class _StaticRing(torch.autograd.Function):
    strategy = "p2p"

    @staticmethod
    def forward(ctx, q, k, v, rows: StaticRows, rank: int, cp: int, group: Any,
                kernel: RowsKernel, scale: float, need_max: bool):
        hkv, d, dv = k.shape[1], k.shape[2], v.shape[2]
        kv = pack_kv(k, v)
        # The calls' tables are copies of the rows as they are now (the backward reuses
        # the calls, whatever plan the buffers hold by then); the queries' side is shared
        # by the cp calls (step 0's keys are the same rows).
        q_side = kernel.side(rows.rank_rows(rank), in_order=True)
        cur, out, lse, row_max, calls = kv, None, None, None, []
        for s in range(cp):
            works = []
            if s + 1 < cp:
                (nxt,), works = _pass([cur], rank, cp, group)
            k_b, v_b = unpack_kv(cur, hkv, d, dv)
            k_rows = q_side if s == 0 else rows.rank_rows((rank - s) % cp)
            call = kernel.call(q, v_b, q_side, k_rows, q_sorted=True, k_sorted=True)
            o, l, m = call.fwd(q, k_b, v_b, scale, need_max)
            out, lse, row_max = fold(out, lse, row_max, o, l, m)
            calls.append(call)
            wait_all(works)
            if s + 1 < cp:
                cur = nxt
        ctx.save_for_backward(q, kv, out, lse)
        ctx.meta = (calls, rank, cp, group, scale, (hkv, d, dv), k.dtype)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse, max_part(row_max, q.shape[1], q.device, need_max)

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, kv, out, lse = ctx.saved_tensors
        calls, rank, cp, group, scale, (hkv, d, dv), dtype = ctx.meta
        cap = q.shape[0]
        dout = torch.zeros_like(out) if dout is None else dout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = kv
        acc = torch.zeros(cap, hkv * (d + dv), dtype=torch.float32, device=q.device)
        for s, call in enumerate(calls):
            k_b, v_b = unpack_kv(cur, hkv, d, dv)
            dq_s, dk_s, dv_s = call.bwd(dout, q, k_b, v_b, out, lse, dlse, scale)
            dq += dq_s
            acc = acc + pack_kv(dk_s, dv_s)
            if cp > 1:   # the block's accumulator on to the next rank (the block too, but
                # after the last step: the accumulator then reaches its owner)
                recv, works = _pass([acc] if s + 1 == cp else [acc, cur], rank, cp, group)
                wait_all(works)
                acc = recv[0]
                if s + 1 < cp:
                    cur = recv[1]
        dk, dv_ = unpack_kv(acc, hkv, d, dv)
        return dq.to(q.dtype), dk.to(dtype), dv_.to(dtype), *(None,) * 7
