"""Context-parallel strategies, one module each: how K/V (or heads) move between CP ranks.

Every module exposes the same surface:
- ``attention(q, k, v, plan, attn, group, block, *, need_lse, need_max, **opts)
  -> (out, lse, max_part)``: differentiable in q, k, v through out AND lse (attention sinks
  compose on the merged lse; backward passes dlse to every kernel call), inputs already
  validated by ``varlen_cp.attention``. ``max_part`` (``need_max``; else None): fp32 [Hq],
  the max scaled visible score over the (query row, head) pairs this rank computed, -inf
  elsewhere, on the current stream; one MAX all-reduce over the CP group (the caller's)
  makes it global. ``lse`` may be an [Hq, 0] stand-in when not ``need_lse`` (a2a);
- ``check_heads(n_heads, n_kv_heads, cp_size, **opts)``: ValueError when the head counts
  don't suit the strategy (checked before any communication);
- ``bytes_sent_per_rank(plan, mask, *, head_dim, n_kv_heads, n_heads, dtype_bytes, ...)``
  and ``compute_per_rank(plan, mask, *, block, ...)``: host-only cost model from the same
  tables the strategy runs on (bench/cp.py, a later ``strategy="auto"``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module (imported on first use, so one strategy's import never costs another's)
STRATEGIES: dict[str, str] = {
    "p2p": "p2p",
    "all_gather": "all_gather",
    "a2a": "a2a",
    "a2a+p2p": "a2a_p2p",
    "dispatch": "dispatch",
}


def get_strategy(name: str) -> ModuleType:
    """The module implementing strategy ``name``; ValueError for an unknown name."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {(*STRATEGIES, 'auto')}, got {name!r}")
    return importlib.import_module(f"{__name__}.{STRATEGIES[name]}")


__all__ = ["STRATEGIES", "get_strategy"]
