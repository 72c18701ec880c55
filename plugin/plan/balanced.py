"""The ``balanced`` layout: equal tokens AND equal mask-weighted attention work per rank.

Documents are cut into chunks of ``chunk_tokens`` positions (boundaries at multiples of it
inside each document, so with the default 256 every full chunk is whole kernel tiles of 64;
a document shorter than a chunk stays one item). Each item's work is its exact number of
visible (query, key) pairs, summed over the model's masks with their layer weights (e.g.
Llama 4: chunked x3, global x1), from closed forms of the mask intervals (no per-token pass).

Assignment, with rho = total work / total tokens:
- items denser than rho form the dense list D, the others the sparse list S, both kept in
  (document, position) order so that a rank's share stays a few contiguous runs;
- rank k gets the token ranges D[x_k, x_k+1) and S[y_k, y_k+1) with
  x_k + y_k = N_k = floor(k * T / cp) (token counts equal up to one token) and x_k chosen
  so that the work of D[0, x_k) + S[0, y_k) is rho * N_k (work equal). Inside an item the
  work is taken as proportional to tokens, so the cut points are found by a vectorized
  search over a monotone piecewise-linear function. Such x_k always exists and is
  non-decreasing in k with y_k, because every range of D is at least rho-dense and every
  range of S at most (proof sketch at ``_cut_points``). This replaces LPT + refinement: it
  is exact up to one token per rank and the within-item linear approximation (at most
  ~chunk_tokens^2 / 8 pairs per cut), whatever the mask mix.

Each rank boundary cuts at most one item of each list, so the layout has at most
``n_items + 2 * (cp - 1)`` runs; no padding. One layout serves every layer, so the balance
is of the weighted SUM of the masks' work; each mask alone can be less balanced (see
bench/balance.py for measured figures).

Limits: work sums are float64 (weights are floats); every op is a deterministic elementwise
op or a sequential cumsum, so all ranks compute the same plan. Host (CPU) tensors only.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..masks import AttnMask

DEFAULT_CHUNK_TOKENS = 256
# Probes per round of the k-ary search for the cut points: 32 finds a cut among 128K tokens
# in 4 rounds of a dozen small vectorized ops (a binary search needs 17).
_PROBES = 32

MaskWeights = tuple[tuple[AttnMask, float], ...]


def normalize_masks(masks: Any) -> MaskWeights:
    """``((AttnMask, weight), ...)`` from None (causal), an AttnMask, or a sequence of
    AttnMask / (AttnMask, weight) entries; ValueError naming ``masks`` otherwise."""
    if masks is None:
        return ((AttnMask(causal=True), 1.0),)
    if isinstance(masks, AttnMask):
        return ((masks, 1.0),)
    if not isinstance(masks, (list, tuple)) or not masks:
        raise ValueError(f"masks must be an AttnMask or a non-empty list of AttnMask or "
                         f"(AttnMask, weight) pairs, got {masks!r}")
    out = []
    for i, entry in enumerate(masks):
        mask, weight = (entry, 1.0) if isinstance(entry, AttnMask) else (
            entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None))
        if not isinstance(mask, AttnMask):
            raise ValueError(f"masks[{i}] must be an AttnMask or an (AttnMask, weight) pair, "
                             f"got {entry!r}")
        if (isinstance(weight, bool) or not isinstance(weight, (int, float))
                or not math.isfinite(weight) or weight <= 0):
            raise ValueError(f"masks[{i}] weight must be a finite number > 0, got {weight!r}")
        out.append((mask, float(weight)))
    return tuple(out)


def check_chunk_tokens(chunk_tokens: Any) -> int:
    """The resolved chunk size; ValueError naming ``chunk_tokens`` unless an int >= 1."""
    if chunk_tokens is None:
        return DEFAULT_CHUNK_TOKENS
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    return chunk_tokens


# ---- exact work from the mask intervals ---------------------------------------------------
def _tri(x: torch.Tensor) -> torch.Tensor:
    """sum of q for q in [0, x): x (x - 1) / 2."""
    return x * (x - 1) // 2


def _block_work(a: torch.Tensor, b: torch.Tensor, c_lo: torch.Tensor, c_hi: torch.Tensor,
                d: int | None, e: int | None) -> torch.Tensor:
    """Visible keys summed over queries q in [a, b) whose interval is
    [max(c_lo, q - d), min(c_hi, q + e)] (``None``: that side has no q-term).

    Every real query sees itself, so each interval is non-empty and the count is
    sum(hi) - sum(lo) + (b - a); each sum splits where the q-term takes over.
    """
    n = b - a
    if e is None:
        s_hi = c_hi * n
    else:
        m = torch.minimum(torch.maximum(c_hi - e, a), b)  # q < m: q + e is the minimum
        s_hi = _tri(m) - _tri(a) + e * (m - a) + c_hi * (b - m)
    if d is None:
        s_lo = c_lo * n
    else:
        m = torch.minimum(torch.maximum(c_lo + d + 1, a), b)  # q >= m: q - d is the maximum
        s_lo = c_lo * (m - a) + _tri(b) - _tri(m) - d * (b - m)
    return s_hi - s_lo + n


def prefix_work(doc_len: torch.Tensor, stop: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens (all keys of the document) under ``mask``; elementwise, 0 <= stop <=
    doc_len. Closed form per mask, checked against ``AttnMask.count_visible`` in the tests."""
    causal, wl, wr, chunk = mask.params
    offsets = [x for x in ((0 if causal else None), (wr if wr >= 0 else None)) if x is not None]
    e = min(offsets) if offsets else None
    d = wl if wl >= 0 else None
    doc_len, stop = doc_len.to(torch.int64), stop.to(torch.int64)
    if not chunk:
        zero = torch.zeros_like(stop)
        return _block_work(zero, stop, zero, doc_len - 1, d, e)
    # Whole chunks before stop all hold the same work (the document end cannot cut them).
    n_full = torch.div(stop, chunk, rounding_mode="floor")
    first = n_full * chunk
    one = torch.zeros(1, dtype=torch.int64)
    per_chunk = _block_work(one, one + chunk, one, one + chunk - 1, d, e)
    last = torch.minimum(doc_len - 1, first + chunk - 1)
    return n_full * per_chunk + _block_work(first, stop, first, last, d, e)


