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
job), and with the CP group's own timeout, which they keep following when it changes later
(a stalled member fails its peers after the time the user gave the CP group, not torch's
10-30 minute default). Limits: creating the sub-group is a blocking call on the first
forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checks import is_int
from ..masks import AttnMask
from ..plan import CPPlan
from ..plan.collective import group_timeout
from ..tables.hybrid import group_members, hybrid_ring_tables
from ..tables.ulysses import ulysses_tables
from .a2a import A2A, UlyssesAttention, UlyssesSpec, check_head_split
from .base import CallSpec, Resolution, Strategy
from .calls import global_rank
from .p2p import P2P, Ring, ring_backward, ring_forward

_SUBGROUPS: dict[tuple, tuple[Any, tuple[int, ...], Any]] = {}


def ulysses_subgroup(cp_group: Any, size: int) -> tuple[Any, tuple[int, ...]]:
    """(process group, its members as CP ranks in group-rank order) of this rank's Ulysses
    group; created on first use (with the CP group's timeout) and cached per (CP group,
    size)."""
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    # id() tells apart a re-initialized default group; the entry keeps the group alive so
    # its id is never reused by another group while cached.
    key = (id(cp_group), ranks, size)
    if key not in _SUBGROUPS:
        me = dist.get_rank(cp_group)
        members = group_members(me, size)
        timeout = group_timeout(cp_group)
        kw = {} if timeout is None else {"timeout": timeout}
        sub = dist.new_group([ranks[m] for m in members], use_local_synchronization=True, **kw)
        order = tuple(ranks.index(g) for g in dist.get_process_group_ranks(sub))
        # Ring partners must hold the same head slice, so member j of every group must be
        # CP rank g*size + j: true as torch sorts a group's global ranks (the CP group's
        # too), checked here rather than assumed.
        if order != members:
            raise RuntimeError(f"Ulysses sub-group ranks {order} are not in CP rank order "
                               f"{members}")
        _SUBGROUPS[key] = (sub, members, cp_group)
    sub, members, _ = _SUBGROUPS[key]
    _follow_timeout(sub, cp_group)
    return sub, members


def _follow_timeout(sub: Any, cp_group: Any) -> None:
    """Give ``sub`` the CP group's CURRENT timeout. Frameworks change a group's timeout
    after creating it (torchtitan's ``set_pg_timeouts`` shortens every mesh group from
    ``comm.init_timeout_seconds`` to ``train_timeout_seconds`` after the first step, i.e.
    after our first forward created the sub-groups), so it is re-read at every call: two
    option reads, ~2 us; ``set_timeout`` is local (no collective) and runs only on a
    change."""
    want = group_timeout(cp_group)
    if want is None or group_timeout(sub) == want:
        return
    setter = getattr(dist, "set_timeout", None) or getattr(dist, "_set_pg_timeout", None)
    if setter is not None:
        setter(want, sub)


# --------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class HybridSpec(UlyssesSpec):
    """Ulysses spec whose core is a ring across the groups (member i with members i)."""

    cp_group: Any = None

    def _ring(self, device: torch.device) -> Ring:
        call, size = self.call, self.size
        plan, mask, block = call.plan, call.attn.mask, call.block
        g, index = divmod(plan.cp_rank, size)
        tables = hybrid_ring_tables(plan, mask, size, g, block, device, call.route)
        # The ring joins the members holding the same head slice: index ``index`` of every
        # group.
        peers = tuple(global_rank(self.cp_group, gg * size + index)
                      for gg in range(plan.cp_size // size))
        return Ring(tables, g, peers, self.cp_group)

    def core_fwd(self, q, k, v, device, need_max):
        out, lse, max_part = ring_forward(q, k, v, self._ring(device), self.call.attn,
                                          need_max)
        return out.to(q.dtype), lse, max_part

    def core_bwd(self, dout, q, k, v, out, lse, device, dlse):
        return ring_backward(dout, q, k, v, out, lse, self._ring(device), self.call.attn,
                             dlse)


class A2AP2P(Strategy):
    """Ulysses inside groups of ``a2a_size`` ranks, a ring across the groups."""

    name = "a2a+p2p"

    def check_heads(self, n_heads: int, n_kv_heads: int, cp_size: int,
                    a2a_size: int | None = None) -> None:
        """a2a_size divides cp, and the heads split over it (ValueError otherwise)."""
        if a2a_size is None:
            return  # the default always fits (1 at worst)
        if not is_int(a2a_size) or a2a_size < 1 or cp_size % a2a_size:
            raise ValueError(f"a2a_size must be a positive divisor of cp_size={cp_size}, got "
                             f"{a2a_size!r}")
        check_head_split(n_heads, n_kv_heads, a2a_size,
                         f"strategy 'a2a+p2p' (a2a_size={a2a_size})")

    def build_tables(self, plan: CPPlan, mask: AttnMask, res: Resolution,
                     device: torch.device) -> None:
        size = res.a2a_size
        if size == 1:
            return P2P().build_tables(plan, mask, res, device)
        if size == plan.cp_size:
            return A2A().build_tables(plan, mask, res, device)
        g = plan.cp_rank // size
        members = group_members(plan.cp_rank, size)
        ulysses_tables(plan, members, device)
        hybrid_ring_tables(plan, mask, size, g, res.block, device, res.route)

    def function(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: CallSpec
                 ) -> tuple[type[torch.autograd.Function], tuple]:
        plan = spec.plan
        size = spec.res.a2a_size
        if size == 1:
            return P2P().function(q, k, v, spec)
        if size == plan.cp_size:
            return A2A().function(q, k, v, spec)
        sub, members = ulysses_subgroup(spec.group, size)
        return UlyssesAttention, (HybridSpec(spec, sub, size, members, spec.group),)
