"""All-gather context parallelism: gather every rank's K/V once, attend locally.

Forward: each rank pads its local K/V (packed in one [T, Hkv*(D+Dv)] buffer) to the largest
local count and one ``all_gather_into_tensor`` moves them all. A host-planned index then
picks, for each of this rank's query documents, exactly the keys its queries can see (under
the mask), ordered by position, from every rank's part: one local varlen call with explicit
positions. Backward: the dK/dV rows of the picked keys go straight back to their owners in
one ``all_to_all_single`` (each rank sends only the rows it picked from that owner: a
reduce-scatter without the zeros) and are summed there in fp32. The LSE output is
differentiable (its gradient joins the one local backward); the max logit (``need_max``) is
that one call's per-head max.

Limits: the all-gather itself ships every rank's K/V whatever the mask (the collective is
what it is; a strategy that fetches only the visible K/V is ``dispatch``, not this one).
The gathered K/V picked for the local call is kept for the backward pass (memory: the keys
this rank's queries can see).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from ..plan import CPPlan
from ..schedules.cost import Shape
from ..schedules.selected import GatherTables, gather_tables
from .base import CallSpec, Strategy
from .calls import Attn, empty_attn, split_kv
from .selected_keys import (local_key_grads, prepare_tables, selected_keys_attention,
                            unpack_key_grads)

# torch 2.13 renames all_gather_into_tensor to all_gather_single (same call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------- engine
def gather_forward(q, k, v, tab: GatherTables, group: Any, attn: Attn, need_max: bool = False):
    """(out in q.dtype, lse, row_max or None, k_sel, v_sel): the picked K/V are kept for the
    backward."""
    t, hkv, d, dv = k.shape[0], k.shape[1], k.shape[2], v.shape[2]
    cp = dist.get_world_size(group)
    padded = k.new_zeros(tab.stride, hkv * (d + dv))
    padded[:t, :hkv * d] = k.flatten(1)
    padded[:t, hkv * d:] = v.flatten(1)
    gathered = k.new_empty(cp * tab.stride, hkv * (d + dv))
    _all_gather_single(gathered, padded, group=group)
    k_sel, v_sel = split_kv(gathered.index_select(0, tab.index), hkv, d, dv)
    if tab.call is None:
        out, lse, row_max = empty_attn(q, dv, need_max)
    else:
        out, lse, row_max = attn.fwd(q, k_sel, v_sel, tab.call, need_max)
    return out, lse, row_max, k_sel, v_sel


def gather_backward(dout, q, k_sel, v_sel, out, lse, tab: GatherTables, group: Any,
                    attn: Attn, k_shape: torch.Size, dlse: torch.Tensor | None = None):
    """(dq, dk, dv): dK/dV of the picked keys summed at their owners (fp32)."""
    dq, grads = local_key_grads(dout, q, k_sel, v_sel, out, lse, tab.call, attn, dlse)
    send = grads.index_select(0, tab.send_order)
    recv = grads.new_empty(sum(tab.recv_splits), grads.shape[1])
    dist.all_to_all_single(recv, send, list(tab.recv_splits), list(tab.send_splits),
                           group=group)
    acc = torch.zeros(k_shape[0], grads.shape[1], dtype=torch.float32, device=q.device)
    acc.index_add_(0, tab.recv_index, recv.float())
    dk, dv = unpack_key_grads(acc, k_shape, k_sel.dtype, v_sel.dtype, v_sel.shape[2])
    return dq, dk, dv


# ------------------------------------------------------------------------------ strategy
class AllGather(Strategy):
    """Every rank's K/V gathered once; one local call over the keys the queries see."""

    name = "all_gather"
    kind = "all_gather"
    build = staticmethod(gather_tables)
    forward = staticmethod(gather_forward)
    backward = staticmethod(gather_backward)

    def prepare(self, plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device, shape: Shape, a2a_size: int | None = None) -> None:
        prepare_tables(self.kind, gather_tables, plan, mask, block, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return selected_keys_attention(q, k, v, spec, self)
