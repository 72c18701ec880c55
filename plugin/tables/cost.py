"""What each strategy costs per layer and rank, in closed form on the plan.

Bytes (who sends what to whom) are ``tables.traffic``'s; visible pairs are exact (``plan.runs`` and ``pair_work``); both come from the run-level
tables (visibility matrices, fetch counts), never from tile schedules or per-token passes,
so ``strategy="auto"`` can compare every candidate in a few milliseconds. Visited pairs
(what the kernels' tiles cover) need each rank's tile schedules: the ``*_visited``
functions build them, for benchmarks and tests.

One function per strategy and quantity, all with the signature ``(plan, mask, shape,
a2a_size=None)`` (visited pairs: ``block`` before ``a2a_size``); ``catalogue`` lists them
per strategy and answers by name (``catalogue.visible_pairs("p2p", ...)``).
"""

from __future__ import annotations

from ..masks import AttnMask
from ..plan import CPPlan
from .hybrid import group_members, hybrid_ring_tables, hybrid_size
from .ring import p2p_tables
from .selected import selected_tokens
from ..shape import AttnShape, kv_heads_per_rank
from .staged import staged_tables
from .ulysses import group_call

__all__ = ["rank_pairs", "a2a_pairs", "hybrid_pairs",
           "p2p_visited", "all_gather_visited", "dispatch_visited", "a2a_visited",
           "hybrid_visited", "nothing_saved", "selected_saved", "a2a_saved", "hybrid_saved"]


# ---- compute ----------------------------------------------------------------------------
def rank_pairs(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
               ) -> list[float]:
    """Per rank, per query head of the model: the visible pairs of its own queries (p2p,
    all_gather, dispatch)."""
    return [float(w) for w in plan.work_per_rank(mask)]


def _group_pairs(plan: CPPlan, mask: AttnMask, size: int) -> list[float]:
    """Each member computes its group's documents for 1/size of the heads."""
    work = plan.work_per_rank(mask)
    return [sum(work[r // size * size:(r // size + 1) * size]) / size
            for r in range(plan.cp_size)]


def a2a_pairs(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
              ) -> list[float]:
    return _group_pairs(plan, mask, plan.cp_size)


def hybrid_pairs(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                 ) -> list[float]:
    return _group_pairs(plan, mask, hybrid_size(plan, shape, a2a_size))


def p2p_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                a2a_size: int | None = None) -> list[float]:
    """Per rank, per query head of the model: pairs the ring's tiles cover (builds every
    rank's schedules: benchmarks and tests)."""
    return [float(sum(c.visited_pairs for c in p2p_tables(plan, mask, block, r).calls
                      if c is not None)) for r in range(plan.cp_size)]


def _staged_visited(name: str, plan: CPPlan, mask: AttnMask, block: tuple[int, int]
                    ) -> list[float]:
    out = []
    for r in range(plan.cp_size):   # one call over every key: S = 1's tables
        tab = staged_tables(name, plan, mask, r, block, 1)
        calls = [tab.local] + [s.call for s in tab.stages]
        out.append(float(sum(c.visited_pairs for c in calls if c is not None)))
    return out


def all_gather_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                       a2a_size: int | None = None) -> list[float]:
    return _staged_visited("all_gather", plan, mask, block)


def dispatch_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                     a2a_size: int | None = None) -> list[float]:
    return _staged_visited("dispatch", plan, mask, block)


def _group_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                   size: int) -> list[float]:
    cp = plan.cp_size
    if size == 1:  # a2a+p2p over groups of one rank is the ring of ranks
        return p2p_visited(plan, mask, shape, block)
    if size == cp:
        call = group_call(plan, tuple(range(cp)), mask, block)
        return [(call.visited_pairs if call is not None else 0) / cp] * cp
    return [sum(c.visited_pairs for c in hybrid_ring_tables(plan, mask, size, r // size,
                                                             block).calls if c is not None)
            / size for r in range(cp)]


def a2a_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                a2a_size: int | None = None) -> list[float]:
    return _group_visited(plan, mask, shape, block, plan.cp_size)


def hybrid_visited(plan: CPPlan, mask: AttnMask, shape: AttnShape, block: tuple[int, int],
                   a2a_size: int | None = None) -> list[float]:
    return _group_visited(plan, mask, shape, block, hybrid_size(plan, shape, a2a_size))


# ---- memory -----------------------------------------------------------------------------
# Max over ranks of what a strategy keeps for the backward beyond q, k, v, out, lse.
def nothing_saved(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                  ) -> int:
    """The ring re-sends K/V in the backward: it keeps nothing extra."""
    return 0


def selected_saved(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                   ) -> int:
    """dispatch, all_gather: the K/V the local queries see."""
    return max(selected_tokens(plan, mask)) * shape.kv_row


def _group_saved(plan: CPPlan, shape: AttnShape, size: int) -> int:
    """The head-sharded q/k/v/out of the group."""
    if size == 1:
        return 0
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    width = (shape.n_heads // size + hk) * (shape.head_dim + shape.value_dim)
    tokens = max(sum(plan.num_tokens_of(m) for m in group_members(g, size))
                 for g in range(0, plan.cp_size, size))
    return tokens * width * shape.dtype_bytes


def a2a_saved(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
              ) -> int:
    return _group_saved(plan, shape, plan.cp_size)


def hybrid_saved(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                 ) -> int:
    return _group_saved(plan, shape, hybrid_size(plan, shape, a2a_size))
