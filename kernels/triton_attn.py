"""Triton varlen attention kernels in one namespace (for tests and benchmarks; the api layer
imports ``triton_fwd`` / ``triton_bwd`` directly).

``triton_fwd`` / ``triton_bwd`` take THD tensors with cu_seqlens and the package's
position-based mask (causal, sliding window, chunks, padding positions); see
``triton_fwd.py`` and ``triton_bwd.py`` for the kernels and their limits, and
``triton_common.py`` for the shared mask math and tile-size choice.
"""

from __future__ import annotations

from .triton_bwd import triton_bwd
from .triton_common import triton_block_sizes
from .triton_fwd import triton_fwd

__all__ = ["triton_block_sizes", "triton_fwd", "triton_bwd"]
