"""Segment tables pairing one rank's local queries with another rank's local keys.

Every layout keeps the invariant "local segment i of any rank is document i", so the
queries of rank q and the keys of rank k line up segment by segment: the pair is a plain
varlen call (cu_seqlens_q, cu_seqlens_k) with explicit positions. Host tensors only.
"""

from __future__ import annotations

import torch

from .cpplan import CPPlan


def pair_segments(plan: CPPlan, q_rank: int, k_rank: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor]:
    """(cu_q int32, cu_k int32, max_q, max_k, q_pos int32, k_pos int32) for the queries
    of ``q_rank`` against the keys of ``k_rank``; document i is segment i on both sides.
    Views of the plan's tables: read-only."""
    return (plan.local_cu_seqlens_of(q_rank), plan.local_cu_seqlens_of(k_rank),
            plan.max_local_seqlen_of(q_rank), plan.max_local_seqlen_of(k_rank),
            plan.positions_of(q_rank), plan.positions_of(k_rank))
