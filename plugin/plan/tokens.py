"""Per-token tables of a layout: pieces (runs of positions) expanded to every rank's tokens.

All ranks' tables live in one concatenation (rank r's local tokens are rows
``rank_offsets[r]:rank_offsets[r+1]``) so that building them is a handful of vectorized ops
over the global token count, with no per-token or per-rank Python loop. Host (CPU) only,
numpy only: the plan (``cpplan.py``) hands them out as tensors (``torch.from_numpy`` views,
no copy).

Local order: pieces sorted by (rank, document, start), so each document's local tokens are
contiguous, documents appear in global order, positions increase, and padding (only at a
document's end in the ``te`` layout) comes last within its document.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .layouts import Pieces


@dataclass(frozen=True)
class RunTable:
    """The layout's pieces in local order, real tokens only, all int64 [R]: a rank's runs of
    consecutive real positions of one document (the plan hands them out as
    ``runs.Runs``, holder = rank)."""

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row: np.ndarray  # local row of the run's first token on its rank


@dataclass(frozen=True)
class TokenTables:
    """Every rank's local tokens, concatenated in rank order (numpy).

    rank_offsets:  int64 [cp+1].
    token_index:   int64 [N] global (unpadded) token index, -1 for padding.
    padded_index:  int64 [N] index in the packed sequence with the layout's padding
                   (TransformerEngine's / Megatron's padded THD indexing for ``te``).
    position:      int32 [N] position within the document, -1 for padding.
    local_cu:      int32 [cp, n_docs+1] local cu_seqlens of each rank.
    runs:          the layout's pieces in local order, real tokens only (:class:`RunTable`).
    piece_doc, piece_count: the merged pieces' documents and token counts (local order).
    doc:           int64 [N] document of each token, built on first use (only the
                   Ulysses schedules read it: 1 MB and a pass at 128K tokens saved for
                   the others).
    """

    rank_offsets: np.ndarray
    token_index: np.ndarray
    padded_index: np.ndarray
    position: np.ndarray
    local_cu: np.ndarray
    runs: RunTable
    piece_doc: np.ndarray
    piece_count: np.ndarray

    @cached_property
    def doc(self) -> np.ndarray:
        return np.repeat(self.piece_doc, self.piece_count)


def _local_order(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, n_docs: int,
                 padded_lengths: np.ndarray) -> np.ndarray:
    """Permutation sorting pieces by (rank, doc, start) (None: already sorted, as the
    ``balanced`` layout's runs come)."""
    span = int(padded_lengths.max()) + 1 if n_docs else 1
    n_ranks = int(rank.max()) + 1 if rank.size else 1
    if n_ranks * n_docs * span < 1 << 62:
        # One sort of a combined key: 128K pieces sort in ~1/3 of the time of three.
        key = (rank * n_docs + doc) * span + start
        if bool((key[1:] > key[:-1]).all()):
            return None
        return np.argsort(key, kind="stable")
    order = np.argsort(start, kind="stable")  # stable sorts, least significant key first
    order = order[np.argsort(doc[order], kind="stable")]
    return order[np.argsort(rank[order], kind="stable")]


def _merge_adjacent(rank: np.ndarray, doc: np.ndarray, start: np.ndarray,
                    count: np.ndarray) -> tuple[np.ndarray, ...]:
    """Pieces sorted by (rank, doc, start) with every piece that continues the previous
    one (same rank and document, next position) merged into it: a layout may emit a piece
    per tile, and every table built from the runs later costs per run."""
    if rank.size < 2:
        return rank, doc, start, count
    new = np.ones(rank.size, dtype=bool)
    new[1:] = ~((rank[1:] == rank[:-1]) & (doc[1:] == doc[:-1])
                & (start[1:] == start[:-1] + count[:-1]))
    if bool(new.all()):
        return rank, doc, start, count
    first = np.flatnonzero(new)
    total = np.concatenate([np.zeros(1, np.int64), np.cumsum(count)])
    ends = np.append(first[1:], rank.size)
    return rank[first], doc[first], start[first], total[ends] - total[first]


def _ramp(first_value: np.ndarray, first_row: np.ndarray, count: np.ndarray,
          n_tokens: int, dtype: type) -> np.ndarray:
    """Per token of pieces laid back to back (non-empty): its piece's ``first_value`` plus
    its offset in the piece, as ONE in-place cumulative sum of steps (1 inside a piece,
    the jump at a piece's first row) in the output's own memory: no 1 MB temporaries,
    whose pages glibc hands back and the next batch faults in again (~250 faults, ~0.2 ms
    each at 128K tokens, measured in the build). Every prefix sum is an output value, so
    int32 does not overflow."""
    out = np.ones(n_tokens, dtype=dtype)
    if n_tokens:
        prev_last = first_value[:-1] + count[:-1] - 1
        out[first_row] = np.concatenate([first_value[:1], first_value[1:] - prev_last])
        np.cumsum(out, dtype=dtype, out=out)
    return out


def expand_pieces(p: Pieces, lengths_np: np.ndarray, cp_size: int) -> TokenTables:
    """Token tables of pieces ``p`` over documents of ``lengths_np`` (int64 [n_docs]).

    Per-piece values, then each per-token table (two without padding: token index and
    position) one in-place pass, :func:`_ramp`. Pieces that come sorted (``balanced``'s
    runs) are not sorted again. 128K tokens, cp 8, in the build: ~2.2 ms -> ~0.5 ms (most
    of the old time was page faults on temporaries)."""
    rank, doc, start, count = p.rank, p.doc, p.start, p.length
    padded_np = p.padded_lengths
    n_docs = lengths_np.size
    order = _local_order(rank, doc, start, n_docs, padded_np)
    if order is not None:
        order = order[count[order] > 0]
        rank, doc, start, count = rank[order], doc[order], start[order], count[order]
    elif not bool((count > 0).all()):
        keep = count > 0
        rank, doc, start, count = rank[keep], doc[keep], start[keep], count[keep]
    rank, doc, start, count = _merge_adjacent(rank, doc, start, count)
    n_tokens = int(count.sum())

    first_row = np.cumsum(count) - count
    cu = np.cumsum(lengths_np) - lengths_np
    # bincount sums in float64: exact below 2**53 tokens.
    per_rank = np.bincount(rank, weights=count, minlength=cp_size).astype(np.int64)
    seg = np.bincount(rank * n_docs + doc, weights=count, minlength=cp_size * n_docs
                      ).astype(np.int64).reshape(cp_size, n_docs)
    local_cu = np.zeros((cp_size, n_docs + 1), dtype=np.int32)
    np.cumsum(seg, 1, out=local_cu[:, 1:])
    rank_offsets = np.zeros(cp_size + 1, dtype=np.int64)
    np.cumsum(per_rank, out=rank_offsets[1:])
    # Real part of each piece (``te`` pads at a document's end, so padding trails a piece).
    real_len = np.maximum(np.minimum(start + count, lengths_np[doc]) - start, 0)
    keep = real_len > 0
    runs = RunTable(rank[keep], doc[keep], start[keep], real_len[keep],
                    (first_row - rank_offsets[rank])[keep])
    if np.array_equal(padded_np, lengths_np):   # no padding (every layout but te)
        token_index = _ramp(cu[doc] + start, first_row, count, n_tokens, np.int64)
        position = _ramp(start, first_row, count, n_tokens, np.int32)
        padded_index = token_index
    else:
        # position (padded) of every token: its piece's start + its offset in the piece
        padded_pos = _ramp(start, first_row, count, n_tokens, np.int64)
        real = padded_pos < np.repeat(lengths_np[doc], count)
        cu_padded = np.cumsum(padded_np) - padded_np
        token_index = np.where(real, np.repeat(cu[doc], count) + padded_pos, -1)
        padded_index = _ramp(cu_padded[doc] + start, first_row, count, n_tokens, np.int64)
        position = np.where(real, padded_pos, -1).astype(np.int32)
    return TokenTables(
        rank_offsets=rank_offsets,
        token_index=token_index,
        padded_index=padded_index,
        position=position,
        local_cu=local_cu,
        runs=runs,
        piece_doc=doc,
        piece_count=count,
    )
