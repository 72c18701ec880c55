"""``strategy="auto"``: pick the CP strategy from the plan's own cost estimates.

The rule (per (plan, mask, head shape, dtype); cached in the plan):

1. Candidates: every strategy whose head split fits (``check_heads``): ``p2p``,
   ``all_gather``, ``dispatch`` always; ``a2a`` when Hq % cp == 0 and Hkv, cp divide one
   another; ``a2a+p2p`` (default a2a_size) when that size is strictly between 1 and cp.
2. Memory: with ``memory_budget_bytes`` set, drop candidates that keep more than that for
   the backward pass per layer and rank beyond their inputs (``saved_bytes``): dispatch and
   all_gather keep the K/V their queries see, a2a / a2a+p2p the head-sharded q/k/v/out of
   their group; p2p keeps nothing extra, so it always survives ("p2p when memory is tight").
3. Time per layer (forward + backward), slowest rank, from each strategy's cost model:
   compute = max over ranks of ``compute_per_rank``'s visited pairs x Hq x flops per pair
   (2(D+Dv) forward, 6D+4Dv backward: FA2's five matmuls) / ``flops_per_s``;
   comm = max over ranks of ``bytes_sent_per_rank`` / ``bytes_per_s``. The ring (p2p)
   overlaps its transfers with compute: max(compute, comm) per pass; the others wait for
   their collectives: compute + comm (a2a+p2p counted so, conservatively).
4. Among the candidates within ``tolerance`` (5%) of the fastest, the one that sends the
   fewest bytes (max over ranks): when compute dominates, all take about the same time, and
   transfers still contend with compute for SMs and memory bandwidth and with other
   parallelisms' traffic. Remaining ties: the order p2p, a2a, dispatch, a2a+p2p, all_gather.

What that gives (README "which strategy when"): long documents with full or causal masks
are compute-bound, so the least traffic wins: a2a when the heads allow (tokens x heads / cp
each way, independent of the mask), else p2p, whose transfers hide behind compute;
sliding windows, chunked attention and many short documents make dispatch's traffic a small
fraction of anyone else's (it fetches only visible K/V); p2p when memory is tight;
all_gather is never better than dispatch (same compute, more bytes).

Limits: the defaults of :class:`CostModel` are one H100 node's order of magnitude (NVLink);
pass your own for other machines. Latency per collective is not modelled, so for tiny
batches the pick is arbitrary (all are fast). The estimates build every candidate's host
tables (tile schedules included) once per (plan, mask): measured 0.5-1 s of one CPU core
for 128K tokens at cp 8, 1-2 s at cp 16-32, on every rank, per batch and mask; pick a
strategy once on representative batches where that is too slow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..masks import AttnMask
from . import get_strategy
from .a2a import kv_heads_per_rank
from .a2a_p2p import default_a2a_size
from .dispatch import all_needed

# Tie order: simpler / less memory first.
CANDIDATES = ("p2p", "a2a", "dispatch", "a2a+p2p", "all_gather")
OVERLAPPED = frozenset({"p2p"})


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Machine rates the estimate converts pairs and bytes with (per rank).

    flops_per_s: attention kernel throughput (default 3e14: FA2-class bf16 on an H100).
    bytes_per_s: bytes one rank sends per second in a collective (default 1.5e11: NCCL
    all-to-all / P2P inside an NVLink node; ~2.5e10 across InfiniBand nodes).
    tolerance: estimates within this fraction of the best count as equal (default 0.05).
    """

    flops_per_s: float = 3e14
    bytes_per_s: float = 1.5e11
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        _positive("CostModel.flops_per_s", self.flops_per_s)
        _positive("CostModel.bytes_per_s", self.bytes_per_s)
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) \
                or not 0 <= self.tolerance < 1:
            raise ValueError(f"CostModel.tolerance must be in [0, 1), got {self.tolerance!r}")


@dataclass(frozen=True)
class Estimate:
    """One strategy's estimate for one layer (forward + backward), slowest rank."""

    seconds: float
    compute_s: float
    comm_s: float
    bytes_sent: int       # max over ranks, forward + backward
    saved_bytes: int      # max over ranks: kept for the backward beyond inputs and out


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


