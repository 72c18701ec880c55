"""Graph-safe ``a2a`` (Ulysses): one ``all_to_all_single`` of q|k|v to heads (equal
splits: capacity rows per rank), one call of every row against every row on this rank's
heads, one back (out|lse); backward the same in reverse. K/V heads fewer than cp are
repeated to cp (their gradients summed back), as the dynamic ``a2a`` does."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.rows import RowsKernel
from ..calls import head_max, no_max
from . import all_gather
from .buffers import StaticRows
from .common import exchange, pair


def _to_heads(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """[cap, cp * h, w] rows of this rank, heads split in cp slices -> [cp * cap, h, w]:
    every rank's rows (rank-major) of this rank's slice (one equal-split all-to-all)."""
    cap, heads, w = x.shape
    send = x.reshape(cap, cp, heads // cp, w).transpose(0, 1).contiguous()
    return exchange(send, cp, group).reshape(cp * cap, heads // cp, w)


def _to_rows(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: [cp * cap, h, w] -> [cap, cp * h, w]."""
    n, h, w = x.shape
    recv = exchange(x.contiguous(), cp, group)
    return recv.reshape(cp, n // cp, h, w).transpose(0, 1).reshape(n // cp, cp * h, w)


def grads_to_heads(dout: torch.Tensor | None, dlse: torch.Tensor | None, out: torch.Tensor,
                   a: int, group: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dout [cap, Hq, Dv] | dlse [Hq, cap] of this rank's rows to every row of the group of
    ``a`` ranks on this rank's head slice, in fp32, in one message per peer: (dout
    [a * cap, Hq / a, Dv], dlse [Hq / a, a * cap] or None). ``out``: the head-sharded
    output (its shape; zeros stand in for a missing dout)."""
    n, hs, dv = out.shape
    cap = n // a
    dout = out.new_zeros(cap, hs * a, dv) if dout is None else dout.float()
    parts = [dout.reshape(cap, a, hs * dv)]
    if dlse is not None:
        parts.append(dlse.float().t().reshape(cap, a, hs))
    grads = _to_heads(torch.cat(parts, 2), a, group).reshape(n, -1)
    dout_s, dlse_s = pair(grads, hs * dv)
    return dout_s.reshape(n, hs, dv), (dlse_s.t() if dlse is not None else None)


def _bytes_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` [n, m] as ``dtype`` elements (its bytes, to travel in one message with
    tensors of that dtype; ``.view(torch.float32)`` gives it back)."""
    return x.view(dtype)


def _kv_repeat(hkv: int, cp: int) -> int:
    """How often each K/V head is repeated so that the heads split into cp slices."""
    return 1 if hkv % cp == 0 else cp // hkv


class _StaticUlysses(torch.autograd.Function):
    strategy = "a2a"

    @staticmethod
    def forward(ctx, q, k, v, rows: StaticRows, rank: int, cp: int, group: Any,
                kernel: RowsKernel, scale: float, need_max: bool):
        cap, hq, d = q.shape
        dv = v.shape[2]
        rep = _kv_repeat(k.shape[1], cp)
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        hk = kr.shape[1]
        # q | k | v of a head slice in one message per peer (heads grouped per slice)
        packed = torch.cat([q.reshape(cap, cp, hq // cp * d),
                            kr.reshape(cap, cp, hk // cp * d),
                            vr.reshape(cap, cp, hk // cp * dv)], 2)
        rows_all = _to_heads(packed, cp, group).reshape(cp * cap, -1)
        qs, rest = pair(rows_all, hq // cp * d)
        ks, vs = pair(rest, hk // cp * d)
        qs = qs.reshape(cp * cap, hq // cp, d)
        ks = ks.reshape(cp * cap, hk // cp, d)
        vs = vs.reshape(cp * cap, hk // cp, dv)
        whole = (rows.doc, rows.pos)   # every rank's rows: sorted per rank only
        call = kernel.call(qs, vs, whole, whole, q_sorted=cp == 1, k_sorted=cp == 1)
        out, lse, row_max = call.fwd(qs, ks, vs, scale, need_max)
        ctx.save_for_backward(qs, ks, vs, out, lse)
        ctx.meta = (cp, group, scale, rep, q.dtype, k.dtype, call)
        ctx.set_materialize_grads(False)
        # out (in q's dtype) | lse (fp32, its bytes) back to their rows, one message per peer
        back = torch.cat([out.reshape(cp * cap, -1).to(q.dtype),
                          _bytes_as(lse.t().contiguous(), q.dtype)], 1).unsqueeze(1)
        mine = _to_rows(back, cp, group).reshape(cap, cp, -1)
        o, l = pair(mine, hq // cp * dv)
        out_rows = o.reshape(cap, hq, dv)
        lse_rows = l.contiguous().view(torch.float32).reshape(cap, hq).t().contiguous()
        part = no_max(q.device)
        if need_max:
            part = head_max(row_max, hq // cp, q.device)
            if cp > 1:
                gathered = part.new_empty(cp * part.shape[0])
                all_gather._all_gather_single(gathered, part, group=group)
                part = gathered                  # [Hq]: slice r's heads from rank r
        return out_rows, lse_rows, part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        qs, ks, vs, out, lse = ctx.saved_tensors
        cp, group, scale, rep, qdtype, kdtype, call = ctx.meta
        n, hs, dv = out.shape
        cap = n // cp
        dout_s, dlse_s = grads_to_heads(dout, dlse, out, cp, group)
        dq, dk, dv_ = call.bwd(dout_s, qs, ks, vs, out, lse, dlse_s, scale)
        back = torch.cat([dq.reshape(n, -1), dk.reshape(n, -1), dv_.reshape(n, -1)], 1)
        mine = _to_rows(back.unsqueeze(1), cp, group).reshape(cap, cp, -1)
        g_q, rest = pair(mine, hs * qs.shape[2])
        g_k, g_v = pair(rest, ks.shape[1] * ks.shape[2])
        dq_rows = g_q.reshape(cap, cp * hs, qs.shape[2])
        dk_rows = g_k.reshape(cap, cp * ks.shape[1], ks.shape[2])
        dv_rows = g_v.reshape(cap, cp * vs.shape[1], vs.shape[2])
        if rep > 1:   # a repeated head's gradient is the sum over its copies
            dk_rows = dk_rows.reshape(cap, -1, rep, ks.shape[2]).sum(2)
            dv_rows = dv_rows.reshape(cap, -1, rep, vs.shape[2]).sum(2)
        return (dq_rows.to(qdtype), dk_rows.to(kdtype), dv_rows.to(kdtype)) + (None,) * 7
