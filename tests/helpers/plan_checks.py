"""Plan invariants (every token held once, positions, order, padding last) and the
balanced layout's token counts, plus the fixed document mixes the plan tests run, and a
dense count of the keys each rank fetches."""

from __future__ import annotations

import numpy as np
import torch

from varlen_cp import CPPlan

FIXED_MIXES = [
    [],  # empty batch
    [0],
    [1],
    [5, 0, 1, 7],  # zero-length doc in the middle
    [2, 3],  # fewer tokens than some cp sizes
    [300, 1, 17, 0, 64, 129],  # one long document, odd lengths
    [1] * 13,
    [97, 96, 95, 33, 2, 1, 250],
]


def mix_id(lengths: list[int]) -> str:
    """A pytest id for a document mix: its lengths (``docs_5_0_1_7``), ``no_docs``, or the
    length and count of a run of equal documents (``docs_1x13``)."""
    if not lengths:
        return "no_docs"
    if len(lengths) > 3 and len(set(lengths)) == 1:
        return f"docs_{lengths[0]}x{len(lengths)}"
    return "docs_" + "_".join(map(str, lengths))


def check_invariants(plan: CPPlan, lengths: list[int]) -> None:
    """The layout-independent contract of a plan, checked token by token."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    assert plan.total_tokens == total and plan.n_docs == len(lengths)
    held = []
    for r in range(plan.cp_size):
        idx, pos, lcu = plan.token_indices_of(r), plan.positions_of(r), \
            plan.local_cu_seqlens_of(r)
        assert idx.dtype == torch.int64 and pos.dtype == torch.int32 and lcu.dtype == torch.int32
        assert idx.shape == pos.shape == (plan.num_tokens_of(r),)
        assert lcu.shape == (len(lengths) + 1,) and int(lcu[0]) == 0
        assert int(lcu[-1]) == plan.num_tokens_of(r)
        seg = (lcu[1:] - lcu[:-1]).tolist()
        assert min(seg, default=0) >= 0
        assert plan.max_local_seqlen_of(r) == max(seg, default=0)
        for d, (a, b) in enumerate(zip(lcu[:-1].tolist(), lcu[1:].tolist())):
            s_idx, s_pos = idx[a:b].tolist(), pos[a:b].tolist()
            real = [i >= 0 for i in s_idx]
            assert real == sorted(real, reverse=True), "padding must come last in its doc"
            for i, p in zip(s_idx, s_pos):
                if i < 0:
                    assert p == -1
                else:
                    assert starts[d] <= i < starts[d + 1] and p == i - starts[d]
            real_pos = [p for p in s_pos if p >= 0]
            assert all(x < y for x, y in zip(real_pos, real_pos[1:]))
        held += [i for i in idx.tolist() if i >= 0]
    assert sorted(held) == list(range(total)), "every global token exactly once"
    assert plan.padded_total_tokens == sum(plan.num_tokens_of(r) for r in range(plan.cp_size))


def check_balanced(plans: list[CPPlan], lengths: list[int]) -> None:
    """No padding and token counts within 2% of the mean, plus one token (cuts move to
    tile and document boundaries within a token budget; tiny batches cut exactly)."""
    p0 = plans[0]
    total = sum(lengths)
    assert p0.padded_total_tokens == total
    counts = [p0.num_tokens_of(r) for r in range(p0.cp_size)]
    mean = total / p0.cp_size
    assert all(abs(c - mean) <= 0.02 * mean + 1 for c in counts), (counts, mean)


def _held(rank, doc, start, length, offs: np.ndarray, r: int, reach: int = 0
          ) -> tuple[np.ndarray, np.ndarray]:
    """(held, seen) dense boolean masks over the batch's tokens for rank ``r``: the
    positions it holds, and those plus ``reach`` positions before each run."""
    held = np.zeros(int(offs[-1]), dtype=bool)
    seen = np.zeros(int(offs[-1]), dtype=bool)
    sel = rank == r
    for d, a, n in zip(doc[sel], start[sel], length[sel]):
        held[offs[d] + a: offs[d] + a + n] = True
        seen[offs[d] + max(0, a - reach): offs[d] + a + n] = True
    return held, seen


def _lacks(part: np.ndarray) -> int:
    """Positions before the last held one of ``part`` that are not held (0: none held)."""
    if not part.any():
        return 0
    last = int(np.flatnonzero(part).max())
    return last + 1 - int(part[: last + 1].sum())


def causal_fetch(rank, doc, start, length, lengths, cp: int) -> np.ndarray:
    """Per rank: the keys its queries see under a causal mask that it does not hold (dense
    boolean masks, one per rank), for runs (rank, doc, start, length) of documents of
    ``lengths`` tokens."""
    return chunked_fetch(rank, doc, start, length, lengths, cp, int(np.sum(lengths)) + 1)


def chunked_fetch(rank, doc, start, length, lengths, cp: int, chunk: int) -> np.ndarray:
    """Per rank: the keys its queries see under a causal mask within chunks of ``chunk``
    tokens that it does not hold (dense boolean masks, one per rank, chunk by chunk)."""
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.zeros(cp, dtype=np.int64)
    for r in range(cp):
        held = _held(rank, doc, start, length, offs, r)[0]
        for d in np.unique(doc[rank == r]):
            seg = held[offs[d]: offs[d + 1]]
            out[r] += sum(_lacks(seg[c0: c0 + chunk]) for c0 in range(0, seg.size, chunk))
    return out


def window_fetch(rank, doc, start, length, lengths, cp: int, window: int) -> np.ndarray:
    """Per rank: the keys its queries see under a causal window of ``window`` keys before
    each query that it does not hold (dense boolean masks, one per rank)."""
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.zeros(cp, dtype=np.int64)
    for r in range(cp):
        held, seen = _held(rank, doc, start, length, offs, r, window)
        out[r] = int((seen & ~held).sum())
    return out


def drop_variants(monkeypatch, solve_module, pred) -> None:
    """The balanced layout without the attempts for which ``pred(variant)`` holds (the
    layout as it was before a variant: monkeypatches ``solve_module.choose_variants``)."""
    choose = solve_module.choose_variants
    monkeypatch.setattr(solve_module, "choose_variants",
                        lambda *a, **k: [v for v in choose(*a, **k) if not pred(v)])


def balanced_within_targets(lengths: np.ndarray, cp: int, masks) -> CPPlan:
    """The ``balanced`` plan of documents of ``lengths`` tokens for ``masks`` ((mask,
    layer count) pairs), checked against the targets by the plan's own tables: tokens
    within 1.02 of the mean, every mask's work within 1.03."""
    from varlen_cp.plan import Balanced
    from varlen_cp.plan.balanced import normalize_masks
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=Balanced(masks=list(masks)))
    assert plan.token_imbalance() <= 1.02
    for m, _ in normalize_masks(list(masks)):
        assert plan.work_imbalance(m) <= 1.03, (m, plan.work_imbalance(m))
    return plan


def assert_runs_unchanged_without(monkeypatch, pred, lengths: np.ndarray, cp: int,
                                  masks) -> None:
    """The balanced runs of ``lengths`` at ``cp`` for ``masks`` (normalized) equal those of
    the layout without the attempts for which ``pred(variant)`` holds."""
    from varlen_cp.plan.balanced import DEFAULT_TILE_TOKENS, balanced_runs
    from varlen_cp.plan.balanced import solve
    new = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    drop_variants(monkeypatch, solve, pred)
    old = balanced_runs(lengths, cp, masks, DEFAULT_TILE_TOKENS)
    for a, b in zip(new, old):
        assert np.array_equal(a, b)
