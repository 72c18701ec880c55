"""Hybrid context parallelism: Ulysses inside groups of a2a_size ranks, a ring across them.

cp = a2a_size x ring_size. CP ranks [g*a, (g+1)*a) form Ulysses group g: one all-to-all
inside the group gives each member all of the group's tokens for Hq/a heads (K/V heads
split or replicated as in ``a2a``). Member i of every group then runs the ring engine of
``p2p`` with the members i of the other groups, each group's merged tokens being one ring
holder: ring steps, early stop and skipped steps come from the same host tables. The
result goes back through the group's all-to-all. Backward mirrors it (the LSE's gradient,
when the LSE was asked for, travels with dout as in ``a2a``; the ring adds its terms at
every step as in ``p2p``). The max logit needs no transfer of its own: each rank's
per-head maxes cover its group's queries for its head slice, and the caller's MAX
all-reduce over the CP group joins the slices and the groups.

a2a_size defaults to the largest divisor of cp that suits the heads (Hq % a == 0, and Hkv
and a divide one another). a2a_size == cp is plain ``a2a`` and a2a_size == 1 plain ``p2p``:
those run the simpler strategy directly. The Ulysses sub-groups are created once per (CP
group, a2a_size) with ``dist.new_group(..., use_local_synchronization=True)`` on first use,
so only the members of each sub-group take part (the CP group may be a subgroup of a larger
job). Limits: creating the sub-group is a blocking call on the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..masks import AttnMask
from . import a2a, p2p
from .a2a import UlyssesAttention, UlyssesSpec, kv_heads_per_rank, ulysses_bytes, ulysses_tables
from .common import Attn, Holder, cached_on, check_head_split, global_rank, maybe_max
from .p2p import (Ring, ring_backward, ring_forward, ring_send_rows, ring_tables,
                  ring_visible)

_SUBGROUPS: dict[tuple, tuple[Any, tuple[int, ...], Any]] = {}


def _heads_fit(n_heads: int, n_kv_heads: int, size: int) -> bool:
    return n_heads % size == 0 and (n_kv_heads % size == 0 or size % n_kv_heads == 0)


def default_a2a_size(n_heads: int, n_kv_heads: int, cp_size: int) -> int:
    """Largest divisor of cp whose all-to-all the head counts allow."""
    return max(a for a in range(1, cp_size + 1)
               if cp_size % a == 0 and _heads_fit(n_heads, n_kv_heads, a))


def check_heads(n_heads: int, n_kv_heads: int, cp_size: int, *, a2a_size: int | None = None,
                **_: Any) -> None:
    """a2a_size divides cp, and the heads split over it (ValueError otherwise)."""
    if a2a_size is None:
        return  # the default always fits (1 at worst)
    if isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1 \
            or cp_size % a2a_size:
        raise ValueError(f"a2a_size must be a positive divisor of cp_size={cp_size}, got "
                         f"{a2a_size!r}")
    check_head_split(n_heads, n_kv_heads, a2a_size, f"strategy 'a2a+p2p' (a2a_size={a2a_size})")


def group_members(rank: int, size: int) -> tuple[int, ...]:
    """CP ranks of ``rank``'s Ulysses group (consecutive ranks)."""
    first = rank // size * size
    return tuple(range(first, first + size))


def ulysses_subgroup(cp_group: Any, size: int) -> tuple[Any, tuple[int, ...]]:
    """(process group, its members as CP ranks in group-rank order) of this rank's Ulysses
    group; created on first use and cached per (CP group, size)."""
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    # id() tells apart a re-initialized default group; the entry keeps the group alive so
    # its id is never reused by another group while cached.
    key = (id(cp_group), ranks, size)
    if key not in _SUBGROUPS:
        me = dist.get_rank(cp_group)
        members = group_members(me, size)
        sub = dist.new_group([ranks[m] for m in members], use_local_synchronization=True)
        order = tuple(ranks.index(g) for g in dist.get_process_group_ranks(sub))
        # Ring partners must hold the same head slice, so member j of every group must be
        # CP rank g*size + j: true as torch sorts a group's global ranks (the CP group's
        # too), checked here rather than assumed.
        if order != members:
            raise RuntimeError(f"Ulysses sub-group ranks {order} are not in CP rank order "
                               f"{members}")
        _SUBGROUPS[key] = (sub, members, cp_group)
    return _SUBGROUPS[key][:2]


