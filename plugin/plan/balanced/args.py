"""The balanced layout's arguments and targets: the model's masks with their layer counts,
the tile size, the balance the layout aims at, and the exact work of a document's prefix.

Everything here is checked or computed before any planning; the other modules of the
package take these values as given.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ...masks import AttnMask
from ..runs import prefix_pairs

DEFAULT_TILE_TOKENS = 64  # the Triton kernels' query block (kernels/triton_common.py)
DEFAULT_CHUNK_TOKENS = DEFAULT_TILE_TOKENS  # the old name of the same parameter

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


def describe(masks: MaskWeights, tile_tokens: int) -> Sequence[Any]:
    """Stable description of the layout's parameters (for the plan's fingerprint)."""
    return (tuple((m.params, w) for m, w in masks), tile_tokens)


def prefix_work(doc_len: torch.Tensor, stop: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    """int64: visible pairs of the queries at positions [0, stop) of documents of
    ``doc_len`` tokens (all keys of the document) under ``mask``; elementwise, 0 <= stop <=
    doc_len. Closed form per mask, checked against a dense count in the tests."""
    return prefix_pairs(doc_len, stop, mask)
