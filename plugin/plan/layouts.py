"""Layouts: which tokens of the global packed batch each context-parallel rank holds.

A layout is described by *pieces*: runs of consecutive positions of one document held by one
rank. Positions here are *padded* positions (only the ``te`` layout pads; a padded position
at or beyond the document's length is a padding token). ``tables.expand_pieces`` turns pieces
into per-token tables, so a layout only decides the runs and never touches single tokens.
numpy only: int64 document lengths in, int64 pieces out (exact integer math, the same on
every rank).

- ``dual_chunk``: documents of at least ``2 * cp * min_chunk_tokens`` tokens
  ("long") are cut into ``2 * cp`` chunks (sizes differ by at most one token, no padding)
  and rank r holds chunks r and 2*cp-1-r, which balances causal work. Every other document
  is one *item*, or, when it is longer than ``spread_limit`` (an eighth of a rank's token
  share) and long enough for chunks of ``min_chunk_tokens``, the dual-chunk idea over a
  subset: 2*g chunks as g items (chunk j with chunk 2*g-1-j). Items go to ranks by a
  two-resource greedy (tokens and causal work, see ``_greedy_owner``). A rank never holds
  more than ``ceil(total / cp) + largest_item - 1`` tokens.
- ``te``: TransformerEngine's THD layout: each document padded at its end to a multiple of
  ``pad_multiple`` (default 2*cp), cut into 2*cp equal chunks, rank r holds chunks r and
  2*cp-1-r (``thd_get_partitioned_indices``).
- ``contiguous``: rank r holds the r-th of cp near-equal contiguous slices of the packed
  sequence (sizes differ by at most one); documents are cut at the slice boundaries.
- ``balanced`` (the default): tokens and the work of EACH of the model's masks equal on every rank
  (Llama 4's chunked and global layers alike), documents cut where the cut costs little
  K/V to fetch: a rank holds few contiguous stretches of a document, long bodies go to
  ranks in whole shares, mirrored or chunk-pair pieces only where balance needs them
  (the package ``balanced/``).

Measured balance (max/mean, 128K tokens, log-normal document mixes of 170-1000 documents):
dual_chunk tokens 1.00-1.02, causal work 1.00-1.02 at cp 8..64, but up to 1.12 when few
documents leave coarse items (43 documents of 3000 tokens at cp 64); te 1.04-1.32 causal
work at cp 8..64 on the 1000-document mix; contiguous 1.6-7. dual_chunk and te do not
balance masks other than causal (chunked 8192 at cp 64: ~1.4-1.7); balanced keeps every
mask of the model within 1.03 and, at 8K tokens per GPU, a simulated per-layer efficiency
of 0.92-0.98 on a heavy-tailed mix at cp 64 for causal and Llama 4 layers (dual_chunk
0.12; bench/plan.py).

Limits: the greedy is a Python loop over items x ranks (build of 128K tokens / 1000 documents:
~25 ms at cp 64, ~10 ms at cp 8 on one shared CPU core); balanced's rank-by-rank solver is a
Python loop over ranks (~20 us a rank); everything else is vectorized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balanced import MaskWeights, balanced_runs
from .layout_spec import TE, Balanced, Contiguous, DualChunk, LayoutSpec


@dataclass(frozen=True)
class Pieces:
    """Runs of padded positions ``start .. start + length - 1`` of document ``doc`` held by
    rank ``rank`` (all int64 numpy [P]); ``padded_lengths`` int64 [n_docs] is each
    document's length including the layout's padding."""

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    padded_lengths: np.ndarray


def _dual_chunk_rank(cp_size: int) -> np.ndarray:
    """Owner of each of the 2*cp chunks: chunk i -> i for i < cp, else 2*cp-1-i."""
    i = np.arange(2 * cp_size, dtype=np.int64)
    return np.where(i < cp_size, i, 2 * cp_size - 1 - i)


def _causal_work(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Causal visible pairs of the queries at positions [start, stop): sum of (p + 1)."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def contiguous_pieces(lengths: np.ndarray, cp_size: int) -> Pieces:
    """Rank r holds packed tokens [r*T//cp, (r+1)*T//cp): slice sizes differ by <= 1."""
    cu = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    total = int(cu[-1])
    bounds = np.arange(cp_size + 1, dtype=np.int64) * total // cp_size
    # Every run ends at a document boundary or a slice boundary, whichever comes first.
    points = np.unique(np.concatenate([cu, bounds]))
    first, stop = points[:-1], points[1:]
    # side="right" skips zero-length documents / empty slices that share the same start.
    doc = np.searchsorted(cu, first, side="right") - 1
    rank = np.searchsorted(bounds, first, side="right") - 1
    return Pieces(rank, doc, first - cu[doc], stop - first, lengths.copy())


def te_pieces(lengths: np.ndarray, cp_size: int, pad_multiple: int) -> Pieces:
    """TransformerEngine's padded dual-chunk layout (see the module docstring)."""
    n_chunks = 2 * cp_size
    padded = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    chunk = padded // n_chunks  # [n_docs]; exact because pad_multiple % (2*cp) == 0
    n_docs = lengths.size
    shape = (n_docs, n_chunks)
    rank = np.broadcast_to(_dual_chunk_rank(cp_size), shape).ravel()
    doc = np.repeat(np.arange(n_docs, dtype=np.int64), n_chunks)
    start = (np.arange(n_chunks, dtype=np.int64) * chunk[:, None]).ravel()
    length = np.repeat(chunk, n_chunks)
    return Pieces(rank, doc, start, length, padded)


def _dual_chunk_sizes(lengths: np.ndarray, cp_size: int) -> np.ndarray:
    """Chunk sizes [n_long, 2*cp] of each long document: floor or ceil of L / (2*cp).

    The ``L % (2*cp)`` leftover tokens are dealt to rank pairs (chunk r, chunk 2*cp-1-r)
    round-robin, continuing across documents, so each rank's token count over all long
    documents differs from any other's by at most one (plain ``i*L//(2*cp)`` cuts would let
    a one-token excess add up over many documents on the same ranks).
    """
    n_chunks = 2 * cp_size
    base = lengths // n_chunks
    extra = lengths % n_chunks
    both = extra // cp_size  # 1 when every pair gets one extra token in each chunk
    rem = extra % cp_size  # pairs that get one more token, dealt round-robin
    offset = (np.cumsum(rem) - rem) % cp_size
    pair = np.arange(cp_size, dtype=np.int64)
    turn = (pair[None, :] - offset[:, None]) % cp_size
    per_pair = both[:, None] + (turn < rem[:, None])  # 0, 1 or 2
    front = base[:, None] + (per_pair >= 1)  # chunk r
    back = base[:, None] + (per_pair >= 2)  # chunk 2*cp-1-r
    return np.concatenate([front, back[:, ::-1]], axis=1)


def spread_limit(total: int, cp_size: int, min_chunk_tokens: int) -> int:
    """Most tokens a rank should take of a document that is not long: an eighth of the
    mean per-rank share (chunks never below ``min_chunk_tokens`` though).

    Whole documents near a rank's share cannot be balanced (at cp 64 on 128K tokens the
    share is 2048, yet only documents of >= 8192 tokens are long). Measured on a
    log-normal mix at cp 64: tokens / causal work imbalance 2.6 / 22 with such documents
    kept whole, 1.02 / 1.02 with share/8, worse again with share/16 (1.03 / 1.03: smaller
    items of dense work crowd the end of the greedy).
    """
    share = -(-total // cp_size)
    return max(2 * min_chunk_tokens, share // 8)


def _spread_items(length: int, n_pairs: int, doc: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """A document cut into 2*n_pairs chunks (sizes differ by <= 1) as n_pairs items
    (doc, [(start, length) of chunk j, of chunk 2*n_pairs-1-j]): causal work equal up to
    rounding, the dual-chunk idea over a subset of ranks."""
    n_chunks = 2 * n_pairs
    cuts = [i * length // n_chunks for i in range(n_chunks + 1)]
    return [(doc, [(cuts[j], cuts[j + 1] - cuts[j]),
                   (cuts[n_chunks - 1 - j], cuts[n_chunks - j] - cuts[n_chunks - 1 - j])])
            for j in range(n_pairs)]


def _greedy_owner(items: list[tuple[int, list[tuple[int, int]]]], work: list[int],
                  tokens: list[int], total: int) -> list[int]:
    """Rank of each item, two-resource greedy (tokens and causal work).

    Items go largest first (by their larger share of the two totals) to the rank whose
    larger normalized load after taking it is smallest, among the ranks below the mean
    token count. Exact integer math, so every rank computes the same assignment.
    Token bound: a rank below the mean always exists (before an item of s tokens is placed
    the ranks hold at most total - s), so no rank ends above ceil(total/cp) + s_max - 1.
    """
    cp_size = len(work)
    work, tokens = list(work), list(tokens)
    size = [sum(n for _, n in runs) for _, runs in items]
    cost = [sum((s + n) * (s + n + 1) // 2 - s * (s + 1) // 2 for s, n in runs)
            for _, runs in items]
    # Normalized loads w / W_total and t / T_total compared as w * T_total vs t * W_total.
    w_tot, t_tot = max(sum(work) + sum(cost), 1), max(total, 1)
    order = sorted(range(len(items)),
                   key=lambda j: (-max(cost[j] * t_tot, size[j] * w_tot), items[j][0]))
    # Scaled loads; ranks at or above the mean token count leave ``open`` for good.
    a = [w * t_tot for w in work]
    b = [t * w_tot for t in tokens]
    open_ranks = [r for r in range(cp_size) if tokens[r] * cp_size < total]
    owner = [0] * len(items)
    for j in order:
        c, s = cost[j] * t_tot, size[j] * w_tot
        scores = [max(a[r] + c, b[r] + s) for r in open_ranks]
        i = scores.index(min(scores))  # first minimum: lowest rank on ties
        best = open_ranks[i]
        owner[j] = best
        a[best] += c
        b[best] += s
        tokens[best] += size[j]
        if tokens[best] * cp_size >= total:
            del open_ranks[i]
    return owner


def dual_chunk_pieces(lengths: np.ndarray, cp_size: int, min_chunk_tokens: int) -> Pieces:
    """Load-balanced dual-chunk layout without padding (see the module docstring)."""
    n_chunks = 2 * cp_size
    is_long = lengths >= n_chunks * min_chunk_tokens
    long_docs = np.flatnonzero(is_long)
    n_long = long_docs.size
    size = _dual_chunk_sizes(lengths[long_docs], cp_size)
    start = np.cumsum(size, 1) - size
    rank = np.broadcast_to(_dual_chunk_rank(cp_size), (n_long, n_chunks)).ravel()
    # Rank r holds chunks r and 2*cp-1-r of every long document: exact int64 sums per
    # column (no scatter).
    cw = _causal_work(start, start + size)
    work = cw[:, :cp_size].sum(0) + cw[:, cp_size:][:, ::-1].sum(0)
    tokens = size[:, :cp_size].sum(0) + size[:, cp_size:][:, ::-1].sum(0)

    # Zero-length documents hold no tokens: they need no piece (their local segments are
    # empty on every rank).
    total = int(lengths.sum())
    limit = spread_limit(total, cp_size, min_chunk_tokens)
    rest = np.flatnonzero(~is_long & (lengths > 0))
    items = []
    for doc, length in zip(rest.tolist(), lengths[rest].tolist()):
        n_pairs = min(-(-length // limit), length // (2 * min_chunk_tokens), cp_size)
        if n_pairs >= 2:
            items.extend(_spread_items(length, n_pairs, doc))
        else:
            items.append((doc, [(0, length)]))
    owner = _greedy_owner(items, work.tolist(), tokens.tolist(), total)
    runs = [(r, doc, s, n) for r, (doc, item) in zip(owner, items) for s, n in item]
    extra = np.array(runs, dtype=np.int64).reshape(-1, 4)
    return Pieces(
        rank=np.concatenate([rank, extra[:, 0]]),
        doc=np.concatenate([np.repeat(long_docs, n_chunks), extra[:, 1]]),
        start=np.concatenate([start.ravel(), extra[:, 2]]),
        length=np.concatenate([size.ravel(), extra[:, 3]]),
        padded_lengths=lengths.copy(),
    )


def balanced_pieces(lengths: np.ndarray, cp_size: int, masks: MaskWeights,
                    tile_tokens: int) -> Pieces:
    """The ``balanced`` layout's runs as pieces (no padding)."""
    rank, doc, start, length = balanced_runs(lengths, cp_size, masks, tile_tokens)
    return Pieces(rank, doc, start, length, lengths.copy())


def layout_pieces(lengths: np.ndarray, cp_size: int, spec: LayoutSpec) -> Pieces:
    """Pieces of the layout ``spec`` (``te``: its ``pad_multiple`` resolved) for documents
    of ``lengths`` (int64 numpy); inputs validated."""
    if isinstance(spec, Balanced):
        return balanced_pieces(lengths, cp_size, spec.masks, spec.tile_tokens)
    if isinstance(spec, DualChunk):
        return dual_chunk_pieces(lengths, cp_size, spec.min_chunk_tokens)
    if isinstance(spec, TE):
        return te_pieces(lengths, cp_size, spec.pad_multiple)
    if isinstance(spec, Contiguous):
        return contiguous_pieces(lengths, cp_size)
    raise ValueError(f"layout must be a layout spec, got {spec!r}")
