"""What each strategy costs per layer and rank, in closed form on the plan.

Bytes are exactly what the strategies' collectives post (the tests count them on gloo);
visible pairs are exact (``plan.runs`` and ``pair_work``); both come from the run-level
tables (visibility matrices, fetch counts), never from tile schedules or per-token passes,
so ``strategy="auto"`` can compare every candidate in a few milliseconds. Visited pairs
(what the kernels' tiles cover) need each rank's tile schedules: the ``*_visited``
functions build them, for benchmarks and tests.

One function per strategy and quantity, all with the signature ``(plan, mask, shape,
a2a_size=None)`` (visited pairs: ``block`` before ``a2a_size``); ``catalogue`` lists them
per strategy and answers by name (``catalogue.bytes_sent("p2p", ...)``).
"""

from __future__ import annotations

import numpy as np

from ..masks import AttnMask
from ..plan import CPPlan
from .hybrid import default_a2a_size, group_members, group_visibility, hybrid_ring_tables
from .ring import p2p_tables, rank_visibility, ring_length
from .selected import fetch_count_array, fetched_tokens, selected_tokens
from ..shape import AttnShape, kv_heads_per_rank
from .staged import staged_tables
from .ulysses import group_call

Sent = dict[str, list[int]]   # {"fwd": bytes per rank, "bwd": bytes per rank}

__all__ = ["Sent", "hybrid_size", "ring_rows", "ulysses_bytes",
           "ulysses_rank_bytes", "p2p_bytes", "all_gather_bytes", "dispatch_bytes",
           "a2a_bytes", "hybrid_bytes", "rank_pairs", "a2a_pairs", "hybrid_pairs",
           "p2p_visited", "all_gather_visited", "dispatch_visited", "a2a_visited",
           "hybrid_visited", "nothing_saved", "selected_saved", "a2a_saved", "hybrid_saved"]


def hybrid_size(plan: CPPlan, shape: AttnShape, a2a_size: int | None) -> int:
    """a2a+p2p's Ulysses group size: ``a2a_size``, or the largest the heads allow."""
    return default_a2a_size(shape.n_heads, shape.n_kv_heads, plan.cp_size) \
        if a2a_size is None else a2a_size


def _local_sizes(plan: CPPlan) -> np.ndarray:
    offsets = plan.arrays.rank_offsets
    return offsets[1:] - offsets[:-1]


# ---- bytes ------------------------------------------------------------------------------
def ring_rows(sizes: np.ndarray, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per ring position: (K/V rows sent per pass, dK/dV partial rows sent backward), as
    the ring engine posts them, for all positions at once: position i sends the K/V of
    ring steps 0..n-2 (sources i - t) and, backward, the partials of the steps whose
    source its queries see (the strategy tests count the bytes it really posts). numpy
    int64 [H] in and out."""
    size, n_steps = sizes.size, ring_length(vis)
    src = (np.arange(size)[:, None] - np.arange(n_steps)[None, :]) % size   # [H, steps]
    kv = sizes[src[:, :-1]].sum(1)
    seen = np.take_along_axis(vis, src[:, 1:], 1) > 0
    grads = (sizes[src[:, 1:]] * seen).sum(1)
    return kv, grads


def ulysses_bytes(sizes: tuple[int, ...], index: int, shape: AttnShape, need_lse: bool = False
                  ) -> tuple[int, int]:
    """(forward, backward) bytes member ``index`` of a group with ``sizes`` sends in its
    all-to-alls (rows to itself excluded), as the engine packs them."""
    size = len(sizes)
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    hq = shape.n_heads // size
    qkv_row = (hq * shape.head_dim + hk * (shape.head_dim + shape.value_dim)) \
        * shape.dtype_bytes
    out_row = hq * shape.value_dim * shape.dtype_bytes
    mine, others = sizes[index], sum(sizes) - sizes[index]
    fwd = (size - 1) * mine * qkv_row + others * out_row
    bwd = (size - 1) * mine * out_row + others * qkv_row
    if need_lse:  # the fp32 LSE back to tokens, its gradient to heads
        fwd += others * hq * 4
        bwd += (size - 1) * mine * hq * 4
    return fwd, bwd


def ulysses_rank_bytes(sizes: np.ndarray, size: int, shape: AttnShape
                       ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ulysses_bytes` of every rank at once (groups of ``size`` consecutive ranks;
    numpy int64 [cp] each; zeros for size 1)."""
    if size == 1:
        return np.zeros_like(sizes), np.zeros_like(sizes)
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    hq = shape.n_heads // size
    qkv_row = (hq * shape.head_dim + hk * (shape.head_dim + shape.value_dim)) \
        * shape.dtype_bytes
    out_row = hq * shape.value_dim * shape.dtype_bytes
    others = np.repeat(sizes.reshape(-1, size).sum(1), size) - sizes
    return ((size - 1) * sizes * qkv_row + others * out_row,
            (size - 1) * sizes * out_row + others * qkv_row)


def p2p_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
              ) -> Sent:
    """The ring: every pass's K/V forward, again backward with the dK/dV partials."""
    kv, grads = ring_rows(_local_sizes(plan), rank_visibility(plan, mask))
    return {"fwd": (kv * shape.kv_row).tolist(), "bwd": ((kv + grads) * shape.kv_row).tolist()}


def all_gather_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                     ) -> Sent:
    """Every rank's padded K/V to every other; back only the picked keys' dK/dV."""
    cp, row = plan.cp_size, shape.kv_row
    stride = int(_local_sizes(plan).max())
    return {"fwd": [(cp - 1) * stride * row] * cp,
            "bwd": [f * row for f in fetched_tokens(plan, mask)]}


def dispatch_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                   ) -> Sent:
    """Exactly the keys others see forward, their dK/dV backward."""
    row = shape.kv_row
    counts = fetch_count_array(plan, mask)
    sent = counts.sum(0) - counts.diagonal()   # what the others fetch from each rank
    return {"fwd": (sent * row).tolist(), "bwd": [f * row for f in fetched_tokens(plan, mask)]}


def _group_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, size: int) -> Sent:
    """Ulysses groups of ``size`` ranks, a ring of the groups when size < cp."""
    sizes = _local_sizes(plan)
    fwd, bwd = ulysses_rank_bytes(sizes, size, shape)
    if size < plan.cp_size:  # a ring across the groups, on this rank's head slice
        hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
        ring_row = hk * (shape.head_dim + shape.value_dim) * shape.dtype_bytes
        group_sizes = sizes.reshape(-1, size).sum(1)
        kv, grads = ring_rows(group_sizes, group_visibility(plan, mask, size))
        fwd = fwd + np.repeat(kv * ring_row, size)
        bwd = bwd + np.repeat((kv + grads) * ring_row, size)
    return {"fwd": fwd.tolist(), "bwd": bwd.tolist()}


def a2a_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
              ) -> Sent:
    return _group_bytes(plan, mask, shape, plan.cp_size)


def hybrid_bytes(plan: CPPlan, mask: AttnMask, shape: AttnShape, a2a_size: int | None = None
                 ) -> Sent:
    return _group_bytes(plan, mask, shape, hybrid_size(plan, shape, a2a_size))


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
