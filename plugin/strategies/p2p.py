"""Ring (P2P) context parallelism: K/V travel around the ring while each step computes.

Rank r at step t holds the K/V of holder (r - t) % R and attends its queries to them; the
send/recv for step t+1 is posted before step t computes, so the transfer overlaps compute
(NCCL runs P2P on its own stream). Partial results are folded with ``merge_attn_partials``
in fp32. The host decides, from the plan, which steps see anything (exact visible-pair
counts): such steps are skipped, and the ring stops after the last step at which ANY rank
still needs K/V, so with sliding windows and chunks distant K/V is never sent. The decision
is identical on every rank, so no rank waits on a message that is never sent.

Backward runs the ring again: K/V travel as in forward; each step's dK/dV partial (already
in the input dtype, as the kernel returns it) is sent straight home to the K/V's owner and
summed there in fp32. Compared with an accumulator travelling with K/V this sends one
buffer fewer per ring, sends nothing for skipped steps (both sides know them from the host
tables), and rounds each partial once instead of once per hop. ``out`` and ``lse`` handed to
the kernels are the final merged ones (ring-attention rule), and so is the LSE's gradient:
the LSE output is differentiable (attention sinks compose on it), every step adding its
P_t * dlse term. The max logit (``need_max``) is the max of the steps' per-head maxes.

The engine (``ring_forward`` / ``ring_backward``) works on any ring of token holders, so the
hybrid a2a+p2p strategy reuses it with Ulysses groups as holders.

Limits: the ring is one-directional, as the contract fixes it; with dual_chunk layouts and
local masks a rank's nearest neighbours sit on both sides, so the early stop saves little
there (it pays off on contiguous layouts). Backward sends K/V again rather than keeping
every rank's K/V from the forward (memory stays one local K/V plus one in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..kernels import merge_attn_partials
from ..masks import AttnMask
from .common import (Attn, Holder, KernelCall, cached_on, dlse_or_none, global_rank,
                     head_max, kernel_call, maybe_max, no_max, pack_flat, rank_holder,
                     unpack_flat, visible_pairs)

_TAG_KV, _TAG_ACC = 0, 1


# ---------------------------------------------------------------------------- host tables
def ring_visible(holders: list[Holder], mask: AttnMask) -> list[list[int]]:
    """vis[s][j]: visible pairs of holder s's queries with holder j's keys."""
    return [[visible_pairs(hq, hk, mask) for hk in holders] for hq in holders]


def ring_length(vis: list[list[int]]) -> int:
    """Steps the ring runs: 1 + the last step t at which some holder s needs the K/V of
    (s - t) % R. Step 0 (own K/V) always runs."""
    size = len(vis)
    last = 0
    for t in range(1, size):
        if any(vis[s][(s - t) % size] for s in range(size)):
            last = t
    return last + 1


@dataclass(frozen=True)
class RingTables:
    """One ring index's view of a ring: how long it runs, what each step computes."""

    n_steps: int
    sizes: tuple[int, ...]                    # tokens of each holder (recv buffer sizes)
    calls: tuple[KernelCall | None, ...]      # per step; None = nothing visible, skipped
    incoming: tuple[bool, ...]                # per step: a dK/dV partial arrives for us

    def to(self, device: torch.device) -> "RingTables":
        return replace(self, calls=tuple(None if c is None else c.to(device)
                                         for c in self.calls))

    def source(self, index: int, step: int) -> int:
        return (index - step) % len(self.sizes)


def ring_tables(holders: list[Holder], vis: list[list[int]], index: int, mask: AttnMask,
                block: tuple[int, int]) -> RingTables:
    """Host tables of ring position ``index`` (schedules for its non-empty steps only)."""
    size = len(holders)
    n_steps = ring_length(vis)
    calls, incoming = [], []
    for t in range(n_steps):
        src = (index - t) % size
        calls.append(kernel_call(holders[index], holders[src], mask, block)
                     if vis[index][src] else None)
        # At step t, position index + t computes on our K/V: it sends its partial home.
        incoming.append(t > 0 and vis[(index + t) % size][index] > 0)
    return RingTables(n_steps, tuple(h.n_tokens for h in holders), tuple(calls),
                      tuple(incoming))


def ring_send_rows(sizes: tuple[int, ...], vis: list[list[int]], index: int
                   ) -> tuple[int, int]:
    """(K/V rows, dK/dV rows) ring position ``index`` sends: K/V in forward and again in
    backward, dK/dV partials in backward only; exactly what the engine posts."""
    size, n_steps = len(sizes), ring_length(vis)
    kv = sum(sizes[(index - t) % size] for t in range(n_steps - 1))
    grads = sum(sizes[(index - t) % size] for t in range(1, n_steps)
                if vis[index][(index - t) % size])
    return kv, grads


