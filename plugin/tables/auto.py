"""``strategy="auto"``: pick the CP strategy from closed-form costs on the plan.

The rule (per (plan, mask, head shape, dtype); cached in the plan):

1. Candidates: every strategy whose head split fits: ``p2p``, ``all_gather``, ``dispatch``
   always; ``a2a`` when Hq % cp == 0 and Hkv, cp divide one another; ``a2a+p2p`` (default
   a2a_size) when that size is strictly between 1 and cp.
2. Memory: with ``memory_budget_bytes`` set, drop candidates that keep more than that for
   the backward pass per layer and rank beyond their inputs (the catalogue's saved bytes):
   dispatch and all_gather keep the K/V their queries see, a2a / a2a+p2p the head-sharded
   q/k/v/out of their group; p2p keeps nothing extra, so it always survives.
3. Time per layer (forward + backward), slowest rank: compute = visible pairs x Hq x
   flops per pair (2(D+Dv) forward, 6D+4Dv backward: FA2's five matmuls) /
   ``flops_per_s``; comm = bytes sent (exactly what the collectives post), those to the
   rank's own node / ``bytes_per_s`` and those to other nodes / ``cross_node_bytes_per_s``
   on their own links, the longer of the two (``tables.traffic``; nodes: the plan's
   ``topology``, which the integrations derive from the CP group, else the model's
   ``ranks_per_node``; the default model takes the topology's link rates).
   How transfers meet compute is each strategy's ``overlap`` in ``tables.catalogue``.
   The ring (p2p) overlaps its transfers with compute: max(compute, comm) per pass;
   dispatch and all_gather overlap theirs in stages (local keys first, remote K/V in the
   cost model's number of stages, ``staged.default_stages``; time ``staged.staged_time``:
   the per-stage max(compute, transfer) plus the first transfer, with a latency and the
   fold's memory traffic per stage, every rank simulated); a2a and a2a+p2p wait for their
   collectives: compute + comm.
4. Among the candidates within ``tolerance`` (5%) of the fastest, the one that sends the
   fewest bytes (max over ranks): when compute dominates, all take about the same time, and
   transfers still contend with compute for SMs and memory bandwidth and with other
   parallelisms' traffic. Remaining ties: the order p2p, a2a, dispatch, a2a+p2p, all_gather.

Everything comes from run-level closed forms (``tables.cost``, listed per strategy in
``tables.catalogue``; machine rates: ``tables.cost_model``): no tile schedule and no
candidate's runtime tables are built, so choosing costs a few milliseconds per plan and mask
(``bench/plan.py`` measures it). Visible pairs stand for the kernels' work (tiles add a
few percent at the edges of windows and chunks, the same for every strategy).

What that gives (docs/strategies.md): long documents with full or causal masks
are compute-bound, so the least traffic wins among the near-equal times: a2a, p2p or
(staged, fewer bytes than the ring) dispatch; sliding windows, chunked attention and many short
documents make dispatch's traffic a small fraction of anyone else's (it fetches only visible K/V);
p2p when memory is tight; all_gather is never better than dispatch (same compute, more bytes).

Limits: the defaults of :class:`CostModel` are one H100 node's order of magnitude (NVLink,
and a 400 Gb/s NIC per GPU across nodes); pass your own for other machines, or set the
``[varlen_cp]`` keys ``node_bandwidth`` / ``cross_node_bandwidth`` (they reach the plan's
topology). Latency per collective is modelled only for the extra
stages of dispatch / all_gather, so for tiny batches the pick is arbitrary (all are fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checks import check_int
from ..masks import AttnMask
from ..plan import CPPlan
from ..shape import AttnShape
from .catalogue import CATALOGUE, traits
from .cost_model import CostModel, check_model
from .cache import host_table, table_key
from .staged import default_stages, staged_time
from .traffic import split

# Tie order: simpler / less memory first (the catalogue's tie ranks).
CANDIDATES: tuple[str, ...] = tuple(t.name for t in sorted(CATALOGUE, key=lambda t: t.tie_rank))

__all__ = ["CANDIDATES", "CostModel", "Estimate", "candidate_options", "choose_strategy",
           "estimate", "estimates", "pick"]


@dataclass(frozen=True)
class Estimate:
    """One strategy's estimate for one layer (forward + backward), slowest rank."""

    seconds: float
    compute_s: float
    comm_s: float
    bytes_sent: int       # max over ranks, forward + backward
    saved_bytes: int      # max over ranks: kept for the backward beyond inputs and out
    cross_node_bytes: int = 0   # max over ranks, forward + backward, to other nodes


