"""What each strategy costs per layer and rank, in closed form on the plan.

Bytes are exactly what the strategies' collectives post (the tests count them on gloo);
visible pairs are exact (``plan.runs`` and ``pair_work``); both come from the run-level
tables (visibility matrices, fetch counts), never from tile schedules or per-token passes,
so ``strategy="auto"`` can compare every candidate in a few milliseconds. Visited pairs
(what the kernels' tiles cover) need each rank's tile schedules: :func:`visited_pairs`
builds them, for benchmarks and tests.
"""

from __future__ import annotations

import torch

from ..masks import AttnMask
from ..plan import CPPlan
from .hybrid import default_a2a_size, group_members, group_visibility, hybrid_ring_tables
from .ring import p2p_tables, rank_visibility, ring_length
from .selected import fetch_counts, fetched_tokens, selected_tokens
from .shape import Shape, kv_heads_per_rank, make_shape
from .staged import staged_tables
from .ulysses import group_call, ulysses_tables

STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch")


def hybrid_size(plan: CPPlan, shape: Shape, a2a_size: int | None) -> int:
    return default_a2a_size(shape.n_heads, shape.n_kv_heads, plan.cp_size) \
        if a2a_size is None else a2a_size


# ---- bytes ------------------------------------------------------------------------------
def ring_rows(sizes: torch.Tensor, vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ring position: (K/V rows sent per pass, dK/dV partial rows sent backward), as
    the ring engine posts them (see ``ring.ring_send_rows``), for all positions at once."""
    size, n_steps = sizes.numel(), ring_length(vis)
    idx = torch.arange(size).unsqueeze(1)
    src = (idx - torch.arange(n_steps).unsqueeze(0)) % size          # [H, steps]
    kv = sizes[src[:, :-1]].sum(1)
    seen = vis.gather(1, src[:, 1:]) > 0
    grads = (sizes[src[:, 1:]] * seen).sum(1)
    return kv, grads


def ulysses_bytes(sizes: tuple[int, ...], index: int, shape: Shape, need_lse: bool = False
                  ) -> tuple[int, int]:
    """(forward, backward) bytes member ``index`` of a group with ``sizes`` sends in its
    all-to-alls (rows to itself excluded), as the engine packs them."""
    size = len(sizes)
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    hq = shape.n_heads // size
    qkv_row = (hq * shape.head_dim + hk * (shape.head_dim + shape.head_dim_v)) \
        * shape.dtype_bytes
    out_row = hq * shape.head_dim_v * shape.dtype_bytes
    mine, others = sizes[index], sum(sizes) - sizes[index]
    fwd = (size - 1) * mine * qkv_row + others * out_row
    bwd = (size - 1) * mine * out_row + others * qkv_row
    if need_lse:  # the fp32 LSE back to tokens, its gradient to heads
        fwd += others * hq * 4
        bwd += (size - 1) * mine * hq * 4
    return fwd, bwd


def bytes_sent(name: str, plan: CPPlan, mask: AttnMask, shape: Shape,
               a2a_size: int | None = None) -> dict[str, list[int]]:
    """Bytes each rank sends per layer: {"fwd": [...], "bwd": [...]} (input dtype)."""
    cp, row = plan.cp_size, shape.kv_row
    offsets = plan.rank_offsets()
    sizes = offsets[1:] - offsets[:-1]
    if name == "p2p":
        kv, grads = ring_rows(sizes, rank_visibility(plan, mask))
        return {"fwd": (kv * row).tolist(), "bwd": ((kv + grads) * row).tolist()}
    if name == "all_gather":
        stride = int(sizes.max())
        return {"fwd": [(cp - 1) * stride * row] * cp,
                "bwd": [f * row for f in fetched_tokens(plan, mask)]}
    if name == "dispatch":
        counts = fetch_counts(plan, mask)
        sent = counts.sum(0) - counts.diagonal()   # what the others fetch from each rank
        return {"fwd": (sent * row).tolist(), "bwd": [f * row for f in fetched_tokens(plan, mask)]}
    size = cp if name == "a2a" else hybrid_size(plan, shape, a2a_size)
    fwd, bwd = ulysses_rank_bytes(sizes, size, shape)
    if size < cp:  # a ring across the groups, on this rank's head slice
        hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
        ring_row = hk * (shape.head_dim + shape.head_dim_v) * shape.dtype_bytes
        group_sizes = sizes.view(-1, size).sum(1)
        kv, grads = ring_rows(group_sizes, group_visibility(plan, mask, size))
        fwd = fwd + (kv * ring_row).repeat_interleave(size)
        bwd = bwd + ((kv + grads) * ring_row).repeat_interleave(size)
    return {"fwd": fwd.tolist(), "bwd": bwd.tolist()}


def ulysses_rank_bytes(sizes: torch.Tensor, size: int, shape: Shape
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ulysses_bytes` of every rank at once (groups of ``size`` consecutive ranks;
    int64 [cp] each; zeros for size 1)."""
    if size == 1:
        return torch.zeros_like(sizes), torch.zeros_like(sizes)
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    hq = shape.n_heads // size
    qkv_row = (hq * shape.head_dim + hk * (shape.head_dim + shape.head_dim_v)) \
        * shape.dtype_bytes
    out_row = hq * shape.head_dim_v * shape.dtype_bytes
    others = sizes.view(-1, size).sum(1).repeat_interleave(size) - sizes
    return ((size - 1) * sizes * qkv_row + others * out_row,
            (size - 1) * sizes * out_row + others * qkv_row)


# ---- compute ----------------------------------------------------------------------------
def visible_pairs(name: str, plan: CPPlan, mask: AttnMask, shape: Shape,
                  a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: the visible pairs its kernels compute."""
    work = plan.work_per_rank(mask)
    if name in ("p2p", "all_gather", "dispatch"):
        return [float(w) for w in work]
    size = plan.cp_size if name == "a2a" else hybrid_size(plan, shape, a2a_size)
    # each member computes its group's documents for 1/size of the heads
    return [sum(work[r // size * size:(r // size + 1) * size]) / size
            for r in range(plan.cp_size)]


def visited_pairs(name: str, plan: CPPlan, mask: AttnMask, shape: Shape,
                  block: tuple[int, int], a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: pairs the kernels' tiles cover (builds every
    rank's schedules: benchmarks and tests)."""
    cp = plan.cp_size
    if name == "p2p":
        return [float(sum(c.visited_pairs for c in p2p_tables(plan, mask, block, r).calls
                          if c is not None)) for r in range(cp)]
    if name in ("all_gather", "dispatch"):  # one call over every key: S = 1's tables
        out = []
        for r in range(cp):
            tab = staged_tables(name, plan, mask, r, block, 1)
            calls = [tab.local] + [s.call for s in tab.stages]
            out.append(float(sum(c.visited_pairs for c in calls if c is not None)))
        return out
    size = cp if name == "a2a" else hybrid_size(plan, shape, a2a_size)
    if size == 1:  # a2a+p2p over groups of one rank is the ring of ranks
        return visited_pairs("p2p", plan, mask, shape, block)
    if size == cp:
        call = group_call(plan, tuple(range(cp)), mask, block)
        return [(call.visited_pairs if call is not None else 0) / cp] * cp
    return [sum(c.visited_pairs for c in hybrid_ring_tables(plan, mask, size, r // size,
                                                             block).calls if c is not None)
            / size for r in range(cp)]


def saved_bytes(name: str, plan: CPPlan, mask: AttnMask, shape: Shape,
                a2a_size: int | None = None) -> int:
    """Max over ranks of what ``name`` keeps for the backward beyond q, k, v, out, lse."""
    if name == "p2p":
        return 0
    if name in ("dispatch", "all_gather"):  # the K/V the local queries see
        return max(selected_tokens(plan, mask)) * shape.kv_row
    size = plan.cp_size if name == "a2a" else hybrid_size(plan, shape, a2a_size)
    if size == 1:
        return 0
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    width = (shape.n_heads // size + hk) * (shape.head_dim + shape.head_dim_v)
    tokens = max(sum(plan.num_tokens_of(m) for m in group_members(g, size))
                 for g in range(0, plan.cp_size, size))
    return tokens * width * shape.dtype_bytes


__all__ = ["Shape", "make_shape", "bytes_sent", "visible_pairs", "visited_pairs",
           "saved_bytes", "ulysses_bytes", "kv_heads_per_rank", "ring_rows", "ulysses_tables"]
