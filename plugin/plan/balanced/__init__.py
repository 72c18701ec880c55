"""The ``balanced`` layout: tokens AND the work of EACH of the model's masks equal on every
rank, and documents cut where the cut costs the ranks little K/V to fetch.

Every layer type waits for its own slowest rank, so a Llama 4 model (chunked 8192 x3 :
global causal x1) or a Gemma-style one (window (4096, 0) x5 : causal x1) needs every mask
balanced by one token layout, not a weighted sum. Targets: each mask's work (visible
query-key pairs of a rank's queries) within 3% of its mean over ranks, tokens within 2%,
no padding. Layer counts (the masks' weights) only set priorities: a snap error goes to the
masks of fewer layers first. Host (CPU), vectorized, deterministic, numpy only (int64
positions and counts, float64 work; arrays in and out): the solver runs ~1000 ops a batch
on arrays of 1 to a few thousand elements, where a numpy op costs ~0.5-1 us and a torch op
1.5-6 us. The plan (``plan/cpplan.py``) makes tensors of its tables; nothing here does.

A rank holding part of a document fetches the keys its queries see and it does not hold:
for a causal layer everything before its first position, for a window one window, for
chunked attention its chunk's prefix. Across nodes one fetched key costs as much as ~1270
visible pairs, so the layout keeps what a rank holds of a document in few contiguous
stretches (a stretch [a, b) costs a), gives long bodies to ranks in whole shares, and cuts
filler near the start of an item. Which of the solver's ranks go to which node is decided
after it, by ``plan/nodes.py`` (a relabelling: every rank's share unchanged). Measurements,
figures and limits:
``docs/balanced-layout.md`` (from ``bench/plan.py``, results in ``bench/results/plan.json``).

How, in the order of the package's modules (each imports only those above it):

- ``args``: masks with layer counts, tile size, targets, the closed-form work of a prefix.
- ``profile``: what the masks imply: theta (the short length), the head rule, the excess
  functionals (with M masks, M - 1 of them).
- ``variants``: the attempts and their order; the first that meets the targets is taken.
- ``segments``: documents (or their chunks), which are long, document work, the excess
  over any positions, the prechecks that skip attempts that cannot balance.
- ``body_split``: where a body in position order is split (tail blocks, late parts).
- ``items``: segments cut into filler and bodies, each walked mirrored, by chunk pairs or
  in position order.
- ``nested``: long causal-like documents (and, ``nest_long``, long ones of small excess)
  cut into nested pieces, one a rank (``nest``).
- ``units``: tile pairs of each item's fold, with exact work and a break point.
- ``unit_list``: units in an order with cumulative values; orders that spread densities.
- ``rank_cut``: the rank-by-rank solver (exact, monotone; the locality variants).
- ``vector_cut``: the all-boundaries solvers and the snap (the fold variants).
- ``phases``: one attempt: phase 1 cuts the bodies by excess, phase 2 the filler.
- ``solve``: :func:`balanced_runs`: attempts in order, the best one's maximal runs.

Glossary:

- **segment**: what the layout cuts: a document, or each chunk of it when every mask is
  chunked with one size (chunks are then independent).
- **theta**: the shortest window or chunk (unbounded for causal and full masks). A segment
  of at most theta tokens is **short**: its work is L(L+1)/2 (causal-like) or L^2
  (full-like) under every mask, so tokens and ONE work column balance every mask on it.
- **excess**: the M - 1 functionals of (tokens, work per mask) that vanish on every short
  segment (Llama 4: causal work - chunked work): what short segments cannot balance.
  ``phi`` is the one the bodies are cut by (the rows oriented and scaled, summed).
- **long** segment: longer than theta and carrying more than negligible excess (0.75% of a
  rank's mean work under the mask with least work; less stays filler; 25% in the
  ``nest_long`` attempt, whose long segments of less are nested).
- **head**: the short-like start of a long segment (the first chunk, the part before a
  chunk-pair fold, or one window rounded up to tiles): filler, except where a window looks
  right (head, middle and tail are then all bodies). **body**: the rest; it carries the
  excess.
- **filler**: short segments and heads; cut in phase 2 to tokens and the **filler column**
  (the mask with least work).
- **item**: a stretch of positions walked in one order: **mirrored** (tiles 0, n-1, 1, ...),
  **chunk pairs** (a chunked + causal body: chunk i with chunk K-i) or **position order**.
- **fold**: an item's order of tiles; **unit**: tiles 2u and 2u+1 of a fold, the smallest
  piece that keeps the item's work per token. A cut inside a unit takes its first tile's
  first and its second tile's last tokens alternately, so the work of its first o tokens is
  about linear in o (exact at the **break point**, where the shorter tile ends).
- **tail block** / **remainder**: a chunked body in position order split at p: [p, L)
  holds whole rank shares of excess, [C, p) the rest (variant ``blocks``; with
  ``mirror_tail``, a tail block's stretch in a chunk where a whole share would hold more
  chunked work than a rank's mean is walked mirrored). **late** /
  **early part**: a window body split where a token's excess reaches the mean (``split``;
  with ``by_doc``, its document group's mean, the early part walked back from there, and
  each group's ranks taking tokens in proportion to excess, so that a rank's late and
  early stretches come from one document).
- **list**: units in an order, with cumulative (tokens, work per mask); **dense** /
  **sparse** list: items denser / sparser than the mean in the column being cut.
- **cut**: a token offset into a list; the cuts [cp+1] give rank k the units between cuts
  k and k+1. **share**: a total / cp. **target**: boundary k's cumulative share, k / cp
  of a total (phase 2: minus what phase 1 gave).
- **finer cut**: a cut inside a unit (off the tile grid). **snap**: moving a cut to the
  cheapest nearby item or unit boundary whose error stays within the **budgets** (tokens
  0.9% of T / cp; excess 0.5%, each mask 0.6% of its mean work per rank).
- **variant**: one attempt (how items are cut, which solver): the **locality variants**
  (``blocks``, ``split``, filler in position order, solved rank by rank) first, the
  **fold variants** (mirrored and chunk-pair items, solved for all boundaries at once and
  snapped) last: they are always feasible when anything is.
- **holders** (``few``, window + causal masks): where the window bodies carry little
  excess (documents little longer than the window), ``split`` gives them to the fewest
  ranks that keep every mask in balance (n0, and n0 + 1), not 1/cp of them to every rank
  (each such sliver costs its rank a window of keys to fetch); of the two, the layout
  whose most-fetching rank fetches least is taken.
- **nested pieces** (``nest``, masks that all look left, no bodies): a whole short
  segment of two or more ranks' work is cut into pieces of whole ranks, each a late
  stretch of it with an early one (in position order, the rank holding its end would
  fetch nearly all of it); their ranks take the sparsest filler. With window bodies of
  small excess (``nest_long``, tried first there, guarded), long documents of such small
  excess stay whole and are nested too, their ranks taking their excess less filler.
- **run**: (rank, document, start, length), maximal: what the plan's tables are built from.

Worked example (a test runs it): a Llama 4-like model with chunks of 16 (chunked x3 :
causal x1), tiles of 4, cp 2, documents of 40, 13, 8 and 13 tokens. Each rank's share is
37 tokens, 263 chunked and 519 causal pairs.

>>> import numpy as np
>>> from varlen_cp import AttnMask
>>> from varlen_cp.plan.balanced import balanced_runs, normalize_masks, prefix_work
>>> masks = normalize_masks([(AttnMask(chunk_size=16), 3), (AttnMask(), 1)])
>>> lengths = np.array([40, 13, 8, 13])
>>> [prefix_work(lengths, lengths, m).tolist() for m, _ in masks]  # chunked, causal
[[308, 91, 36, 91], [820, 91, 36, 91]]

theta is 16, so documents 1-3 are short (filler: L(L+1)/2 under both masks). Document 0 is
long: its excess, causal - chunked, is 820 - 308 = 512, two rank shares of 256.

>>> from varlen_cp.plan.balanced.profile import profile_of
>>> prof = profile_of(masks, 4)
>>> prof.theta, prof.head, prof.excess.tolist()  # excess row over (tokens, chunked, causal)
(16, 'chunk', [[0.0, -1.0, 1.0]])

The first variant, ``blocks``, makes the first chunk [0, 16) a head (filler) and the body
[16, 40) one tail block of two whole shares: rank 0 takes [16, 32) (392 - 136 = 256 of
excess), rank 1 [32, 40) (292 - 36 = 256), each ONE contiguous piece. Phase 2 gives rank 0
the 37 - 16 = 21 tokens and 263 - 136 = 127 chunked pairs it lacks (documents 1 and 2:
13 + 8 tokens, 91 + 36 pairs) and rank 1 its 29 tokens and 227 (the head, 16 tokens and
136, and document 3, 13 and 91):

>>> rank, doc, start, length = balanced_runs(lengths, 2, masks, 4)
>>> list(zip(rank.tolist(), doc.tolist(), start.tolist(), length.tolist()))
[(0, 0, 16, 16), (0, 1, 0, 13), (0, 2, 0, 8), (1, 0, 0, 16), (1, 0, 32, 8), (1, 3, 0, 13)]
>>> def held(r):  # tokens, chunked and causal pairs of rank r
...     d, a, n = doc[rank == r], start[rank == r], length[rank == r]
...     return [int(n.sum())] + [int((prefix_work(lengths[d], a + n, m)
...                                   - prefix_work(lengths[d], a, m)).sum()) for m, _ in masks]
>>> held(0), held(1)
([37, 263, 519], [37, 263, 519])

The fold variants (the fallback) would keep the head [0, 8) (16 - 8: document 0 ends 8
tokens into a chunk) and fold the body [8, 40) by chunk pairs, [8, 16) with [32, 40) and
[16, 32) with itself. Every unit then holds the body's work per token under both masks,
so cutting the body list by excess (two units a rank) balances both:

>>> from varlen_cp.plan.balanced.items import cut_items
>>> from varlen_cp.plan.balanced.units import units_of
>>> from varlen_cp.plan.balanced.variants import Variant
>>> units = units_of(cut_items(lengths, prof, 2, Variant()), lengths, prof)
>>> body = np.flatnonzero(units.body)
>>> list(zip(units.a_start[body].tolist(), units.b_start[body].tolist()))  # tile a, b
[(8, 36), (12, 32), (16, 28), (20, 24)]
>>> units.vec[body].tolist()  # tokens, chunked, causal of each unit
[[8.0, 68.0, 196.0], [8.0, 68.0, 196.0], [8.0, 68.0, 196.0], [8.0, 68.0, 196.0]]
"""

from .args import (DEFAULT_TILE_TOKENS, TOKEN_TOL, WORK_TOL, MaskWeights, normalize_masks,
                   prefix_work)
from .solve import balanced_runs

__all__ = ["DEFAULT_TILE_TOKENS", "TOKEN_TOL", "WORK_TOL", "MaskWeights", "balanced_runs",
           "normalize_masks", "prefix_work"]
