"""Graph-safe ``dispatch``: every rank sends each other rank the keys its queries see, in
one ``all_to_all_single`` of equal splits of ``send_capacity`` rows (the lists padded with
a zero row; their rows in a device buffer refreshed per plan), and computes its queries
against its own rows and the received ones; backward: the dK|dV of the received keys go
back in one equal-split ``all_to_all_single`` and each owner adds every peer's rows into
its own, one peer after another (rows within a peer's list are distinct: deterministic).
Bytes per rank and direction: (cp - 1) x send_capacity rows, whatever the batch needs
(docs/graph-safe.md measures the padding)."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.rows import RowsKernel
from .buffers import DispatchRows, StaticRows
from .common import exchange, max_part, pack_kv, unpack_kv


class _StaticDispatch(torch.autograd.Function):
    strategy = "dispatch"

    @staticmethod
    def forward(ctx, q, k, v, rows: StaticRows, rank: int, cp: int, group: Any,
                kernel: RowsKernel, scale: float, need_max: bool, sent: DispatchRows):
        hkv, d, dv = k.shape[1], k.shape[2], v.shape[2]
        kv = pack_kv(k, v)
        padded = torch.cat([kv, kv.new_zeros(1, kv.shape[1])])   # row ``cap``: zeros
        got = exchange(padded.index_select(0, sent.send.reshape(-1)), cp, group)
        keys = torch.cat([kv, got])
        own_doc, own_pos = rows.rank_rows(rank)
        k_all, v_all = unpack_kv(keys, hkv, d, dv)
        call = kernel.call(q, v_all, (own_doc, own_pos), (torch.cat([own_doc, sent.doc]),
                                                         torch.cat([own_pos, sent.pos])),
                           q_sorted=True, k_sorted=False)
        out, lse, row_max = call.fwd(q, k_all, v_all, scale, need_max)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        # (the send lists as this plan's: the buffers may hold another plan's by then)
        ctx.meta = (cp, group, scale, k.dtype, sent.send.clone(), call)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse, max_part(row_max, q.shape[1], q.device, need_max)

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        cp, group, scale, dtype, send, call = ctx.meta
        cap = q.shape[0]
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = call.bwd(dout, q, k_all, v_all, out, lse, dlse, scale)
        grads = pack_kv(dk, dv)
        back = exchange(grads[cap:].contiguous(), cp, group)     # [cp * K, w]
        mine = torch.cat([grads[:cap], grads.new_zeros(1, grads.shape[1])])
        for p, rows_p in enumerate(back.view(cp, -1, back.shape[1]).unbind(0)):
            mine.index_add_(0, send[p], rows_p)   # distinct rows; padding -> row cap
        dk_own, dv_own = unpack_kv(mine[:cap], *k_all.shape[1:], v_all.shape[2])
        return (dq.to(q.dtype), dk_own.to(dtype), dv_own.to(dtype)) + (None,) * 8