# ---------------------------------------------------------------------------- host tables
def _group_holders(plan: Any, size: int) -> list[Holder]:
    def build() -> list[Holder]:
        return [plan.cached(("ulysses", group_members(g * size, size)),
                            lambda g=g: ulysses_tables(plan, list(group_members(g * size, size)))
                            ).holder for g in range(plan.cp_size // size)]
    return plan.cached(("a2a+p2p", "holders", size), build)


def _visible(plan: Any, mask: AttnMask, size: int) -> list[list[int]]:
    return plan.cached(("a2a+p2p", "visible", size, mask),
                       lambda: ring_visible(_group_holders(plan, size), mask))


def host_ring_tables(plan: Any, mask: AttnMask, size: int, group_index: int,
                     block: tuple[int, int]) -> p2p.RingTables:
    return plan.cached(("a2a+p2p", "tables", size, mask, block, group_index),
                       lambda: ring_tables(_group_holders(plan, size),
                                           _visible(plan, mask, size), group_index, mask,
                                           block))


# --------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class HybridSpec(UlyssesSpec):
    """Ulysses spec whose core is a ring across the groups (member i with members i)."""

    block: tuple[int, int] = (64, 64)
    cp_group: Any = None

    def _ring(self, device: torch.device) -> Ring:
        plan, size, mask = self.plan, self.size, self.attn.mask
        g, index = divmod(plan.cp_rank, size)
        tables = cached_on(plan, ("a2a+p2p", "tables", size, mask, self.block, g), device,
                           lambda: host_ring_tables(plan, mask, size, g, self.block))
        # The ring joins the members holding the same head slice: index ``index`` of every
        # group.
        peers = tuple(global_rank(self.cp_group, gg * size + index)
                      for gg in range(plan.cp_size // size))
        return Ring(tables, g, peers, self.cp_group)

    def core_fwd(self, q, k, v, device, need_max):
        out, lse, max_part = ring_forward(q, k, v, self._ring(device), self.attn, need_max)
        return out.to(q.dtype), lse, max_part

    def core_bwd(self, dout, q, k, v, out, lse, device, dlse):
        return ring_backward(dout, q, k, v, out, lse, self._ring(device), self.attn, dlse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, attn: Attn,
              group: Any, block: tuple[int, int], *, need_lse: bool = True,
              need_max: bool = False, a2a_size: int | None = None, **_: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Differentiable hybrid attention (inputs checked): (out, lse, max_part)."""
    cp = plan.cp_size
    size = default_a2a_size(q.shape[1], k.shape[1], cp) if a2a_size is None else a2a_size
    if size == 1:
        return p2p.attention(q, k, v, plan, attn, group, block, need_max=need_max)
    if size == cp:
        return a2a.attention(q, k, v, plan, attn, group, block, need_lse=need_lse,
                             need_max=need_max)
    sub, members = ulysses_subgroup(group, size)
    spec = HybridSpec(plan, attn, sub, size, members, need_lse, block, group)
    out, lse, max_part = UlyssesAttention.apply(q, k, v, spec, need_max)
    return out, lse, maybe_max(max_part)


# ---------------------------------------------------------------------------- cost model
def bytes_sent_per_rank(plan: Any, mask: AttnMask, *, head_dim: int, n_kv_heads: int,
                        n_heads: int, dtype_bytes: int, head_dim_v: int | None = None,
                        a2a_size: int | None = None, **_: Any) -> dict[str, list[int]]:
    """Bytes each rank sends per layer: its group's all-to-alls plus its ring's K/V (and,
    backward, K/V again and the dK/dV partials) for its head slice."""
    cp = plan.cp_size
    size = default_a2a_size(n_heads, n_kv_heads, cp) if a2a_size is None else a2a_size
    dv = head_dim if head_dim_v is None else head_dim_v
    hk, _ = kv_heads_per_rank(n_kv_heads, size)
    row = hk * (head_dim + dv) * dtype_bytes
    sizes = tuple(h.n_tokens for h in _group_holders(plan, size))
    vis = _visible(plan, mask, size)
    fwd, bwd = [], []
    for r in range(cp):
        members = group_members(r, size)
        f, b = ulysses_bytes(tuple(plan.num_tokens_of(m) for m in members), r % size,
                             n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                             head_dim_v=dv, dtype_bytes=dtype_bytes)
        kv, grads = ring_send_rows(sizes, vis, r // size)
        fwd.append(f + kv * row)
        bwd.append(b + (kv + grads) * row)
    return {"fwd": fwd, "bwd": bwd}


def compute_per_rank(plan: Any, mask: AttnMask, *, block: tuple[int, int], n_heads: int,
                     n_kv_heads: int, a2a_size: int | None = None, **_: Any
                     ) -> dict[str, list[float]]:
    """Per rank, per query head of the model: its group's ring work over 1/a2a_size of the
    heads."""
    cp = plan.cp_size
    size = default_a2a_size(n_heads, n_kv_heads, cp) if a2a_size is None else a2a_size
    vis = _visible(plan, mask, size)
    visited, visible = [], []
    for r in range(cp):
        g = r // size
        tab = host_ring_tables(plan, mask, size, g, block)
        visited.append(sum(c.visited_pairs for c in tab.calls if c is not None) / size)
        visible.append(sum(vis[g][tab.source(g, t)] for t in range(tab.n_steps)) / size)
    return {"visited": visited, "visible": visible}

def prepare(plan: Any, mask: AttnMask, block: tuple[int, int], device: torch.device, *,
            n_heads: int, n_kv_heads: int, a2a_size: int | None = None, **_: Any) -> None:
    """Build and cache this rank's Ulysses and ring tables (host and ``device`` copy)."""
    cp = plan.cp_size
    size = default_a2a_size(n_heads, n_kv_heads, cp) if a2a_size is None else a2a_size
    if size == 1:
        return p2p.prepare(plan, mask, block, device)
    if size == cp:
        return a2a.prepare(plan, mask, block, device)
    g = plan.cp_rank // size
    members = group_members(plan.cp_rank, size)
    cached_on(plan, ("ulysses", members), device,
              lambda: ulysses_tables(plan, list(members)))
    cached_on(plan, ("a2a+p2p", "tables", size, mask, block, g), device,
              lambda: host_ring_tables(plan, mask, size, g, block))