# --------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class Ring:
    """A ring at run time: device tables, this rank's index, global rank of each index."""

    tables: RingTables
    index: int
    peers: tuple[int, ...]
    group: Any

    @property
    def next(self) -> int:
        return self.peers[(self.index + 1) % len(self.peers)]

    @property
    def prev(self) -> int:
        return self.peers[(self.index - 1) % len(self.peers)]


def _post(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
          group: Any, tag: int) -> list:
    ops = [dist.P2POp(dist.isend, t, p, group, tag) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, p, group, tag) for t, p in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _kv_shapes(n: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple[int, ...]]:
    return [(n, k.shape[1], k.shape[2]), (n, v.shape[1], v.shape[2])]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, attn: Attn,
                 need_max: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Ring attention forward: (out fp32 [Tq, Hq, Dv], lse fp32 [Hq, Tq], max_part):
    max_part fp32 [Hq] is the max logit over every step's visible pairs (``need_max``;
    else None). Per-step maxes fold with ``torch.maximum`` on the compute stream, so no
    step's value is read before the kernel that made it."""
    tab = ring.tables
    cur = pack_flat(k, v)
    out = lse = None
    max_part = head_max(None, q.shape[1], q.device) if need_max else None
    for t in range(tab.n_steps):
        works, nxt = [], None
        if t + 1 < tab.n_steps:
            n_next = tab.sizes[tab.source(ring.index, t + 1)]
            nxt = cur.new_empty(n_next * (k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2]))
            works = _post([(cur, ring.next)], [(nxt, ring.prev)], ring.group, _TAG_KV)
        call = tab.calls[t]
        if call is not None:
            n_src = tab.sizes[tab.source(ring.index, t)]
            k_t, v_t = unpack_flat(cur, _kv_shapes(n_src, k, v))
            o, l, m = attn.fwd(q, k_t, v_t, call, need_max)
            if need_max:
                max_part = torch.maximum(max_part, head_max(m, q.shape[1], q.device))
            if out is None:
                out, lse = o.float(), l
            else:
                out, lse = merge_attn_partials(out, lse, o, l)
        _wait(works)
        if nxt is not None:
            cur = nxt
    if out is None:  # nothing visible anywhere: empty rows
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    return out, lse, max_part


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ring: Ring, attn: Attn,
                  dlse: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward with the FINAL out/lse (and the final LSE's gradient
    ``dlse``, or None): (dq, dk, dv) in input dtypes. Every step gets the same dlse: its
    term P_t * dlse sums over the steps to the whole row's, as P_t uses the final lse."""
    tab, size, me = ring.tables, len(ring.peers), ring.index
    row = k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2]
    cur = pack_flat(k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc = torch.zeros(cur.numel(), dtype=torch.float32, device=q.device)  # our dK/dV
    pending: tuple[list, list[torch.Tensor], torch.Tensor | None] = ([], [], None)
    for t in range(tab.n_steps):
        kv_works, nxt = [], None
        if t + 1 < tab.n_steps:
            nxt = cur.new_empty(tab.sizes[tab.source(me, t + 1)] * row)
            kv_works = _post([(cur, ring.next)], [(nxt, ring.prev)], ring.group, _TAG_KV)
        call, sends = tab.calls[t], []
        if call is not None:
            src = tab.source(me, t)
            k_t, v_t = unpack_flat(cur, _kv_shapes(tab.sizes[src], k, v))
            dq_t, dk_t, dv_t = attn.bwd(dout, q, k_t, v_t, out, lse, call, dlse)
            dq += dq_t
            if t == 0:
                acc += pack_flat(dk_t, dv_t, dtype=torch.float32)
            else:
                sends.append((pack_flat(dk_t, dv_t), ring.peers[src]))
        incoming = cur.new_empty(tab.sizes[me] * row) if tab.incoming[t] else None
        recvs = [] if incoming is None else [(incoming, ring.peers[(me + t) % size])]
        works = _post(sends, recvs, ring.group, _TAG_ACC)
        # Fold the previous step's partial now: it travelled while this step computed.
        _wait(pending[0])
        if pending[2] is not None:
            acc += pending[2].float()
        pending = (works, [b for b, _ in sends], incoming)  # keep send buffers alive
        _wait(kv_works)
        if nxt is not None:
            cur = nxt
    _wait(pending[0])
    if pending[2] is not None:
        acc += pending[2].float()
    dk, dv = unpack_flat(acc, _kv_shapes(k.shape[0], k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------ strategy
def _rank_holders(plan: Any) -> list[Holder]:
    return plan.cached(("p2p", "holders"), lambda: [rank_holder(plan, r)
                                                    for r in range(plan.cp_size)])


def _visible(plan: Any, mask: AttnMask) -> list[list[int]]:
    return plan.cached(("p2p", "visible", mask),
                       lambda: ring_visible(_rank_holders(plan), mask))


def host_tables(plan: Any, mask: AttnMask, rank: int, block: tuple[int, int]) -> RingTables:
    """Ring tables of ``rank`` (host), cached in the plan."""
    return plan.cached(("p2p", "tables", mask, block, rank),
                       lambda: ring_tables(_rank_holders(plan), _visible(plan, mask), rank,
                                           mask, block))


@dataclass(frozen=True)
class P2PSpec:
    """Non-tensor arguments of one p2p call."""

    plan: Any
    attn: Attn
    group: Any
    block: tuple[int, int]


def _ring(spec: P2PSpec, device: torch.device) -> Ring:
    plan, rank = spec.plan, spec.plan.cp_rank
    key = ("p2p", "tables", spec.attn.mask, spec.block, rank)
    tables = cached_on(plan, key, device,
                       lambda: host_tables(plan, spec.attn.mask, rank, spec.block))
    peers = tuple(global_rank(spec.group, r) for r in range(plan.cp_size))
    return Ring(tables, rank, peers, spec.group)


class P2PAttention(torch.autograd.Function):
    """Ring attention over a CP group: (out, lse, max_part) of the local queries vs all
    keys; lse is differentiable, max_part (or its empty stand-in) is not."""

    @staticmethod
    def forward(ctx, q, k, v, spec: P2PSpec, need_max: bool):
        ring = _ring(spec, q.device)
        out, lse, max_part = ring_forward(q, k, v, ring, spec.attn, need_max)
        out = out.to(q.dtype)
        max_part = max_part if need_max else no_max(q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(max_part)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient
        return out, lse, max_part

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        ring = _ring(ctx.spec, q.device)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ring, ctx.spec.attn,
                                   dlse_or_none(dlse))
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, attn: Attn,
              group: Any, block: tuple[int, int], *, need_lse: bool = True,
              need_max: bool = False, **_: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Differentiable ring attention (inputs already checked): (out, lse, max_part)."""
    out, lse, max_part = P2PAttention.apply(q, k, v, P2PSpec(plan, attn, group, block),
                                            need_max)
    return out, lse, maybe_max(max_part)


def check_heads(n_heads: int, n_kv_heads: int, cp_size: int, **_: Any) -> None:
    """The ring moves whole K/V: any GQA head split works."""


# ---------------------------------------------------------------------------- cost model
def bytes_sent_per_rank(plan: Any, mask: AttnMask, *, head_dim: int, n_kv_heads: int,
                        dtype_bytes: int, head_dim_v: int | None = None, **_: Any
                        ) -> dict[str, list[int]]:
    """Bytes each rank posts per layer: {"fwd": [...], "bwd": [...]}; K/V forward, K/V
    again and the dK/dV partials backward, all in the input dtype."""
    dv = head_dim if head_dim_v is None else head_dim_v
    row = n_kv_heads * (head_dim + dv) * dtype_bytes
    vis = _visible(plan, mask)
    sizes = tuple(h.n_tokens for h in _rank_holders(plan))
    fwd, bwd = [], []
    for r in range(plan.cp_size):
        kv, grads = ring_send_rows(sizes, vis, r)
        fwd.append(kv * row)
        bwd.append((kv + grads) * row)
    return {"fwd": fwd, "bwd": bwd}


def compute_per_rank(plan: Any, mask: AttnMask, *, block: tuple[int, int], **_: Any
                     ) -> dict[str, list[float]]:
    """Per rank: query-key pairs the kernels visit (tiles from the schedules) and the
    visible pairs among them, per query head (all heads are local in p2p)."""
    visited, visible = [], []
    for r in range(plan.cp_size):
        tab = host_tables(plan, mask, r, block)
        visited.append(float(sum(c.visited_pairs for c in tab.calls if c is not None)))
        vis = _visible(plan, mask)[r]
        visible.append(float(sum(vis[tab.source(r, t)] for t in range(tab.n_steps))))
    return {"visited": visited, "visible": visible}

def prepare(plan: Any, mask: AttnMask, block: tuple[int, int], device: torch.device,
            **_: Any) -> None:
    """Build and cache this rank's ring tables (host and ``device`` copy) ahead of a call."""
    rank = plan.cp_rank
    cached_on(plan, ("p2p", "tables", mask, block, rank), device,
              lambda: host_tables(plan, mask, rank, block))
