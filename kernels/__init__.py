"""Local varlen attention kernels: Triton for GPUs, a PyTorch twin for CPUs.

No process groups and no framework imports live here (DESIGN.md's lowest layer).
Public: ``varlen_attn`` (differentiable, flash_attn_varlen_func-like), ``varlen_attn_fwd`` /
``varlen_attn_bwd`` (the halves CP strategies call per step), ``merge_attn_partials`` (LSE
merge), ``block_sizes_for`` and ``build_block_schedule`` (host-side tile schedules).
"""

from .api import block_sizes_for, varlen_attn, varlen_attn_bwd, varlen_attn_fwd
from .merge import merge_attn_partials
from .schedule import BlockSchedule, build_block_schedule

__all__ = ["varlen_attn", "varlen_attn_fwd", "varlen_attn_bwd", "merge_attn_partials",
           "block_sizes_for", "BlockSchedule", "build_block_schedule"]
