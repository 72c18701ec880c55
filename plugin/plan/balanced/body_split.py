"""Where a long body is split when it is walked in position order (the locality variants):
chunked + causal bodies at the start of a tail block that holds whole rank shares of excess
(``blocks``), window + causal bodies where a token's excess reaches the bodies' mean
(``split``). Both are searches over positions on the closed forms, vectorized over bodies.
"""

from __future__ import annotations

from typing import Any

import torch

from .profile import Profile
from .segments import excess_of

# Probes per round of a k-ary search (here and in vector_cut.py's pair cuts): 32 takes 2-3
# rounds over 128K tokens.
PROBES = 32


def _last_true(lo: torch.Tensor, hi: torch.Tensor, pred: Any) -> torch.Tensor:
    """Per row, the largest p in [lo, hi] with pred(p) (pred true then false along p;
    lo is returned where pred(lo) is false): a k-ary search, PROBES probes a round."""
    lo, hi = lo.clone(), hi.clone()
    rows = torch.arange(lo.numel())
    steps = torch.arange(1, PROBES + 1)
    while bool((hi > lo).any()):
        probe = lo.unsqueeze(1) + ((hi - lo).unsqueeze(1) * steps + PROBES - 1) // PROBES
        ok = pred(probe.flatten(), rows.repeat_interleave(PROBES)).view(-1, PROBES)
        last = ok.to(torch.int8).cumprod(1).sum(1) - 1  # ok is a prefix of the probes
        new_lo = torch.where(last >= 0, probe[rows, last.clamp(min=0)], lo)
        new_hi = torch.where(last < PROBES - 1,
                             probe[rows, (last + 1).clamp(max=PROBES - 1)] - 1, hi)
        lo, hi = new_lo, torch.maximum(new_hi, new_lo)
    return lo


def tail_split(lengths: torch.Tensor, prof: Profile, cp: int, doc: torch.Tensor,
               start: torch.Tensor, end: torch.Tensor, memo: dict
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, n) per body [start, end): the excess of [p, end) is n whole rank shares (n =
    floor of the body's excess in shares), p the largest position with at least that much
    (p = end when n = 0)."""
    excess, total = excess_of(lengths, prof, memo)
    dl = lengths[doc]
    share = total / cp
    n = torch.floor(excess(start, end, dl) / share * (1 + 1e-12)).to(torch.int64)
    want = n.to(torch.float64) * share
    p = _last_true(start, end, lambda x, r: excess(x, end[r], dl[r]) >= want[r])
    return p, n


def density_split(lengths: torch.Tensor, prof: Profile, doc: torch.Tensor,
                  start: torch.Tensor, end: torch.Tensor, memo: dict) -> torch.Tensor:
    """Per body [start, end): the first position whose token carries at least the bodies'
    mean excess per token. With every mask looking left a token's work depends on its
    position only, and grows with it, so one search over positions serves all bodies."""
    excess, _ = excess_of(lengths, prof, memo)
    dl = lengths[doc]
    mean = float(excess(start, end, dl).sum()) / max(float((end - start).sum()), 1.0)
    top = int(lengths.max())
    # First position p with excess(p, p+1) >= mean: a coarse grid, then the bracket.
    step = max(1, -(-top // 1024))
    grid = torch.arange(0, top, step)
    ok = excess(grid, grid + 1, torch.full_like(grid, top)) >= mean
    i = int(torch.argmax(ok.to(torch.int8))) if bool(ok.any()) else grid.numel()
    fine = torch.arange(max(0, (i - 1) * step), min(top, i * step + 1))
    ok = excess(fine, fine + 1, torch.full_like(fine, top)) >= mean
    q = torch.tensor([int(fine[int(torch.argmax(ok.to(torch.int8)))]) if bool(ok.any())
                      else top])
    q = (q + prof.tile - 1) // prof.tile * prof.tile  # on the tile grid: no extra cut
    return torch.minimum(torch.maximum(q.expand_as(start), start), end)
