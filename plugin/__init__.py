"""varlen-cp: context-parallel attention for packed variable-length sequences.

Layers (see DESIGN.md): ``varlen_cp.kernels`` (local varlen attention, no process groups),
``masks`` (the mask spec), ``plan`` (layout specs, host-side layouts and the plan),
``schedules`` (per-strategy host tables and costs), ``options`` (``AttnOptions``: how an
attention call runs), ``strategies`` (one file per CP communication strategy),
``attention`` (the public CP op and module), ``config`` (``CPConfig``: the integrations'
options, composing the two), ``sharding`` (batch sharding hooks), ``integrations``
(torchtitan, megatron adapters).
"""

from .attention import ContextParallelVarlenAttention, cp_varlen_attn
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan

__all__ = ["AttnMask", "AttnOptions", "CPPlan", "cp_varlen_attn",
           "ContextParallelVarlenAttention"]
__version__ = "0.1.0"
