"""megatron-core integration: context-parallel varlen attention through the layer spec.

- ``VarlenCPCoreAttention``: a core-attention module (megatron's builder and forward
  protocols), THD and sbhd, every mask, CP strategies "p2p", "all_gather", "a2a", "a2a+p2p".
- ``swap_core_attention(spec, options)`` / ``get_varlen_cp_layer_spec(options, ...)``.
- ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, ...)``: TE-free THD sharding that
  returns megatron's packed params with the step's plan attached.
- ``VarlenCPOptions``: the ``[varlen_cp]`` settings (chunked attention, strategy, layout).
- ``clip_qk_step(model)``: QK-clip after the optimizer step (megatron's ``clip_qk`` on the
  max logits that ``config.qk_clip`` / ``log_max_attention_logit`` make each layer record);
  ``config.softmax_type`` "off-by-one" / "learnable" adds an attention sink.
- ``config.load_config(path)`` and ``train`` (``python -m varlen_cp.integrations.megatron.train``).

Needs megatron-core (tested with 0.16.1, Python 3.11); never imported by the core package.
"""

from .core_attention import VarlenCPCoreAttention
from .options import VarlenCPOptions, layer_mask, layer_strategy
from .qk_clip import clip_qk_step
from .sharding import (VarlenCPPackedSeqParams, get_thd_batch_on_this_cp_rank,
                       packed_seq_params_for)
from .spec import core_attention_spec, get_varlen_cp_layer_spec, swap_core_attention

__all__ = ["VarlenCPCoreAttention", "VarlenCPOptions", "VarlenCPPackedSeqParams", "clip_qk_step",
           "core_attention_spec", "get_thd_batch_on_this_cp_rank", "get_varlen_cp_layer_spec",
           "layer_mask", "layer_strategy", "packed_seq_params_for", "swap_core_attention"]
