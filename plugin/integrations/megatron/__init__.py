"""megatron-core integration: context-parallel varlen attention through the layer spec.

- ``VarlenCPCoreAttention``: a core-attention module (megatron's builder and forward
  protocols; a ``varlen_cp.ContextParallelVarlenAttention`` with the layer's mask and
  ``AttnOptions``), THD and sbhd, every mask, CP strategies "p2p", "all_gather", "a2a",
  "a2a+p2p", "dispatch", "auto".
- ``VarlenCPSelfAttention``: megatron's ``SelfAttention`` whose THD RoPE takes each token's
  position from the plan, so every layout (default "balanced") is correct.
- ``swap_core_attention(spec, options)`` / ``get_varlen_cp_layer_spec(options, ...)``: both.
- ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, ...)``: TE-free THD sharding that
  returns megatron's packed params with the step's plan attached (layers never plan); in
  the graph-safe mode they are equal for every batch, so megatron's per-layer CUDA graphs
  (``cuda_graph_impl="local"``) replay them.
- ``PrefetchedTHDBatches(source, config=..., options=...)``: the data iterator that builds
  the next batch's plan and tables on a background thread.
- ``VarlenCPOptions``: ``varlen_cp.CPConfig`` plus megatron's extras (chunked attention,
  per-layer strategies, each layer's ``AttnOptions`` from ``layer_options``);
  ``model_attention(config, options)``: the layer masks, options and head shape the
  planner uses.
- ``clip_qk_step(model)``: QK-clip after the optimizer step (megatron's ``clip_qk`` on the
  max logits that ``config.qk_clip`` / ``log_max_attention_logit`` make each layer record);
  ``config.softmax_type`` "off-by-one" / "learnable" adds an attention sink.
- MoE layers (``moe.py``): the local batches carry ``padding_mask`` (the plan's padding, for
  ``GPTModel(..., padding_mask=)``), MoE specs get ``VarlenCPTopKRouter`` (megatron's router,
  its padding mask fixed), ``update_expert_bias(models)`` for loops without megatron's
  ``finalize_model_grads``.
- ``config.load_config(path)`` and ``train`` (``python -m varlen_cp.integrations.megatron.train``).

Needs megatron-core (tested with 0.16.1, Python 3.11); never imported by the core package.
"""

from .core_attention import VarlenCPCoreAttention
from .moe import VarlenCPTopKRouter, padding_mask, update_expert_bias
from .options import VarlenCPOptions, layer_mask, layer_strategy
from .planning import ModelAttention, model_attention, plan_batch
from .prefetch import PrefetchedTHDBatches
from .qk_clip import clip_qk_step
from .rope import VarlenCPSelfAttention
from .sharding import (VarlenCPPackedSeqParams, get_thd_batch_on_this_cp_rank,
                       packed_seq_params_for)
from .spec import core_attention_spec, get_varlen_cp_layer_spec, swap_core_attention

__all__ = ["ModelAttention", "PrefetchedTHDBatches", "VarlenCPCoreAttention",
           "VarlenCPOptions", "VarlenCPPackedSeqParams", "VarlenCPSelfAttention",
           "VarlenCPTopKRouter", "clip_qk_step", "core_attention_spec",
           "get_thd_batch_on_this_cp_rank", "get_varlen_cp_layer_spec", "layer_mask",
           "layer_strategy", "model_attention", "packed_seq_params_for", "padding_mask",
           "plan_batch", "swap_core_attention", "update_expert_bias"]
