"""``VarlenCPCoreAttention``: a megatron-core core-attention module backed by varlen_cp.

It is a ``varlen_cp.ContextParallelVarlenAttention`` (the layer's mask and ``AttnOptions``,
resolved from megatron's config and ``VarlenCPOptions`` at build time, and its ``attend``);
it follows megatron's builder protocol (``config, layer_number, attn_mask_type,
attention_type, cp_comm_type, softmax_scale, pg_collection``, plus ``options`` from the
spec's params) and forward protocol (``query, key, value, attention_mask, *,
attn_mask_type, attention_bias, packed_seq_params``), so it drops into any GPT layer spec in
place of ``DotProductAttention`` / ``TEDotProductAttention``, with context parallelism
(which megatron's own DotProductAttention refuses) and every varlen_cp mask.

Formats: THD (``packed_seq_params.qkv_format == "thd"``: q [t, h, d] -> [t, h*dv]) with the
step's plan from the sharding hook (the module never plans: no plan attached is a
ValueError), and RoPE per token from the plan when ``VarlenCPSelfAttention`` routed megatron's
RoPE table here (any layout; without it, layouts other than ``te`` are refused at CP > 1,
since megatron's own THD RoPE assumes TE's); sbhd (q [s, b, h, d] -> [s, b, h*dv]) where each
row is one sequence sharded like megatron's ``get_batch_on_this_cp_rank``: its plan is a pure
function of (b, s, cp, rank), built once per process per shape and shared by every layer and
step (``sharding.sbhd_plan``).
Softmax extras, from megatron's own config fields: ``softmax_type`` "vanilla" |
"off-by-one" | "learnable" (the learnable sink is the parameter ``softmax_offset``, one
logit per local query head, named and initialised as megatron's DotProductAttention does, so
checkpoints interchange; it is kept in fp32), and ``qk_clip`` / ``log_max_attention_logit``:
each forward's max logit per head (global over the CP group) is kept in ``max_logit`` and
max-accumulated over micro-batches in ``current_max_attn_logits``, which is what megatron's
``Attention.clip_qk`` / ``megatron.core.optimizer.qk_clip.clip_qk`` read and reset.
CUDA graphs: megatron's ``cuda_graph_impl="local"`` (one graph per TransformerLayer) in
the graph-safe mode, whose packed params are equal for every batch (``sharding``);
``check_cuda_graphs`` refuses the rest at build time.
Limits: self-attention only; no attention dropout, attention bias or mask tensors (a
ValueError at build or call time says which).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ...attention import ContextParallelVarlenAttention
from ...checks import check_choice
from ...config import SOFTMAX_TYPES
from ...masks import AttnMask
from ...plan import CPPlan
from ...strategies.relay_group import prepare_node_groups
from .options import (CAUSAL_TYPES, VarlenCPOptions, layer_a2a_size, layer_mask,
                      layer_strategy)
from .planning import tracks_max_logit
from .rope import apply_plan_rope
from .sharding import cp_group_and_rank, plan_from_packed_seq_params, sbhd_plan


def _cp_group(pg_collection: Any) -> Any:
    """The CP group: ``pg_collection.cp`` when given, else megatron's parallel_state."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


def _check_config(config: Any, attention_type: str) -> None:
    """Settings the varlen kernels cannot honour fail at build time, not silently."""
    if attention_type != "self":
        raise ValueError(f"attention_type must be 'self' for VarlenCPCoreAttention, got "
                         f"{attention_type!r}")
    if config.attention_dropout:
        raise ValueError(f"config.attention_dropout={config.attention_dropout!r}: attention "
                         f"dropout is not supported by varlen_cp; set it to 0.0")
    check_choice("config.softmax_type", getattr(config, "softmax_type", "vanilla"),
                 SOFTMAX_TYPES)


