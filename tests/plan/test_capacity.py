"""Plans at a fixed capacity (``CPPlan.build(capacity=...)``, ``varlen_cp.plan.capacity``):
every rank holds exactly ``capacity`` rows, its tokens (as the plan without a capacity
gives them) then padding rows; sharding, gathering back, real rows and token counts treat
the padding as the ``te`` layout's; a rank over the capacity is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.cp_grid import DOCS, LAYOUTS, cu
from varlen_cp import AttnMask, CPPlan
from varlen_cp.plan import layout_spec
from varlen_cp.plan.capacity import default_capacity
from varlen_cp.sharding import shard_packed_batch


def _plan(layout, cp, rank, capacity=None):
    spec = {"dual_chunk": {"min_chunk_tokens": 4},
            "balanced": {"masks": AttnMask(), "tile_tokens": 8}}.get(layout, {})
    return CPPlan.build(cu(DOCS), cp_size=cp, cp_rank=rank,
                        layout=layout_spec(layout, **spec), capacity=capacity)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_capacity_plan_holds_the_plans_tokens_then_padding(layout, cp):
    x = torch.randn(sum(DOCS), 3)
    parts = []
    for rank in range(cp):
        plain = _plan(layout, cp, rank)
        plan = _plan(layout, cp, rank, "auto")
        cap = default_capacity(plain.padded_total_tokens, cp)
        n = plain.num_tokens
        assert plan.capacity == cap and plan.num_tokens == cap
        assert torch.equal(plan.token_indices[:n], plain.token_indices)
        assert torch.equal(plan.positions[:n], plain.positions)
        assert bool((plan.token_indices[n:] == -1).all())
        assert bool((plan.positions[n:] == -1).all())
        assert torch.equal(plan.local_cu_seqlens, plain.local_cu_seqlens)
        assert plan.num_real_tokens == plain.num_real_tokens
        real = plan.real_rows("cpu")
        assert torch.equal(real, torch.nonzero(plain.token_indices >= 0).flatten())
        mine = plan.arrays.doc[plan.local_rows_of(rank)]
        assert np.array_equal(mine[:n], plain.arrays.doc[plain.local_rows_of(rank)])
        assert bool((mine[n:] == -1).all())
        local = plan.shard(x)
        assert torch.equal(local[:n], plain.shard(x)) and bool((local[n:] == 0).all())
        parts.append(local)
        labels = torch.arange(sum(DOCS)).view(1, -1)
        sharded = shard_packed_batch({"labels": labels}, plan, ignore_index=-7)["labels"]
        assert bool((sharded[0, n:] == -7).all())
    assert torch.equal(_plan(layout, cp, 0, "auto").unshard_parts(parts), x)


def test_over_capacity_is_refused_and_capacity_enters_the_fingerprint():
    with pytest.raises(ValueError, match="graph_capacity=50 is below this batch's largest "
                                         "rank share: rank 1 holds 104 of 207 tokens"):
        _plan("contiguous", 2, 0, 50)
    for bad in (0, -3, 1.5, "big"):
        with pytest.raises(ValueError, match="capacity must be None, 'auto' or an int"):
            _plan("contiguous", 2, 0, bad)
    prints = {_plan("contiguous", 2, 0, c).fingerprint() for c in (None, 128, 192)}
    assert len(prints) == 3
