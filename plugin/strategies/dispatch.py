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

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from .common import (Attn, Holder, KernelCall, empty_attn, kernel_call, rank_holder,
                     segment_ids, visible_pairs)
from .selected_keys import (SelectedKeysSpec, local_key_grads, selected_keys_attention,
                            unpack_key_grads)


# ---------------------------------------------------------------------------- host tables
@dataclass(frozen=True)
class Needed:
    """Keys one rank's queries see, in (document, position) order (host tensors)."""

    owner: torch.Tensor      # int64 [n]: rank holding the key
    row: torch.Tensor        # int64 [n]: its local row there
    holder: Holder           # cu / positions of these keys (segment i = document i)


def owners(plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, row) int64 [total_tokens]: which rank holds each global token, at which
    local row (cached: shared by every mask)."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.empty(plan.total_tokens, dtype=torch.int64)
        row = torch.empty(plan.total_tokens, dtype=torch.int64)
        for r in range(plan.cp_size):
            idx = plan.token_indices_of(r)
            real = idx >= 0
            owner[idx[real]] = r
            row[idx[real]] = torch.arange(idx.numel())[real]
        return owner, row
    return plan.cached(("dispatch", "owners"), build)


def key_ranges(plan: Any, mask: AttnMask, rank: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(doc, first, length) int64 of the disjoint key-position ranges ``rank``'s queries
    see, in (document, position) order: the union of the local queries' key intervals."""
    pos = plan.positions_of(rank).to(torch.int64)
    doc = segment_ids(plan.local_cu_seqlens_of(rank), pos.numel())
    live = pos >= 0  # padding sees nothing; local order is (doc, position) already
    pos, doc = pos[live], doc[live]
    lo, hi = mask.key_interval(pos)
    doc_len = plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]
    lo, hi = lo.clamp(min=0), torch.minimum(hi, doc_len[doc] - 1)
    # Both ends are non-decreasing in position, so the keys a token adds beyond those of
    # the tokens before it in its document start after its predecessor's last key.
    prev_hi = torch.full_like(hi, -1)
    if hi.numel() > 1:
        same = doc[1:] == doc[:-1]
        prev_hi[1:] = torch.where(same, hi[:-1], torch.full_like(hi[:-1], -1))
    first = torch.maximum(lo, prev_hi + 1)
    length = (hi - first + 1).clamp(min=0)
    keep = length > 0
    return doc[keep], first[keep], length[keep]


def needed_keys(plan: Any, mask: AttnMask, rank: int) -> Needed:
    """The keys some query of ``rank`` sees, with their owners and rows there."""
    doc, first, length = key_ranges(plan, mask, rank)
    n = int(length.sum())
    start = plan.cu_seqlens[doc] + first                 # global index of each range start
    range_of = torch.repeat_interleave(torch.arange(length.numel()), length, output_size=n)
    offset = torch.arange(n) - (torch.cumsum(length, 0) - length)[range_of]
    glob = start[range_of] + offset
    owner, row = owners(plan)
    key_doc = doc[range_of]
    counts = torch.bincount(key_doc, minlength=plan.n_docs)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    max_len = int(counts.max()) if counts.numel() else 0
    pos = (first[range_of] + offset).to(torch.int32)
    return Needed(owner[glob], row[glob], Holder(cu.to(torch.int32), pos, max_len))


def all_needed(plan: Any, mask: AttnMask) -> list[Needed]:
    """``needed_keys`` of every rank (each rank needs them all to know what it sends)."""
    return plan.cached(("dispatch", "needed", mask),
                       lambda: [needed_keys(plan, mask, r) for r in range(plan.cp_size)])


@dataclass(frozen=True)
class DispatchTables:
    """Everything one rank's dispatch call needs (host, or copied to the device)."""

    send_rows: torch.Tensor        # int64 [n_send]: local K/V rows to send, by destination
    send_splits: tuple[int, ...]   # rows sent to each rank (0 to itself)
    recv_splits: tuple[int, ...]   # rows fetched from each rank (0 from itself)
    gather: torch.Tensor           # int64 [n_sel]: row of [local K/V; fetched] per key slot
    recv_order: torch.Tensor       # int64 [n_recv]: key slot of each fetched row
    local_slots: torch.Tensor      # int64 [n_loc]: key slots served by local rows
    local_rows: torch.Tensor       # int64 [n_loc]: their local rows
    call: KernelCall | None        # local queries x needed keys; None = nothing visible

    def to(self, device: torch.device) -> "DispatchTables":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return replace(self, send_rows=mv(self.send_rows), gather=mv(self.gather),
                       recv_order=mv(self.recv_order), local_slots=mv(self.local_slots),
                       local_rows=mv(self.local_rows),
                       call=None if self.call is None else self.call.to(device))


