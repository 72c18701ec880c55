"""Local varlen attention kernels: Triton for GPUs, a PyTorch twin for CPUs,
FlashAttention where a call is in its form.

No process groups and no framework imports live here (docs/design.md's lowest layer).
Public (``__all__``, frozen by tests/package/test_public_api.py): the op ``varlen_attn``
(differentiable, flash_attn_varlen_func-like), its validated non-autograd halves
``varlen_attn_fwd`` / ``varlen_attn_bwd``, the LSE merge ``merge_attn_partials``, and the
host-side tile schedule (``BlockSchedule``, ``build_block_schedule``, ``block_sizes_for``).
What the CP strategies use besides (the unvalidated halves and the backward's per-row terms
in ``api``, the in-place merge in ``merge``, attention sinks and the max logit in ``sink``,
FlashAttention in ``flash``) is imported from those modules: internal, free to change.
"""

from .api import block_sizes_for, varlen_attn, varlen_attn_bwd, varlen_attn_fwd
from .merge import merge_attn_partials
from .schedule import BlockSchedule, build_block_schedule

__all__ = ["varlen_attn", "varlen_attn_fwd", "varlen_attn_bwd", "merge_attn_partials",
           "BlockSchedule", "build_block_schedule", "block_sizes_for"]
