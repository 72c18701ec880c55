"""What the graph-safe strategies share: K|V rows packed per token, equal-split exchanges
and the max-logit output."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..calls import head_max, no_max


def pair(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` split at ``width`` along its last dim (two views)."""
    return x[..., :width], x[..., width:]


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[n, Hkv * (D + Dv)]: each row's K then V (one message row per token)."""
    n = k.shape[0]
    return torch.cat([k.reshape(n, -1), v.reshape(n, -1)], 1)


def unpack_kv(x: torch.Tensor, hkv: int, d: int, dv: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_kv`: (K [n, Hkv, D], V [n, Hkv, Dv])."""
    k, v = pair(x, hkv * d)
    return k.reshape(-1, hkv, d), v.reshape(-1, hkv, dv)


def exchange(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """Equal-split ``all_to_all_single`` of [cp * m, ...] (block p to rank p; cp 1: x)."""
    if cp == 1:
        return x
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x, group=group)
    return recv


def max_part(row_max: torch.Tensor | None, n_heads: int, device: torch.device,
             need_max: bool) -> torch.Tensor:
    """The Function's third output: the per-head max (``need_max``) or the stand-in."""
    return head_max(row_max, n_heads, device) if need_max else no_max(device)
