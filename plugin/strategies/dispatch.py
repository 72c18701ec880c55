"""Dispatch context parallelism: fetch exactly the K/V each rank's queries can see.

Host plan (once per (plan, mask), cached in the plan): for every rank, the keys its queries
see are, per document, the union of the query tokens' key intervals. The intervals' ends
never decrease with the position, so the union is a few disjoint ranges of positions, found
with one shifted running maximum; keys held locally are used in place, the others are
fetched from their owners. Every rank computes every rank's needs, so each also knows what
to send and in which order, with no metadata exchange.

Forward: ONE ``all_to_all_single`` with uneven splits moves K and V (packed per token into
one row) from owners to the ranks that need them; nothing is sent to oneself. A
host-planned index then lays out, per document, the local and fetched keys in position order
(padding never included), and one local varlen call with explicit positions computes the
attention. Backward: one local backward with the FINAL out/lse, then ONE more
``all_to_all_single`` returns the dK/dV rows of fetched keys to their owners (in the input
dtype, as the kernel returns them), where they are summed with the local ones in fp32
(``index_add_``). The LSE output is differentiable (its gradient joins the local
backward); the max logit (``need_max``) is the one call's per-head max.

Bytes: forward, each rank sends the K/V rows others need from it; backward, the dK/dV rows
of the keys it fetched. That equals the lower bound of any scheme that moves K/V to the
queries (the other ranks' keys that a rank's queries see), with no padding to equal sizes.

Limits: the fetched K/V picked for the local call are kept for the backward pass (memory:
the keys this rank's queries see, as all_gather); no overlap of the transfer with compute
(the one all-to-all runs before the one kernel call). Every rank builds every rank's
needs (O(sum of the needed keys), at most cp x tokens): measured 30-50 ms of one CPU core
for 128K tokens, 1K documents, cp 8..32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from ..plan import CPPlan
from ..schedules.cost import Shape
from ..schedules.selected import DispatchTables, dispatch_tables
from .base import CallSpec, Strategy
from .calls import Attn, empty_attn, split_kv
from .selected_keys import (local_key_grads, prepare_tables, selected_keys_attention,
                            unpack_key_grads)


# --------------------------------------------------------------------------------- engine
def dispatch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tab: DispatchTables,
                     group: Any, attn: Attn, need_max: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor,
                                torch.Tensor]:
    """(out in q.dtype, lse, row_max or None, k_sel, v_sel): the needed K/V are kept for
    the backward."""
    hkv, d, dv = k.shape[1], k.shape[2], v.shape[2]
    packed = torch.cat([k.flatten(1), v.flatten(1)], dim=1)   # one row per token: 1 message
    send = packed.index_select(0, tab.send_rows)
    recv = packed.new_empty(sum(tab.recv_splits), packed.shape[1])
    dist.all_to_all_single(recv, send, list(tab.recv_splits), list(tab.send_splits),
                           group=group)
    k_sel, v_sel = split_kv(torch.cat([packed, recv]).index_select(0, tab.gather), hkv, d, dv)
    if tab.call is None:
        out, lse, row_max = empty_attn(q, dv, need_max)
    else:
        out, lse, row_max = attn.fwd(q, k_sel, v_sel, tab.call, need_max)
    return out, lse, row_max, k_sel, v_sel


def dispatch_backward(dout: torch.Tensor, q: torch.Tensor, k_sel: torch.Tensor,
                      v_sel: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      tab: DispatchTables, group: Any, attn: Attn, k_shape: torch.Size,
                      dlse: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): dK/dV of fetched keys go home and are summed with the local ones.
    ``k_shape``: shape of this rank's local K (the layout dk/dv come back in)."""
    dq, grads = local_key_grads(dout, q, k_sel, v_sel, out, lse, tab.call, attn, dlse)
    back = grads.new_empty(tab.send_rows.shape[0], grads.shape[1])
    # The reverse of the forward exchange: what we fetched goes back, what we sent returns.
    dist.all_to_all_single(back, grads.index_select(0, tab.recv_order),
                           list(tab.send_splits), list(tab.recv_splits), group=group)
    acc = torch.zeros(k_shape[0], grads.shape[1], dtype=torch.float32, device=q.device)
    acc.index_add_(0, tab.local_rows, grads.index_select(0, tab.local_slots).float())
    acc.index_add_(0, tab.send_rows, back.float())
    dk, dv = unpack_key_grads(acc, k_shape, k_sel.dtype, v_sel.dtype, v_sel.shape[2])
    return dq, dk, dv


# ------------------------------------------------------------------------------ strategy
class Dispatch(Strategy):
    """Exactly the K/V ranges each rank's queries see, fetched in one all-to-all."""

    name = "dispatch"
    kind = "dispatch"
    build = staticmethod(dispatch_tables)
    forward = staticmethod(dispatch_forward)
    backward = staticmethod(dispatch_backward)

    def prepare(self, plan: CPPlan, mask: AttnMask, block: tuple[int, int],
                device: torch.device, shape: Shape, a2a_size: int | None = None) -> None:
        prepare_tables(self.kind, dispatch_tables, plan, mask, block, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return selected_keys_attention(q, k, v, spec, self)
