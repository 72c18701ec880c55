"""The ``balanced`` layout: tokens AND the work of EACH of the model's masks equal on every
rank, and documents cut where the cut costs the ranks little K/V to fetch.

Every layer type waits for its own slowest rank, so a Llama 4 model (chunked 8192 x3 :
global causal x1) or a Gemma-style one (window (4096, 0) x5 : causal x1) needs every mask
balanced by one token layout, not a weighted sum. Targets: each mask's work (visible
query-key pairs of a rank's queries) within 3% of its mean over ranks, tokens within 2%,
no padding. Layer counts (the masks' weights) only set priorities: a snap error goes to
the masks of fewer layers first. Host (CPU) tensors, vectorized, deterministic.

Communication: a rank holding part of a document fetches the keys its queries see and it
does not hold: for a causal layer everything before its first position (minus what it
holds of it), for a window one window, for chunked attention its chunk's prefix. At 8K
tokens per GPU across nodes one fetched key costs as much as ~1270 visible pairs, so a
rank affords a few such fetches (bench/plan.py's model: a heavy-tailed mix at cp 64
affords ~27K causal keys a rank, the longest document is 25.8K). So the layout keeps what a
rank holds of a document in few contiguous stretches (a stretch [a, b) costs a), gives
long bodies to ranks in whole shares, and cuts filler items near their start.

How (M distinct masks):
1. Short segments are filler. A document of at most ``theta`` tokens (the shortest window
   or chunk; unbounded for causal and full) costs L(L+1)/2 (causal-like) or L^2
   (full-like) under every mask, so tokens and ONE work column balance every mask on
   filler. The M-1 "excess" functionals of (tokens, work per mask) that vanish on short
   documents (Llama 4: causal - chunked work) measure what filler cannot balance.
2. A long document becomes a short-like head (filler) and a body (carries the excess).
   Long documents whose excess is negligible (< 0.75% of a rank's mean work) stay filler.
3. Units are two tiles (64 tokens, on the document's grid) at places 2u, 2u+1 of an
   item's order; a cut inside a unit takes a's first and b's last tokens alternately
   (the work of the first o tokens is about linear in o, the break point exact). An item's
   order is mirrored (tiles 0, n-1, 1, ...: every stretch has the item's work per token),
   chunk pairs (below), or position order (a cut gives the earlier rank a prefix, which
   costs it nothing, and the later rank the rest, which costs it the prefix: one fetch
   where a mirrored cut costs two).
4. Phase 1 cuts the bodies so that every rank gets 1/cp of the excess; phase 2 cuts the
   filler, as a dense and a sparse list (items denser than the filler's mean in the
   least-work mask vs the others), to per-rank targets: tokens and that mask, minus what
   phase 1 gave. Both lists are in an order that spreads densities evenly (8 equal-token
   density groups merged by phase).
5. Attempts, in order; the first that meets the targets is taken:
   a. everything filler (one mask, or no body): filler items in position order, the
      dense / sparse pair solved rank by rank (``_rank_cut``: rank k's cuts are a root of
      its own (tokens, work) in the lists' next stretches, regula falsi on the
      piecewise linear sums, its error carried to rank k+1; monotone whatever the local
      densities, which in position order range from an item's sparse start to its dense
      end, where the global k-ary search of the fold variants fails); then the same with
      two density classes a side, each rank taking the pair of lists that brackets its
      target by >= 10%, furthest behind schedule and cheapest to start on (``_MARGIN``,
      ``_OFFSET_W``). Skipped when an item longer than a rank's share is much sparser
      over its first share than the mean (a rank starting on it could not reach its
      work: one long document, or long documents at 2-4K tokens per rank).
   b. chunked + causal (Llama 4): the head is the whole first chunk; the body [C, L) runs
      in position order, split at p (off the tile grid, a k-ary search on the closed
      forms) into a tail block [p, L) of n whole rank shares of excess and a remainder
      [C, p). The body list is the remainders (largest, smallest, second largest, ...:
      about two a rank, each a chunk of causal keys to fetch) then the tail blocks
      (longest document first), cut by excess with targets on the blocks' boundaries: a
      tail rank holds ONE contiguous piece of one document. Filler: the two-class solver,
      items of more than 2 ranks' work mirrored.
   c. window + causal (Gemma): each body split on the tile grid where a token's excess
      reaches the bodies' mean (late parts of less than half a rank's excess stay
      early); late and early parts, in position order and document order, cut rank by
      rank to equal tokens and excess; filler as in a.
   d. the fold variants, always feasible when anything is: bodies folded (chunked +
      causal: head [0, C - ceil(r/64)*64), body walked by chunk pairs (i, K-i), tile a of
      one with the mirror tile of the other: equal causal and chunked work per unit;
      windows: head [0, W), body mirrored; right-looking windows: head, middle and tail
      items, each mirrored), as one list spread by excess per token (an exact 1-D cut),
      then as a dense / sparse pair cut to equal tokens and excess, then with every long
      segment split; filler mirrored, the exact dense / sparse cut by a k-ary search,
      cuts that go backwards made monotone and their error diffused to the neighbours.
   Locality variants (a-c) run only when every mask looks left (a filler prefix is then
   causal-like under all of them) or there is one mask.
6. Snapping (fold variants): every cut moves to the cheapest nearby boundary - an item,
   then a unit boundary, else a finer cut - within budgets (tokens 0.9% of T/cp; excess
   0.5%, each mask 0.6% of its mean work). The rank-by-rank cuts are exact and not
   snapped: at most two finer cuts per rank boundary and list in use (+ one per body
   split), <= 8 (cp - 1) in all.
7. Runs are maximal: one per rank, document and stretch of consecutive positions (the
   plan's tables scale with them).

Measured (bench/plan.py; 128K-token mixes of bench/balance.py: 1000 log-normal documents,
a heavy tail, TE-style 24K-32K buckets, one 128K document, 5000 short ones, a few long
among 3000 short; cp 8..128): every mask of causal, SWA 4096, chunked 8192, Llama 4 3:1
and SWA 5:1 within 1.023 of its mean, tokens within 1.017. Simulated per-layer efficiency
at 8K tokens per GPU (bench/plan.py's model, cp 8/16/32/64, layer-weighted; before this
layout's locality variants in brackets): heavy tail causal .98/1.0/.98/.98 (.99/.98/.84/
.83), Llama 4 1.0/.95/.93/.92 (1.0/.72/.68/.49), SWA 5:1 1.0/.78/.73/.70 (.99/.60/.52/.59);
a few long among short: causal .99/.96/.63/.33 (bound .86/.43 at cp 32/64; was .58/.26),
SWA 5:1 1.0/.81/.43/.24 (.58/.32/.22), Llama 4 .99/.56/.36/.25 (unchanged); 1000
log-normal documents .46/.38/.30 at cp 16..64 (bound 1.0/.74/.56; was .47/.37/.28), SWA
5:1 .46/.20/.16; TE buckets, one long document, short documents .85-1.0 (Llama 4 on TE
buckets .91/.88/.85: fold variant). Host time (bench/plan.py: thread CPU, median, one
core of a shared 2-core machine) at cp 64, 128K tokens: 1000 documents 3.6-4.2 ms (SWA
5:1 6.3 ms: a window body split and two rank-by-rank solves; the fold-only layout took
4.9-6.9 ms measured the same way); the heavy tail 4.1-4.5 ms, Llama 4 12.4 and SWA 5:1
13.1 ms (fold-only 10.6 / 10.5: at 2K tokens per rank the locality variants fail their
checks or their solve, then the fold variants' fallbacks run). Runs: 670 for Llama 4 on
the heavy tail at cp 64 and 8K tokens per rank (was 8315).

Limits: exact balance rests on the folds and splits above; mask sets they do not fit are
balanced as far as the filler allows (worst max/mean measured on the mixes above, cp
2..128): chunked attention with a window inside chunks plus global causal layers 1.11 at
cp 64-128 (<= 1.03 up to cp 32, except TE buckets: 1.05); a full or chunked non-causal
mask with a causal one 1.31 at cp 64-128; a bidirectional window alone 1.10 at cp 64-128
on the heavy tail, with a causal mask 1.26; three distinct masks, or two local masks of
different kinds (SWA + chunked): 1.3-1.8. Efficiency >= 0.9 is not reached (bench/plan.py)
where one document holds many ranks' work at 8K tokens per rank (a few long among
short, 1000 log-normal at cp >= 32: the bound is below 0.9 or close to it; the rank
holding a long document's end fetches most of it); with a window and causal layers on a
heavy tail beyond cp 8 (0.70-0.78: a rank holds late parts of 1-2 bodies, early parts of
1-2, and 2 filler cuts, each a window; bodies with excess near the body start need
pairing with late parts of other documents); chunked + causal on TE buckets and a few
long among short (tail blocks need more tokens than a rank has, the fold variant is
used: a rank holds chunk pairs of 2-4 documents).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..masks import AttnMask
from .runs import prefix_pairs

DEFAULT_TILE_TOKENS = 64  # the Triton kernels' query block (kernels/triton_common.py)
DEFAULT_CHUNK_TOKENS = DEFAULT_TILE_TOKENS  # the old name of the same parameter
_INF = 1 << 40

# Targets (max / mean over ranks) and the share of them one rank boundary may use: a rank's
# error is the difference of its two boundaries' errors.
TOKEN_TOL = 0.02
WORK_TOL = 0.03
_TOKEN_BUDGET = 0.009  # of T / cp
_EXCESS_BUDGET = 0.005  # of a mask's mean work per rank (phase 1, long bodies)
_FILL_BUDGET = 0.006  # of a mask's mean work per rank (phase 2, filler)
_KEEP_EXCESS = 0.0075  # long segments with less excess work than this stay filler
# Probes per round of the k-ary search of the pair cuts (32: 2-3 rounds for 128K tokens).
_PROBES = 32
# Cost of a cut, by where it falls: an item (document, head, body) boundary, a unit (tile
# pair) boundary inside a folded item, inside a unit (a "finer" cut, off the tile grid).
_COST = (0, 1, 4)
# Rank-by-rank solver: a list pair must bracket a rank's target by this share of it before
# the pair is chosen by schedule rather than by margin (0.02-0.1 measured alike).
_MARGIN = 0.1
# ... and a pair's cost: the rest of the cut items the rank starts on (a fetch for it),
# weighed against the schedule (relative to the rank's tokens). 0.5-2 measured alike.
_OFFSET_W = 2.0
# Window bodies: a late part with less excess than this share of a rank's stays with the
# early part (a rank would otherwise collect slivers of several documents' ends).
_MINLATE = 0.5
# Rank-by-rank solver tolerance (of a rank's share): its error goes to the next rank's
# target, so it does not add up; the snap budgets are 6x larger.
_SOLVE_TOL = 1e-3
# An item in position order longer than a rank's filler share is only tried when its first
# share of tokens holds at least this share of the mean target density (see _rank_reachable).
_PREFIX_DENSITY = 0.75

MaskWeights = tuple[tuple[AttnMask, float], ...]


# ---- arguments ----------------------------------------------------------------------------
def normalize_masks(masks: Any) -> MaskWeights:
    """``((AttnMask, weight), ...)`` from None (causal), an AttnMask, or a sequence of
    AttnMask / (AttnMask, weight) entries; ValueError naming ``masks`` otherwise. Weights
    are layer counts (any positive numbers): they break ties and set priorities, every
    mask is balanced on its own."""
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


def check_tile_tokens(tile_tokens: Any, name: str = "tile_tokens") -> int:
    """The resolved tile size; ValueError naming ``name`` unless an int >= 1."""
    if tile_tokens is None:
        return DEFAULT_TILE_TOKENS
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"{name} must be an int >= 1, got {tile_tokens!r}")
    return tile_tokens


def check_chunk_tokens(chunk_tokens: Any) -> int:
    """Old name of :func:`check_tile_tokens` (``chunk_tokens`` is the tile size)."""
    return check_tile_tokens(chunk_tokens, "chunk_tokens")


# ---- exact work from the mask intervals ---------------------------------------------------
def prefix_work(doc_len: torch.Tensor, stop: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens (all keys of the document) under ``mask``; elementwise, 0 <= stop <=
    doc_len. Closed form per mask, checked against a dense count in the tests."""
    return prefix_pairs(doc_len, stop, mask)


