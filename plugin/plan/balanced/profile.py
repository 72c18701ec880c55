"""What a mask set implies for the layout: which documents are short (their work is the same
function of length under every mask), how a long one is cut into a head and a body, and the
excess functionals that measure what short documents cannot balance.

With M distinct masks, the work of a short segment of L tokens under mask m is
``coef[m, 0] * L + coef[m, 1] * L^2``: L(L+1)/2 when the mask looks only left within it
(causal-like), L^2 when it sees the whole segment (full-like). Tokens and ONE work column
then fix every mask's work on short segments, and the M - 1 excess rows (functionals of
(tokens, work per mask) that vanish on every short segment) are what only long bodies can
balance. Llama 4 (chunked 8192 : causal): excess = causal work - chunked work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...masks import AttnMask
from .args import MaskWeights

INF = 1 << 40  # "no window or chunk": longer than any document (positions < 2**30)


def locality(mask: AttnMask, with_chunk: bool = True) -> tuple[int, bool]:
    """(longest document in which every query sees every earlier key (causal-like) or
    every key (full-like) of it, whether the mask looks only left (k <= p))."""
    causal, wl, wr, chunk = mask.params
    left = causal or wr == 0
    if left:
        w = wl + 1 if wl >= 0 else INF
    else:
        sides = [x + 1 for x in (wl, wr) if x >= 0]
        w = min(sides) if sides else INF
    return min(chunk if (chunk and with_chunk) else INF, w), left


@dataclass(frozen=True, eq=False)
class Profile:
    """What the mask set implies for the layout (see the module docstring).

    masks / weights: the distinct masks (duplicates merged, weights summed).
    theta:    segments of at most theta tokens are "short": each mask's work on a whole
              short segment is L(L+1)/2 (causal-like) or L^2 (full-like).
    split:    chunk size when every mask is chunked with it (chunks are then independent
              segments), else 0.
    head:     "chunk" (bodies folded by chunk pairs), "prefix" (bodies folded after a
              short-like head), "ends" (a window looks right: head, middle and tail
              items), "none" (no windows or chunks).
    chunk / prefix / suffix: the chunk size of "chunk", the head length of "prefix" and
              "ends", the right window of "ends" (its tail starts on the tile grid at or
              before L - suffix).
    coef:     [M, 2] work of a short segment = coef[m, 0] * L + coef[m, 1] * L^2.
    excess:   [E, 1+M] functionals of (tokens, work per mask) that vanish on short segments
              (E = M - 1): what short documents cannot balance.

    Compared and hashed by identity (``eq=False``: its fields hold arrays); profiles are
    cached per (masks, tile) and never modified.
    """

    masks: tuple[AttnMask, ...]
    weights: tuple[float, ...]
    tile: int
    theta: int
    split: int
    head: str
    chunk: int
    prefix: int
    suffix: int
    coef: np.ndarray
    excess: np.ndarray


def profile_of(masks: MaskWeights, tile: int) -> Profile:
    """The :class:`Profile` of ``masks`` (layer counts summed over equal masks) for tiles of
    ``tile`` tokens."""
    merged: dict[AttnMask, float] = {}
    for m, w in masks:
        merged[m] = merged.get(m, 0.0) + w
    ms, ws = tuple(merged), tuple(merged.values())
    chunks = {m.chunk_size or 0 for m in ms}
    split = chunks.pop() if len(chunks) == 1 else 0
    loc = [locality(m, with_chunk=not split) for m in ms]
    theta = min(t for t, _ in loc)
    left = all(lf for _, lf in loc)
    head, chunk, prefix, suffix = "none", 0, 0, 0
    if theta < INF and not left:
        # Windows that look right: the ends of a long document (where a window is clipped)
        # become items of their own, so that the middle is uniform.
        wl = max([m.window_size[0] for m in ms if m.window_size[0] >= 0] or [0])
        wr = max([m.window_size[1] for m in ms if m.window_size[1] >= 0 and not m.causal]
                 or [0])
        head, prefix, suffix = "ends", -(-wl // tile) * tile, wr
    elif theta < INF and left:
        windows = any(m.window_size[0] >= 0 for m in ms)
        c = {m.chunk_size for m in ms if m.chunk_size}
        if not split and not windows and len(c) == 1 and next(iter(c)) % tile == 0:
            head, chunk = "chunk", next(iter(c))
        else:
            head, prefix = "prefix", theta // tile * tile
    coef = np.array([[0.5, 0.5] if lf else [0.0, 1.0] for _, lf in loc], dtype=np.float64)
    # Annihilator of span{(1, coef[:, 0]), (0, coef[:, 1])} relative to mask 0.
    rows = []
    for m in range(1, len(ms)):
        r = np.zeros(1 + len(ms), dtype=np.float64)
        ratio = coef[m, 1] / coef[0, 1]
        r[1 + m], r[1] = 1.0, -ratio
        r[0] = ratio * coef[0, 0] - coef[m, 0]
        rows.append(r)
    excess = np.stack(rows) if rows else np.zeros((0, 1 + len(ms)), dtype=np.float64)
    coef.setflags(write=False)
    excess.setflags(write=False)
    return Profile(ms, ws, tile, theta, split, head, chunk, prefix, suffix, coef, excess)


# excess_functional's last results by (profile, total's bytes): a batch asks for it ~4
# times with the same total (the documents' and the units' sums of integer counts are
# equal to the bit: integers below 2**53 sum exactly in float64, in any order).
_FUNCTIONALS: dict[tuple[int, bytes], tuple[Profile, np.ndarray]] = {}


def excess_functional(prof: Profile, total: np.ndarray) -> np.ndarray:
    """The excess functional [1+M] (float64) the bodies are cut by: the excess rows
    oriented so that their totals ``excess @ total`` are >= 0 and scaled to equal totals,
    summed (M - 1 = 1: the row). Memoized on (prof, total) and read-only: callers share
    it."""
    key = (id(prof), np.ascontiguousarray(total, dtype=np.float64).tobytes())
    hit = _FUNCTIONALS.get(key)
    if hit is not None and hit[0] is prof:
        return hit[1]
    phi = _excess_functional(prof, total)
    phi.setflags(write=False)
    if len(_FUNCTIONALS) >= 16:
        _FUNCTIONALS.clear()
    _FUNCTIONALS[key] = (prof, phi)  # holds prof: its id stays unique while cached
    return phi


def _excess_functional(prof: Profile, total: np.ndarray) -> np.ndarray:
    tot_ex = prof.excess @ total
    sign = np.where(tot_ex < 0, -1.0, 1.0)
    scale = np.abs(tot_ex).max() / np.maximum(np.abs(tot_ex), 1e-300)
    return (prof.excess * (sign * scale)[:, None]).sum(0)
