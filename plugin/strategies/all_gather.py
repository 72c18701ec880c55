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

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from .common import (SORT_STRIDE, Attn, Holder, KernelCall, empty_attn, kernel_call,
                     rank_holder, segment_ids, visible_pairs)
from .selected_keys import (SelectedKeysSpec, local_key_grads, selected_keys_attention,
                            unpack_key_grads)

# torch 2.13 renames all_gather_into_tensor to all_gather_single (same call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------- host tables
@dataclass(frozen=True)
class Selection:
    """Keys one rank's queries need, in (document, position) order (host tensors)."""

    owner: torch.Tensor      # int64 [n]: rank holding the key
    row: torch.Tensor        # int64 [n]: its local row there
    holder: Holder           # cu / positions of the picked keys


def _all_keys(plan: Any) -> tuple[torch.Tensor, ...]:
    """(owner, row, doc, pos) of every real (non-padding) token, by (doc, position)."""
    owner, row, doc, pos = [], [], [], []
    for r in range(plan.cp_size):
        n = plan.num_tokens_of(r)
        owner.append(torch.full((n,), r, dtype=torch.int64))
        row.append(torch.arange(n))
        doc.append(segment_ids(plan.local_cu_seqlens_of(r), n))
        pos.append(plan.positions_of(r).to(torch.int64))
    owner, row, doc, pos = (torch.cat(x) for x in (owner, row, doc, pos))
    live = pos >= 0
    owner, row, doc, pos = owner[live], row[live], doc[live], pos[live]
    order = torch.argsort(doc * SORT_STRIDE + pos, stable=True)
    return owner[order], row[order], doc[order], pos[order]


def select_keys(plan: Any, mask: AttnMask, rank: int) -> Selection:
    """The keys some query of ``rank`` sees: key k is needed iff a local query position of
    its document lies in k's query interval (exact, vectorized with searchsorted)."""
    owner, row, doc, pos = plan.cached(("all_gather", "keys"), lambda: _all_keys(plan))
    q_pos = plan.positions_of(rank).to(torch.int64)
    q_doc = segment_ids(plan.local_cu_seqlens_of(rank), q_pos.numel())
    live = q_pos >= 0
    q_key = torch.sort(q_doc[live] * SORT_STRIDE + q_pos[live]).values
    lo, hi = mask.query_interval(pos)
    base = doc * SORT_STRIDE
    hits = (torch.searchsorted(q_key, base + hi, right=True)
            - torch.searchsorted(q_key, base + lo.clamp(min=0)))
    need = hits > 0
    counts = torch.bincount(doc[need], minlength=plan.n_docs)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    max_len = int(counts.max()) if counts.numel() else 0
    return Selection(owner[need], row[need],
                     Holder(cu.to(torch.int32), pos[need].to(torch.int32), max_len))


@dataclass(frozen=True)
class GatherTables:
    """Everything one rank's all_gather call needs (host, or copied to the device)."""

    stride: int                    # rows per rank in the gathered buffer (max local count)
    index: torch.Tensor            # int64 [n_sel]: gathered rows this rank attends to
    call: KernelCall | None        # local queries x picked keys; None = nothing visible
    send_order: torch.Tensor       # int64 [n_sel]: picked rows grouped by owner
    send_splits: tuple[int, ...]   # dK/dV rows sent to each owner
    recv_index: torch.Tensor       # int64 [n_recv]: local row of each incoming dK/dV row
    recv_splits: tuple[int, ...]   # dK/dV rows received from each rank

    def to(self, device: torch.device) -> "GatherTables":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return replace(self, index=mv(self.index), send_order=mv(self.send_order),
                       recv_index=mv(self.recv_index),
                       call=None if self.call is None else self.call.to(device))


