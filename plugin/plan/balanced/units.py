"""Units: pairs of tiles, the pieces a list orders and a cut splits. A fold is an item's
order of tiles (mirrored, chunk pairs or position order, see items.py); places 2u and 2u+1
of it form unit u. Each unit carries its exact tokens and work per mask (closed forms), and
the same up to its break point, so that the work of any first o tokens of a unit can be
interpolated (unit_list.py) and a cut inside it turned back into position runs
(:func:`unit_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runs import prefix_pairs
from .items import CHUNK_PAIRS, POSITION_ORDER, REVERSED, Items
from .profile import Profile


@dataclass
class Units:
    """Pairs of tiles: places 2u and 2u+1 of an item's fold (tile a, then tile b, which
    may be missing: b_len 0). A cut inside a unit takes tokens from the start of a and the
    end of b alternately (see :func:`unit_runs`), so a unit's work grows about linearly with
    the tokens taken, and a unit is the smallest piece that keeps an item's work per token.
    All numpy, int64 [n] unless noted.
    """

    doc: np.ndarray
    item: np.ndarray
    ufold: np.ndarray  # place of the unit in its item's fold
    a_start: np.ndarray
    a_len: np.ndarray
    b_start: np.ndarray
    b_len: np.ndarray
    vec: np.ndarray  # [n, 1+M] float64: tokens, work per mask
    mid: np.ndarray  # [n, 1+M]: the same for the unit's first 2*min(a_len, b_len) tokens
    body: np.ndarray  # bool: the unit belongs to a body (phase 1)
    block: np.ndarray  # int64: its item's block class (TAIL_BLOCK / REMAINDER / 0)


def mirror_index(j: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Place of tile j among m in the order 0, m-1, 1, m-2, ..."""
    return np.where(j < (m + 1) // 2, 2 * j, 2 * (m - 1 - j) + 1)


def chunk_fold(pos: np.ndarray, head: np.ndarray, doc_len: np.ndarray, chunk: int,
               tile: int) -> np.ndarray:
    """Place in the body's fold of the body tile at ``pos``.

    A body of n full chunks and a partial chunk of r tokens starts at the head length
    h = C - ceil(r/tile)*tile: segment 0 is [h, C) (r > 0) or chunk 0 (r = 0), segments
    1.. are the chunks. Segment i is paired with segment K-i and the pair is walked tile i
    of the first with the mirror tile of the second (tile a of segment i with tile m-1-a
    of segment K-i; the middle segment with itself): every pair of tiles then has the same
    position sum (causal work) and the same sum of positions inside their chunks (chunked
    work), whatever the pair, so any run of the fold holds the body's per-token work under
    both masks; pairs go outside in, so a rank's run is two position runs per document.
    """
    n = doc_len // chunk
    r = doc_len - n * chunk
    K = np.where(r > 0, n, n - 1)
    seg = np.where(pos < chunk, 0, pos // chunk)
    seg_start = np.where(seg == 0, head, seg * chunk)
    j = (pos - seg_start) // tile
    ct = chunk // tile
    t0 = (chunk - head) // tile
    m = np.where((seg == 0) | ((seg == K) & (r > 0)), t0, ct)
    i = np.minimum(seg, K - seg)
    base = np.where(i == 0, 0, 2 * t0 + 2 * (i - 1) * ct)
    first = seg < K - seg
    middle = seg == K - seg
    local = np.where(middle, mirror_index(j, m), np.where(first, 2 * j, 2 * (m - 1 - j) + 1))
    return base + local


def units_of(items: Items, lengths_np: np.ndarray, prof: Profile) -> Units:
    """The units of ``items`` in item order, each item's units in fold order, for
    documents of ``lengths_np`` tokens (int64): ~40 ops on arrays of a few to 2K tiles."""
    t = prof.tile
    i_start, i_end, i_doc, i_kind = items.start, items.end, items.doc, items.kind
    # Tiles are aligned to the document start (items start tile-aligned, except chunks of
    # a chunk size that is no multiple of the tile).
    first_tile = i_start // t
    n = (i_end + t - 1) // t - first_tile
    item = np.repeat(np.arange(n.size, dtype=np.int64), n)
    total = item.size
    off = n.cumsum() - n
    j = np.arange(total, dtype=np.int64) - off[item]
    start = np.maximum((first_tile[item] + j) * t, i_start[item])
    stop = np.minimum((first_tile[item] + j + 1) * t, i_end[item])
    doc_len = lengths_np[i_doc[item]]
    fold = mirror_index(j, n[item])
    kind = i_kind[item]
    if prof.head == "chunk":
        sel = np.flatnonzero(kind == CHUNK_PAIRS)
        if sel.size:
            fold[sel] = chunk_fold(start[sel], i_start[item[sel]], doc_len[sel],
                                       prof.chunk, t)
    fold = np.where(kind == POSITION_ORDER, j, np.where(kind == REVERSED, n[item] - 1 - j,
                                                        fold))
    nu = (n + 1) // 2
    uoff = nu.cumsum() - nu
    unit = uoff[item] + fold // 2
    n_units = int(nu.sum())
    side_a = fold % 2 == 0
    a, b = np.flatnonzero(side_a), np.flatnonzero(~side_a)
    u_item = np.zeros(n_units, dtype=np.int64)
    u_item[unit[a]] = item[a]
    a_start = np.zeros(n_units, dtype=np.int64)
    a_start[unit[a]] = start[a]
    a_len = np.zeros(n_units, dtype=np.int64)
    a_len[unit[a]] = stop[a] - start[a]
    b_start = a_start.copy()
    b_start[unit[b]] = start[b]
    b_len = np.zeros(n_units, dtype=np.int64)
    b_len[unit[b]] = stop[b] - start[b]
    # Up to its first 2*min(a_len, b_len) tokens a unit alternates a's first and b's last
    # tokens: about linear; after that it takes the rest of the longer tile: about linear
    # again. The work at that break point makes the interpolation inside a unit accurate.
    m = np.minimum(a_len, b_len)
    u_doc = i_doc[u_item]
    # One closed-form call per mask: the whole unit (both tiles) and its first 2m tokens.
    a_end, b_end = a_start + a_len, b_start + b_len
    ends = np.concatenate([a_end, a_start, b_end, b_start, a_start + m, b_end - m]
                          ).reshape(6, n_units)
    lens = lengths_np[u_doc]  # broadcast against the 6 rows (elementwise integer math)
    u_vec = np.empty((n_units, 1 + len(prof.masks)), dtype=np.float64)
    mid = np.empty_like(u_vec)
    u_vec[:, 0] = a_len + b_len
    mid[:, 0] = 2 * m
    for k, mask in enumerate(prof.masks):
        w = prefix_pairs(lens, ends, mask)  # [6, n_units]
        u_vec[:, 1 + k] = w[0] - w[1] + w[2] - w[3]
        mid[:, 1 + k] = w[4] - w[1] + w[2] - w[5]
    return Units(u_doc, u_item, np.arange(n_units, dtype=np.int64) - uoff[u_item],
                 a_start, a_len, b_start, b_len, u_vec, mid, items.body[u_item],
                 items.block[u_item])


def unit_runs(u: Units, unit: np.ndarray, o1: np.ndarray, o2: np.ndarray
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Position runs (start, length) of the tokens [o1, o2) of units ``unit`` in the
    unit's own order: first a[0], b[-1], a[1], b[-2], ... while both tiles last (2m tokens,
    m = min of their lengths), then the rest R of the longer tile mirrored (R[0], R[-1],
    R[1], ...). Both stretches keep the work per token about constant, so the work of any
    first o tokens is close to linear in o on each; four runs, some empty."""
    a_start, b_start = u.a_start[unit], u.b_start[unit]
    la, lb = u.a_len[unit], u.b_len[unit]
    m = np.minimum(la, lb)
    r = np.abs(la - lb)
    r_start = np.where(la >= lb, a_start + m, b_start)

    def taken(o: np.ndarray) -> tuple[np.ndarray, ...]:
        p = np.minimum(o, 2 * m)
        q = o - p
        return (p + 1) // 2, p // 2, (q + 1) // 2, q // 2

    n1, n2 = taken(o1), taken(o2)
    return [(a_start + n1[0], n2[0] - n1[0]),
            (b_start + lb - n2[1], n2[1] - n1[1]),
            (r_start + n1[2], n2[2] - n1[2]),
            (r_start + r - n2[3], n2[3] - n1[3])]
