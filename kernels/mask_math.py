"""Mask interval math on plain integers: the one fact every layer builds on.

Every supported mask gives a query at position ``p`` (counted from its document start)
one contiguous interval of visible key positions ``[lo(p), hi(p)]``, and both ends never
decrease as ``p`` grows. The inverse holds too: a key at position ``k`` is seen by the
query positions ``[qlo(k), qhi(k)]``. This module evaluates those intervals and the
pairwise predicate on int tensors, vectorized, on any device (the intervals also on numpy
arrays, for the host planner).

Parameters are primitives so kernels and the host planner share them without importing
the plugin layer: ``causal`` (bool), ``window_left`` / ``window_right`` (flash-attn's
convention, -1 = unbounded) and ``chunk_size`` (Llama 4 local attention, 0 = no chunks).

Padding: an explicit position < 0 sees nothing and is seen by nothing. Callers that use
implicit bottom-right positions (flash-attn's alignment, where a query position can be
negative without being padding) pass ``negative_is_padding=False``.
"""

from __future__ import annotations

import numpy as np
import torch

# Stand-in for "unbounded" in interval ends; far above any real position (int64 math).
UNBOUNDED = 1 << 40


def floor_div(x: torch.Tensor, d: int) -> torch.Tensor:
    """Floor division on ints (torch's ``//`` floors already; named for the kernels' twin)."""
    return torch.div(x, d, rounding_mode="floor")


def _as_int64(x):
    """``x`` as int64 and its array module: torch tensors for the kernels' twin and the
    checks, numpy arrays for the host planner (whose per-op cost on a few hundred block
    ends is ~0.5 us in numpy against ~3-5 us in torch)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.int64, copy=False), np
    return x.to(torch.int64), torch


def _at_least(x, v: int):
    return np.maximum(x, v) if isinstance(x, np.ndarray) else torch.clamp(x, min=v)


def key_interval(
    q_pos, causal: bool, window_left: int, window_right: int, chunk_size: int,
    *, negative_is_padding: bool = True,
):
    """Inclusive ``(lo, hi)`` of key positions visible to each query position (int64, a
    torch tensor or a numpy array as given).

    Empty intervals (padding queries) come back as ``lo > hi``. Unbounded ends are
    ``-UNBOUNDED`` / ``UNBOUNDED``; callers clip them to the key positions they hold.
    """
    p, xp = _as_int64(q_pos)
    lo = xp.full_like(p, -UNBOUNDED)
    hi = xp.full_like(p, UNBOUNDED)
    if causal:
        hi = xp.minimum(hi, p)
    if window_left >= 0:
        lo = xp.maximum(lo, p - window_left)
    if window_right >= 0:
        hi = xp.minimum(hi, p + window_right)
    if chunk_size:
        start = (p // chunk_size) * chunk_size    # floors in both modules
        lo = xp.maximum(lo, start)
        hi = xp.minimum(hi, start + chunk_size - 1)
    # Keys at negative positions are padding, so no query ever sees below 0.
    lo = _at_least(lo, 0)
    if negative_is_padding:
        pad = p < 0
        lo = xp.where(pad, 1, lo)
        hi = xp.where(pad, 0, hi)
    return lo, hi


def query_interval(
    k_pos, causal: bool, window_left: int, window_right: int, chunk_size: int,
):
    """Inclusive ``(lo, hi)`` of query positions that see each key position (int64, a
    torch tensor or a numpy array as given).

    The inverse of :func:`key_interval` (p sees k  <=>  qlo(k) <= p <= qhi(k)), used to
    bound the query loop of the dK/dV pass. Padding keys (k < 0) get an empty interval.
    """
    k, xp = _as_int64(k_pos)
    lo = xp.full_like(k, -UNBOUNDED)
    hi = xp.full_like(k, UNBOUNDED)
    if causal:
        lo = xp.maximum(lo, k)
    if window_right >= 0:
        lo = xp.maximum(lo, k - window_right)
    if window_left >= 0:
        hi = xp.minimum(hi, k + window_left)
    if chunk_size:
        start = (k // chunk_size) * chunk_size
        lo = xp.maximum(lo, start)
        hi = xp.minimum(hi, start + chunk_size - 1)
    pad = k < 0
    return xp.where(pad, 1, lo), xp.where(pad, 0, hi)


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window_left: int,
    window_right: int, chunk_size: int, *, negative_is_padding: bool = True,
) -> torch.Tensor:
    """Boolean ``[..., Lq, Lk]`` visibility of every (query, key) pair (broadcast outer)."""
    lo, hi = key_interval(q_pos, causal, window_left, window_right, chunk_size,
                          negative_is_padding=negative_is_padding)
    k = k_pos.to(torch.int64).unsqueeze(-2)
    return (k >= lo.unsqueeze(-1)) & (k <= hi.unsqueeze(-1))


def count_visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window_left: int,
    window_right: int, chunk_size: int,
) -> int:
    """Exact number of visible (query, key) pairs between two blocks of one document.

    ``k_pos`` may be any set of distinct positions (a chunk, two chunks, a gather);
    cost is O((Lq + Lk) log Lk), never Lq x Lk. Host-side planning helper.
    """
    k_sorted = torch.sort(k_pos.to(torch.int64)[k_pos >= 0]).values
    lo, hi = key_interval(q_pos, causal, window_left, window_right, chunk_size)
    n = torch.searchsorted(k_sorted, hi, right=True) - torch.searchsorted(k_sorted, lo)
    return int(torch.clamp(n, min=0).sum())


def implicit_positions(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's bottom-right aligned positions, materialized (int64, device of cu).

    Query i of a segment with lengths (Lq, Lk) sits at ``i + Lk - Lq``; key j at ``j``.
    Computed with device ops and known output sizes, so it never syncs with the host.
    """
    def offsets(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        lens = (cu[1:] - cu[:-1]).to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens,
                                      output_size=total)
        idx = torch.arange(total, device=cu.device, dtype=torch.int64)
        return idx - cu.to(torch.int64)[seg], seg

    q_off, q_seg = offsets(cu_seqlens_q, total_q)
    k_off, _ = offsets(cu_seqlens_k, total_k)
    shift = (cu_seqlens_k[1:] - cu_seqlens_k[:-1] - cu_seqlens_q[1:] + cu_seqlens_q[:-1])
    return q_off + shift.to(torch.int64)[q_seg], k_off
