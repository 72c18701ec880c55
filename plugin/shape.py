"""``AttnShape``: the one description of a layer's heads, head dims, dtype and softmax
extras. The planner's costs and host tables are computed (and cached) for one, the per-call
resolution (``varlen_cp.resolve``) reads one off the call's tensors, and the integrations
give one for their model ahead of the step; the same value in all three places is what makes
a call find what was prepared for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_bool, check_int

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True)
class AttnShape:
    """Head counts, head dims and dtype of a model's attention (what tile sizes and the
    ``auto`` cost model depend on), and the softmax extras its layers use, which decide
    which calls FlashAttention may take: ``lse_grad`` (attention sinks, or a returned
    LSE: FA2 / FA3 cannot take its gradient) and ``row_max`` (QK-clip's max logit).
    ``head_dim_v``: V's head dim, None when it is ``head_dim`` (a V head dim equal to
    ``head_dim`` is stored as None, so equal shapes compare equal however they were
    written, and ``dataclasses.replace(shape, head_dim=...)`` keeps V's equal);
    :attr:`value_dim` reads it as an int."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    dtype: torch.dtype = torch.bfloat16
    lse_grad: bool = False
    row_max: bool = False

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            check_int(f"AttnShape.{name}", getattr(self, name), 1)
        check_int("AttnShape.head_dim_v", self.head_dim_v, 1, optional=True)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"AttnShape: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        check_bool("AttnShape.lse_grad", self.lse_grad)
        check_bool("AttnShape.row_max", self.row_max)
        if self.dtype not in DTYPES:
            raise ValueError(f"AttnShape.dtype must be torch.float16, bfloat16 or float32, "
                             f"got {self.dtype!r}")
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)
        # a part of every table key (hashed on each lookup): the fields' hash made once
        object.__setattr__(self, "_hash", hash((self.n_heads, self.n_kv_heads, self.head_dim,
                                                self.head_dim_v, self.dtype, self.lse_grad,
                                                self.row_max)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def value_dim(self) -> int:
        """V's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def costs(self) -> "AttnShape":
        """This shape without the softmax extras: what costs, stage counts and host tables
        depend on (their cache keys use it)."""
        if not (self.lse_grad or self.row_max):
            return self
        return AttnShape(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                         head_dim=self.head_dim, head_dim_v=self.head_dim_v, dtype=self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def kv_row(self) -> int:
        """Bytes of one token's K and V over all K/V heads."""
        return self.n_kv_heads * (self.head_dim + self.value_dim) * self.dtype_bytes

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lse_grad: bool = False,
           row_max: bool = False) -> "AttnShape":
        """The shape of a call's q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], which the
        caller has checked (``kernels.validation.check_qkv``: head counts, GQA, head dims,
        dtype), so the fields are not checked again: this runs on every layer call."""
        shape = object.__new__(cls)
        d, dv = q.shape[2], v.shape[2]
        fields = (q.shape[1], k.shape[1], d, None if dv == d else dv, q.dtype, lse_grad,
                  row_max)
        for name, value in zip(_FIELDS, fields):
            object.__setattr__(shape, name, value)
        object.__setattr__(shape, "_hash", hash(fields))
        return shape


_FIELDS = ("n_heads", "n_kv_heads", "head_dim", "head_dim_v", "dtype", "lse_grad", "row_max")


def kv_heads_per_rank(n_kv_heads: int, size: int) -> tuple[int, int]:
    """(K/V heads each rank holds after an all-to-all over ``size``, replication factor)."""
    if n_kv_heads % size == 0:
        return n_kv_heads // size, 1
    return 1, size // n_kv_heads