# ---- how the masks shape the problem ------------------------------------------------------
def _locality(mask: AttnMask, with_chunk: bool = True) -> tuple[int, bool]:
    """(longest document in which every query sees every earlier key (causal-like) or
    every key (full-like) of it, whether the mask looks only left (k <= p))."""
    causal, wl, wr, chunk = mask.params
    left = causal or wr == 0
    if left:
        w = wl + 1 if wl >= 0 else _INF
    else:
        sides = [x + 1 for x in (wl, wr) if x >= 0]
        w = min(sides) if sides else _INF
    return min(chunk if (chunk and with_chunk) else _INF, w), left


@dataclass(frozen=True)
class _Profile:
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
    coef: torch.Tensor
    excess: torch.Tensor


def _profile(masks: MaskWeights, tile: int) -> _Profile:
    merged: dict[AttnMask, float] = {}
    for m, w in masks:
        merged[m] = merged.get(m, 0.0) + w
    ms, ws = tuple(merged), tuple(merged.values())
    chunks = {m.chunk_size or 0 for m in ms}
    split = chunks.pop() if len(chunks) == 1 else 0
    loc = [_locality(m, with_chunk=not split) for m in ms]
    theta = min(t for t, _ in loc)
    left = all(lf for _, lf in loc)
    head, chunk, prefix, suffix = "none", 0, 0, 0
    if theta < _INF and not left:
        # Windows that look right: the ends of a long document (where a window is clipped)
        # become items of their own, so that the middle is uniform.
        wl = max([m.window_size[0] for m in ms if m.window_size[0] >= 0] or [0])
        wr = max([m.window_size[1] for m in ms if m.window_size[1] >= 0 and not m.causal]
                 or [0])
        head, prefix, suffix = "ends", -(-wl // tile) * tile, wr
    elif theta < _INF and left:
        windows = any(m.window_size[0] >= 0 for m in ms)
        c = {m.chunk_size for m in ms if m.chunk_size}
        if not split and not windows and len(c) == 1 and next(iter(c)) % tile == 0:
            head, chunk = "chunk", next(iter(c))
        else:
            head, prefix = "prefix", theta // tile * tile
    coef = torch.tensor([[0.5, 0.5] if lf else [0.0, 1.0] for _, lf in loc],
                        dtype=torch.float64)
    # Annihilator of span{(1, coef[:, 0]), (0, coef[:, 1])} relative to mask 0.
    rows = []
    for m in range(1, len(ms)):
        r = torch.zeros(1 + len(ms), dtype=torch.float64)
        ratio = coef[m, 1] / coef[0, 1]
        r[1 + m], r[1] = 1.0, -ratio
        r[0] = ratio * coef[0, 0] - coef[m, 0]
        rows.append(r)
    excess = torch.stack(rows) if rows else torch.zeros(0, 1 + len(ms), dtype=torch.float64)
    return _Profile(ms, ws, tile, theta, split, head, chunk, prefix, suffix, coef, excess)


# ---- items and tiles ----------------------------------------------------------------------
# Item kinds: a mirrored run of positions [s, e) (tiles 0, n-1, 1, n-2, ...), a long
# document's body [s, e) folded by chunk pairs (see _chunk_fold), or a run in position order
# (a cut gives the earlier rank a prefix and the later one the rest: one fetch, not two).
_MIRROR, _CHUNKS, _PREFIX = 0, 1, 2
# Body item classes of the "blocks" variant: a tail block, a remainder (see _items).
_TAIL, _REST = 1, 2


@dataclass(frozen=True)
class _Variant:
    """How one attempt cuts the documents and solves the lists (see the module docstring).

    body:   "fold" (chunk pairs / mirrored bodies) or "blocks" (bodies in position order,
            split into tail blocks of whole rank shares and remainders).
    pair:   bodies cut as a dense / sparse pair (to equal tokens and excess) instead of one
            list cut by excess.
    keep_small: long segments with negligible excess stay filler.
    fill:   "mirror" or "prefix" (filler items in position order; items holding more than
            ``big`` ranks' work stay mirrored).
    solver: "vector" (the k-ary search over the whole pair), "seq" (rank by rank, one dense
            and one sparse list) or "classes" (rank by rank, two density classes per side).
    """

    body: str = "fold"
    pair: bool = False
    keep_small: bool = True
    fill: str = "mirror"
    big: float = math.inf
    solver: str = "vector"


_LEGACY = (_Variant(), _Variant(pair=True), _Variant(pair=True, keep_small=False))


@dataclass
class _Items:
    doc: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    kind: torch.Tensor  # _MIRROR / _CHUNKS / _PREFIX
    body: torch.Tensor  # bool: carries excess work (phase 1) vs filler (phase 2)
    block: torch.Tensor  # int64: _TAIL / _REST for the bodies of the "blocks" variant, else 0


def _phi(prof: _Profile, total: torch.Tensor) -> torch.Tensor:
    """The excess functional [1+M] the bodies are cut by: the excess rows oriented so
    that their totals are >= 0 and scaled to equal totals, summed (M - 1 = 1: the row)."""
    tot_ex = prof.excess @ total
    sign = torch.where(tot_ex < 0, -1.0, 1.0)
    scale = tot_ex.abs().max() / tot_ex.abs().clamp(min=1e-300)
    return (prof.excess * (sign * scale).unsqueeze(1)).sum(0)


def _segments(lengths: torch.Tensor, prof: _Profile, cp: int, keep_small: bool,
              memo: dict | None = None) -> tuple[torch.Tensor, ...]:
    """(doc, start, end, long) of the non-empty segments: documents, or their chunks when
    every mask is chunked with one size; long: longer than theta and, with keep_small,
    carrying more than negligible excess (see :func:`_items`). ``memo``: per-call cache."""
    if memo is not None and ("seg", keep_small) in memo:
        return memo[("seg", keep_small)]
    out = _segments_of(lengths, prof, cp, keep_small)
    if memo is not None:
        memo[("seg", keep_small)] = out
    return out


def _segments_of(lengths: torch.Tensor, prof: _Profile, cp: int, keep_small: bool
                 ) -> tuple[torch.Tensor, ...]:
    n_docs = lengths.numel()
    doc, start, end = torch.arange(n_docs), torch.zeros_like(lengths), lengths.clone()
    if prof.split:  # independent chunks: each is a segment of its own
        n = (lengths + prof.split - 1) // prof.split
        doc = torch.repeat_interleave(doc, n)
        first = torch.cumsum(n, 0) - n
        start = (torch.arange(doc.numel()) - first[doc]) * prof.split
        end = torch.minimum(start + prof.split, lengths[doc])
    keep = end > start
    doc, start, end = doc[keep], start[keep], end[keep]
    size = end - start
    long = size > prof.theta
    if keep_small and prof.excess.shape[0] and bool(long.any()):
        vec = torch.empty(size.numel(), 1 + len(prof.masks), dtype=torch.float64)
        vec[:, 0] = size.to(torch.float64)
        ends, lens = torch.cat([end, start]), lengths[doc].repeat(2)
        for k, mask in enumerate(prof.masks):
            w = prefix_work(lens, ends, mask).view(2, -1)
            vec[:, 1 + k] = (w[0] - w[1]).to(torch.float64)
        total = vec.sum(0)
        phi = _phi(prof, total)
        tau = _KEEP_EXCESS * float(total[1:].min()) / cp
        long &= (vec @ phi).abs() > tau
    return doc, start, end, long


def _items(lengths: torch.Tensor, prof: _Profile, cp: int, var: _Variant,
           memo: dict | None = None) -> _Items:
    """Cut the documents into filler items (short documents, heads) and bodies.

    ``var.body == "blocks"`` (chunked masks only): the head is the whole first chunk, the
    body [C, L) runs in position order and is split at p into a tail block [p, L) holding
    exactly n whole rank shares of the excess (n = floor of the body's shares; p off the
    tile grid) and a remainder [C, p): the tail block's ranks then hold ONE contiguous
    piece of one document each, and only the remainders (all starting at C, the cheapest
    place to start) share ranks.

    keep_small: long segments whose excess work is negligible (``_KEEP_EXCESS`` of a
    rank's mean work) stay whole filler items, split like any dense filler: spreading their
    body over every rank would fetch a whole window or chunk on each for nothing (one
    4242-token document among 1000 short ones with a 4096 window at cp 16: SWA-layer
    efficiency 0.26 spread, 0.46 as filler)."""
    memo = {} if memo is None else memo
    doc, start, end, long = _segments(lengths, prof, cp, var.keep_small, memo)
    blocks = var.body == "blocks" and prof.head == "chunk"
    h, tail, ends = _heads(prof, blocks, start, end, long)
    has_head = long & (h > 0)
    mid_end = torch.where(ends, tail, end)
    # Filler: short segments and short-like heads; bodies (and the heads and tails of
    # "ends") carry the excess. With one mask (no excess) everything is filler.
    like = prof.head in ("chunk", "prefix")
    f_sel = [(~long, start, end)] + ([(has_head, start, start + h)] if like else [])
    b_sel = [(long, start + h, mid_end)] + ([] if like else [(has_head, start, start + h)])
    b_sel.append((ends, tail, end))
    f_doc = torch.cat([doc[m] for m, _, _ in f_sel])
    f_start = torch.cat([a[m] for m, a, _ in f_sel])
    f_end = torch.cat([b[m] for m, _, b in f_sel])
    b_doc = torch.cat([doc[m] for m, _, _ in b_sel])
    b_start = torch.cat([a[m] for m, a, _ in b_sel])
    b_end = torch.cat([b[m] for m, _, b in b_sel])
    n_f, n_long = f_doc.numel(), int(long.sum())
    b_doc, b_start, b_end, kind, block = _split_bodies(
        lengths, prof, cp, var, blocks, n_long, b_doc, b_start, b_end, memo)
    n_b = b_doc.numel()
    excess = prof.excess.shape[0] > 0
    return _Items(
        doc=torch.cat([f_doc, b_doc]), start=torch.cat([f_start, b_start]),
        end=torch.cat([f_end, b_end]),
        kind=torch.cat([_filler_kinds(lengths, prof, cp, var, f_doc, f_start, f_end, memo),
                        kind]),
        body=torch.cat([torch.zeros(n_f, dtype=torch.bool),
                        torch.full((n_b,), excess, dtype=torch.bool)]),
        block=torch.cat([torch.zeros(n_f, dtype=torch.int64), block]))


def _heads(prof: _Profile, blocks: bool, start: torch.Tensor, end: torch.Tensor,
           long: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head length of each segment (0: none), the start of the "ends" tail item, which
    segments have one) of segments [start, end), ``long`` marking those with a body."""
    size = end - start
    if blocks:
        h = torch.full_like(size, prof.chunk)
    elif prof.head == "chunk":
        r = size % prof.chunk
        t = prof.tile
        h = torch.where(r == 0, 0, prof.chunk - (r + t - 1) // t * t)
    elif prof.head in ("prefix", "ends"):
        h = torch.full_like(size, prof.prefix)
    else:
        h = torch.zeros_like(size)
    t = prof.tile
    tail = torch.div(end - prof.suffix, t, rounding_mode="floor") * t  # "ends" only
    ends = long & (prof.head == "ends") & (start + h < tail) & (prof.suffix > 0)
    h = torch.where(long & ((prof.head != "ends") | (start + h < tail)), h, 0)
    return h, tail, ends


def _split_bodies(lengths: torch.Tensor, prof: _Profile, cp: int, var: _Variant,
                  blocks: bool, n_long: int, b_doc: torch.Tensor, b_start: torch.Tensor,
                  b_end: torch.Tensor, memo: dict) -> tuple[torch.Tensor, ...]:
    """The body items (the first ``n_long`` are the long segments' bodies) with their
    kinds and blocks: for ``blocks`` and ``split`` variants each long body cut at p into a
    remainder [start, p) and a tail block [p, end) (see :func:`_items`); else unchanged,
    mirrored (chunk-pair walked for chunked masks)."""
    n_b = b_doc.numel()
    kind = torch.full((n_b,), _MIRROR)
    block = torch.zeros(n_b, dtype=torch.int64)
    if not ((blocks or var.body == "split") and n_long and prof.excess.shape[0]):
        if prof.head == "chunk":
            kind[:n_long] = _CHUNKS
        return b_doc, b_start, b_end, kind, block
    if blocks:
        p, n_sh = _tail_split(lengths, prof, cp, b_doc[:n_long], b_start[:n_long],
                              b_end[:n_long], memo)
        tail = torch.nonzero(n_sh >= 1).flatten()
    else:
        p = _density_split(lengths, prof, b_doc[:n_long], b_start[:n_long],
                           b_end[:n_long], memo)
        if _MINLATE > 0:
            excess, tot_e = _excess_of(lengths, prof, memo)
            small = excess(p, b_end[:n_long], lengths[b_doc[:n_long]]) < _MINLATE * tot_e / cp
            p = torch.where(small, b_end[:n_long], p)
        tail = torch.nonzero(p < b_end[:n_long]).flatten()
    rest = torch.nonzero(p > b_start[:n_long]).flatten()
    b_doc = torch.cat([b_doc[rest], b_doc[tail], b_doc[n_long:]])
    b_start, b_end = (torch.cat([b_start[rest], p[tail], b_start[n_long:]]),
                      torch.cat([p[rest], b_end[tail], b_end[n_long:]]))
    n_b = b_doc.numel()
    block = torch.cat([torch.full((rest.numel(),), _REST), torch.full((tail.numel(),), _TAIL),
                       torch.zeros(n_b - rest.numel() - tail.numel(), dtype=torch.int64)])
    return b_doc, b_start, b_end, torch.full((n_b,), _PREFIX), block


def _filler_kinds(lengths: torch.Tensor, prof: _Profile, cp: int, var: _Variant,
                  f_doc: torch.Tensor, f_start: torch.Tensor, f_end: torch.Tensor,
                  memo: dict) -> torch.Tensor:
    """How each filler item is walked: in position order (``var.fill == "prefix"``),
    except items holding more than ``var.big`` ranks' work, which stay mirrored: in
    position order such an item's stretches would range from far too sparse (its start)
    to far too dense for the rank-by-rank solver."""
    n_f = f_doc.numel()
    if var.fill != "prefix":
        return torch.full((n_f,), _MIRROR)
    f_kind = torch.full((n_f,), _PREFIX)
    if var.big < math.inf:
        m0 = prof.masks[0]
        fl = lengths[f_doc]
        w = (prefix_work(fl, f_end, m0) - prefix_work(fl, f_start, m0)).to(torch.float64)
        share = float(_doc_work(lengths, prof, memo)[:, 0].sum()) / cp
        f_kind[w > var.big * share] = _MIRROR
    return f_kind


def _excess_of(lengths: torch.Tensor, prof: _Profile, memo: dict) -> tuple[Any, float]:
    """(excess(a, b, doc_len): the excess functional over positions [a, b) of documents of
    doc_len tokens, its total over all documents)."""
    if "excess" not in memo:
        memo["excess"] = _excess_fn(lengths, prof, memo)
    return memo["excess"]


def _doc_work(lengths: torch.Tensor, prof: _Profile, memo: dict) -> torch.Tensor:
    """[n_docs, M] float64: each document's work under each mask (memoized per call)."""
    if "docw" not in memo:
        memo["docw"] = torch.stack([prefix_work(lengths, lengths, m).to(torch.float64)
                                    for m in prof.masks], 1)
    return memo["docw"]


def _excess_fn(lengths: torch.Tensor, prof: _Profile, memo: dict) -> tuple[Any, float]:
    vec = torch.empty(lengths.numel(), 1 + len(prof.masks), dtype=torch.float64)
    vec[:, 0] = lengths.to(torch.float64)
    vec[:, 1:] = _doc_work(lengths, prof, memo)
    phi = _phi(prof, vec.sum(0))

    def excess(a: torch.Tensor, b: torch.Tensor, dl: torch.Tensor) -> torch.Tensor:
        out = phi[0] * (b - a).to(torch.float64)
        for k, mask in enumerate(prof.masks):
            out = out + phi[1 + k] * (prefix_work(dl, b, mask)
                                      - prefix_work(dl, a, mask)).to(torch.float64)
        return out

    return excess, float(phi @ vec.sum(0))


def _last_true(lo: torch.Tensor, hi: torch.Tensor, pred: Any) -> torch.Tensor:
    """Per row, the largest p in [lo, hi] with pred(p) (pred true then false along p;
    lo is returned where pred(lo) is false): a k-ary search, _PROBES probes a round."""
    lo, hi = lo.clone(), hi.clone()
    rows = torch.arange(lo.numel())
    steps = torch.arange(1, _PROBES + 1)
    while bool((hi > lo).any()):
        probe = lo.unsqueeze(1) + ((hi - lo).unsqueeze(1) * steps + _PROBES - 1) // _PROBES
        ok = pred(probe.flatten(), rows.repeat_interleave(_PROBES)).view(-1, _PROBES)
        last = ok.to(torch.int8).cumprod(1).sum(1) - 1  # ok is a prefix of the probes
        new_lo = torch.where(last >= 0, probe[rows, last.clamp(min=0)], lo)
        new_hi = torch.where(last < _PROBES - 1,
                             probe[rows, (last + 1).clamp(max=_PROBES - 1)] - 1, hi)
        lo, hi = new_lo, torch.maximum(new_hi, new_lo)
    return lo


def _tail_split(lengths: torch.Tensor, prof: _Profile, cp: int, doc: torch.Tensor,
                start: torch.Tensor, end: torch.Tensor, memo: dict
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, n) per body [start, end): the excess of [p, end) is n whole rank shares (n =
    floor of the body's excess in shares), p the largest position with at least that much
    (p = end when n = 0)."""
    excess, total = _excess_of(lengths, prof, memo)
    dl = lengths[doc]
    share = total / cp
    n = torch.floor(excess(start, end, dl) / share * (1 + 1e-12)).to(torch.int64)
    want = n.to(torch.float64) * share
    p = _last_true(start, end, lambda x, r: excess(x, end[r], dl[r]) >= want[r])
    return p, n


def _density_split(lengths: torch.Tensor, prof: _Profile, doc: torch.Tensor,
                   start: torch.Tensor, end: torch.Tensor, memo: dict) -> torch.Tensor:
    """Per body [start, end): the first position whose token carries at least the bodies'
    mean excess per token. With every mask looking left a token's work depends on its
    position only, and grows with it, so one search over positions serves all bodies."""
    excess, _ = _excess_of(lengths, prof, memo)
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


def _mirror_index(j: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Place of tile j among m in the order 0, m-1, 1, m-2, ..."""
    return torch.where(j < (m + 1) // 2, 2 * j, 2 * (m - 1 - j) + 1)


def _chunk_fold(pos: torch.Tensor, head: torch.Tensor, doc_len: torch.Tensor, chunk: int,
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
    local = torch.where(middle, _mirror_index(j, m), torch.where(first, 2 * j, 2 * (m - 1 - j) + 1))
    return base + local


@dataclass
class _Units:
    """Pairs of tiles: places 2u and 2u+1 of an item's fold (tile a, then tile b, which
    may be missing: b_len 0). A cut inside a unit takes tokens from the start of a and the
    end of b alternately (see :func:`_split`), so a unit's work grows about linearly with
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
    block: torch.Tensor  # int64: its item's block class (_TAIL / _REST / 0)


def _units(items: _Items, lengths: torch.Tensor, prof: _Profile) -> _Units:
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
    fold = _mirror_index(j, n[item])
    if prof.head == "chunk":
        sel = torch.nonzero(items.kind[item] == _CHUNKS).flatten()
        if sel.numel():
            fold[sel] = _chunk_fold(start[sel], items.start[item[sel]], doc_len[sel],
                                    prof.chunk, t)
    fold = torch.where(items.kind[item] == _PREFIX, j, fold)
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
    return _Units(u_doc, u_item, torch.arange(n_units) - uoff[u_item], a_start, a_len,
                  b_start, b_len, u_vec, mid, items.body[u_item], items.block[u_item])


def _split(u: _Units, unit: torch.Tensor, o1: torch.Tensor, o2: torch.Tensor
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


# ---- lists of units and cuts --------------------------------------------------------------
class _List:
    """Units in a fixed order, with cumulative (tokens, work...) at every unit boundary and
    at every unit's break point (see :class:`_Units`); values in between are interpolated
    linearly."""

    def __init__(self, units: _Units, order: torch.Tensor) -> None:
        self.order = order
        n = self.n = order.numel()
        vec, mid = units.vec[order], units.mid[order]
        r = vec.shape[1]
        cum = torch.cumsum(vec, 0)
        # Merged points: unit start, its break point, ..., the end.
        pv = torch.zeros(2 * n + 1, r, dtype=torch.float64)
        pv[2::2] = cum
        pv[1:-1:2] = pv[:-1:2] + mid
        self.pv = pv
        self.pt = pv[:, 0].round().to(torch.int64)
        self.tok = self.pt[::2].contiguous()
        self.total = int(self.pt[-1])
        # Boundary classes: 0 where an item starts (and at the end), 1 between units.
        cls = (units.ufold[order] != 0).to(torch.int64)
        if n:
            cls[0] = 0
        self.cls = torch.cat([cls, torch.zeros(1, dtype=torch.int64)])
        self._cols: dict[Any, torch.Tensor] = {}
        self._bounds: list[torch.Tensor] = []
        self.even_cuts = True

    def item_starts(self) -> torch.Tensor:
        """Token offsets where an item starts in the list (0 first; [1] = 0 if empty)."""
        if self.n == 0:
            return torch.zeros(1, dtype=torch.int64)
        return self.tok[:-1][self.cls[:-1] == 0]

    def column(self, col: Any) -> torch.Tensor:
        """Cumulative column ``col`` (an index, or a [1+M] functional) at the merged
        points; a functional is guarded to be non-decreasing (negative work in mixed mask
        sets counts as flat)."""
        key = col if isinstance(col, int) else tuple(col.tolist())
        if key not in self._cols:
            if isinstance(col, int):
                c = self.pv[:, col].contiguous()
            else:
                c = torch.cummax((self.pv @ col).clamp(min=0), 0).values
            self._cols[key] = c
        return self._cols[key]

    def _locate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        j = (torch.searchsorted(self.pt, x, right=True) - 1).clamp(0, 2 * self.n - 1)
        x0 = self.pt[j]
        frac = ((x - x0).to(torch.float64) / (self.pt[j + 1] - x0).clamp(min=1)).clamp(0, 1)
        return j, frac

    def at(self, x: torch.Tensor) -> torch.Tensor:
        """Cumulative vectors at token offsets ``x`` (int64, any shape): [..., 1+M]."""
        if self.n == 0:
            return torch.zeros(*x.shape, self.pv.shape[1], dtype=torch.float64)
        j, frac = self._locate(x)
        v0 = self.pv[j]
        return v0 + frac.unsqueeze(-1) * (self.pv[j + 1] - v0)

    def at_col(self, x: torch.Tensor, col: Any) -> torch.Tensor:
        """One column (or a functional, see :meth:`column`) of :meth:`at`."""
        if self.n == 0:
            return torch.zeros(x.shape, dtype=torch.float64)
        c = self.column(col)
        j, frac = self._locate(x)
        v0 = c[j]
        return v0 + frac * (c[j + 1] - v0)

    def value_slope(self, x: torch.Tensor, col: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`at_col` and the column's increase per token there."""
        c = self.column(col)
        j, frac = self._locate(x)
        v0, dv = c[j], c[j + 1] - c[j]
        return v0 + frac * dv, dv / (self.pt[j + 1] - self.pt[j]).clamp(min=1)

    def at_cols(self, x: torch.Tensor, cols: list) -> list[torch.Tensor]:
        """:meth:`at_col` for several columns, locating ``x`` once."""
        if self.n == 0:
            return [torch.zeros(x.shape, dtype=torch.float64) for _ in cols]
        j, frac = self._locate(x)
        out = []
        for col in cols:
            c = self.column(col)
            v0 = c[j]
            out.append(v0 + frac * (c[j + 1] - v0))
        return out

    def inverse(self, col: Any, value: torch.Tensor) -> torch.Tensor:
        """Smallest token offset where column ``col`` reaches ``value`` (any shape),
        interpolated, clamped to [0, total]."""
        if self.n == 0:
            return torch.zeros(value.shape, dtype=torch.int64)
        c = self.column(col)
        flat = value.reshape(-1).contiguous()
        j = torch.searchsorted(c, flat).clamp(1, 2 * self.n)
        i = j - 1
        frac = ((flat - c[i]) / (c[j] - c[i]).clamp(min=1e-300)).clamp(0, 1)
        x = self.pt[i] + torch.round(frac * (self.pt[j] - self.pt[i]).to(torch.float64)
                                     ).to(torch.int64)
        return torch.where(flat <= 0, 0, x).view(value.shape)

    def even(self, x: torch.Tensor) -> torch.Tensor:
        """Cuts inside a unit moved down to an even offset in it (both stretches of a
        unit's order alternate two ends, and its first stretch is even, so only even
        offsets keep the work linear). Off for tiny batches (``even_cuts``), where one
        token is more than the token budget."""
        if self.n == 0 or not self.even_cuts:
            return x
        i = (torch.searchsorted(self.tok, x, right=True) - 1).clamp(0, self.n - 1)
        odd = ((x - self.tok[i]) % 2 == 1) & (x < self.tok[i + 1])
        return torch.where(odd, x - 1, x)

    def snap_candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets near ``x`` [K] a cut may move to, [K, 5], and their costs [5]: x itself
        (a finer cut unless it is a boundary), the nearest item boundary below and above,
        the nearest unit boundary below and above."""
        cands = [x]
        if not self._bounds:
            self._bounds = [self.tok[self.cls <= c] for c in range(2)]
        for b in self._bounds:
            lo = (torch.searchsorted(b, x, right=True) - 1).clamp(min=0)
            hi = torch.searchsorted(b, x).clamp(max=b.numel() - 1)
            cands += [b[lo], b[hi]]
        cost = torch.tensor([_COST[2], _COST[0], _COST[0], _COST[1], _COST[1]],
                            dtype=torch.float64)
        return torch.stack(cands, 1), cost


def _cut_excess(lst: _List, phi: torch.Tensor, target: torch.Tensor, budget: float
                ) -> torch.Tensor:
    """Token offsets [K] of the body list where its cumulative excess ``phi`` (a [1+M]
    functional) reaches ``target`` [K], moved to a cheaper boundary within ``budget``."""
    if lst.n == 0:
        return torch.zeros(target.shape, dtype=torch.int64)
    tok = lst.inverse(phi, target)
    cands, cost = lst.snap_candidates(tok)
    err = (lst.at_col(cands, phi) - target.unsqueeze(1)).abs()
    ok = (err <= budget) & _between(cands, tok)
    ok[:, 0] = True
    score = torch.where(ok, cost, math.inf) + err / (budget + 1e-300) * 1e-3
    best = score.argmin(1)
    return torch.cummax(lst.even(cands.gather(1, best.unsqueeze(1)).squeeze(1)), 0).values


def _cut_fill(dense: _List, sparse: _List, n_tok: torch.Tensor, target: torch.Tensor,
              col: Any) -> torch.Tensor:
    """x with f(x) = dense(x) + sparse(N - x) - target = 0 in column ``col``, per boundary
    (x in [max(0, N - |S|), min(|D|, N)]); f is non-decreasing while the dense units are
    denser than the sparse ones. A k-ary search brackets the root to 32 tokens (2-3 rounds
    for 128K tokens; regula falsi needs ~10 on these piecewise linear f), then f is taken
    as linear there (the snap evaluates its candidates exactly); ends clamp when the
    target is out of reach."""
    lo = (n_tok - sparse.total).clamp(min=0)
    hi = torch.minimum(n_tok, torch.full_like(n_tok, dense.total)).clamp(min=0)
    lo = torch.minimum(lo, hi)
    steps = torch.arange(1, _PROBES + 1)
    rows = torch.arange(n_tok.numel())

    def f(x: torch.Tensor, n: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return dense.at_col(x, col) + sparse.at_col(n - x, col) - t

    while bool((hi - lo > 32).any()):
        probe = lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * steps // _PROBES
        ok = f(probe, n_tok.unsqueeze(1), target.unsqueeze(1)) >= 0
        ok[:, -1] = True
        j = ok.to(torch.int8).argmax(1)
        new_hi = probe[rows, j]
        lo = torch.where(j > 0, probe[rows, (j - 1).clamp(min=0)], lo)
        hi = new_hi
    f_lo, f_hi = f(lo, n_tok, target), f(hi, n_tok, target)
    frac = (-f_lo / (f_hi - f_lo).clamp(min=1e-300)).clamp(0, 1)
    x = lo + torch.round(frac * (hi - lo).to(torch.float64)).to(torch.int64)
    return torch.where(f_lo >= 0, lo, torch.where(f_hi <= 0, hi, x))


def _snap_pair(dense: _List, sparse: _List, x: torch.Tensor, n_tok: torch.Tensor,
               col: Any, limits: list[tuple[Any, float, float]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a dense / sparse cut pair (dense at x, sparse at N - x) to cheap boundaries.

    A candidate is acceptable when, for each (column or functional, budget, priority) of
    ``limits``, the change it causes there relative to the exact cuts is within the
    budget; the cheapest acceptable one wins, else the one with the smallest changes
    relative to the budgets, weighted by priority (layer counts: errors go to the masks of
    fewer layers first). The sparse candidates are taken near two anchors per dense
    candidate: the token-exact offset and the ``col``-exact one.
    """
    K = x.numel()
    s = n_tok - x
    dc, dcost = dense.snap_candidates(x)  # [K, C]
    d_col = dense.at_col(dc, col)
    s_col = sparse.inverse(col, (dense.at_col(x, col) + sparse.at_col(s, col)).unsqueeze(1)
                           - d_col)
    anchors = torch.cat([(n_tok.unsqueeze(1) - dc).clamp(0, sparse.total), s_col], 1)
    A = anchors.shape[1]
    sc, scost = sparse.snap_candidates(anchors.reshape(-1))  # [K*2C, C]
    n_c = scost.numel()
    sc = sc.reshape(K, A * n_c)
    scost = scost.repeat(A)
    ok = _between(dc, x).unsqueeze(2) & _between(sc, s).unsqueeze(1)
    rel = torch.zeros(ok.shape, dtype=torch.float64)
    cols = [c for c, _, _ in limits]
    refs = [a + b for a, b in zip(dense.at_cols(x, cols), sparse.at_cols(s, cols))]
    for ref, dv, sv, (_, budget, prio) in zip(refs, dense.at_cols(dc, cols),
                                              sparse.at_cols(sc, cols), limits):
        err = (dv.unsqueeze(2) + sv.unsqueeze(1) - ref.view(K, 1, 1)).abs()
        ok &= err <= budget
        rel += err * (prio / max(budget, 1e-9))
    cost = dcost.view(1, -1, 1) + scost.view(1, 1, -1)
    score = torch.where(ok, cost + 1e-3 * rel, 1e6 + rel).view(K, -1)
    best = score.argmin(1)
    bi, si = best // (A * n_c), best % (A * n_c)
    rows = torch.arange(K)
    return dc[rows, bi], sc[rows, si]


def _between(cands: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Candidates [K, C] of boundary k lying between the midpoints of the exact cuts [K]
    of boundaries k-1, k and k, k+1, so that moving every cut keeps them in order."""
    prev = torch.cat([exact[:1], exact[:-1]])
    nxt = torch.cat([exact[1:], exact[-1:]])
    lo = (prev + exact + 1) // 2
    hi = (exact + nxt) // 2
    return (cands >= lo.unsqueeze(1)) & (cands <= hi.unsqueeze(1))


# ---- the layout ---------------------------------------------------------------------------
@dataclass
class _Layout:
    lists: list[_List]
    cuts: list[torch.Tensor]  # [cp+1] token offsets per list
    per_rank: torch.Tensor  # [cp, 1+M] float64 estimate (interpolated inside cut tiles)
    unreachable: bool = False  # the rank-by-rank solver's precheck failed (see _solve)


def _rank_vectors(lists: list[_List], cuts: list[torch.Tensor]) -> torch.Tensor:
    out = 0
    for lst, c in zip(lists, cuts):
        v = lst.at(c)
        out = out + (v[1:] - v[:-1])
    return out


def _score(per_rank: torch.Tensor) -> float:
    """Worst of max/mean - 1 over tokens and masks, relative to their tolerances (inf for
    a variant given up early)."""
    if not bool(torch.isfinite(per_rank).all()):
        return math.inf
    mean = per_rank.mean(0).clamp(min=1e-300)
    imb = per_rank.max(0).values / mean - 1
    tol = torch.full_like(imb, WORK_TOL)
    tol[0] = TOKEN_TOL
    return float((imb / tol).max())


def _new_list(units: _Units, order: torch.Tensor, tok_budget: float) -> _List:
    lst = _List(units, order)
    lst.even_cuts = tok_budget >= 2
    return lst


def _order(units: _Units, sel: torch.Tensor, item_key: torch.Tensor) -> torch.Tensor:
    """Indices of the selected units ordered by (item_key of their item, fold)."""
    idx = torch.nonzero(sel).flatten()
    span = int(units.ufold.max()) + 1 if units.ufold.numel() else 1
    return idx[torch.argsort(item_key[units.item[idx]] * span + units.ufold[idx])]


def _spread_key(density: torch.Tensor, tokens: torch.Tensor, groups: int = 8
                ) -> torch.Tensor:
    """Item sort key spreading densities evenly by tokens: items sorted by density are
    cut into ``groups`` runs of equal tokens, then merged by phase (each item's middle
    token's share of its run), so every stretch of a list holds each density range in
    proportion to its tokens and per-rank targets near the mean stay reachable."""
    order = torch.argsort(density, stable=True)
    t = tokens[order]
    cum = torch.cumsum(t, 0)
    total = float(cum[-1]) if cum.numel() else 1.0
    mid = cum - t / 2
    g = torch.clamp((mid * groups / max(total, 1.0)).to(torch.int64), max=groups - 1)
    g_start = torch.zeros(groups, dtype=torch.float64).scatter_reduce_(
        0, g, cum - t, "amin", include_self=False)
    g_tok = torch.zeros(groups, dtype=torch.float64).index_add_(0, g, t)
    phase = (mid - g_start[g]) / g_tok[g].clamp(min=1)
    key = torch.empty_like(order)
    key[order[torch.argsort(phase, stable=True)]] = torch.arange(order.numel())
    return key


def _untangle(dense: _List, sparse: _List, y: torch.Tensor, n_tok: torch.Tensor,
              target: torch.Tensor, col: Any, rounds: int = 16) -> torch.Tensor:
    """Exact dense cuts ``y`` that go backwards (in the dense or the sparse list) made
    monotone, and the errors that leaves diffused to the neighbouring ranks.

    The exact cuts only go backwards where a stretch of a list is locally denser or
    sparser than the rank targets allow (a unit of an item holding its partial last tile
    is sparser than the item, the others denser): clamping then leaves one rank over and
    its neighbour under. Each round moves every boundary (dense forward, sparse back by as
    many tokens) half way to the error of its two neighbours, within its neighbours' cuts:
    a few rounds spread the error over a few ranks (at cp 128 on 128K tokens: max/mean
    1.049 -> measured below 1.03)."""
    s = n_tok - y
    if bool((y[1:] >= y[:-1]).all()) and bool((s[1:] >= s[:-1]).all()):
        return y
    for _ in range(3):
        y = torch.cummax(y, 0).values
        y = n_tok - torch.cummax(n_tok - y, 0).values
    y = torch.minimum(torch.cummax(y, 0).values, n_tok)
    y[0], y[-1] = 0, dense.total
    if dense.n == 0 or sparse.n == 0:
        return y
    for _ in range(rounds):
        s = n_tok - y
        vd, dd = dense.value_slope(y, col)
        vs, ds = sparse.value_slope(s, col)
        err = vd + vs - target
        want = (err[:-2] + err[2:]) / 2 - err[1:-1]
        yi = y[1:-1]
        step = torch.round(0.5 * want / (dd[1:-1] - ds[1:-1]).clamp(min=1e-9)).to(torch.int64)
        lo = torch.maximum(y[:-2], n_tok[1:-1] - s[2:])
        hi = torch.minimum(y[2:], n_tok[1:-1] - s[:-2])
        new = torch.minimum(torch.maximum(yi + step, lo), hi)
        y = torch.cat([y[:1], torch.where(lo <= hi, new, yi), y[-1:]])
    return y


def _pair_cut(dense: _List, sparse: _List, n_tok: torch.Tensor, target: torch.Tensor,
              col: Any, limits: list[tuple[Any, float, float]], give_up: bool = False,
              seq: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cuts [cp+1] of a dense / sparse list pair giving boundary k ``n_tok[k]`` tokens and
    ``target[k]`` in column ``col`` (exact, then snapped within the budgets of ``limits``,
    relative to what the exact cuts reach, see :func:`_snap_pair`). give_up: None
    instead of untangling exact cuts that go backwards (a sign of targets out of reach).
    seq: exact cuts rank by rank (:func:`_rank_cut`), not snapped."""
    n_tok = n_tok.clamp(0, dense.total + sparse.total)
    n_tok[-1] = dense.total + sparse.total
    if seq:
        # Exact rank by rank and not snapped: the snap saved no fetch here (a cut in an
        # item in position order costs its offset either way) and took a third of the time.
        y = _rank_cut([dense], [sparse], n_tok, target, col)[0]
        return y, n_tok - y
    else:
        y = _cut_fill(dense, sparse, n_tok, target, col)
        if give_up and not (bool((y[1:] >= y[:-1]).all())
                            and bool((n_tok[1:] - y[1:] >= n_tok[:-1] - y[:-1]).all())):
            return None
        y = _untangle(dense, sparse, y, n_tok, target, col)
    yd, ys = _snap_pair(dense, sparse, y, n_tok, col, limits)
    yd, ys = torch.cummax(dense.even(yd), 0).values, torch.cummax(sparse.even(ys), 0).values
    yd[0], ys[0] = 0, 0
    yd[-1], ys[-1] = dense.total, sparse.total
    return yd, ys


def _item_sums(units: _Units, n_items: int, col: Any) -> torch.Tensor:
    v = units.vec[:, col] if isinstance(col, int) else units.vec @ col
    return torch.zeros(n_items, dtype=torch.float64).index_add_(0, units.item, v)


def _reachable(dense: _List, sparse: _List, f_tok: torch.Tensor, f_target: torch.Tensor,
               col: int) -> bool:
    """Whether every rank's filler share (tokens, column) lies between the sparse and the
    dense list's mean densities: with the lists' densities spread evenly that is about
    what a dense / sparse cut can reach. Checked before the filler cut, so that a variant
    that cannot balance costs little (lognormal_long, Llama 4, cp 64: 8.5 -> ~1 ms)."""
    if dense.n == 0 or sparse.n == 0:  # nothing to mix: the bodies must do it alone
        return True
    t = (f_tok[1:] - f_tok[:-1]).to(torch.float64)
    w = f_target[1:] - f_target[:-1]
    lo = float(sparse.pv[-1, col]) / max(sparse.total, 1)
    hi = float(dense.pv[-1, col]) / max(dense.total, 1)
    return bool((t >= 0).all()) and bool(((w >= lo * t) & (w <= hi * t)).all())


class _Curves:
    """The lists' cumulative (tokens -> column) curves as Python lists: the rank-by-rank
    solver reads single values, where Python floats beat tensor ops by ~100x."""

    def __init__(self, lists: list[_List], col: Any) -> None:
        self.pts = [lst.pt.tolist() for lst in lists]
        self.cols = [lst.column(col).tolist() if lst.n else [0.0] for lst in lists]
        self.last = [len(p) - 1 for p in self.pts]
        self.starts = [lst.item_starts().tolist() for lst in lists]
        self.tot = [lst.total for lst in lists]

    def val(self, i: int, x: int) -> float:
        """Column value of list ``i``'s first ``x`` tokens (linear inside a unit)."""
        p, c = self.pts[i], self.cols[i]
        j = bisect.bisect_right(p, x) - 1
        if j >= self.last[i]:
            return c[-1]
        x0 = p[j]
        return c[j] + (c[j + 1] - c[j]) * (x - x0) / (p[j + 1] - x0)

    def offset(self, i: int, x: int) -> int:
        """Tokens of list ``i``'s item at ``x`` before ``x`` (what starting there cuts)."""
        s = self.starts[i]
        return x - s[bisect.bisect_right(s, x) - 1]


def _pick_pair(cv: _Curves, n_d: int, pos: list[int], cur: list[float], k: int, n_r: int,
               t_k: int, w_k: float) -> tuple | None:
    """(score, dense a, sparse b, lo, hi, g(lo), g(hi), base) of the pair of lists whose
    next ``t_k`` tokens can hold the rank's column target ``w_k`` (g = what the rank would
    hold minus its target, for lo..hi tokens from ``a``): feasible first; with several
    pairs, those with a margin of ``_MARGIN``, then the one furthest behind schedule and
    cheapest to start in; else the largest margin. None when no pair has room."""
    n_l = len(cv.tot)
    best = None
    for a in range(n_d):
        for b in range(n_d, n_l):
            lo, hi = max(0, t_k - (cv.tot[b] - pos[b])), min(t_k, cv.tot[a] - pos[a])
            if hi < lo:
                continue
            if hi == lo and n_l == 2:  # no choice: skip the evaluations
                best = ((True,), a, b, lo, hi, 0.0, 0.0, 0.0)
                continue
            base = cur[a] + cur[b] + w_k
            g_lo = cv.val(a, pos[a] + lo) + cv.val(b, pos[b] + t_k - lo) - base
            g_hi = cv.val(a, pos[a] + hi) + cv.val(b, pos[b] + t_k - hi) - base
            feasible = g_lo <= 0 <= g_hi
            score = (feasible,)
            if n_l > 2:
                margin = min(-g_lo, g_hi) / max(abs(w_k), 1.0)
                good = feasible and margin >= _MARGIN
                if good:
                    off = cv.offset(a, pos[a]) + cv.offset(b, pos[b])
                    lag = (2 * k / n_r - pos[a] / max(cv.tot[a], 1)
                           - pos[b] / max(cv.tot[b], 1) - _OFFSET_W * off / max(t_k, 1))
                score = (feasible, good, lag if good else margin)
            if best is None or score > best[0]:
                best = (score, a, b, lo, hi, g_lo, g_hi, base)
    return best


def _regula_falsi(g: Any, lo: int, hi: int, g_lo: float, g_hi: float, tol: float) -> int:
    """The integer x in [lo, hi] nearest g's zero (Illinois regula falsi; g increasing,
    g(lo) < 0 < g(hi)), stopping once within ``tol``."""
    side = 0
    while hi - lo > 1 and -g_lo > tol and g_hi > tol:
        m = min(max(int(lo + (hi - lo) * (-g_lo) / (g_hi - g_lo) + 0.5), lo + 1), hi - 1)
        g_m = g(m)
        if g_m >= 0:
            hi, g_hi = m, g_m
            g_lo = g_lo / 2 if side == 1 else g_lo
            side = 1
        else:
            lo, g_lo = m, g_m
            g_hi = g_hi / 2 if side == -1 else g_hi
            side = -1
    return lo if -g_lo <= g_hi else hi


def _rank_cut(dense: list[_List], sparse: list[_List], n_tok: torch.Tensor,
              target: torch.Tensor, col: Any) -> list[torch.Tensor]:
    """Cuts [cp+1] of every list, solved rank by rank (a Python loop over ranks, on
    Python floats: ~20 us a rank): rank k takes the next stretches of one dense and one
    sparse list, the pair whose stretches bracket its target density (tokens and column
    ``col`` exact up to _SOLVE_TOL of the rank's share, by regula falsi on the piecewise linear
    cumulative values), so the cuts are monotone whatever the lists' local densities
    (items in position order are sparse at their start and dense at their end). With
    several lists a side, among the pairs with a margin of at least ``_MARGIN`` the one
    furthest behind schedule, and least costly to start in (the rest of a cut item is a
    fetch for this rank), is taken. A rank whose target is out of reach takes the nearest
    end; targets are cumulative, so its error goes to the next rank. The last rank takes
    what is left."""
    lists = dense + sparse
    n_l, n_d = len(lists), len(dense)
    cv = _Curves(lists, col)
    nt, tg = n_tok.tolist(), target.tolist()
    n_r = len(nt) - 1
    pos = [0] * n_l
    cur = [0.0] * n_l  # cv.val(i, pos[i])
    out = [[0] * (n_r + 1) for _ in lists]
    done = 0.0
    for k in range(1, n_r):
        t_k, w_k = nt[k] - nt[k - 1], tg[k] - done
        best = _pick_pair(cv, n_d, pos, cur, k, n_r, t_k, w_k)
        if best is None:
            continue
        _, a, b, lo, hi, f_lo, f_hi, base = best
        if f_lo >= 0:
            dx = lo
        elif f_hi <= 0:
            dx = hi
        else:
            dx = _regula_falsi(
                lambda m: cv.val(a, pos[a] + m) + cv.val(b, pos[b] + t_k - m) - base,
                lo, hi, f_lo, f_hi, _SOLVE_TOL * abs(w_k))
        pos[a] += dx
        pos[b] += t_k - dx
        va, vb = cv.val(a, pos[a]), cv.val(b, pos[b])
        done += va - cur[a] + vb - cur[b]
        cur[a], cur[b] = va, vb
        for i in range(n_l):
            out[i][k] = pos[i]
    for i in range(n_l):
        out[i][n_r] = cv.tot[i]
    return [torch.tensor(o, dtype=torch.int64) for o in out]


def _block_targets(units: _Units, body: _List, phi: torch.Tensor, cp: int) -> torch.Tensor:
    """Excess targets [cp+1] of the "blocks" body list (remainders first, then tail
    blocks): the remainders in equal shares, then each tail block in equal shares of its
    own, so that the cuts fall on the blocks' boundaries (each block is a whole number of
    shares up to one token)."""
    it = units.item[body.order]
    new = torch.ones(body.n, dtype=torch.bool)
    new[1:] = it[1:] != it[:-1]
    first = torch.nonzero(new).flatten()
    cum = body.column(phi)
    c_s = cum[2 * first]
    c_e = torch.cat([c_s[1:], cum[-1:]])
    tail = units.block[body.order[first]] == _TAIL
    total = float(cum[-1])
    n_sh = torch.clamp(torch.round((c_e - c_s)[tail] * cp / max(total, 1e-300)),
                       min=1).to(torch.int64)
    n_rest = cp - int(n_sh.sum())
    if not bool(tail.any()) or n_rest < 0 or (n_rest == 0 and not bool(tail[0])):
        return torch.arange(cp + 1, dtype=torch.float64) * total / cp
    s_t, e_t = c_s[tail], c_e[tail]
    rest_end = float(s_t[0])
    rep = torch.repeat_interleave(torch.arange(n_sh.numel()), n_sh)
    off = (torch.arange(int(n_sh.sum())) - (torch.cumsum(n_sh, 0) - n_sh)[rep]).to(torch.float64)
    return torch.cat([torch.arange(n_rest, dtype=torch.float64) * rest_end / max(n_rest, 1),
                      s_t[rep] + (e_t - s_t)[rep] * off / n_sh[rep].to(torch.float64),
                      torch.tensor([total], dtype=torch.float64)])


def _classes(units: _Units, sel: torch.Tensor, item_d: torch.Tensor, item_t: torch.Tensor,
             key: torch.Tensor, n: int, tok_budget: float) -> list[_List]:
    """The selected units as ``n`` lists of equal tokens by item density (low first),
    each in ``key`` order."""
    items = torch.unique(units.item[sel])
    o = items[torch.argsort(item_d[items], stable=True)]
    cum = torch.cumsum(item_t[o], 0)
    total = float(cum[-1]) if cum.numel() else 1.0
    grp = torch.clamp(((cum - item_t[o] / 2) * n / max(total, 1.0)).to(torch.int64), max=n - 1)
    g_of = torch.full((item_t.numel(),), -1, dtype=torch.int64)
    g_of[o] = grp
    return [_new_list(units, _order(units, sel & (g_of[units.item] == g), key), tok_budget)
            for g in range(n)]


def _rank_reachable(items: _Items, fill_items: torch.Tensor, lengths: torch.Tensor,
                    prof: _Profile, col: int, f_tok: torch.Tensor, f_target: torch.Tensor
                    ) -> bool:
    """Cheap test before the rank-by-rank solver: every rank's filler share must be
    non-negative, and a filler item in position order that is longer than a rank's share
    must not be much sparser over its first share of tokens than the ranks' mean target
    (a rank starting on it could not reach its work: 128K tokens of the heavy tail at cp
    64, 2K tokens per rank, vs ~4K mean causal density)."""
    t = (f_tok[1:] - f_tok[:-1]).to(torch.float64)
    w = f_target[1:] - f_target[:-1]
    if bool((t < 0).any()) or bool((w < -1e-6 * float(w.abs().max())).any()):
        return False
    pre = fill_items & (items.kind == _PREFIX)
    share = int(t.median())
    long = torch.nonzero(pre & (items.end - items.start > share)).flatten()
    if not long.numel() or share <= 0:
        return True
    mask = prof.masks[col - 1]
    dl, a = lengths[items.doc[long]], items.start[long]
    first = (prefix_work(dl, a + share, mask) - prefix_work(dl, a, mask)).to(torch.float64)
    return bool((first >= _PREFIX_DENSITY * float(w.sum() / t.sum()) * share).all())


@dataclass(frozen=True)
class _Setup:
    """What both phases of :func:`_solve` share (targets, budgets, the items' orders)."""

    n_items: int
    is_body: torch.Tensor     # [units] bool
    total: torch.Tensor       # [1+M] tokens and each mask's work
    share: torch.Tensor       # total / cp
    k: torch.Tensor           # rank boundaries 0..cp
    n_tok: torch.Tensor       # token targets: floor(k T / cp)
    tok_budget: float
    col: int                  # the filler column: the mask with least work
    first: torch.Tensor       # [items] doc << 40 | first position
    doc_order: torch.Tensor   # [items] rank of each item in document order
    item_t: torch.Tensor      # [items] tokens
    fail: "_Layout"

    @property
    def n_masks(self) -> int:
        return self.total.numel() - 1


def _setup(units: _Units, prof: _Profile, cp: int) -> _Setup:
    n_items = int(units.item.max()) + 1 if units.item.numel() else 0
    total = units.vec.sum(0)  # [1+M]
    T = float(total[0])
    k = torch.arange(cp + 1, dtype=torch.int64)
    # Items in document order (items are numbered filler first, bodies after).
    first = torch.zeros(n_items, dtype=torch.int64).scatter_reduce_(
        0, units.item, units.doc * (1 << 40) + units.a_start, "amin", include_self=False)
    doc_order = torch.empty(n_items, dtype=torch.int64)
    doc_order[torch.argsort(first)] = torch.arange(n_items)
    fail = _Layout([], [], torch.full((cp, total.numel()), math.inf, dtype=torch.float64))
    # The filler column: the mask with least work (its relative errors are the largest).
    return _Setup(n_items, units.body & (prof.excess.shape[0] > 0), total, total / cp, k,
                  k * int(T) // cp, _TOKEN_BUDGET * T / cp, 1 + int(torch.argmin(total[1:])),
                  first, doc_order, _item_sums(units, n_items, 0), fail)


def _solve(units: _Units, prof: _Profile, cp: int, var: _Variant, items: _Items,
           lengths: torch.Tensor) -> _Layout:
    """Phase 1 (bodies: the excess work) then phase 2 (filler: tokens and the rest).

    Bodies (``var``): one list spread by excess per token and cut by excess alone (a
    rank's bodies are then one or two documents; phase 2 absorbs the token differences);
    or a dense / sparse pair (in excess per token) cut to equal tokens and excess (more
    documents per rank, always feasible for phase 2); or the blocks of :func:`_items`.
    """
    st = _setup(units, prof, cp)
    lists, cuts = [], []
    b_val = torch.zeros(cp + 1, st.total.numel(), dtype=torch.float64)
    if prof.excess.shape[0] and bool(st.is_body.any()):
        lists, cuts, b_val = _cut_bodies(units, prof, cp, var, st, lengths)
    return _cut_filler(units, prof, var, items, lengths, st, lists, cuts, b_val)


def _cut_bodies(units: _Units, prof: _Profile, cp: int, var: _Variant, st: _Setup,
                lengths: torch.Tensor) -> tuple[list, list, torch.Tensor]:
    """Phase 1: bodies, cut so that every rank gets 1/cp of the excess work: (lists, cuts,
    the cumulative vector [cp+1, 1+M] they give the rank boundaries)."""
    is_body, k, tok_budget = st.is_body, st.k, st.tok_budget
    phi = _phi(prof, st.total)
    others = [m for m in range(st.n_masks) if 1 + m != st.col] or list(range(st.n_masks))
    budget = _EXCESS_BUDGET * float(min(st.share[1 + m] for m in others))
    item_phi = _item_sums(units, st.n_items, phi)
    if var.body == "split":
        # Late parts (dense in excess) and early parts, in position order and document
        # order, cut rank by rank to equal tokens and excess.
        late = is_body & (units.block == _TAIL)
        dense = _new_list(units, _order(units, late, st.doc_order), tok_budget)
        sparse = _new_list(units, _order(units, is_body & ~late, st.doc_order), tok_budget)
        t_b = dense.total + sparse.total
        b_tok = k * t_b // cp
        b_phi = k.to(torch.float64) * float(dense.column(phi)[-1] + sparse.column(phi)[-1]) / cp
        xd, xs = _rank_cut([dense], [sparse], b_tok, b_phi, phi)
        return [dense, sparse], [xd, xs], dense.at(xd) + sparse.at(xs)
    body_items = torch.zeros(st.n_items, dtype=torch.bool)
    body_items[units.item[is_body]] = True
    if var.pair:
        t_b = float(st.item_t[body_items].sum())
        p_b = float(item_phi[body_items].sum())
        hi = (item_phi * t_b > p_b * st.item_t)[units.item]
        dense = _new_list(units, _order(units, is_body & hi, st.doc_order), tok_budget)
        sparse = _new_list(units, _order(units, is_body & ~hi, st.doc_order), tok_budget)
        b_tok = k * int(t_b) // cp
        b_phi = k.to(torch.float64) * p_b / cp
        xd, xs = _pair_cut(dense, sparse, b_tok, b_phi, phi,
                           [(0, 2 * tok_budget, 1.0), (phi, budget, 1.0)])
        return [dense, sparse], [xd, xs], dense.at(xd) + sparse.at(xs)
    if var.body == "blocks":
        key = _block_order(units, st, lengths)
    else:
        # Bodies spread by excess per token, so that the excess cut gives no rank
        # a stretch of only sparse bodies (too many tokens for the filler).
        key = _spread_key(item_phi / st.item_t.clamp(min=1), st.item_t * body_items)
    body = _new_list(units, _order(units, is_body, key), tok_budget)
    if var.body == "blocks":
        target = _block_targets(units, body, phi, cp)
    else:
        target = k.to(torch.float64) * float(body.pv[-1] @ phi) / cp
    x = _cut_excess(body, phi, target, budget)
    x[0], x[-1] = 0, body.total
    return [body], [x], body.at(x)


def _block_order(units: _Units, st: _Setup, lengths: torch.Tensor) -> torch.Tensor:
    """Item key of the body blocks: remainders first, largest, smallest, second largest,
    ... (about two on a rank: each costs a chunk of causal keys to fetch), then the tail
    blocks, longest documents first, so that the last rank, which phase 2 gives what is
    left of every filler list, holds the shortest document's end."""
    i_blk = torch.zeros(st.n_items, dtype=torch.int64)
    i_blk[units.item] = units.block
    ln = lengths[st.first >> 40]
    key = ((1 << 40) - ln) * (1 << 22) + (st.first >> 40)
    r_idx = torch.nonzero(i_blk == _REST).flatten()
    o = r_idx[torch.argsort(-st.item_t[r_idx], stable=True)]
    zz = torch.empty(o.numel(), dtype=torch.int64)
    zz[0::2] = torch.arange((o.numel() + 1) // 2)
    zz[1::2] = o.numel() - 1 - torch.arange(o.numel() // 2)
    key[o[zz]] = torch.arange(o.numel())
    return torch.argsort(torch.argsort(key))


def _cut_filler(units: _Units, prof: _Profile, var: _Variant, items: _Items,
                lengths: torch.Tensor, st: _Setup, lists: list, cuts: list,
                b_val: torch.Tensor) -> _Layout:
    """Phase 2: filler (short documents and heads), dense / sparse in the filler column,
    cut to what phase 1 left of every rank's targets."""
    col, k, tok_budget, total = st.col, st.k, st.tok_budget, st.total
    fill = ~st.is_body
    f_tok = torch.cummax((st.n_tok - b_val[:, 0].round().to(torch.int64)).clamp(min=0),
                         0).values
    f_target = k.to(torch.float64) * float(st.share[col]) - b_val[:, col]
    item_w = _item_sums(units, st.n_items, col)
    f_w = float(total[col] - b_val[-1, col])
    f_t = float(total[0]) - float(b_val[-1, 0])
    is_dense = (item_w * f_t > f_w * st.item_t)[units.item]
    # Filler items in an order that spreads their densities evenly (any stretch of the
    # list holds about its mean density), so per-rank targets stay reachable.
    fill_items = torch.zeros(st.n_items, dtype=torch.bool)
    fill_items[units.item[fill]] = True
    if var.solver != "vector" and not _rank_reachable(items, fill_items, lengths, prof, col,
                                                      f_tok, f_target):
        return _Layout([], [], st.fail.per_rank, unreachable=True)
    spread = _spread_key(item_w / st.item_t.clamp(min=1), st.item_t * fill_items)
    if var.solver == "classes":
        dens = item_w / st.item_t.clamp(min=1)
        dl = _classes(units, fill & is_dense, dens, st.item_t, spread, 2, tok_budget)
        sl = _classes(units, fill & ~is_dense, dens, st.item_t, spread, 2, tok_budget)
        f_tok[-1] = sum(lst.total for lst in dl + sl)
        lists = lists + dl + sl
        cuts = cuts + _rank_cut(dl, sl, f_tok, f_target, col)
        return _Layout(lists, cuts, _rank_vectors(lists, cuts))
    dense = _new_list(units, _order(units, fill & is_dense, spread), tok_budget)
    sparse = _new_list(units, _order(units, fill & ~is_dense, spread), tok_budget)
    one_list = bool(lists) and not var.pair
    if one_list and var.solver == "vector" and not _reachable(
            dense, sparse, st.n_tok - b_val[:, 0], f_target, col):
        return st.fail
    prio = torch.tensor(prof.weights, dtype=torch.float64)
    prio = prio / prio.max()
    limits = [(0, tok_budget, 1.0)] + [(1 + m, _FILL_BUDGET * float(st.share[1 + m]),
                                        float(prio[m])) for m in range(st.n_masks)]
    cut = _pair_cut(dense, sparse, f_tok, f_target, col, limits, give_up=one_list,
                    seq=var.solver == "seq")
    if cut is None:
        return st.fail
    lists = lists + [dense, sparse]
    cuts = cuts + list(cut)
    return _Layout(lists, cuts, _rank_vectors(lists, cuts))


def _runs(units: _Units, lay: _Layout) -> tuple[torch.Tensor, ...]:
    """(rank, doc, start, length) of every run (not merged: the token tables sort them)."""
    parts = []
    for lst, cut in zip(lay.lists, lay.cuts):
        if lst.n == 0:
            continue
        # Units no cut falls inside go whole to one rank: tiles a and b as they are.
        rank_u = torch.searchsorted(cut, lst.tok[:-1], right=True) - 1
        inner = cut[(cut > 0) & (cut < lst.total)]
        hit = torch.searchsorted(lst.tok, inner, right=True) - 1
        split_u = torch.zeros(lst.n, dtype=torch.bool)
        split_u[hit[lst.tok[hit] != inner]] = True
        whole = lst.order[~split_u]
        r = rank_u[~split_u]
        d = units.doc[whole]
        parts.append((torch.cat([r, r]), torch.cat([d, d]),
                      torch.cat([units.a_start[whole], units.b_start[whole]]),
                      torch.cat([units.a_len[whole], units.b_len[whole]])))
        if not bool(split_u.any()):
            continue
        # Units that cuts fall inside: one segment per (unit, rank), four runs each.
        su = torch.nonzero(split_u).flatten()
        points = torch.unique(torch.cat([lst.tok[su], lst.tok[su + 1], inner]))
        first, stop = points[:-1], points[1:]
        ui = torch.searchsorted(lst.tok, first, right=True) - 1
        keep = split_u[ui.clamp(max=lst.n - 1)] & (ui < lst.n)
        first, stop, ui = first[keep], stop[keep], ui[keep]
        rank = torch.searchsorted(cut, first, right=True) - 1
        u = lst.order[ui]
        runs = _split(units, u, first - lst.tok[ui], stop - lst.tok[ui])
        d = units.doc[u]
        parts.append((rank.repeat(4), d.repeat(4), torch.cat([x for x, _ in runs]),
                      torch.cat([n for _, n in runs])))
    rank, doc, start, length = (torch.cat(x) for x in zip(*parts))
    keep = length > 0
    return rank[keep], doc[keep], start[keep], length[keep]


def _has_bodies(lengths: torch.Tensor, prof: _Profile, cp: int, memo: dict) -> bool:
    """Whether any segment carries excess work (a long document with more than the
    negligible excess of ``keep_small``)."""
    if not prof.excess.shape[0]:
        return False
    return bool(_segments(lengths, prof, cp, True, memo)[3].any())


def _prefix_ok(lengths: torch.Tensor, prof: _Profile, cp: int, memo: dict) -> bool:
    """:func:`_rank_reachable`'s density test when everything is filler, before any item
    is built: no segment longer than a rank's share may be much sparser over its first
    share than the mean (the single 128K document, 24-32K documents at 8-16K tokens per
    rank, the heavy tail at 2-4K tokens per rank fail it)."""
    doc, start, end, _ = _segments(lengths, prof, cp, True, memo)
    share = int(lengths.sum()) // cp
    long = end - start > share
    if not bool(long.any()) or share <= 0:
        return True
    w = _doc_work(lengths, prof, memo).sum(0)
    m = int(torch.argmin(w))
    mask = prof.masks[m]
    mean = float(w[m]) / max(int(lengths.sum()), 1)
    dl, a = lengths[doc[long]], start[long]
    first = (prefix_work(dl, a + share, mask) - prefix_work(dl, a, mask)).to(torch.float64)
    return bool((first >= _PREFIX_DENSITY * mean * share).all())


def _variants(prof: _Profile, bodies: bool, prefix_ok: bool = True) -> list[_Variant]:
    """Attempts in order (the first that meets the targets is taken): locality-first
    variants where their pieces keep the masks' work in a fixed relation (every mask
    looks left, so a filler item's prefix is causal-like under all of them), then the
    fold variants (always feasible when anything is)."""
    left = all(_locality(m)[1] for m in prof.masks)
    if not bodies and (len(prof.masks) == 1 or left):
        local = [_Variant(fill="prefix", solver="seq"), _Variant(fill="prefix", solver="classes")]
        return (local if prefix_ok else []) + list(_LEGACY[:1])
    if not left:
        return list(_LEGACY)
    local = []
    if prof.head == "chunk":
        local.append(_Variant(body="blocks", fill="prefix", big=2.0, solver="classes"))
    elif prof.head == "prefix":
        local.append(_Variant(body="split", fill="prefix", big=2.0, solver="seq"))
        local.append(_Variant(body="split", fill="prefix", big=2.0, solver="classes"))
    return local + list(_LEGACY)


def balanced_runs(lengths: torch.Tensor, cp_size: int, masks: MaskWeights, tile_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, doc, start, length) int64 runs of the balanced layout (see the module
    docstring) for documents of ``lengths`` (int64, CPU); inputs validated. Runs are
    maximal: one per (rank, document, stretch of consecutive positions)."""
    lengths = lengths.to(torch.int64)
    if cp_size == 1 or int(lengths.sum()) == 0:
        d = torch.nonzero(lengths > 0).flatten()
        return torch.zeros_like(d), d, torch.zeros_like(d), lengths[d]
    prof = _profile(masks, tile_tokens)
    best = None
    items_of: dict[tuple, tuple[_Items, _Units]] = {}
    memo: dict = {}
    unreachable = set()
    bodies = _has_bodies(lengths, prof, cp_size, memo)
    for var in _variants(prof, bodies, bodies or _prefix_ok(lengths, prof, cp_size, memo)):
        key = (var.body, var.keep_small, var.fill, var.big)
        if key in unreachable and var.solver != "vector":
            continue  # the same items and precheck: the other rank-by-rank solver fails too
        if key not in items_of:
            items = _items(lengths, prof, cp_size, var, memo)
            items_of[key] = (items, _units(items, lengths, prof))
        items, units = items_of[key]
        lay = _solve(units, prof, cp_size, var, items, lengths)
        if lay.unreachable:
            unreachable.add(key)
        if best is None or _score(lay.per_rank) < _score(best[0].per_rank):
            best = (lay, units)
        if _score(best[0].per_rank) <= 1.0:
            break
    return _merge(*_runs(best[1], best[0]))


def _merge(rank: torch.Tensor, doc: torch.Tensor, start: torch.Tensor, length: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    """Runs sorted by (rank, doc, start) with touching runs of one rank and document
    merged (the layout cuts on a tile grid: ~one run per tile before merging)."""
    n_docs = int(doc.max()) + 1 if doc.numel() else 1
    span = int((start + length).max()) + 1 if doc.numel() else 1
    n_ranks = int(rank.max()) + 1 if doc.numel() else 1
    if n_ranks * n_docs * span < 1 << 62:
        o = torch.argsort((rank * n_docs + doc) * span + start)
    else:  # stable sorts, least significant key first
        o = torch.argsort(start, stable=True)
        o = o[torch.argsort(doc[o], stable=True)]
        o = o[torch.argsort(rank[o], stable=True)]
    rank, doc, start, length = rank[o], doc[o], start[o], length[o]
    new = torch.ones(rank.numel(), dtype=torch.bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (
        start[1:] != start[:-1] + length[:-1])
    head = torch.nonzero(new).flatten()
    stop = torch.cat([head[1:], torch.tensor([rank.numel()])])
    end = (start + length)[stop - 1]
    return rank[head], doc[head], start[head], end - start[head]


def describe(masks: MaskWeights, tile_tokens: int) -> Sequence[Any]:
    """Stable description of the layout's parameters (for the plan's fingerprint)."""
    return (tuple((m.params, w) for m, w in masks), tile_tokens)
