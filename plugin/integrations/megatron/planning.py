"""A megatron model's attention as the planner sees it, and one batch's plan with its tables.

``model_attention(config, options)`` reads the layer masks (causal, ``window_size`` /
``window_attn_skip_freq``, the options' chunked layers, ``no_rope_freq``), each layer's
``AttnOptions`` (its strategy: options, else ``cp_comm_type``) and the head shape from
megatron's ``TransformerConfig``, exactly as ``VarlenCPCoreAttention`` resolves them at
build time.
``plan_batch`` builds the batch's plan with those masks (the ``balanced`` layout balances each
of them) through ``varlen_cp.prefetch.build_plan`` and, given a device, every host table and
device copy the layers' attention calls and the RoPE lookup will need
(``varlen_cp.prefetch.build_tables``), so the model's forward never plans;
``refresh_model_buffers`` rewrites the graph-safe buffers for a plan before its step.
``report_layers`` groups the layers by (mask, strategy) with their counts for
``varlen_cp.report``.

Limits: GPT-style self-attention (one ``attn_mask_type`` for every layer, causal by default);
planning is host work only (no collectives), so it may run on a background thread; the
refresh runs on the step's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType

from ... import prefetch
from ...attention import refresh_layer_buffers
from ...config import CPConfig
from ...masks import AttnMask
from ...options import AttnOptions
from ...plan import CPPlan
from ...prefetch import AttnShape
from ...report import LayerType
from ...sharding import rope_positions
from .moe import padding_mask
from .options import VarlenCPOptions, layer_a2a_size, layer_mask, layer_strategy

# cp == 1: the identity layout (no reordering, no padding), whatever the options say.
_SINGLE_RANK = CPConfig(layout="contiguous", validate=False, prefetch=False)


@dataclass(frozen=True)
class ModelAttention:
    """layer_masks: the distinct layer masks with their layer counts (``build_plan``);
    calls: the distinct (mask, AttnOptions) of the layers (``build_tables``);
    shape: heads per tensor-parallel rank, head dims and dtype."""

    layer_masks: tuple[tuple[AttnMask, int], ...]
    calls: tuple[tuple[AttnMask, AttnOptions], ...]
    shape: AttnShape


def _dtype(config: Any) -> torch.dtype:
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return getattr(config, "params_dtype", None) or torch.float32


def attn_shape(config: Any) -> AttnShape:
    """The core attention's input shape on one tensor-parallel rank."""
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    heads = config.num_attention_heads
    groups = getattr(config, "num_query_groups", None) or heads
    if getattr(config, "multi_latent_attention", False):
        head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        head_dim_v = config.v_head_dim
        groups = heads  # MLA expands K/V to every head before the core attention
    else:
        head_dim = config.kv_channels
        head_dim_v = None
    for name, n in (("num_attention_heads", heads), ("num_query_groups", groups)):
        if n % tp:
            raise ValueError(f"config.{name}={n} is not divisible by "
                             f"tensor_model_parallel_size={tp}")
    # The softmax extras the layers' calls ask for (so the resolution ahead of the step
    # is the one each call looks up): a sink needs the LSE's gradient, QK-clip (or the
    # logged max logit) the row max.
    return AttnShape(n_heads=heads // tp, n_kv_heads=groups // tp, head_dim=head_dim,
                     head_dim_v=head_dim_v, dtype=_dtype(config),
                     lse_grad=getattr(config, "softmax_type", "vanilla") != "vanilla",
                     row_max=tracks_max_logit(config))


def tracks_max_logit(config: Any) -> bool:
    """Whether the core attention records the max logit (QK-clip, or its logging)."""
    return bool(getattr(config, "qk_clip", False)
                or getattr(config, "log_max_attention_logit", False))


