"""Context-parallel strategies, runtime only: how K/V (or heads) move between CP ranks.

One module per strategy, each an implementation of ``base.Strategy`` (exchange, kernel
calls, autograd.Function) over host tables from ``varlen_cp.schedules``:
``p2p`` (ring), ``all_gather``, ``a2a`` (Ulysses), ``a2a+p2p`` (hybrid), ``dispatch``;
``local`` is cp == 1. ``STRATEGIES`` maps each name to its one instance.
"""

from __future__ import annotations

from .a2a import A2A
from .a2a_p2p import A2AP2P
from .all_gather import AllGather
from .base import CallSpec, Strategy
from .dispatch import Dispatch
from .local import Local
from .p2p import P2P

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (P2P(), AllGather(), A2A(), A2AP2P(),
                                                      Dispatch())}
LOCAL = Local()


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError for an unknown name."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {(*STRATEGIES, 'auto')}, got {name!r}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "LOCAL", "CallSpec", "Strategy", "get_strategy"]
