"""The head shape and dtype a layer's host tables and costs are computed for."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int


@dataclass(frozen=True)
class Shape:
    """Head shape and dtype of the layer being planned."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        # a part of every table key (hashed on each lookup): the fields' hash made once
        object.__setattr__(self, "_hash", hash((self.n_heads, self.n_kv_heads, self.head_dim,
                                                self.head_dim_v, self.dtype_bytes)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def kv_row(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.head_dim_v) * self.dtype_bytes


def make_shape(n_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int | None,
               dtype_bytes: int) -> Shape:
    """Validated :class:`Shape` (ValueError naming the field)."""
    values = (n_heads, n_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v,
              dtype_bytes)
    for name, value in zip(("n_heads", "n_kv_heads", "head_dim", "head_dim_v",
                            "dtype_bytes"), values):
        check_int(name, value, 1)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    return Shape(*values)


def kv_heads_per_rank(n_kv_heads: int, size: int) -> tuple[int, int]:
    """(K/V heads each rank holds after an all-to-all over ``size``, replication factor)."""
    if n_kv_heads % size == 0:
        return n_kv_heads // size, 1
    return 1, size // n_kv_heads