def candidate_options(name: str, shape: AttnShape, cp: int) -> dict[str, Any] | None:
    """Strategy options, or None when the strategy is not a candidate for these heads."""
    return traits(name).options(shape, cp)


def estimate(plan: CPPlan, mask: AttnMask, name: str, shape: AttnShape, model: CostModel,
             a2a_size: int | None = None) -> Estimate:
    """Time, bytes and saved memory of strategy ``name`` (host only, closed form)."""
    entry = traits(name)
    links = split(entry.traffic(plan, mask, shape, a2a_size), model.nodes(plan.cp_size, plan.topology))
    pairs = max(entry.visible_pairs(plan, mask, shape, a2a_size)) * shape.n_heads
    d, dv = shape.head_dim, shape.value_dim
    c_fwd = pairs * 2 * (d + dv) / model.flops_per_s
    c_bwd = pairs * (6 * d + 4 * dv) / model.flops_per_s
    x_fwd = float(model.link_seconds(links["fwd_in"], links["fwd_cross"]).max())
    x_bwd = float(model.link_seconds(links["bwd_in"], links["bwd_cross"]).max())
    if entry.overlap == "stages":
        # all_gather is timed with dispatch's stage count (one simulation, not a second
        # search): it moves at least dispatch's bytes with the same compute, so a search of
        # its own could not change the pick.
        searched = "dispatch" if name == "all_gather" else name
        stages = default_stages(plan, mask, searched, shape, model)
        seconds = staged_time(name, plan, mask, shape, model, stages).seconds
    elif entry.overlap == "ring":
        seconds = max(c_fwd, x_fwd) + max(c_bwd, x_bwd)
    else:
        seconds = c_fwd + x_fwd + c_bwd + x_bwd
    total = sum(links.values())   # fwd + bwd, in the node and across
    cross = links["fwd_cross"] + links["bwd_cross"]
    return Estimate(seconds, c_fwd + c_bwd, x_fwd + x_bwd, int(total.max()),
                    entry.saved_bytes(plan, mask, shape, a2a_size), int(cross.max()))


def estimates(plan: CPPlan, mask: AttnMask, shape: AttnShape, *,
              model: CostModel | None = None) -> dict[str, Estimate]:
    """Estimate of every candidate strategy (see the module docstring), in tie order."""
    check_kinds(mask=mask, shape=shape)
    model = check_model(model, plan.topology)
    out = {}
    for name in CANDIDATES:
        opts = candidate_options(name, shape, plan.cp_size)
        if opts is not None:
            out[name] = estimate(plan, mask, name, shape, model, opts.get("a2a_size"))
    return out


def check_kinds(*, mask: object, shape: object) -> None:
    """ValueError unless ``mask`` is an ``AttnMask`` and ``shape`` an ``AttnShape`` (the
    host-cost entry points take them from users and tools)."""
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    if not isinstance(shape, AttnShape):
        raise ValueError(f"shape must be a varlen_cp.AttnShape, got {type(shape).__name__}")


def pick(costs: dict[str, Estimate], model: CostModel,
         memory_budget_bytes: int | None = None) -> str:
    """Rules 2 and 4 of the module docstring on precomputed estimates."""
    fits = {n: e for n, e in costs.items()
            if memory_budget_bytes is None or e.saved_bytes <= memory_budget_bytes}
    best = min(e.seconds for e in fits.values())
    close = [n for n, e in fits.items() if e.seconds <= best * (1 + model.tolerance)]
    return min(close, key=lambda n: (fits[n].bytes_sent, CANDIDATES.index(n)))


def choose_strategy(plan: CPPlan, mask: AttnMask, shape: AttnShape, *,
                    memory_budget_bytes: int | None = None,
                    model: CostModel | None = None) -> str:
    """The strategy ``strategy="auto"`` runs for ``mask`` on ``plan`` for layers of
    ``shape`` (rule: module docstring). ``memory_budget_bytes``: what a strategy may keep
    per layer and rank for the backward beyond its inputs (None: no limit). Cached in the
    plan per arguments; the same on every rank (host integer math on the shared plan)."""
    check_kinds(mask=mask, shape=shape)
    check_int("memory_budget_bytes", memory_budget_bytes, 0, optional=True)
    model = check_model(model, plan.topology)
    if plan.cp_size == 1:
        return "p2p"  # every strategy is the local op
    key = table_key("auto", mask, None, shape, memory_budget_bytes, model)

    def choose() -> str:
        return pick(estimates(plan, mask, shape, model=model), model, memory_budget_bytes)
    return host_table(plan, key, choose)