def chunk_work(doc_len: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
               masks: MaskWeights) -> torch.Tensor:
    """float64: weighted visible pairs of the queries at positions [start, start+size) of
    each chunk, for chunks in ``chunk_items`` order (a document's chunks consecutive, the
    first at position 0), so one prefix per chunk end serves both of its ends."""
    total = torch.zeros(start.shape, dtype=torch.float64)
    first = start == 0
    for mask, weight in masks:
        upto = prefix_work(doc_len, start + size, mask)
        before = torch.cat([upto.new_zeros(1), upto])[:-1].masked_fill_(first, 0)
        total += weight * (upto - before).to(torch.float64)
    return total


# ---- items and cut points -----------------------------------------------------------------
def chunk_items(lengths: torch.Tensor, chunk_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(doc, start, size) int64 of every chunk, in (document, position) order."""
    n_items = (lengths + chunk_tokens - 1) // chunk_tokens
    total = int(n_items.sum())
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), n_items, output_size=total)
    first = torch.cumsum(n_items, 0) - n_items
    start = (torch.arange(total) - first[doc]) * chunk_tokens
    size = torch.minimum(lengths[doc] - start, torch.full_like(start, chunk_tokens))
    return doc, start, size


class _Run:
    """Items of one list, in order, as a cumulative (tokens, work) curve that is linear
    inside each item: work of the first x tokens = base[i] + x * density[i] for x in
    item i."""

    def __init__(self, tokens: torch.Tensor, work: torch.Tensor) -> None:
        if tokens.numel() == 0:  # one empty item keeps the lookups total
            tokens, work = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.float64)
        self.tok_start = torch.cumsum(tokens, 0) - tokens
        self.density = work / tokens.clamp(min=1).to(torch.float64)
        self.base = torch.cumsum(work, 0) - work - self.tok_start.to(torch.float64) * self.density
        self.tokens = int(tokens.sum())

    def work_at(self, x: torch.Tensor) -> torch.Tensor:
        """Work of the list's first ``x`` tokens (x: int64, any shape, 0..tokens)."""
        # tok_start[0] == 0 <= x, so the index is >= 0.
        i = torch.searchsorted(self.tok_start, x, right=True) - 1
        return torch.take(self.base, i) + x.to(torch.float64) * torch.take(self.density, i)


def _cut_points(dense: _Run, sparse: _Run, n_tokens: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
    """Smallest x with f(x) = dense.work_at(x) + sparse.work_at(N - x) - target >= 0 per
    boundary (x in [max(0, N - |S|), min(|D|, N)]).

    f is non-decreasing (a dense token adds >= rho, a sparse one <= rho) and is >= 0 at the
    top of the range, <= 0 at the bottom; moving from boundary k to k+1 (n more tokens,
    rho * n more target) lowers f pointwise and f_{k+1}(x + n) >= f_k(x), so the answers
    x_k and N_k - x_k are both non-decreasing in k.
    """
    lo = (n_tokens - sparse.tokens).clamp(min=0)
    hi = torch.minimum(n_tokens, torch.full_like(n_tokens, dense.tokens))
    steps = torch.arange(1, _PROBES + 1)
    rows = torch.arange(n_tokens.numel())
    while bool((hi > lo).any()):
        probe = lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * steps // _PROBES  # last = hi
        f = (dense.work_at(probe) + sparse.work_at(n_tokens.unsqueeze(1) - probe)
             - target.unsqueeze(1))
        ok = f >= 0
        ok[:, -1] = True  # float rounding at the top: the range always ends at hi
        j = ok.to(torch.int8).argmax(1)  # first probe that reaches the target
        new_hi = probe[rows, j]
        lo = torch.where(j > 0, probe[rows, (j - 1).clamp(min=0)] + 1, lo)
        hi = new_hi
    # The first x reaching the target overshoots by up to one token's work; the step
    # below may be nearer.
    below = (hi - 1).clamp(min=0)
    keep_below = (hi > 0) & (below >= (n_tokens - sparse.tokens).clamp(min=0))
    f_hi = dense.work_at(hi) + sparse.work_at(n_tokens - hi) - target
    f_below = dense.work_at(below) + sparse.work_at(n_tokens - below) - target
    return torch.where(keep_below & (f_below.abs() < f_hi.abs()), below, hi)


def _monotone(x: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """Guard against float ties: x and N - x non-decreasing (a no-op in exact math)."""
    steps_ok = (x[1:] >= x[:-1]) & (n_tokens[1:] - x[1:] >= n_tokens[:-1] - x[:-1])
    if bool(steps_ok.all()):
        return x
    out = x.tolist()
    n = n_tokens.tolist()
    for k in range(1, len(out)):
        out[k] = min(max(out[k], out[k - 1]), out[k - 1] + n[k] - n[k - 1])
    return torch.tensor(out, dtype=torch.int64)


def _split_runs(doc: torch.Tensor, start: torch.Tensor, size: torch.Tensor, cuts: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, doc, start, length) of a list's items cut at token offsets ``cuts`` [cp+1]:
    rank k holds the list's tokens [cuts[k], cuts[k+1]).

    Inside an item the list order is folded (first position, last, second, second to
    last, ...), so a cut item gives each side a front run and a back run whose work is
    its token share of the item's work whenever the work per position is linear across
    the item (causal, window and chunk ramps), as the cut search assumes; a plain prefix
    cut would be off by up to size^2 / 8 pairs per cut (2.6% work imbalance measured at
    cp 64 on 1000 short documents).
    """
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(size, 0)])
    points = torch.unique(torch.cat([bounds, cuts]))
    first, stop = points[:-1], points[1:]
    item = torch.searchsorted(bounds, first, right=True) - 1
    rank = torch.searchsorted(cuts, first, right=True) - 1
    a, b = first - bounds[item], stop - bounds[item]
    s, n = start[item], size[item]
    whole = (a == 0) & (b == n)
    # Whole items stay one run; a cut item's share is [ceil(a/2), ceil(b/2)) from the
    # front and [n - b//2, n - a//2) from the back.
    front_lo = torch.where(whole, 0, (a + 1) // 2)
    front_hi = torch.where(whole, n, (b + 1) // 2)
    back_lo, back_hi = n - b // 2, n - a // 2
    back_hi = torch.where(whole, back_lo, back_hi)
    d = doc[item]
    return (torch.cat([rank, rank]), torch.cat([d, d]),
            torch.cat([s + front_lo, s + back_lo]),
            torch.cat([front_hi - front_lo, back_hi - back_lo]))


def balanced_runs(lengths: torch.Tensor, cp_size: int, masks: MaskWeights, chunk_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, doc, start, length) int64 runs of the balanced layout (see the module
    docstring) for documents of ``lengths`` (int64, CPU); inputs validated."""
    doc, start, size = chunk_items(lengths, chunk_tokens)
    work = chunk_work(lengths[doc], start, size, masks)
    total_tokens = int(lengths.sum())
    total_work = float(torch.cumsum(work, 0)[-1]) if work.numel() else 0.0
    # Dense: work / size > rho, compared without division (float64, exact for < 2^53).
    is_dense = work * total_tokens > total_work * size.to(torch.float64)
    lists = [(doc[m], start[m], size[m], work[m]) for m in (is_dense, ~is_dense)]
    dense, sparse = _Run(lists[0][2], lists[0][3]), _Run(lists[1][2], lists[1][3])

    n_tokens = torch.arange(cp_size + 1, dtype=torch.int64) * total_tokens // cp_size
    target = n_tokens.to(torch.float64) * (total_work / max(total_tokens, 1))
    x = _monotone(_cut_points(dense, sparse, n_tokens, target), n_tokens)
    parts = [_split_runs(*lists[0][:3], x), _split_runs(*lists[1][:3], n_tokens - x)]
    rank, pdoc, pstart, plen = (torch.cat([a, b]) for a, b in zip(*parts))
    keep = plen > 0
    return rank[keep], pdoc[keep], pstart[keep], plen[keep]


def describe(masks: MaskWeights, chunk_tokens: int) -> Sequence[Any]:
    """Stable description of the layout's parameters (for the plan's fingerprint)."""
    return (tuple((m.params, w) for m, w in masks), chunk_tokens)
