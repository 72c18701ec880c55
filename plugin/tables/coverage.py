"""How much of one rank's attention work runs on FlashAttention-class kernels.

``flash_coverage(plan, mask, strategy, route)`` builds (or reads from the plan's cache) the
host tables of ``strategy`` for ``plan.cp_rank`` with ``route`` and counts, over the rank's
``KernelCall``s, the visible (query, key) pairs computed in FlashAttention's form and the
calls with / without one. Host-only: numpy / python integer math, no process group, no
device, no registered kernels.

Numerator: ``call.flash.pairs`` of every call with an FA form. A form exists only where it
is exact, and then it computes exactly the call's visible pairs (no tile waste), so these
are visible pairs.

Denominator: the visible pairs of the queries the rank's calls cover, counted independently
of the tables, in closed form by the plan (``plan.work_per_rank(mask)``: each rank's
queries against whole documents, cached in the plan, which the report computes anyway; it
equals the rows of ``selected.pair_counts``, ~5x dearer at cp 64): rank ``rank``'s for
p2p / all_gather / dispatch, whose calls split exactly that set of pairs between them, and
for "local" (the single-device op at cp 1: one call, every pair); every rank's for a2a (the
group call over all ranks' merged tokens: whole documents, a head subset per rank); those
of the rank's Ulysses group for a2a+p2p (its ring over the groups: each step the group's
merged queries against one group's merged keys; ``a2a_size`` 1 is plain p2p, cp plain a2a,
as the strategy runs them). The calls left on the Triton kernels report tile-visited pairs (an
over-count), so they are never summed: the denominator is exact, and a coverage of 1.0
means every visible pair of the rank runs on FlashAttention.

``block`` only shapes the tile schedules of the calls left on our kernels: which calls exist
and their FA forms do not depend on it (``holders.set_calls`` builds forms from positions
alone), so any block gives the same counts; the step's block finds its cached tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashRoute
from .catalogue import STAGED, STRATEGY_NAMES
from .holders import KernelCall
from .hybrid import group_members, hybrid_ring_tables
from .local import local_call
from .ring import p2p_tables
from .staged import staged_tables
from .ulysses import group_call

LOCAL = "local"
STRATEGIES = (*STRATEGY_NAMES, LOCAL)
"""The strategies whose calls it counts; "local": the single-device op (cp 1 only)."""


@dataclass(frozen=True)
class FlashCoverage:
    """One rank's work on FlashAttention (``flash_pairs`` of ``total_pairs``, visible
    pairs) and its kernel calls: ``flash_calls`` with an FA form (``fa_calls``
    FlashAttention calls among them), ``other_calls`` on the Triton kernels."""

    strategy: str
    rank: int
    flash_pairs: int
    total_pairs: int
    flash_calls: int
    other_calls: int
    fa_calls: int

    @property
    def pair_share(self) -> float:
        """Share of the visible pairs on FA (1.0 when nothing is visible)."""
        return self.flash_pairs / self.total_pairs if self.total_pairs else 1.0

    @property
    def call_share(self) -> float:
        """Share of the kernel calls with an FA form (1.0 when there are none)."""
        n = self.flash_calls + self.other_calls
        return self.flash_calls / n if n else 1.0


def hybrid_size(plan: CPPlan, strategy: str, a2a_size: int | None) -> int | None:
    """The Ulysses group size of "a2a+p2p" (ValueError unless a divisor of cp); None for
    the other strategies."""
    if strategy != "a2a+p2p":
        return None
    if isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1 \
            or plan.cp_size % a2a_size:
        raise ValueError(f"flash_coverage: strategy 'a2a+p2p' needs a2a_size, a positive "
                         f"divisor of cp_size={plan.cp_size}, got {a2a_size!r}")
    return a2a_size


def query_ranks(plan: CPPlan, strategy: str, a2a_size: int | None = None) -> tuple[int, ...]:
    """The ranks whose queries ``plan.cp_rank``'s calls of ``strategy`` compute (all
    heads or a head subset): itself, every rank (a2a) or its Ulysses group (a2a+p2p)."""
    size = hybrid_size(plan, strategy, a2a_size)
    if strategy == "a2a":
        size = plan.cp_size
    return group_members(plan.cp_rank, size) if size else (plan.cp_rank,)


def rank_calls(plan: CPPlan, mask: AttnMask, strategy: str, route: FlashRoute | None,
               block: tuple[int, int] = (128, 128), stages: int | None = None,
               a2a_size: int | None = None) -> list[KernelCall]:
    """The kernel calls of ``strategy`` on ``plan.cp_rank`` (host tables, cached in the
    plan under the keys the step reads); steps or stages with nothing visible make no
    call. ``a2a_size``: "a2a+p2p" only (required there: the heads decide its default)."""
    rank = plan.cp_rank
    size = hybrid_size(plan, strategy, a2a_size)
    if size is not None:  # as A2AP2P.prepare: 1 and cp are plain p2p and a2a
        strategy = "p2p" if size == 1 else "a2a" if size == plan.cp_size else strategy
    if strategy == LOCAL and plan.cp_size != 1:
        raise ValueError(f"flash_coverage: strategy 'local' is the single-device op (cp 1), "
                         f"this plan has cp {plan.cp_size}")
    if strategy == LOCAL:
        calls = (local_call(plan, mask, block, None, route),)
    elif strategy == "a2a+p2p":
        calls = hybrid_ring_tables(plan, mask, size, rank // size, block, None, route).calls
    elif strategy == "p2p":
        calls = p2p_tables(plan, mask, block, rank, None, route).calls
    elif strategy in STAGED:
        t = staged_tables(strategy, plan, mask, rank, block, stages or 2, None, route)
        calls = (t.local, *(s.call for s in t.stages))
    elif strategy == "a2a":
        calls = (group_call(plan, tuple(range(plan.cp_size)), mask, block, None, route),)
    else:
        raise ValueError(f"flash_coverage: strategy must be one of {STRATEGIES}, "
                         f"got {strategy!r}")
    return [c for c in calls if c is not None]


def flash_coverage(plan: CPPlan, mask: AttnMask, strategy: str, route: FlashRoute | None,
                   block: tuple[int, int] = (128, 128), stages: int | None = None,
                   a2a_size: int | None = None) -> FlashCoverage:
    """Visible pairs and kernel calls of ``strategy`` on ``plan.cp_rank`` that run on
    FlashAttention with ``route`` (None: none do), against the rank's exact visible pairs
    (module docstring). ``stages``: all_gather / dispatch only (None: 2); ``a2a_size``:
    a2a+p2p only."""
    calls = rank_calls(plan, mask, strategy, route, block, stages, a2a_size)
    work = plan.work_per_rank(mask)
    total = sum(work[r] for r in query_ranks(plan, strategy, a2a_size))
    forms = [c.flash for c in calls if c.flash is not None]
    return FlashCoverage(strategy, plan.cp_rank, sum(f.pairs for f in forms), total,
                         len(forms), len(calls) - len(forms),
                         sum(len(f.calls) for f in forms))
