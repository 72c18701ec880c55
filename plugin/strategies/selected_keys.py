"""What all_gather and dispatch share: attention over a selection of keys brought to the
queries.

Both strategies make one local kernel call over the keys this rank's queries can see and
send those keys' dK/dV back to their owners; they differ only in how the keys travel (one
padded all-gather vs one all_to_all_single of exactly the needed ranges). Each supplies its
tables (``varlen_cp.schedules.selected``) and a forward (exchange + call) and backward
(call + return) engine; this module holds the one autograd.Function around them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..schedules.keys import device_table, table_key
from .base import CallSpec
from .calls import Attn, dlse_or_none, head_max, maybe_max, no_max


def local_key_grads(dout, q, k_sel, v_sel, out, lse, call, attn: Attn, dlse
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, grads): this rank's dQ and the selected keys' dK|dV packed as rows
    [n_selected, Hkv * (D + Dv)] in the input dtype, ready for the exchange back."""
    if call is None:  # nothing visible: nothing to differentiate
        width = k_sel.shape[1] * (k_sel.shape[2] + v_sel.shape[2])
        return torch.zeros_like(q), k_sel.new_zeros(k_sel.shape[0], width)
    dq, dk_sel, dv_sel = attn.bwd(dout, q, k_sel, v_sel, out, lse, call, dlse)
    return dq, torch.cat([dk_sel.flatten(1), dv_sel.flatten(1)], dim=1)


def unpack_key_grads(acc: torch.Tensor, k_shape: torch.Size, k_dtype: torch.dtype,
                     v_dtype: torch.dtype, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the fp32 accumulator of packed dK|dV rows into dk, dv in the local K layout."""
    n, hkv, d = k_shape
    dk = acc[:, :hkv * d].reshape(n, hkv, d).to(k_dtype)
    dv = acc[:, hkv * d:].reshape(n, hkv, head_dim_v).to(v_dtype)
    return dk, dv


class SelectedKeysAttention(torch.autograd.Function):
    """(out, lse, max_part) of the local queries vs the selected keys; lse is
    differentiable, max_part (or its empty stand-in) is not.

    ``engine`` supplies ``kind`` (the table key), ``build(plan, mask, block, rank)`` (host
    tables), ``forward(q, k, v, tables, group, attn, need_max) -> (out, lse, row_max,
    k_sel, v_sel)`` and ``backward(dout, q, k_sel, v_sel, out, lse, tables, group, attn,
    k_shape, dlse) -> (dq, dk, dv)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, spec: CallSpec, engine: Any):
        tables = _tables(spec, engine, q.device)
        out, lse, row_max, k_sel, v_sel = engine.forward(q, k, v, tables, spec.group,
                                                         spec.attn, spec.need_max)
        max_part = head_max(row_max, q.shape[1], q.device) if spec.need_max \
            else no_max(q.device)
        ctx.save_for_backward(q, k_sel, v_sel, out, lse)
        ctx.spec, ctx.engine, ctx.k_shape = spec, engine, k.shape
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k_sel, v_sel, out, lse = ctx.saved_tensors
        spec, engine = ctx.spec, ctx.engine
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = engine.backward(dout, q, k_sel, v_sel, out, lse,
                                     _tables(spec, engine, q.device), spec.group, spec.attn,
                                     ctx.k_shape, dlse_or_none(dlse))
        return dq, dk, dv, None, None


def _tables(spec: CallSpec, engine: Any, device: torch.device) -> Any:
    plan, mask, rank = spec.plan, spec.attn.mask, spec.plan.cp_rank
    return device_table(plan, table_key(engine.kind, mask, spec.block, rank), device,
                        lambda: engine.build(plan, mask, rank, spec.block))


def prepare_tables(kind: str, build: Callable[..., Any], plan, mask, block, device) -> None:
    """Build and cache one rank's tables of ``kind`` and their ``device`` copy."""
    rank = plan.cp_rank
    device_table(plan, table_key(kind, mask, block, rank), device,
                 lambda: build(plan, mask, rank, block))


def selected_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            spec: CallSpec, engine: Any
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Differentiable (out, lse, per-head max or None)."""
    out, lse, max_part = SelectedKeysAttention.apply(q, k, v, spec, engine)
    return out, lse, maybe_max(max_part)
