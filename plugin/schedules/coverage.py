"""How much of one rank's attention work runs on FlashAttention-class kernels.

``flash_coverage(plan, mask, strategy, route)`` builds (or reads from the plan's cache) the
host tables of ``strategy`` for ``plan.cp_rank`` with ``route`` and counts, over the rank's
``KernelCall``s, the visible (query, key) pairs computed in FlashAttention's form and the
calls with / without one. Host-only: numpy / python integer math, no process group, no
device, no registered kernels.

Numerator: ``call.flash.pairs`` of every call with an FA form. A form exists only where it
is exact, and then it computes exactly the call's visible pairs (no tile waste), so these
are visible pairs.

Denominator: the rank's visible pairs, counted independently of the tables, in closed
form: ``selected.pair_counts(plan, mask)[rank].sum()`` (its queries against every rank's
keys) for p2p / all_gather / dispatch, whose calls split exactly that set of pairs between
them; for a2a the group call over all ranks' merged tokens (whole documents, a head subset
per rank), whose pairs are every document's, ``pair_counts(plan, mask).sum()``. The
calls left on the Triton kernels report tile-visited pairs (an over-count), so they are
never summed: the denominator is exact, and a coverage of 1.0 means every visible pair of
the rank runs on FlashAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashRoute
from .catalogue import STAGED, STRATEGY_NAMES
from .holders import KernelCall
from .ring import p2p_tables
from .selected import pair_counts
from .staged import staged_tables
from .ulysses import group_call

STRATEGIES = tuple(n for n in STRATEGY_NAMES if "+" not in n)
"""The strategies whose calls it counts (the hybrid's are those of a2a and p2p)."""


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


def rank_calls(plan: CPPlan, mask: AttnMask, strategy: str, route: FlashRoute | None,
               block: tuple[int, int] = (128, 128), stages: int | None = None
               ) -> list[KernelCall]:
    """The kernel calls of ``strategy`` on ``plan.cp_rank`` (host tables, cached in the
    plan); steps or stages with nothing visible make no call."""
    rank = plan.cp_rank
    if strategy == "p2p":
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
                   block: tuple[int, int] = (128, 128), stages: int | None = None
                   ) -> FlashCoverage:
    """Visible pairs and kernel calls of ``strategy`` on ``plan.cp_rank`` that run on
    FlashAttention with ``route`` (None: none do), against the rank's exact visible pairs
    (module docstring). ``stages``: all_gather / dispatch only (None: 2)."""
    calls = rank_calls(plan, mask, strategy, route, block, stages)
    counts = pair_counts(plan, mask)
    total = int(counts.sum()) if strategy == "a2a" else int(counts[plan.cp_rank].sum())
    forms = [c.flash for c in calls if c.flash is not None]
    return FlashCoverage(strategy, plan.cp_rank, sum(f.pairs for f in forms), total,
                         len(forms), len(calls) - len(forms),
                         sum(len(f.calls) for f in forms))
