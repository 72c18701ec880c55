"""Attention masks as data: the spec every layer of the plugin shares.

An ``AttnMask`` is the (causal, window, chunk) triple of docs/design.md's mask table. It is frozen
and hashable, so plans cache per-mask schedules under it (Llama 4's chunked and global layers
share one plan). The interval math is delegated to ``varlen_cp.kernels.mask_math`` so that the
kernels, the planner and this spec can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import is_int
from .kernels import mask_math


@dataclass(frozen=True, kw_only=False)
class AttnMask:
    """Which keys a query at position p (within its document) sees.

    causal:       k <= p.
    window_size:  (left, right), flash-attn's convention: p - left <= k <= p + right;
                  -1 leaves that side unbounded.
    chunk_size:   Llama 4 chunked local attention: k // chunk_size == p // chunk_size.
    All conditions that are set apply together (e.g. chunked + causal is Llama 4's RoPE layer).
    """

    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise ValueError(f"AttnMask.causal must be a bool, got {self.causal!r}")
        ws = self.window_size
        if (not isinstance(ws, (tuple, list)) or len(ws) != 2
                or not all(is_int(w) for w in ws)):
            raise ValueError(f"AttnMask.window_size must be a pair of ints, got {ws!r}")
        if ws[0] < -1 or ws[1] < -1:
            raise ValueError(f"AttnMask.window_size entries must be >= -1, got {tuple(ws)!r}")
        object.__setattr__(self, "window_size", (int(ws[0]), int(ws[1])))
        c = self.chunk_size
        if c is not None and (not is_int(c) or c < 1):
            raise ValueError(f"AttnMask.chunk_size must be None or an int >= 1, got {c!r}")
        # Masks key every cached table (hashed on each lookup, hundreds per batch): the
        # hash of the fields, as the dataclass would compute it, made once.
        object.__setattr__(self, "_hash", hash((self.causal, self.window_size,
                                                self.chunk_size)))

    def __hash__(self) -> int:
        return self._hash

    # Primitive form understood by the kernels and mask_math.
    @property
    def params(self) -> tuple[bool, int, int, int]:
        """(causal, window_left, window_right, chunk_size or 0)."""
        return (self.causal, self.window_size[0], self.window_size[1], self.chunk_size or 0)

    def kernel_kwargs(self) -> dict:
        """Keyword arguments of ``varlen_attn`` / ``varlen_attn_fwd`` for this mask."""
        return {"causal": self.causal, "window_size": self.window_size,
                "chunk_size": self.chunk_size}

    @property
    def is_local(self) -> bool:
        """True when a query sees a bounded range of keys (window or chunk), so far-away
        K/V never matters; CP strategies use it to stop rings early and fetch less."""
        return self.chunk_size is not None or (
            self.window_size[0] >= 0 and (self.causal or self.window_size[1] >= 0))

    def key_interval(self, q_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inclusive (first, last) visible key position per query position (int64).

        Padding queries (position < 0) get an empty interval (first > last). Unbounded ends
        are clipped at 0 below and ``mask_math.UNBOUNDED`` above. A numpy array in gives
        numpy out (the host planner's form).
        """
        return mask_math.key_interval(q_positions, *self.params)

    def query_interval(self, k_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inclusive (first, last) query position that sees each key position (int64; numpy
        in, numpy out)."""
        return mask_math.query_interval(k_positions, *self.params)

    def visible(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Boolean [Lq, Lk] visibility matrix (small blocks only: it is dense)."""
        return mask_math.visible(q_positions, k_positions, *self.params)

    def count_visible(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> int:
        """Exact number of visible pairs between a query block and a key block of one
        document (keys: any set of distinct positions). O((Lq + Lk) log Lk)."""
        return mask_math.count_visible(q_positions, k_positions, *self.params)

    def document_work(self, length: int) -> int:
        """Visible pairs inside one whole document of ``length`` tokens."""
        pos = torch.arange(length)
        return self.count_visible(pos, pos)


CAUSAL = AttnMask(causal=True)
FULL = AttnMask(causal=False)
