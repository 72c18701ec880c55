"""The balanced layout's arguments and targets: the model's masks with their layer counts,
the default tile size, the balance the layout aims at, the exact work of a document's
prefix and of runs per rank.

Everything here is checked or computed before any planning (the layout's spec,
``plan.layout_spec.Balanced``, checks its fields with these); the other modules of the
package take these values as given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...checks import check_positive
from ...masks import AttnMask
from ..runs import prefix_pairs

DEFAULT_TILE_TOKENS = 64  # the Triton kernels' query block (kernels/triton_common.py)

# Targets, max / mean over ranks minus 1: tokens, and each mask's work. An attempt that
# meets both is taken (solve.py); the snap budgets (phases.py) are shares of these.
TOKEN_TOL = 0.02
WORK_TOL = 0.03

MaskWeights = tuple[tuple[AttnMask, float], ...]


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
        out.append((mask, check_positive(f"masks[{i}] weight", weight)))
    return tuple(out)


def prefix_work(doc_len: Any, stop: Any, mask: AttnMask) -> np.ndarray:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens (all keys of the document) under ``mask``; elementwise, 0 <= stop <=
    doc_len (integer arrays, or anything ``np.asarray`` takes, such as a CPU tensor).
    Closed form per mask (``runs.prefix_pairs``), checked against a dense count in the
    tests."""
    return np.asarray(prefix_pairs(np.asarray(doc_len, dtype=np.int64),
                                   np.asarray(stop, dtype=np.int64), mask))


def runs_per_rank(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray,
                  lengths: np.ndarray, masks: Any, cp: int) -> np.ndarray:
    """float64 [cp, 1+M]: each rank's tokens and work under each of ``masks`` (AttnMask
    per column), counted from runs (rank, document, start, length) with the closed forms
    of ``runs.prefix_pairs``: the layout of ``phases.Layout.per_rank``."""
    dl = lengths[doc]
    cols = [length] + [prefix_pairs(dl, start + length, m) - prefix_pairs(dl, start, m)
                       for m in masks]
    return np.stack([np.bincount(rank, weights=c.astype(np.float64), minlength=cp)
                     for c in cols], 1)
