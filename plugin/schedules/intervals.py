"""Numpy twins of ``kernels.mask_math.key_interval`` / ``query_interval`` for host planning.

The tile schedules evaluate the mask's intervals on a few hundred block ends per call, and
numpy does an op on such a small array in ~0.5 us against torch's ~3-5 us (CPU dispatch),
so the planner keeps its integer math in numpy and hands torch tensors to the kernels only
at the end. Same values as the torch functions (tests/test_schedule_cache.py compares them).
"""

from __future__ import annotations

import numpy as np

from ..kernels.mask_math import UNBOUNDED
from ..masks import AttnMask


def key_interval(mask: AttnMask, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 inclusive (first, last) key position each query position ``p`` sees; padding
    queries (p < 0) get an empty interval (first > last)."""
    causal, left, right, chunk = mask.params
    lo = np.full(p.shape, -UNBOUNDED, dtype=np.int64)
    hi = np.full(p.shape, UNBOUNDED, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, p)
    if left >= 0:
        lo = np.maximum(lo, p - left)
    if right >= 0:
        hi = np.minimum(hi, p + right)
    if chunk:
        start = (p // chunk) * chunk
        lo = np.maximum(lo, start)
        hi = np.minimum(hi, start + chunk - 1)
    lo = np.maximum(lo, 0)
    pad = p < 0
    return np.where(pad, 1, lo), np.where(pad, 0, hi)


def query_interval(mask: AttnMask, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 inclusive (first, last) query position that sees each key position ``k``;
    padding keys (k < 0) get an empty interval."""
    causal, left, right, chunk = mask.params
    lo = np.full(k.shape, -UNBOUNDED, dtype=np.int64)
    hi = np.full(k.shape, UNBOUNDED, dtype=np.int64)
    if causal:
        lo = np.maximum(lo, k)
    if right >= 0:
        lo = np.maximum(lo, k - right)
    if left >= 0:
        hi = np.minimum(hi, k + left)
    if chunk:
        start = (k // chunk) * chunk
        lo = np.maximum(lo, start)
        hi = np.minimum(hi, start + chunk - 1)
    pad = k < 0
    return np.where(pad, 1, lo), np.where(pad, 0, hi)