def cuda_graph_impl(config: Any) -> str:
    """megatron's CUDA-graph implementation of ``config``: "none", "local" or
    "transformer_engine" (the deprecated ``enable_cuda_graph`` / ``external_cuda_graph``
    mapped as megatron maps them)."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none" and getattr(config, "enable_cuda_graph", False):
        return "local"
    if impl == "none" and getattr(config, "external_cuda_graph", False):
        return "transformer_engine"
    return impl


def check_cuda_graphs(config: Any, options: VarlenCPOptions) -> None:
    """megatron's CUDA graphs with varlen_cp's attention: ``cuda_graph_impl="local"`` (one
    graph per TransformerLayer, replayed when a call's arguments equal the captured ones
    field by field) in the graph-safe mode, whose packed params are equal for every batch
    and whose layers issue the same device work (docs/megatron.md); refused otherwise, and
    with what a replay would freeze (ValueError naming the setting). megatron's own THD
    RoPE is refused with the graph-safe mode itself (``check_graph_safe_rope``)."""
    impl = cuda_graph_impl(config)
    if impl == "none":
        return
    where = f"config.cuda_graph_impl={impl!r}"
    if impl != "local":
        raise ValueError(f"{where}: TransformerEngine's CUDA graphs refuse packed_seq_params "
                         f"(megatron-core 0.16.1); use cuda_graph_impl='local' with "
                         f"[varlen_cp] graph_safe = true (docs/megatron.md)")
    if not options.graph_safe:
        raise ValueError(f"{where} needs [varlen_cp] graph_safe = true "
                         f"(VarlenCPOptions(graph_safe=True)): otherwise every batch issues "
                         f"its own attention work and a replay would run the first batch's")
    if options.graph_capacity is None:
        raise ValueError(f"{where} needs [varlen_cp] graph_capacity (rows per rank) set: "
                         f"derived from each batch's tokens it changes with them, and so "
                         f"would the layers' argument shapes, which megatron's replay "
                         f"refuses")
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if getattr(config, "recompute_granularity", None) and pp > 1:
        raise ValueError(f"{where} with recompute_granularity="
                         f"{config.recompute_granularity!r} and pipeline_model_parallel_size="
                         f"{pp}: a recomputed layer replays on the buffers of the micro-batch "
                         f"sharded last, not its own")
    scopes = getattr(config, "cuda_graph_scope", None) or []
    if any(getattr(s, "name", s) == "full_iteration" for s in scopes):
        raise ValueError(f"{where} with cuda_graph_scope full_iteration: the iteration "
                         f"includes the batch's sharding and buffer refresh, which must run "
                         f"before each step; use the per-layer scopes")
    if getattr(config, "num_moe_experts", None):
        raise ValueError(f"{where} with config.num_moe_experts={config.num_moe_experts}: "
                         f"the MoE layers route a per-batch number of real rows "
                         f"(padding-free routing); set cuda_graph_impl='none'")
    if tracks_max_logit(config):
        raise ValueError(f"{where} with qk_clip / log_max_attention_logit: each layer "
                         f"records its max logit in Python after its forward, which a "
                         f"replay skips; set cuda_graph_impl='none'")


def check_graph_safe_rope(config: Any, options: VarlenCPOptions,
                          rope_from_plan: bool = True) -> None:
    """The graph-safe packed params carry no cu_seqlens (``sharding``), so megatron's own
    THD RoPE (``rope_from_plan=False``, mRoPE) cannot run with them: refused at build."""
    if not options.graph_safe:
        return
    if not rope_from_plan:
        raise ValueError("VarlenCPOptions.graph_safe=True: this layer's self-attention "
                         "applies megatron's own THD RoPE, which reads the batch's "
                         "cu_seqlens (the graph-safe packed params have none); build the "
                         "model with rope_from_plan=True (VarlenCPSelfAttention)")
    if getattr(config, "mrope_section", None) is not None:
        raise ValueError(f"config.mrope_section={config.mrope_section!r} with "
                         f"VarlenCPOptions.graph_safe=True: mRoPE keeps megatron's own THD "
                         f"RoPE, which reads the batch's cu_seqlens (the graph-safe packed "
                         f"params have none)")


def _local_heads(config: Any) -> int:
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if config.num_attention_heads % tp:
        raise ValueError(f"config.num_attention_heads={config.num_attention_heads} is not "
                         f"divisible by tensor_model_parallel_size={tp}")
    return config.num_attention_heads // tp


class VarlenCPCoreAttention(MegatronModule, ContextParallelVarlenAttention):
    """Core attention of one layer: mask and strategy resolved from the config at build."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, options: VarlenCPOptions | None = None,
                 rope_from_plan: bool = True, **unused: Any) -> None:
        options = VarlenCPOptions() if options is None else options
        if not isinstance(options, VarlenCPOptions):
            raise ValueError(f"options must be a VarlenCPOptions, got "
                             f"{type(options).__name__}")
        _check_config(config, attention_type)
        check_cuda_graphs(config, options)
        check_graph_safe_rope(config, options, rope_from_plan)
        if not rope_from_plan and config.context_parallel_size > 1 and options.layout != "te":
            raise ValueError(
                f"VarlenCPOptions.layout={options.layout!r}: this layer's self-attention "
                f"applies megatron's own THD RoPE, which assumes TE's layout; use layout='te', "
                f"or megatron's SelfAttention with rope_from_plan=True in swap_core_attention "
                f"(RoPE positions from the plan, any layout)")
        if attention_dropout:
            raise ValueError(f"attention_dropout={attention_dropout!r} is not supported by "
                             f"varlen_cp; use 0.0")
        options.check_num_layers(config.num_layers)
        layer_number = max(1, int(layer_number))
        strategy = layer_strategy(config, options, layer_number, cp_comm_type)
        scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies
        # it back inside megatron's fp16 softmax: no net effect, so it is ignored here.
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(config.kv_channels)
        group, cp_size, cp_rank = cp_group_and_rank(_cp_group(pg_collection))
        if cp_size != config.context_parallel_size:
            raise ValueError(f"config.context_parallel_size={config.context_parallel_size} "
                             f"differs from the CP group's size {cp_size}")
        # One nn.Module.__init__, through the module's; MegatronModule.__init__ only sets
        # ``config`` (its super() call would reach the module's __init__ without a mask).
        ContextParallelVarlenAttention.__init__(
            self, layer_mask(config, options, layer_number, attn_mask_type),
            options.layer_options(strategy, layer_a2a_size(config, options, strategy)), group,
            softmax_scale=scale, track_max_logit=tracks_max_logit(config))
        self.config = config
        self.varlen_options = options
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.cp_size, self.cp_rank = cp_size, cp_rank
        # Which CP ranks share a node (the sbhd plans' topology; THD plans get theirs from
        # the sharding hook): the CP group's global ranks // gpus_per_node.
        self.cp_topology = (options.topology(dist.get_process_group_ranks(group))
                            if group is not None and cp_size > 1 else None)
        # dispatch's relay through nodes: its in-node groups, made at the first layer, on
        # every rank (every rank builds the same layers)
        prepare_node_groups(group, self.cp_topology)
        self._init_softmax_extras(config)

    def _init_softmax_extras(self, config: Any) -> None:
        """The sink is megatron's parameter ``softmax_offset`` (the module's own ``sink``
        stays None), named and initialised as in megatron's DotProductAttention, so
        checkpoints interchange."""
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        self.softmax_offset: torch.nn.Parameter | None = None
        if self.softmax_type == "learnable":
            # fp32 whatever params_dtype is: the sink is added to fp32 LSEs.
            offset = torch.zeros(_local_heads(config), dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(offset)
            self.softmax_offset = torch.nn.Parameter(offset)
        self.current_max_attn_logits: torch.Tensor | None = None

    def sink_tensor(self) -> torch.Tensor | None:
        return None if self.softmax_offset is None else self.softmax_offset.float()

    def record_max_logit(self, max_logit: torch.Tensor) -> None:
        """Last forward's value, and the running max over micro-batches that megatron's
        ``clip_qk`` reads (and resets to None after each optimizer step)."""
        value = max_logit.detach()
        self.max_logit = value
        prev = self.current_max_attn_logits
        self.current_max_attn_logits = value if prev is None else torch.maximum(prev, value)

    def _mask_for(self, attn_mask_type: AttnMaskType | None) -> AttnMask:
        if attn_mask_type is None or attn_mask_type == self.attn_mask_type:
            return self.mask
        return layer_mask(self.config, self.varlen_options, self.layer_number, attn_mask_type)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """THD: q [t, hq, d], k [t, hkv, d], v [t, hkv, dv] -> [t, hq*dv].
        sbhd: q [s, b, hq, d], k/v [s, b, hkv, d/dv] -> [s, b, hq*dv]."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by VarlenCPCoreAttention")
        mask = self._mask_for(attn_mask_type)
        if packed_seq_params is not None:
            fmt = getattr(packed_seq_params, "qkv_format", None)
            if fmt != "thd":
                raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {fmt!r}")
            if query.dim() != 3:
                raise ValueError(f"query: THD input must be [t, h, d], got shape "
                                 f"{tuple(query.shape)}")
            plan = plan_from_packed_seq_params(packed_seq_params, self.cp_size, self.cp_rank)
            query, key = self._rope(query, key, plan, packed_seq_params)
            out = self.attend(query, key, value, plan, mask=mask)[0]
            return out.reshape(out.shape[0], -1)
        return self._forward_sbhd(query, key, value, attention_mask, attn_mask_type, mask)

    def _rope(self, query: torch.Tensor, key: torch.Tensor, plan: CPPlan,
              params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE by the plan's positions when the self-attention routed it here; else
        megatron applied its own THD RoPE, which is right only for TE's layout."""
        rope = getattr(params, "varlen_cp_rope", None)
        if rope is not None:
            return apply_plan_rope(query, key, rope, self.config, self.group)
        if plan.cp_size > 1 and plan.layout != "te":
            raise ValueError(
                f"layout {plan.layout!r} needs RoPE positions from the plan, but this layer's "
                f"self-attention applied megatron's own THD RoPE (which assumes TE's layout): "
                f"build the model from swap_core_attention / get_varlen_cp_layer_spec, whose "
                f"self-attention (VarlenCPSelfAttention) routes RoPE through the plan, or use "
                f"VarlenCPOptions(layout='te')")
        return query, key

    def _forward_sbhd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None,
                      attn_mask_type: AttnMaskType | None, mask: AttnMask) -> torch.Tensor:
        if query.dim() != 4:
            raise ValueError(f"query: sbhd input must be [s, b, h, d], got shape "
                             f"{tuple(query.shape)}")
        if key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
            raise ValueError(f"key/value: self-attention needs the [s, b] of query "
                             f"{tuple(query.shape[:2])}, got {tuple(key.shape[:2])} and "
                             f"{tuple(value.shape[:2])}")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None and mask_type not in CAUSAL_TYPES \
                and mask_type != AttnMaskType.no_mask:
            raise ValueError(f"attention_mask: mask tensors are not supported (attn_mask_type "
                             f"{mask_type!r}); pack the sequences as THD instead")
        s, b = query.shape[:2]
        plan = sbhd_plan(b, s, self.cp_size, self.cp_rank, self.cp_topology)

        def thd(x: torch.Tensor) -> torch.Tensor:  # [s, b, h, d] -> [b*s, h, d], row-major
            return x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3])

        out = self.attend(thd(query), thd(key), thd(value), plan, mask=mask)[0]
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def extra_repr(self) -> str:
        return (f"layer={self.layer_number}, mask={self.mask}, options={self.options}, "
                f"cp_size={self.cp_size}, softmax_type={self.softmax_type!r}")