def gather_tables(plan: Any, mask: AttnMask, rank: int, block: tuple[int, int]
                  ) -> GatherTables:
    """Host tables of ``rank`` (needs every rank's selection for the backward receive)."""
    cp = plan.cp_size
    stride = max(plan.num_tokens_of(r) for r in range(cp))
    sels = [plan.cached(("all_gather", "select", mask, r), lambda r=r: select_keys(plan, mask, r))
            for r in range(cp)]
    mine = sels[rank]
    q_holder = rank_holder(plan, rank)
    call = (kernel_call(q_holder, mine.holder, mask, block)
            if visible_pairs(q_holder, mine.holder, mask) else None)
    send_order = torch.argsort(mine.owner, stable=True)
    send_splits = torch.bincount(mine.owner, minlength=cp)
    recv_index = torch.cat([s.row[s.owner == rank] for s in sels])
    recv_splits = [int((s.owner == rank).sum()) for s in sels]
    return GatherTables(stride, mine.owner * stride + mine.row, call, send_order,
                        tuple(int(x) for x in send_splits), recv_index, tuple(recv_splits))


# --------------------------------------------------------------------------------- engine
def _split_kv(buf: torch.Tensor, hkv: int, d: int, dv: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    n = buf.shape[0]
    return (buf[:, :hkv * d].reshape(n, hkv, d).contiguous(),
            buf[:, hkv * d:].reshape(n, hkv, dv).contiguous())


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
    k_sel, v_sel = _split_kv(gathered.index_select(0, tab.index), hkv, d, dv)
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
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, attn: Attn,
              group: Any, block: tuple[int, int], *, need_lse: bool = True,
              need_max: bool = False, **_: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Differentiable all-gather attention (inputs already checked): (out, lse,
    max_part)."""
    spec = SelectedKeysSpec("all_gather", plan, attn, group, block, gather_tables,
                            gather_forward, gather_backward)
    return selected_keys_attention(q, k, v, spec, need_max)


def check_heads(n_heads: int, n_kv_heads: int, cp_size: int, **_: Any) -> None:
    """All heads stay local: any GQA head split works."""


# ---------------------------------------------------------------------------- cost model
def bytes_sent_per_rank(plan: Any, mask: AttnMask, *, head_dim: int, n_kv_heads: int,
                        dtype_bytes: int, head_dim_v: int | None = None, **_: Any
                        ) -> dict[str, list[int]]:
    """Bytes each rank sends per layer: forward, its padded K/V block to each of the other
    cp-1 ranks; backward, the dK/dV rows it picked from other owners (input dtype)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    row = n_kv_heads * (head_dim + dv) * dtype_bytes
    cp = plan.cp_size
    stride = max(plan.num_tokens_of(r) for r in range(cp))
    fwd, bwd = [], []
    for r in range(cp):
        sel = plan.cached(("all_gather", "select", mask, r), lambda r=r: select_keys(plan, mask, r))
        fwd.append((cp - 1) * stride * row)
        bwd.append(int((sel.owner != r).sum()) * row)
    return {"fwd": fwd, "bwd": bwd}


def compute_per_rank(plan: Any, mask: AttnMask, *, block: tuple[int, int], **_: Any
                     ) -> dict[str, list[float]]:
    """Per rank: pairs the kernel visits (schedule tiles) and visible pairs, per head."""
    visited, visible = [], []
    for r in range(plan.cp_size):
        tab = plan.cached(("all_gather", "tables", mask, block, r),
                          lambda r=r: gather_tables(plan, mask, r, block))
        visited.append(float(tab.call.visited_pairs) if tab.call is not None else 0.0)
        sel = plan.cached(("all_gather", "select", mask, r), lambda r=r: select_keys(plan, mask, r))
        visible.append(float(visible_pairs(rank_holder(plan, r), sel.holder, mask)))
    return {"visited": visited, "visible": visible}

def prepare(plan: Any, mask: AttnMask, block: tuple[int, int], device: torch.device,
            **_: Any) -> None:
    """Build and cache this rank's tables (host and ``device`` copy) ahead of a call."""
    SelectedKeysSpec("all_gather", plan, Attn(mask, 1.0, "auto"), None, block, gather_tables,
                     gather_forward, gather_backward).tables(device)
