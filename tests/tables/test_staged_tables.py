"""The staged strategies' host side against its per-token reference (tests/staged_reference.py).

- Tables: on random batches (layouts balanced, dual_chunk, te, contiguous; causal, full,
  sliding-window, chunked masks; cp 2, 3, 4, 8; S = 1, 2, 3, 5; every rank) the run-based
  tables (``staged.tables``) equal the per-token construction field by field: calls (their
  keys, positions and tile schedules), receive-buffer picks, dK/dV return order, splits,
  given rows. The returns' rounds changed form (consecutive slices instead of each row's
  j-th occurrence): checked to cover the given rows in list order, unique rows per round,
  and to add every row's values in the order the old rounds did.
- Rounds: ``UniqueRounds.of`` / ``of_runs`` on random row lists: valid, greedy, equal.
- Counts, time model, memory walk and default stage count (16-bit inputs, D = Dv, where the
  old walk was right): equal to the torch reference on random batches and cost models.
About 25 s on 2 cores.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from tests import staged_reference as ref
from varlen_cp import AttnMask, CPPlan
from varlen_cp.tables import staged
from varlen_cp.tables.cost_model import CostModel
from varlen_cp.tables.rounds import UniqueRounds
from varlen_cp.tables.selected import fetch_counts
from varlen_cp.plan.layout_spec import layout_spec
from varlen_cp.shape import AttnShape

MASKS = (AttnMask(), AttnMask(causal=False), AttnMask(window_size=(7, 0)),
         AttnMask(chunk_size=16), AttnMask(window_size=(5, 3), causal=False),
         AttnMask(chunk_size=12, window_size=(4, 0)))
LAYOUTS = ("balanced", "dual_chunk", "te", "contiguous")


def _batch(rng: random.Random) -> tuple[CPPlan, AttnMask]:
    docs = [rng.choice([0, 1, 2, 3, 5, 9, 17, 30, 64, 100]) for _ in range(rng.randint(1, 9))]
    docs.append(rng.randint(1, 40))
    cu = torch.tensor([0] + docs).cumsum(0)
    layout = rng.choice(LAYOUTS)
    spec = layout_spec(layout, min_chunk_tokens=4) if layout == "dual_chunk" else layout
    plan = CPPlan.build(cu, cp_size=rng.choice([2, 3, 4, 8]), cp_rank=0, layout=spec)
    return plan, rng.choice(MASKS)


def _same(a, b, path: str) -> None:
    """Equal tensors (dtype too), dataclasses field by field, sequences, values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), path
        for name in a.__dataclass_fields__:
            _same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _additions(rounds: UniqueRounds) -> dict[int, list[int]]:
    """Per row, the list positions of the values added into it, in the order of addition;
    and each round holds a row once."""
    order = range(rounds.rows.numel()) if rounds.perm is None else rounds.perm.tolist()
    entries = list(order)
    out: dict[int, list[int]] = {}
    start = 0
    for end in rounds.ends:
        rows = rounds.rows[start:end].tolist()
        assert len(set(rows)) == len(rows), "a row twice in one round"
        for row, at in zip(rows, entries[start:end]):
            out.setdefault(row, []).append(at)
        start = end
    assert start == rounds.rows.numel()
    return out


def _check_rounds(new: UniqueRounds, old: UniqueRounds, in_rows: torch.Tensor) -> bool:
    """The new rounds: slices of the given rows in list order, summing every row in the
    old rounds' order. Returns whether a row repeats."""
    assert new.perm is None and torch.equal(new.rows, in_rows)
    assert _additions(new) == _additions(old)
    return in_rows.numel() != torch.unique(in_rows).numel()


def test_run_based_tables_equal_the_per_token_construction(one_thread):
    rng = random.Random(0)
    cases = repeats = 0
    for _ in range(30):
        plan, mask = _batch(rng)
        for name in ("dispatch", "all_gather"):
            for stages in (1, 2, 3, 5):
                for rank in range(plan.cp_size):
                    new = staged.staged_tables(name, plan, mask, rank, (16, 16), stages)
                    old = ref.staged_tables(name, plan, mask, rank, (16, 16), stages)
                    what = f"{name} S={stages} rank {rank} {plan.layout} {mask}"
                    _same(new.local, old.local, what + " local")
                    assert len(new.stages) == len(old.stages), what
                    for p, (a, b) in enumerate(zip(new.stages, old.stages)):
                        for field in a.__dataclass_fields__:
                            if field != "rounds":
                                _same(getattr(a, field), getattr(b, field),
                                      f"{what} transfer {p}.{field}")
                        repeats += _check_rounds(a.rounds, b.rounds, a.in_rows)
                    cases += 1
    assert cases > 500 and repeats > 20, (cases, repeats)   # the mix covers repeated rows


