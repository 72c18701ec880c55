"""Graph-safe ``all_gather``: one ``all_gather_single`` of every rank's K|V rows (capacity
each), one call of the local rows against all of them; backward: the dK|dV rows of every
rank go back in one ``all_to_all_single`` of equal splits and are summed in fp32 in rank
order (a reduce-scatter, deterministic)."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.rows import RowsKernel
from ...plan.collective import all_gather_single
from .buffers import StaticRows
from .common import exchange, max_part, pack_kv, unpack_kv

# The one shim (plan/collective.py); looked up here at call time, so tests can replace it.
_all_gather_single = all_gather_single


class _StaticAllGather(torch.autograd.Function):
    strategy = "all_gather"

    @staticmethod
    def forward(ctx, q, k, v, rows: StaticRows, rank: int, cp: int, group: Any,
                kernel: RowsKernel, scale: float, need_max: bool):
        cap, hkv, d, dv = q.shape[0], k.shape[1], k.shape[2], v.shape[2]
        kv = pack_kv(k, v)
        gathered = kv
        if cp > 1:
            gathered = kv.new_empty(cp * cap, kv.shape[1])
            _all_gather_single(gathered, kv, group=group)
        k_all, v_all = unpack_kv(gathered, hkv, d, dv)
        q_doc, q_pos = rows.rank_rows(rank)
        call = kernel.call(q, v_all, (q_doc, q_pos), (rows.doc, rows.pos), q_sorted=True,
                           k_sorted=cp == 1)
        out, lse, row_max = call.fwd(q, k_all, v_all, scale, need_max)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.meta = (cp, group, scale, k.dtype, call)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse, max_part(row_max, q.shape[1], q.device, need_max)

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        cp, group, scale, dtype, call = ctx.meta
        cap = q.shape[0]
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = call.bwd(dout, q, k_all, v_all, out, lse, dlse, scale)
        recv = exchange(pack_kv(dk, dv), cp, group)
        mine = recv.view(cp, cap, -1).sum(0)        # in rank order: deterministic
        dk_own, dv_own = unpack_kv(mine, *k_all.shape[1:], v_all.shape[2])
        return (dq.to(q.dtype), dk_own.to(dtype), dv_own.to(dtype)) + (None,) * 7
