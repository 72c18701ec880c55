"""What each strategy costs per layer and rank, in closed form on the plan.

Bytes are exactly what the strategies' collectives post (the tests count them on gloo);
visible pairs are exact (``plan.runs`` and ``pair_work``); both come from the run-level
tables (visibility matrices, fetch counts), never from tile schedules or per-token passes,
so ``strategy="auto"`` can compare every candidate in a few milliseconds. Visited pairs
(what the kernels' tiles cover) need each rank's tile schedules: :func:`visited_pairs`
builds them, for benchmarks and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from ..masks import AttnMask
from ..plan import CPPlan
from .hybrid import default_a2a_size, group_members, group_visibility, hybrid_ring_tables
from .ring import p2p_tables, rank_visibility, ring_length
from .selected import dispatch_tables, fetch_counts, fetched_tokens, gather_tables, \
    selected_tokens
from .ulysses import group_call, ulysses_tables

STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch")


@dataclass(frozen=True)
class Shape:
    """Head shape and dtype of the layer being planned."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype_bytes: int

    @property
    def kv_row(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.head_dim_v) * self.dtype_bytes


def make_shape(n_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int | None,
               dtype_bytes: int) -> Shape:
    """Validated :class:`Shape` (ValueError naming the field)."""
    values = (n_heads, n_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v,
              dtype_bytes)
    for name, value in zip(("n_heads", "n_kv_heads", "head_dim", "head_dim_v",
                            "dtype_bytes"), values):
        check_int(name, value, 1)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    return Shape(*values)


def kv_heads_per_rank(n_kv_heads: int, size: int) -> tuple[int, int]:
    """(K/V heads each rank holds after an all-to-all over ``size``, replication factor)."""
    if n_kv_heads % size == 0:
        return n_kv_heads // size, 1
    return 1, size // n_kv_heads


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
    sizes = torch.tensor([plan.num_tokens_of(r) for r in range(cp)])
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
    fwd, bwd = [], []
    if size > 1:
        for r in range(cp):
            members = group_members(r, size)
            f, b = ulysses_bytes(tuple(sizes[list(members)].tolist()), r % size, shape)
            fwd.append(f)
            bwd.append(b)
    else:
        fwd, bwd = [0] * cp, [0] * cp
    if size < cp:  # a ring across the groups, on this rank's head slice
        hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
        ring_row = hk * (shape.head_dim + shape.head_dim_v) * shape.dtype_bytes
        group_sizes = sizes.view(-1, size).sum(1)
        kv, grads = ring_rows(group_sizes, group_visibility(plan, mask, size))
        for r in range(cp):
            fwd[r] += int(kv[r // size]) * ring_row
            bwd[r] += int(kv[r // size] + grads[r // size]) * ring_row
    return {"fwd": fwd, "bwd": bwd}


# ---- compute ----------------------------------------------------------------------------
def visible_pairs(name: str, plan: CPPlan, mask: AttnMask, shape: Shape,
                  a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: the visible pairs its kernels compute."""
    work = [plan.work_of(r, mask) for r in range(plan.cp_size)]
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
    if name in ("all_gather", "dispatch"):
        build = gather_tables if name == "all_gather" else dispatch_tables
        calls = [build(plan, mask, r, block).call for r in range(cp)]
        return [float(c.visited_pairs) if c is not None else 0.0 for c in calls]
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
