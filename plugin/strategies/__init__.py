"""Context-parallel strategies, runtime only: how K/V (or heads) move between CP ranks.

One module per strategy, each an implementation of ``base.Strategy`` (exchange, kernel
calls, autograd.Function) over host tables from ``varlen_cp.tables``:
``p2p`` (ring), ``all_gather``, ``a2a`` (Ulysses), ``a2a+p2p`` (hybrid), ``dispatch``;
``local`` is cp == 1. ``STRATEGIES`` maps each name of the catalogue
(``varlen_cp.tables.catalogue``: names, traits, costs) to its one instance, in the
catalogue's order; an implementation without an entry, or an entry without one, fails here
at import.
"""

from __future__ import annotations

from ..tables.catalogue import STRATEGY_NAMES, traits
from .a2a import A2A
from .a2a_p2p import A2AP2P
from .all_gather import AllGather
from .base import CallSpec, Resolution, Strategy
from .dispatch import Dispatch
from .local import Local
from .p2p import P2P

_IMPLEMENTED: dict[str, Strategy] = {s.name: s for s in (P2P(), AllGather(), A2A(), A2AP2P(),
                                                        Dispatch())}
if set(_IMPLEMENTED) != set(STRATEGY_NAMES):
    raise ImportError(f"strategies implemented {sorted(_IMPLEMENTED)} differ from the "
                      f"catalogue's {sorted(STRATEGY_NAMES)}")
STRATEGIES: dict[str, Strategy] = {name: _IMPLEMENTED[name] for name in STRATEGY_NAMES}
LOCAL = Local()


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError for an unknown name."""
    return STRATEGIES[traits(name).name]


__all__ = ["STRATEGIES", "LOCAL", "CallSpec", "Resolution", "Strategy", "get_strategy"]
