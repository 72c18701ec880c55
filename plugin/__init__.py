"""varlen-cp: context-parallel attention for packed variable-length sequences.

Layers (see DESIGN.md): ``varlen_cp.kernels`` (local varlen attention, no process groups),
``masks`` (the mask spec), ``plan`` (host-side layouts and schedules), ``strategies`` (one
file per CP communication strategy), ``attention`` (the public CP op and module),
``sharding`` (batch sharding hooks), ``integrations`` (torchtitan, megatron adapters).
"""

from .attention import ContextParallelVarlenAttention, cp_varlen_attn
from .masks import AttnMask
from .plan import CPPlan

__all__ = ["AttnMask", "CPPlan", "cp_varlen_attn", "ContextParallelVarlenAttention"]
__version__ = "0.1.0"
