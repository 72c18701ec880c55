"""Dispatch context parallelism: fetch exactly the K/V each rank's queries can see, in
stages that overlap with compute.

Host plan (once per (plan, mask), cached in the plan): for every rank, the keys its queries
see are, per document, the union of the query tokens' key intervals. The intervals' ends
never decrease with the position, so the union is a few disjoint ranges of positions, found
with one shifted running maximum; keys held locally are used in place, the others are
fetched from their owners. Every rank computes every rank's needs, so each also knows what
to send in each transfer and in which order, with no metadata exchange
(``varlen_cp.tables.staged``: what a rank fetches from each owner, cut into equal
pieces, one per transfer).

``overlap_stages`` = S (default: the cost model's, ``staged.default_stages``). S >= 2
(``selected_keys``' engine): the first ``all_to_all_single`` (uneven splits, K and V packed
per token into one row, nothing sent to oneself, ``async_op=True``) is posted, then the
local keys' call runs on the local K/V in place; each later transfer is posted before the
previous one's keys are computed, so stage s computes while stage s+1 is in flight. Each
stage's keys, listed per document by position (padding never included), make one varlen
call with explicit positions and its own tile schedule; the partials fold by their LSE.
Backward: each fetched stage's dK/dV (in the input dtype, as the kernel returns them) goes
back to its owners in one ``all_to_all_single`` posted while the next stage computes, and
is summed there with the local ones in fp32; the local call runs last. Each call uses the
FINAL out/lse and the same LSE gradient. S = 1: one all-to-all, then one call over the
local and fetched keys (no overlap; what the cost model picks when the transfer is small
next to the extra folds).

Bytes: forward, each rank sends the K/V rows others need from it; backward, the dK/dV rows
of the keys it fetched: the same totals in any number of stages, and the lower bound of any
scheme that moves K/V to the queries (the other ranks' keys that a rank's queries see).

Limits: the fetched K/V are kept for the backward pass (memory: the remote keys this
rank's queries see; with S = 1 the local ones too). Every rank plans every rank's needs as
runs (a few per document and rank: what travels where is a [P, cp, cp] count table) and
lists only its own keys one by one (the call's positions and index tables): the plan +
tables of one batch are in ``bench/results/host_tables.json``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..tables.staged import Stage
from .selected_keys import Pending, SelectedKeysStrategy


def dispatch_exchange(kf: torch.Tensor, vf: torch.Tensor, stage: Stage, group: Any) -> Pending:
    """Post one stage: our rows that others take in it, theirs that we take (K|V rows)."""
    send = torch.cat([kf.index_select(0, stage.in_rows), vf.index_select(0, stage.in_rows)],
                     dim=1)
    recv = kf.new_empty(sum(stage.back_splits), kf.shape[1] + vf.shape[1])
    work = dist.all_to_all_single(recv, send, list(stage.back_splits), list(stage.in_splits),
                                  group=group, async_op=True)
    return Pending(recv, work, send)


class Dispatch(SelectedKeysStrategy):
    """Exactly the K/V ranges each rank's queries see, fetched in overlapped stages."""

    name = "dispatch"
    exchange = staticmethod(dispatch_exchange)