def _check_shape(n_heads: Any, n_kv_heads: Any, head_dim: Any, head_dim_v: Any,
                 dtype_bytes: Any) -> Shape:
    names = ("n_heads", "n_kv_heads", "head_dim", "head_dim_v", "dtype_bytes")
    values = (n_heads, n_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v,
              dtype_bytes)
    for name, value in zip(names, values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    return Shape(*values)


def _options(name: str, shape: Shape, cp: int) -> dict[str, Any] | None:
    """Strategy options, or None when the strategy is not a candidate for these heads."""
    if name == "a2a+p2p":
        size = default_a2a_size(shape.n_heads, shape.n_kv_heads, cp)
        return {"a2a_size": size} if 1 < size < cp else None
    try:
        get_strategy(name).check_heads(shape.n_heads, shape.n_kv_heads, cp)
    except ValueError:
        return None
    return {}


def saved_bytes(name: str, plan: Any, mask: AttnMask, shape: Shape,
                opts: dict[str, Any]) -> int:
    """Max over ranks of what ``name`` keeps for the backward beyond q, k, v, out, lse."""
    if name == "p2p":
        return 0
    if name in ("dispatch", "all_gather"):  # the K/V the local queries see
        return max(n.owner.numel() for n in all_needed(plan, mask)) * shape.kv_row
    size = plan.cp_size if name == "a2a" else opts["a2a_size"]
    hk, _ = kv_heads_per_rank(shape.n_kv_heads, size)
    width = (shape.n_heads // size + hk) * (shape.head_dim + shape.head_dim_v)
    tokens = max(sum(plan.num_tokens_of(g + m) for m in range(size))
                 for g in range(0, plan.cp_size, size))
    return tokens * width * shape.dtype_bytes


def estimate(plan: Any, mask: AttnMask, name: str, shape: Shape, block: tuple[int, int],
             model: CostModel, opts: dict[str, Any]) -> Estimate:
    """Time, bytes and saved memory of strategy ``name`` (host only)."""
    strat = get_strategy(name)
    kw = dict(n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
              head_dim_v=shape.head_dim_v, dtype_bytes=shape.dtype_bytes, **opts)
    sent = strat.bytes_sent_per_rank(plan, mask, **kw)
    work = strat.compute_per_rank(plan, mask, block=block, **kw)
    pairs = max(work["visited"]) * shape.n_heads
    d, dv = shape.head_dim, shape.head_dim_v
    c_fwd = pairs * 2 * (d + dv) / model.flops_per_s
    c_bwd = pairs * (6 * d + 4 * dv) / model.flops_per_s
    x_fwd = max(sent["fwd"]) / model.bytes_per_s
    x_bwd = max(sent["bwd"]) / model.bytes_per_s
    if name in OVERLAPPED:
        seconds = max(c_fwd, x_fwd) + max(c_bwd, x_bwd)
    else:
        seconds = c_fwd + x_fwd + c_bwd + x_bwd
    total = max(f + b for f, b in zip(sent["fwd"], sent["bwd"]))
    return Estimate(seconds, c_fwd + c_bwd, x_fwd + x_bwd, total,
                    saved_bytes(name, plan, mask, shape, opts))


def estimates(plan: Any, mask: AttnMask, *, n_heads: int, n_kv_heads: int, head_dim: int,
              head_dim_v: int | None = None, dtype_bytes: int = 2,
              block: tuple[int, int] = (64, 64), model: CostModel | None = None
              ) -> dict[str, Estimate]:
    """Estimate of every candidate strategy (see the module docstring), in tie order."""
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    shape = _check_shape(n_heads, n_kv_heads, head_dim, head_dim_v, dtype_bytes)
    model = CostModel() if model is None else model
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel or None, got {type(model).__name__}")
    out = {}
    for name in CANDIDATES:
        opts = _options(name, shape, plan.cp_size)
        if opts is not None:
            out[name] = estimate(plan, mask, name, shape, tuple(block), model, opts)
    return out


def pick(costs: dict[str, Estimate], model: CostModel,
         memory_budget_bytes: int | None = None) -> str:
    """Rules 2 and 4 of the module docstring on precomputed estimates."""
    fits = {n: e for n, e in costs.items()
            if memory_budget_bytes is None or e.saved_bytes <= memory_budget_bytes}
    best = min(e.seconds for e in fits.values())
    close = [n for n, e in fits.items() if e.seconds <= best * (1 + model.tolerance)]
    return min(close, key=lambda n: (fits[n].bytes_sent, CANDIDATES.index(n)))


def choose_strategy(plan: Any, mask: AttnMask, *, n_heads: int, n_kv_heads: int,
                    head_dim: int, head_dim_v: int | None = None, dtype_bytes: int = 2,
                    block: tuple[int, int] = (64, 64), memory_budget_bytes: int | None = None,
                    model: CostModel | None = None) -> str:
    """The strategy ``strategy="auto"`` runs for ``mask`` on ``plan`` (rule: module
    docstring). ``block``: the kernel tiles the schedules use (``block_sizes_for``);
    ``memory_budget_bytes``: what a strategy may keep per layer and rank for the backward
    beyond its inputs (None: no limit). Cached in the plan per arguments; the same on every
    rank (host integer math on the shared plan)."""
    if memory_budget_bytes is not None and (isinstance(memory_budget_bytes, bool) or not
                                            isinstance(memory_budget_bytes, int)
                                            or memory_budget_bytes < 0):
        raise ValueError(f"memory_budget_bytes must be None or an int >= 0, got "
                         f"{memory_budget_bytes!r}")
    _check_shape(n_heads, n_kv_heads, head_dim, head_dim_v, dtype_bytes)
    model = CostModel() if model is None else model
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel or None, got {type(model).__name__}")
    if plan.cp_size == 1:
        return "p2p"  # every strategy is the local op
    key = ("auto", mask, n_heads, n_kv_heads, head_dim, head_dim_v, dtype_bytes,
           tuple(block), memory_budget_bytes, model)

    def choose() -> str:
        costs = estimates(plan, mask, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          head_dim=head_dim, head_dim_v=head_dim_v, dtype_bytes=dtype_bytes,
                          block=block, model=model)
        return pick(costs, model, memory_budget_bytes)
    return plan.cached(key, choose)
