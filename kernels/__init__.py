"""Local varlen attention kernels: Triton for GPUs, a PyTorch twin for CPUs.

No process groups and no framework imports live here (docs/design.md's lowest layer).
Public: ``varlen_attn`` (differentiable, flash_attn_varlen_func-like), ``varlen_attn_fwd`` /
``varlen_attn_bwd`` (the validated non-autograd halves), ``varlen_fwd_unchecked`` /
``varlen_bwd_unchecked`` (the same, unvalidated, for CP strategies that validated once),
``varlen_bwd_stats`` (the backward's per-row terms, computed once per layer by CP strategies),
``resolve_backend``, ``merge_attn_partials`` (LSE merge), ``block_sizes_for`` and
``build_block_schedule`` (host-side tile schedules),
``apply_softmax_sink`` / ``check_softmax_args`` (attention sinks, applied after any merge)
and ``max_logit_of`` (per-head max logit from the kernels' row maxima).
"""

from .api import (
    block_sizes_for, resolve_backend, varlen_attn, varlen_attn_bwd, varlen_attn_fwd,
    varlen_attn_unchecked, varlen_bwd_stats, varlen_bwd_unchecked, varlen_fwd_unchecked,
)
from .merge import merge_attn_partials, merge_attn_partials_
from .schedule import BlockSchedule, build_block_schedule
from .sink import SOFTMAX_TYPES, apply_softmax_sink, check_softmax_args, max_logit_of

__all__ = ["varlen_attn", "varlen_attn_fwd", "varlen_attn_bwd", "varlen_fwd_unchecked",
           "varlen_bwd_unchecked", "resolve_backend", "merge_attn_partials", "merge_attn_partials_",
           "block_sizes_for", "BlockSchedule", "build_block_schedule", "apply_softmax_sink",
           "check_softmax_args", "max_logit_of", "SOFTMAX_TYPES", "varlen_attn_unchecked",
           "varlen_bwd_stats"]
