"""Layout specs: which layout a plan uses, with that layout's own options and no others.

One small frozen class per layout, checked in ``__post_init__`` (ValueError naming the
field and value); ``CPPlan.build`` takes one and checks only what involves cp (``te``'s
``pad_multiple`` must be a multiple of 2*cp). What each layout does: ``plan/layouts.py``.

- :class:`Balanced` (``CPPlan.build``'s and the integrations' default): tokens and the work
  of each of ``masks`` equal on every rank, documents cut on a grid of ``tile_tokens``.
  Without masks it balances causal attention.
- :class:`DualChunk`: documents of at least 2*cp*``min_chunk_tokens`` tokens in 2*cp
  chunks, rank r holding chunks r and 2*cp-1-r; shorter ones placed whole or as chunk
  pairs.
- :class:`TE`: TransformerEngine's padded THD layout (``pad_multiple``: None = 2*cp).
- :class:`Contiguous`: rank r holds the r-th of cp near-equal slices.

:func:`layout_spec` builds a spec from a layout name and flat options (the TOML keys of
``varlen_cp.CPConfig``); an option of another layout is a ValueError: it would otherwise be
written and silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from ..checks import check_int
from .balanced import DEFAULT_TILE_TOKENS, MaskWeights, normalize_masks


@dataclass(frozen=True, kw_only=True)
class DualChunk:
    """``dual_chunk``: documents shorter than 2*cp*``min_chunk_tokens`` stay whole (or go
    as chunk pairs when long for a rank's share)."""

    name: ClassVar[str] = "dual_chunk"
    min_chunk_tokens: int = 64

    def __post_init__(self) -> None:
        check_int("min_chunk_tokens", self.min_chunk_tokens, 1)


@dataclass(frozen=True, kw_only=True)
class TE:
    """``te``: each document padded at its end to a multiple of ``pad_multiple`` (a multiple
    of 2*cp; None: 2*cp, e.g. 2*cp*tp for Megatron's sequence parallelism)."""

    name: ClassVar[str] = "te"
    pad_multiple: int | None = None

    def __post_init__(self) -> None:
        check_int("pad_multiple", self.pad_multiple, 1, optional=True)


@dataclass(frozen=True, kw_only=True)
class Contiguous:
    """``contiguous``: the packed sequence in cp near-equal slices, no options."""

    name: ClassVar[str] = "contiguous"


@dataclass(frozen=True, kw_only=True)
class Balanced:
    """``balanced``: every mask's work and the tokens equal on every rank.

    masks: the model's masks, each an AttnMask or (AttnMask, layer count), e.g. Llama 4's
    ``[(AttnMask(chunk_size=8192), 3), (AttnMask(), 1)]``; stored as ``((AttnMask,
    float), ...)``; None or empty: causal. Every mask's work is balanced on its own (each
    layer type waits for its own slowest rank); the counts only set priorities.
    tile_tokens: documents are cut at multiples of it (the Triton kernels' query block) or
    at their ends, apart from a few finer cuts per rank boundary (``plan/balanced/``).
    """

    name: ClassVar[str] = "balanced"
    masks: MaskWeights | Any = None
    tile_tokens: int = DEFAULT_TILE_TOKENS

    def __post_init__(self) -> None:
        # Stored normalized, so that equal specs are equal and hashable (as AttnMask
        # stores its window).
        object.__setattr__(self, "masks", normalize_masks(self.masks))
        check_int("tile_tokens", self.tile_tokens, 1)


LayoutSpec = Union[Balanced, DualChunk, TE, Contiguous]
SPECS: dict[str, type] = {s.name: s for s in (Balanced, DualChunk, TE, Contiguous)}
LAYOUTS: tuple[str, ...] = ("dual_chunk", "te", "contiguous", "balanced")
"""Every layout name (the order users have seen in error messages)."""


def layout_spec(layout: Any, **options: Any) -> LayoutSpec:
    """The spec of layout ``layout`` (a name; a spec is returned as it is when no options
    come with it) with ``options`` (None values: the layout's defaults). An option of
    another layout is a ValueError naming it, its value and the layout."""
    if isinstance(layout, tuple(SPECS.values())):
        if options:
            raise ValueError(f"layout: {layout!r} is a layout spec; give its options in it, "
                             f"got {sorted(options)} too")
        return layout
    if not isinstance(layout, str) or layout not in SPECS:
        raise ValueError(f"layout must be one of {LAYOUTS} or a layout spec "
                         f"(varlen_cp.plan.Balanced, DualChunk, TE, Contiguous), got "
                         f"{layout!r}")
    cls = SPECS[layout]
    own = {f.name for f in fields(cls)}
    for key, value in options.items():
        if key in own or value is None:
            continue
        owner = [n for n, s in SPECS.items() if key in {f.name for f in fields(s)}]
        if not owner:
            raise ValueError(f"{key} is not an option of any layout (layouts: {LAYOUTS})")
        raise ValueError(f"{key} applies to layout {owner[0]!r} only, got {key}={value!r} "
                         f"with layout={layout!r}")
    return cls(**{k: v for k, v in options.items() if v is not None})
