"""What every strategy's runtime shares: the kernel calls, empty results, the max-logit and
LSE-gradient conventions, and flat message packing.

``Attn`` holds the constants of one ``cp_varlen_attn`` call (mask, scale, backend) and runs
one kernel call of a strategy on its host-built ``KernelCall`` tables. The inputs were
validated once by ``varlen_cp.attention`` and the tables are built by the plan's schedules,
so the per-step calls go through the kernels' unchecked entry: no argument check, no host
sync, no device copy per ring step or per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..kernels import max_logit_of, varlen_bwd_stats, varlen_bwd_unchecked, varlen_fwd_unchecked
from ..masks import AttnMask
from ..schedules.holders import KernelCall


@dataclass(frozen=True)
class Attn:
    """The per-call constants every kernel invocation of a strategy shares.
    ``backend``: resolved ("triton" or "torch")."""

    mask: AttnMask
    scale: float
    backend: str

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: KernelCall,
            need_max: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, lse, row_max): row_max fp32 [Hq, Tq] when ``need_max``, else None."""
        causal, wl, wr, chunk = self.mask.params
        return varlen_fwd_unchecked(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, self.scale,
                                    causal, wl, wr, chunk, c.q_pos, c.k_pos, self.backend,
                                    c.schedule, need_max)

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, c: KernelCall,
            dlse: torch.Tensor | None = None, stats: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This call's (dq, dk, dv) given the FINAL out/lse and their gradients.
        ``stats``: :meth:`bwd_stats` of the same dout, out, lse, dlse (None: made here)."""
        causal, wl, wr, chunk = self.mask.params
        return varlen_bwd_unchecked(dout, q, k, v, out, lse, dlse, c.cu_q, c.cu_k, c.max_q,
                                    c.max_k, self.scale, causal, wl, wr, chunk, c.q_pos,
                                    c.k_pos, self.backend, c.schedule, stats)

    def bwd_stats(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dlse: torch.Tensor | None = None) -> torch.Tensor:
        """The backward's per-row terms (delta, base-2 LSE) of the FINAL out/lse: the same
        for every step of a layer's backward, so computed once and passed to :meth:`bwd`."""
        return varlen_bwd_stats(dout, out, lse, dlse, self.backend)


def empty_attn(q: torch.Tensor, dv: int, need_max: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, row_max) of queries that see no key: 0, -inf, -inf."""
    hq, t = q.shape[1], q.shape[0]
    lse = torch.full((hq, t), float("-inf"), device=q.device)
    return (q.new_zeros(t, hq, dv), lse,
            torch.full((hq, t), float("-inf"), device=q.device) if need_max else None)


def head_max(row_max: torch.Tensor | None, n_heads: int, device: torch.device
             ) -> torch.Tensor:
    """fp32 [Hq]: the max over rows of ``row_max`` [Hq, T] (-inf where nothing is
    visible, or when ``row_max`` is None: a rank that computed nothing)."""
    if row_max is None:
        return torch.full((n_heads,), float("-inf"), device=device)
    return max_logit_of(row_max)


def no_max(device: torch.device) -> torch.Tensor:
    """Stand-in third output of the autograd functions when the max is not asked for
    (their outputs must be tensors); ``maybe_max`` turns it into None."""
    return torch.empty(0, device=device)


def maybe_max(max_part: torch.Tensor) -> torch.Tensor | None:
    """None for the :func:`no_max` stand-in, else ``max_part`` itself."""
    return max_part if max_part.numel() else None


def dlse_or_none(dlse: torch.Tensor | None) -> torch.Tensor | None:
    """The LSE gradient handed to backward, or None when the LSE fed nothing (no
    materialized zeros: the kernels then skip the term)."""
    if dlse is None or dlse.numel() == 0:
        return None
    return dlse.float().contiguous()


def global_rank(group: Any, group_rank: int) -> int:
    """Global rank of ``group_rank`` (P2P ops address global ranks)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def pack_flat(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One flat buffer holding ``tensors`` back to back (one message instead of several)."""
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])


def unpack_flat(buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous views of ``buf`` with ``shapes`` (the inverse of :func:`pack_flat`)."""
    out, at = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(buf[at:at + n].view(s))
        at += n
    return out