def _valid_greedy(rounds: UniqueRounds, rows: list[int], units: list[int]) -> None:
    """Rounds are slices of the list with unique rows that start at unit starts (``units``:
    each row, or each run), and a round ends only where the next unit repeats one of its
    rows (greedy)."""
    assert rounds.perm is None and rounds.rows.tolist() == rows
    bounds = sorted(set(units) | {len(rows)})
    start = 0
    for end in rounds.ends:
        part = rows[start:end]
        assert len(set(part)) == len(part)
        if end < len(rows):
            assert end in units
            unit = rows[end:min(b for b in bounds if b > end)]
            assert set(unit) & set(part), "a round ended without a repeated row"
        start = end
    assert start == len(rows)


def test_unique_rounds_of_rows_and_of_runs():
    rng = np.random.default_rng(1)
    for trial in range(300):
        n_runs = int(rng.integers(0, 8))
        start = torch.from_numpy(rng.integers(0, 30, n_runs))
        length = torch.from_numpy(rng.integers(0, 9, n_runs))
        listed = [s + i for s, n in zip(start.tolist(), length.tolist()) for i in range(n)]
        rows = torch.tensor(listed, dtype=torch.int64)
        run_starts = (torch.cumsum(length, 0) - length)[length > 0].tolist()
        by_row = UniqueRounds.of(rows)
        _valid_greedy(by_row, listed, list(range(len(listed))))
        by_run = UniqueRounds.of_runs(start, length)
        live = length > 0   # of_runs cuts per row when the runs' pieces outnumber the rows
        bounds = torch.unique(torch.cat([start[live], (start + length)[live]]))
        pieces = int((torch.searchsorted(bounds, (start + length)[live])
                      - torch.searchsorted(bounds, start[live])).sum())
        _valid_greedy(by_run, listed, run_starts if pieces <= len(listed) or live.sum() <= 1
                      else list(range(len(listed))))
        # the same additions per row, in list order, either way
        assert _additions(by_row) == _additions(by_run) == _additions(ref.occurrence_rounds(rows))
        vals = torch.randn(len(listed), 2, dtype=torch.float64)
        want = torch.zeros(40, 2, dtype=torch.float64).index_add_(0, rows, vals)
        torch.testing.assert_close(by_run.add_(torch.zeros(40, 2, dtype=torch.float64), vals),
                                   want)


def _old_dispatch_counts(plan: CPPlan, mask: AttnMask, parts: int) -> torch.Tensor:
    counts = fetch_counts(plan, mask).clone()
    counts.fill_diagonal_(0)
    cuts = counts.unsqueeze(0) * torch.arange(parts + 1).view(-1, 1, 1) // parts
    steps = cuts[1:] - cuts[:-1]
    return steps[steps.flatten(1).sum(1) > 0]


def test_counts_time_walk_and_default_stages_equal_the_reference(one_thread):
    rng = random.Random(2)
    models = (CostModel(), CostModel(bytes_per_s=1e9), CostModel(bytes_per_s=3e12),
              CostModel(flops_per_s=1e12, stage_latency_s=0.0))
    picked = set()
    for _ in range(40):
        plan, mask = _batch(rng)
        hq, hkv, d, dv = rng.choice([(8, 2, 16, 16), (32, 8, 128, 128)])
        shape = AttnShape(n_heads=hq, n_kv_heads=hkv, head_dim=d, head_dim_v=dv)
        model = rng.choice(models)
        for parts in (1, 2, 3, 7):
            _same(staged.dispatch_stage_counts(plan, mask, parts),
                  _old_dispatch_counts(plan, mask, parts), f"dispatch counts {parts}")
        for name in ("dispatch", "all_gather"):
            for s in (*staged.CANDIDATE_STAGES, 5):
                assert staged.staged_time(name, plan, mask, shape, model, s) == \
                    ref.staged_time(name, plan, mask, shape, model, s)
                assert staged.staged_memory(name, plan, mask, shape, s) == \
                    ref.staged_memory(name, plan, mask, shape, s)
            times = staged.staged_times(name, plan, mask, shape, model)   # (cached)
            assert times == {s: ref.staged_time(name, plan, mask, shape, model, s)
                             for s in staged.CANDIDATE_STAGES}
            got = staged.default_stages(plan, mask, name, shape, model)
            assert got == ref.default_stages(plan, mask, name, shape, model)
            picked.add(got)
    assert len(picked) >= 3, picked   # the cases reach several stage counts