def dispatch_tables(plan: Any, mask: AttnMask, rank: int, block: tuple[int, int]
                    ) -> DispatchTables:
    """Host tables of ``rank``: its fetches, its sends (others' needs) and its local call."""
    cp, needs = plan.cp_size, all_needed(plan, mask)
    mine = needs[rank]
    remote = mine.owner != rank
    # Fetched rows arrive grouped by owner, each owner's in (doc, position) order: the
    # order in which the owner lists them below, since a stable sort keeps that order.
    recv_order = torch.nonzero(remote).flatten()
    recv_order = recv_order[torch.argsort(mine.owner[recv_order], stable=True)]
    local_slots = torch.nonzero(~remote).flatten()
    gather = torch.empty(mine.owner.numel(), dtype=torch.int64)
    gather[local_slots] = mine.row[local_slots]
    gather[recv_order] = plan.num_tokens_of(rank) + torch.arange(recv_order.numel())
    recv_splits = torch.bincount(mine.owner[remote], minlength=cp)
    sends = [n.row[n.owner == rank] if d != rank else n.row[:0] for d, n in enumerate(needs)]
    n_sel = mine.owner.numel()
    call = (kernel_call(rank_holder(plan, rank), mine.holder, mask, block)
            if n_sel else None)
    return DispatchTables(torch.cat(sends), tuple(int(s.numel()) for s in sends),
                          tuple(int(x) for x in recv_splits), gather, recv_order,
                          local_slots, mine.row[local_slots], call)


# --------------------------------------------------------------------------------- engine
def _split_kv(buf: torch.Tensor, hkv: int, d: int, dv: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    n = buf.shape[0]
    return (buf[:, :hkv * d].reshape(n, hkv, d).contiguous(),
            buf[:, hkv * d:].reshape(n, hkv, dv).contiguous())


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
    k_sel, v_sel = _split_kv(torch.cat([packed, recv]).index_select(0, tab.gather), hkv, d, dv)
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
def host_tables(plan: Any, mask: AttnMask, rank: int, block: tuple[int, int]
                ) -> DispatchTables:
    """Dispatch tables of ``rank`` (host), cached in the plan."""
    return plan.cached(("dispatch", "tables", mask, block, rank),
                       lambda: dispatch_tables(plan, mask, rank, block))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, attn: Attn,
              group: Any, block: tuple[int, int], *, need_lse: bool = True,
              need_max: bool = False, **_: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Differentiable dispatch attention (inputs already checked): (out, lse, max_part)."""
    spec = SelectedKeysSpec("dispatch", plan, attn, group, block, dispatch_tables,
                            dispatch_forward, dispatch_backward)
    return selected_keys_attention(q, k, v, spec, need_max)


def check_heads(n_heads: int, n_kv_heads: int, cp_size: int, **_: Any) -> None:
    """All heads stay local: any GQA head split works."""


# ---------------------------------------------------------------------------- cost model
def fetched_tokens(plan: Any, mask: AttnMask) -> list[int]:
    """Per rank: other ranks' K/V tokens its queries see (= what dispatch fetches; the
    lower bound of any scheme that moves K/V to the queries)."""
    return [int((n.owner != r).sum()) for r, n in enumerate(all_needed(plan, mask))]


def bytes_sent_per_rank(plan: Any, mask: AttnMask, *, head_dim: int, n_kv_heads: int,
                        dtype_bytes: int, head_dim_v: int | None = None, **_: Any
                        ) -> dict[str, list[int]]:
    """Bytes each rank sends per layer: forward, the K/V rows the other ranks need from
    it; backward, the dK/dV rows of the keys it fetched (input dtype)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    row = n_kv_heads * (head_dim + dv) * dtype_bytes
    cp, needs = plan.cp_size, all_needed(plan, mask)
    sent = [0] * cp
    for r, n in enumerate(needs):
        counts = torch.bincount(n.owner[n.owner != r], minlength=cp)
        for s in range(cp):
            sent[s] += int(counts[s])
    return {"fwd": [s * row for s in sent], "bwd": [f * row for f in fetched_tokens(plan, mask)]}


def compute_per_rank(plan: Any, mask: AttnMask, *, block: tuple[int, int], **_: Any
                     ) -> dict[str, list[float]]:
    """Per rank, per query head: pairs the kernel visits (schedule tiles) and visible
    pairs (all heads are local in dispatch)."""
    visited, visible = [], []
    needs = all_needed(plan, mask)
    for r in range(plan.cp_size):
        tab = host_tables(plan, mask, r, block)
        visited.append(float(tab.call.visited_pairs) if tab.call is not None else 0.0)
        visible.append(float(visible_pairs(rank_holder(plan, r), needs[r].holder, mask)))
    return {"visited": visited, "visible": visible}

def prepare(plan: Any, mask: AttnMask, block: tuple[int, int], device: torch.device,
            **_: Any) -> None:
    """Build and cache this rank's tables (host and ``device`` copy) ahead of a call."""
    SelectedKeysSpec("dispatch", plan, Attn(mask, 1.0, "auto"), None, block, dispatch_tables,
                     dispatch_forward, dispatch_backward).tables(device)
