"""QK-clip with varlen_cp's core attention: megatron's own ``clip_qk`` protocol, CP-aware.

megatron-core 0.16.1 implements QK-clip (MuonClip) in ``Attention.clip_qk``: it reads
``core_attention.current_max_attn_logits`` ([local Hq], max over the step's micro-batches),
rescales the layer's ``linear_qkv`` Q and K rows by (tau / max_logit) ** alpha and
** (1 - alpha) (``qk_clip_threshold`` = tau, ``qk_clip_alpha``), and resets the value.
``VarlenCPCoreAttention`` fills that attribute when ``config.qk_clip`` or
``config.log_max_attention_logit`` is set, already reduced over the CP group; this module
adds the data-parallel MAX (other DP ranks saw other batches) and calls megatron's clip.
megatron's own ``megatron.core.optimizer.qk_clip.clip_qk`` expects DDP-wrapped chunks
(``chunk.module.module.decoder``); ``clip_qk_step`` takes the bare ``GPTModel``.
Limits: one host read per call (the returned float), after the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _core_attentions(model: Any) -> list[tuple[Any, Any]]:
    """(self_attention, core_attention) of every decoder layer that records max logits."""
    out = []
    for layer in model.decoder.layers:
        attn = getattr(layer, "self_attention", None)
        core = getattr(attn, "core_attention", None)
        if core is not None and getattr(core, "current_max_attn_logits", None) is not None:
            out.append((attn, core))
    return out


def clip_qk_step(model: Any, *, log_only: bool = False, group: Any = None) -> float:
    """After ``optimizer.step()``: reduce each layer's max logits over the data-parallel
    group, apply megatron's ``clip_qk`` to every layer (unless ``log_only``; then the
    values are only reset), and return the model's largest max logit (-inf if none was
    recorded). ``group``: default megatron's data-parallel group (with CP; a no-op for CP,
    whose ranks already agree)."""
    layers = _core_attentions(model)
    if not layers:
        return float("-inf")
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with torch.no_grad():
        values = torch.stack([core.current_max_attn_logits for _, core in layers])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        for (attn, core), v in zip(layers, values):
            core.current_max_attn_logits = v
            if log_only:
                core.current_max_attn_logits = None
            else:
                attn.clip_qk()  # megatron's: rescales linear_qkv, resets the value
        return float(values.max())