def model_attention(config: Any, options: VarlenCPOptions | None = None,
                    attn_mask_type: AttnMaskType = AttnMaskType.causal) -> ModelAttention:
    """Masks, strategies and shape of every layer of a megatron model (see module doc)."""
    options = VarlenCPOptions() if options is None else options
    if not isinstance(options, VarlenCPOptions):
        raise ValueError(f"options must be a VarlenCPOptions, got {type(options).__name__}")
    options.check_num_layers(config.num_layers)
    counts: dict[AttnMask, int] = {}
    calls: dict[tuple[AttnMask, AttnOptions], None] = {}
    for n in range(1, config.num_layers + 1):
        mask = layer_mask(config, options, n, attn_mask_type)
        strategy = layer_strategy(config, options, n, None)
        counts[mask] = counts.get(mask, 0) + 1
        layer = options.layer_options(strategy, layer_a2a_size(config, options, strategy))
        calls[(mask, layer)] = None
    return ModelAttention(layer_masks=tuple(counts.items()), calls=tuple(calls),
                          shape=attn_shape(config))


def report_layers(config: Any, options: VarlenCPOptions | None = None,
                  attn_mask_type: AttnMaskType = AttnMaskType.causal) -> list[LayerType]:
    """The model's layer types for ``varlen_cp.report``: each distinct (mask, strategy,
    a2a_size) of its layers with its layer count, in first-use order."""
    options = VarlenCPOptions() if options is None else options
    counts: dict[tuple[AttnMask, str, int | None], int] = {}
    for n in range(1, config.num_layers + 1):
        mask = layer_mask(config, options, n, attn_mask_type)
        strategy = layer_strategy(config, options, n, None)
        key = (mask, strategy, layer_a2a_size(config, options, strategy))
        counts[key] = counts.get(key, 0) + 1
    return [LayerType(m, n, s, a) for (m, s, a), n in counts.items()]


def resolve_device(device: Any) -> torch.device:
    """``device`` with its index pinned: a CUDA device without one means the CALLER's current
    device, which a background thread (whose current device is 0) would not see."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def rope_index(plan: CPPlan, device: torch.device) -> torch.Tensor:
    """Each local token's position in its document (padding: 0) on ``device``: the rows of
    megatron's RoPE table that the tokens take (cached in the plan)."""
    return rope_positions(plan, device)


def prepare_model_plan(plan: CPPlan, options: VarlenCPOptions, model: ModelAttention,
                       device: Any) -> CPPlan:
    """Every table the model's attention layers, the RoPE lookup and the MoE routers'
    padding mask need, on ``device``."""
    device = resolve_device(device)
    masks, layers = zip(*model.calls) if model.calls else ((), ())
    prefetch.build_tables(plan, options, [(m, 1) for m in masks], model.shape, device,
                         options=list(layers))
    rope_index(plan, device)
    padding_mask(plan, device)  # for the MoE routers (moe.py)
    return plan


def refresh_model_buffers(plan: CPPlan, options: VarlenCPOptions, model: ModelAttention,
                          device: Any) -> None:
    """The graph-safe mode: every layer type's device buffers rewritten in place for
    ``plan`` (``varlen_cp.attention.refresh_layer_buffers``), on the calling thread's
    current stream: before the step, so that no layer (captured or not) copies a table."""
    device = resolve_device(device)
    for mask, layer in model.calls:
        refresh_layer_buffers(plan, mask, layer, model.shape, device)


def plan_batch(cu_seqlens: torch.Tensor, options: VarlenCPOptions, cp_size: int, cp_rank: int,
               model: ModelAttention | None = None, device: Any = None,
               group: Any = None) -> CPPlan:
    """One batch's plan: ``options``' layout balanced for ``model``'s layer masks (causal
    when None); with ``model`` and ``device``, prepared (tables built) for the model's
    layers. With one CP rank the ``contiguous`` layout (the identity) replaces the
    configured one. ``group``: the CP group, whose ranks' nodes the plan's topology
    records (``options.gpus_per_node``; None: one node)."""
    config = _SINGLE_RANK if cp_size == 1 else options
    if cp_size == 1 and options.graph_safe:   # rows at the capacity at cp 1 too
        config = CPConfig(layout="contiguous", validate=False, prefetch=False,
                          graph_safe=True, graph_capacity=options.graph_capacity)
    topology = None
    if group is not None and cp_size > 1:
        topology = options.topology(dist.get_process_group_ranks(group))
    plan = prefetch.build_plan(cu_seqlens, config, cp_size=cp_size, cp_rank=cp_rank,
                              layer_masks=None if model is None else model.layer_masks,
                              topology=topology)
    if model is not None and device is not None:
        prepare_model_plan(plan, options, model, device)
    return plan
