"""Staged host tables of ``dispatch`` and ``all_gather``, and the cost model of staging.

``overlap_stages`` = S kernel stages. S = 1: one exchange of the remote keys the queries
see, then one call over all of them, local and fetched (no overlap, no partial results).
S >= 2: stage 0 is the keys the rank holds, read in place (local queries x local K/V, the
local tile schedule, no copy); stages 1..S-1 are the remote keys, fetched in S-1
collectives (``dispatch``: an ``all_to_all_single`` each, of exactly the needed rows;
``all_gather``: an all-gather each, of a slice of every rank's padded local K/V), each in
flight while the previous stage computes. Each stage's keys are listed per document by
position (segment i is document i), so each stage is one varlen call with explicit
positions and its own tile schedule; the partial (out, lse) fold by their LSE.

Modules, each importing only those listed before it:

- ``routes``: which remote keys travel in which transfer (the [P, cp, cp] counts every
  rank computes alike) and the cut of a rank's runs of keys at the transfers' bounds.
- ``relay``: dispatch through nodes on a plan whose topology spans them: both hops' routes
  of every rank (each node fetches a key from another node once, then shares it).
- ``links``: the rows each transfer moves per hop, and the keys its calls use (what the
  time model and the memory walk read).
- ``tables``: one rank's tables (``Stage`` per transfer, the local call), built from runs.
- ``relay_tables``: one rank's tables of relayed dispatch (``RelayStage``).
- ``cached``: a rank's tables of a strategy, cached in the plan (the entry).
- ``memory``: the host walk of the engine's allocations (peak bytes per rank).
- ``timing``: the pipeline's time per layer and the default stage count (least time under
  S = 1's memory).
"""

from __future__ import annotations

from .memory import StagedMemory, staged_memory
from .cached import staged_tables
from .tables import Stage, StagedTables
from .timing import (CANDIDATE_STAGES, MAX_STAGES, StagedTime, default_stages, resolve_stages,
                     staged_time, staged_times)
from .links import stage_counts
from .routes import dispatch_stage_counts, gather_stage_counts, gather_stage_rows, transfers

__all__ = ["CANDIDATE_STAGES", "MAX_STAGES", "Stage", "StagedMemory", "StagedTables",
           "StagedTime", "default_stages", "dispatch_stage_counts", "gather_stage_counts",
           "gather_stage_rows", "resolve_stages", "stage_counts", "staged_memory",
           "staged_tables", "staged_time", "staged_times", "transfers"]
