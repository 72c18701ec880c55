"""All-gather context parallelism: gather every rank's K/V, in stages that overlap with
compute, and attend to the keys the local queries see.

Each rank's local K/V (packed per token in one [T, Hkv*(D+Dv)] row, padded to the largest
local count) is gathered in slices of equal size (``varlen_cp.tables.staged``), one
``all_gather_into_tensor`` (``async_op=True``) each. ``overlap_stages`` = S >= 2
(``selected_keys``' engine): S - 1 slices; the first is posted, the local keys' call runs
on the local K/V in place, and each later slice is posted before the previous one's keys
are computed. A host-planned index picks, per slice, exactly the remote keys the queries
see (ordered per document by position): one varlen call with explicit positions each; the
partials fold by their LSE. Backward: the dK/dV rows of each slice's picked keys go
straight back to their owners in one ``all_to_all_single`` per slice (each rank sends only
the rows it picked from that owner: a reduce-scatter without the zeros), posted while the
next slice computes, and are summed there in fp32; the local call runs last. Each call
uses the FINAL out/lse and the same LSE gradient. S = 1: one all-gather, one call over the
local and picked keys, one all-to-all back (no overlap).

Limits: the all-gather itself ships every rank's K/V whatever the mask (the collective is
what it is; a strategy that fetches only the visible K/V is ``dispatch``, not this one).
The picked K/V are kept for the backward pass (memory: the remote keys this rank's queries
see; with S = 1 the local ones too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..plan.collective import all_gather_single
from ..tables.staged import Stage
from .selected_keys import Pending, SelectedKeysStrategy

# The one shim (plan/collective.py); looked up here at call time, so tests can count it.
_all_gather_single = all_gather_single


def gather_exchange(kf: torch.Tensor, vf: torch.Tensor, stage: Stage, group: Any) -> Pending:
    """Post one slice: rows [lo, hi) of every rank's padded local K|V rows."""
    t, hd = kf.shape[0], kf.shape[1]
    n, real = stage.hi - stage.lo, max(0, min(stage.hi, t) - stage.lo)
    part = kf.new_zeros(n, hd + vf.shape[1])
    part[:real, :hd] = kf[stage.lo:stage.lo + real]
    part[:real, hd:] = vf[stage.lo:stage.lo + real]
    gathered = kf.new_empty(dist.get_world_size(group) * n, part.shape[1])
    work = _all_gather_single(gathered, part, group=group, async_op=True)
    return Pending(gathered, work, part)


class AllGather(SelectedKeysStrategy):
    """Every rank's K/V gathered in overlapped slices; calls over the keys the queries see."""

    name = "all_gather"
    exchange = staticmethod(gather_exchange)
