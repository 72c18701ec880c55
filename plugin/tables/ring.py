"""Ring tables: which ring steps compute, how long the ring runs, what each step sends.

Holder s at step t holds the K/V of holder (s - t) % H. Which holder's keys another
holder's queries see comes from the runs (``selected.fetch_counts``: a query run's keys form
one span, cut by the key holders' runs), so no Python loop over holder pairs and no
per-token pass. Steps
with nothing visible are skipped, and the ring stops after the last step at which ANY
holder still needs K/V: the decision is the same on every rank, so no rank waits on a
message that is never sent.

Used with ranks as holders (``p2p``) and with Ulysses groups as holders (``a2a+p2p``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashRoute
from .holders import HolderSet, KernelCall, rank_set, set_calls
from .cache import cached_table, table_key
from .selected import fetch_count_array


def ring_length(vis: np.ndarray) -> int:
    """Steps the ring runs: 1 + the last step t at which some holder s needs the K/V of
    (s - t) % H (``vis``: int [H, H], numpy). Step 0 (own K/V) always runs."""
    vis = np.asarray(vis)
    size = vis.shape[0]
    s = np.arange(size)
    # need[t, s] = vis[s, (s - t) % H]
    need = (vis > 0)[s[None, :], (s[None, :] - s[:, None]) % size]
    steps = np.flatnonzero(need[1:].any(1))
    return int(steps[-1]) + 2 if steps.size else 1


@dataclass(frozen=True)
class RingTables:
    """One ring index's view of a ring: how long it runs, what each step computes."""

    n_steps: int
    sizes: tuple[int, ...]                    # tokens of each holder (recv buffer sizes)
    calls: tuple[KernelCall | None, ...]      # per step; None = nothing visible, skipped
    incoming: tuple[bool, ...]                # per step: a dK/dV partial arrives for us

    def to(self, device: torch.device) -> "RingTables":
        return replace(self, calls=tuple(None if c is None else c.to(device)
                                         for c in self.calls))

    def source(self, index: int, step: int) -> int:
        return (index - step) % len(self.sizes)


def ring_tables(holders: HolderSet, vis: np.ndarray, index: int, mask: AttnMask,
                block: tuple[int, int], route: FlashRoute | None = None) -> RingTables:
    """Host tables of ring position ``index`` (schedules, or FA forms with a ``route``,
    for its non-empty steps only, all computed together; ``vis`` int64 [H, H], numpy)."""
    size = len(holders.max_len)
    n_steps = ring_length(vis)
    t = np.arange(n_steps)
    src = ((index - t) % size).tolist()
    mine = (vis[index, (index - t) % size] > 0).tolist()
    # At step t, position index + t computes on our K/V: it sends its partial home.
    incoming = ((vis[(index + t) % size, index] > 0) & (t > 0)).tolist()
    steps = [s for s in range(n_steps) if mine[s]]
    made = dict(zip(steps, set_calls(holders, index, holders, [src[s] for s in steps],
                                     mask, block, route)))
    sizes = (holders.offsets[1:] - holders.offsets[:-1]).tolist()
    return RingTables(n_steps, tuple(sizes), tuple(made.get(s) for s in range(n_steps)),
                      tuple(incoming))


# ---- p2p: ranks as holders ----------------------------------------------------------------
def rank_visibility(plan: CPPlan, mask: AttnMask) -> np.ndarray:
    """int64 [cp, cp] (numpy): how many of rank j's keys rank s's queries see (> 0: the
    ring step that brings j's K/V to s computes something)."""
    return fetch_count_array(plan, mask)


def p2p_tables(plan: CPPlan, mask: AttnMask, block: tuple[int, int], rank: int,
               device: torch.device | str | None = None,
               route: FlashRoute | None = None) -> RingTables:
    """Ring tables of ``rank`` for the ring of all ranks, on the host or copied to
    ``device`` (cached); FA forms where exact with a ``route``."""
    return cached_table(plan, table_key("p2p", mask, block, rank, route=route),
                        lambda: ring_tables(rank_set(plan), rank_visibility(plan, mask),
                                            rank, mask, block, route), device)
