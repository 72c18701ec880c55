"""Units: pairs of tiles, the pieces a list orders and a cut splits. A fold is an item's
order of tiles (mirrored, chunk pairs or position order, see items.py); places 2u and 2u+1
of it form unit u. Each unit carries its exact tokens and work per mask (closed forms), and
the same up to its break point, so that the work of any first o tokens of a unit can be
interpolated (unit_list.py) and a cut inside it turned back into position runs
(:func:`unit_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import prefix_work
from .items import CHUNK_PAIRS, POSITION_ORDER, Items
from .profile import Profile


def mirror_index(j: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Place of tile j among m in the order 0, m-1, 1, m-2, ..."""
    return torch.where(j < (m + 1) // 2, 2 * j, 2 * (m - 1 - j) + 1)


def chunk_fold(pos: torch.Tensor, head: torch.Tensor, doc_len: torch.Tensor, chunk: int,
               tile: int) -> torch.Tensor:
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
    K = torch.where(r > 0, n, n - 1)
    seg = torch.where(pos < chunk, 0, pos // chunk)
    seg_start = torch.where(seg == 0, head, seg * chunk)
    j = (pos - seg_start) // tile
    ct = chunk // tile
    t0 = (chunk - head) // tile  # tiles of segment 0 and of segment K when r > 0
    m = torch.where((seg == 0) | ((seg == K) & (r > 0)), t0, ct)
    i = torch.minimum(seg, K - seg)
    base = torch.where(i == 0, 0, 2 * t0 + 2 * (i - 1) * ct)
    first = seg < K - seg
    middle = seg == K - seg
    local = torch.where(middle, mirror_index(j, m), torch.where(first, 2 * j, 2 * (m - 1 - j) + 1))
    return base + local


@dataclass
class Units:
    """Pairs of tiles: places 2u and 2u+1 of an item's fold (tile a, then tile b, which
    may be missing: b_len 0). A cut inside a unit takes tokens from the start of a and the
    end of b alternately (see :func:`unit_runs`), so a unit's work grows about linearly with
    the tokens taken, and a unit is the smallest piece that keeps an item's work per token.
    """

    doc: torch.Tensor
    item: torch.Tensor
    ufold: torch.Tensor  # place of the unit in its item's fold
    a_start: torch.Tensor
    a_len: torch.Tensor
    b_start: torch.Tensor
    b_len: torch.Tensor
    vec: torch.Tensor  # [n, 1+M] float64: tokens, work per mask
    mid: torch.Tensor  # [n, 1+M]: the same for the unit's first 2*min(a_len, b_len) tokens
    body: torch.Tensor  # bool: the unit belongs to a body (phase 1)
    block: torch.Tensor  # int64: its item's block class (TAIL_BLOCK / REMAINDER / 0)


def units_of(items: Items, lengths: torch.Tensor, prof: Profile) -> Units:
    """The units of ``items`` in item order, each item's units in fold order."""
    t = prof.tile
    # Tiles are aligned to the document start (items start tile-aligned, except chunks of
    # a chunk size that is no multiple of the tile).
    first_tile = items.start // t
    n = (items.end + t - 1) // t - first_tile
    total = int(n.sum())
    item = torch.repeat_interleave(torch.arange(n.numel()), n, output_size=total)
    off = torch.cumsum(n, 0) - n
    j = torch.arange(total) - off[item]
    start = torch.maximum((first_tile[item] + j) * t, items.start[item])
    stop = torch.minimum((first_tile[item] + j + 1) * t, items.end[item])
    doc = items.doc[item]
    doc_len = lengths[doc]
    fold = mirror_index(j, n[item])
    if prof.head == "chunk":
        sel = torch.nonzero(items.kind[item] == CHUNK_PAIRS).flatten()
        if sel.numel():
            fold[sel] = chunk_fold(start[sel], items.start[item[sel]], doc_len[sel],
                                    prof.chunk, t)
    fold = torch.where(items.kind[item] == POSITION_ORDER, j, fold)
    nu = (n + 1) // 2
    uoff = torch.cumsum(nu, 0) - nu
    unit = uoff[item] + fold // 2
    n_units = int(nu.sum())
    side_a = fold % 2 == 0
    a, b = torch.nonzero(side_a).flatten(), torch.nonzero(~side_a).flatten()
    u_item = torch.zeros(n_units, dtype=torch.int64)
    u_item[unit[a]] = item[a]
    a_start = torch.zeros(n_units, dtype=torch.int64)
    a_start[unit[a]] = start[a]
    a_len = torch.zeros(n_units, dtype=torch.int64)
    a_len[unit[a]] = stop[a] - start[a]
    b_start = a_start.clone()
    b_start[unit[b]] = start[b]
    b_len = torch.zeros(n_units, dtype=torch.int64)
    b_len[unit[b]] = stop[b] - start[b]
    # Up to its first 2*min(a_len, b_len) tokens a unit alternates a's first and b's last
    # tokens: about linear; after that it takes the rest of the longer tile: about linear
    # again. The work at that break point makes the interpolation inside a unit accurate.
    m = torch.minimum(a_len, b_len)
    u_doc = items.doc[u_item]
    # One closed-form call per mask: the whole unit (both tiles) and its first 2m tokens.
    a_end, b_end = a_start + a_len, b_start + b_len
    ends = torch.cat([a_end, a_start, b_end, b_start, a_start + m, b_end - m])
    lens = lengths[u_doc].repeat(6)
    u_vec = torch.empty(n_units, 1 + len(prof.masks), dtype=torch.float64)
    mid = torch.empty_like(u_vec)
    u_vec[:, 0] = (a_len + b_len).to(torch.float64)
    mid[:, 0] = (2 * m).to(torch.float64)
    for k, mask in enumerate(prof.masks):
        w = prefix_work(lens, ends, mask).view(6, n_units)
        u_vec[:, 1 + k] = (w[0] - w[1] + w[2] - w[3]).to(torch.float64)
        mid[:, 1 + k] = (w[4] - w[1] + w[2] - w[5]).to(torch.float64)
    return Units(u_doc, u_item, torch.arange(n_units) - uoff[u_item], a_start, a_len,
                  b_start, b_len, u_vec, mid, items.body[u_item], items.block[u_item])


def unit_runs(u: Units, unit: torch.Tensor, o1: torch.Tensor, o2: torch.Tensor
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Position runs (start, length) of the tokens [o1, o2) of units ``unit`` in the
    unit's own order: first a[0], b[-1], a[1], b[-2], ... while both tiles last (2m tokens,
    m = min of their lengths), then the rest R of the longer tile mirrored (R[0], R[-1],
    R[1], ...). Both stretches keep the work per token about constant, so the work of any
    first o tokens is close to linear in o on each; four runs, some empty."""
    la, lb = u.a_len[unit], u.b_len[unit]
    m = torch.minimum(la, lb)
    r = (la - lb).abs()
    r_start = torch.where(la >= lb, u.a_start[unit] + m, u.b_start[unit])

    def taken(o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = torch.minimum(o, 2 * m)
        q = o - p
        return (p + 1) // 2, p // 2, (q + 1) // 2, q // 2

    n1, n2 = taken(o1), taken(o2)
    return [(u.a_start[unit] + n1[0], n2[0] - n1[0]),
            (u.b_start[unit] + lb - n2[1], n2[1] - n1[1]),
            (r_start + n1[2], n2[2] - n1[2]),
            (r_start + r - n2[3], n2[3] - n1[3])]
