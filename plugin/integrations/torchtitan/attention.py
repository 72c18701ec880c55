"""torchtitan inner-attention adapter: ``VarlenCPInnerAttention`` and its ``@override``.

torchtitan's attention modules (``GQAttention``, gpt_oss's and DeepSeek's ``Attention``)
project q/k/v, apply RoPE with the batch's positions and call
``inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=..., [enable_gqa=...,
out_transform=...])``. ``VarlenCPInnerAttention`` is that inner module, a
``varlen_cp.ContextParallelVarlenAttention`` (its forward unpacks torchtitan's arguments and
calls the module's ``attend``): its config carries the layer's mask (causal / window /
chunk: Llama 4's chunked and global layers, or gpt_oss's window and global layers, differ
only here) and the attention options (``varlen_cp.AttnOptions``: strategy, backend, ...);
``attention_masks`` carries a ``PackedBatch`` holding the batch's ``CPPlan``, built once per
step on the host and shared by every layer.

``varlen_cp_attention`` is a torchtitan ``@override`` of ``VarlenAttention.Config``: it turns
each layer's ``window_size`` into that layer's ``AttnMask`` and takes its ``options``
(``CPConfig.attn_options``, the ``AttnOptions`` object itself: torchtitan hands an override's
keyword arguments over as given) into the replacement config. The trainer applies it before the model config's own
``update_from_config``, whose "Varlen attention is not supported with CP" check then sees
varlen-cp's attention (a different class) and passes: only this attention bypasses it.
The module always declares its own sharding (q/k/v stay sequence-sharded on CP, head-sharded
on TP; the strategy moves K/V itself), whatever sharding a model's setter gave the config
(torchtitan's would all-gather K/V along CP at the module boundary).

Inputs arrive as [B=1, T_local, H, D] (the packed batch, this rank's tokens in the plan's
local order), v may have its own head dim (MLA: q/k 192, v 128); the output is
[1, T_local, Hq, Dv]. The CP process group is bound once after the model is built
(``bind_cp_group``); with a cp=1 plan the call is the local varlen op.
Softmax extras: ``softmax_type`` "vanilla" | "off-by-one" | "learnable" (the Llama 4 style
model's learnable sink is ``self.sink``, one fp32 logit per query head, replicated on CP/DP
and head-sharded on TP like the heads); gpt_oss's sinks stay the parameter
``attention.sinks`` of its own module (same name and shape, so checkpoints load both ways)
and become varlen-cp's learnable sink of that layer: its ``out_transform`` is recognised and
the parameter passed as ``sink``. Any other ``out_transform(out, lse)`` gets the exact
global LSE of each local query. ``track_max_logit``: every forward stores the layer's max
attention logit over the global batch in ``self.max_logit`` (detached fp32 [Hq], the same
on every CP rank) for metrics and QK-clip.
Limits: B must be 1 (the trainer packs the batch's rows into one sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import spmd_types as spmd
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.override import derive, override
from torchtitan.models.common.attention import VarlenAttention
from torchtitan.models.common.decoder_sharding import (dense_activation_placement,
                                                       dense_param_placement)
from torchtitan.models.gpt_oss.model import Attention as GptOssAttention
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig

from ...attention import ContextParallelVarlenAttention
from ...masks import AttnMask
from ...options import AttnOptions
from ...plan import CPPlan
from ...plan.capacity import GraphKey
from ...tables.static_rows import capacity_of


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """What every attention layer needs about the current batch (passed as attention_masks).

    ``graph_key`` (the graph-safe mode: ``graph_key_of(plan)``) makes two batches' values
    equal when a captured step replays right for both (same capacity, cp and rank):
    torchtitan's step CUDA graph (``training.disable_cuda_graphs = false``) requires its
    non-tensor inputs to stay equal across steps, and in that mode the step reads nothing of
    the plan after its buffers were refreshed. Without it, two values are equal only for
    one plan."""

    plan: CPPlan
    graph_key: GraphKey | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedBatch):
            return NotImplemented
        if self.graph_key is not None or other.graph_key is not None:
            return self.graph_key == other.graph_key
        return self.plan is other.plan

    def __hash__(self) -> int:
        return hash(self.graph_key) if self.graph_key is not None else id(self.plan)


def graph_key_of(plan: CPPlan, capacity: int | None = None) -> GraphKey:
    """What a graph-safe step's device work depends on besides buffer contents: the rows per
    rank (the plan's capacity, else ``capacity``, as the graph-safe call derives it), cp and
    the rank (the buffers' sizes, the collectives' peers)."""
    return GraphKey(capacity_of(plan, capacity), plan.cp_size, plan.cp_rank)


class VarlenCPInnerAttention(Module, ContextParallelVarlenAttention):
    """Varlen (packed-document) attention with context parallelism, as a torchtitan module."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        causal: bool = True
        window_left: int = -1
        """flash-attn window: a query sees keys p - window_left .. p + window_right (-1 = all)."""
        window_right: int = -1
        chunk_size: int = 0
        """Llama 4 chunked attention: keys in the same chunk of this size (0 = off)."""
        options: AttnOptions = field(default_factory=AttnOptions)
        """How the CP call runs (strategy, backend, validate, a2a_size, overlap_stages)."""
        softmax_type: str = "vanilla"
        """"vanilla", "off-by-one" (a zero sink logit) or "learnable" (``sink`` parameter)."""
        n_heads: int = 0
        """Query heads of the layer (the learnable sink's size; 0 = unknown)."""
        track_max_logit: bool = False
        """Keep the last forward's max logit per head in ``max_logit``."""

        def mask(self) -> AttnMask:
            return AttnMask(causal=self.causal, window_size=(self.window_left, self.window_right),
                            chunk_size=self.chunk_size or None)

        def build(self, **kwargs: Any) -> "VarlenCPInnerAttention":
            # The sharding is a property of this attention, not of the model: always ours.
            module = Module.Config.build(self, **kwargs)
            module._sharding_config = inner_attention_sharding()
            return module

    def __init__(self, config: Config) -> None:
        # nn.Module.__init__ runs once, through ContextParallelVarlenAttention's super() chain.
        # "auto" is resolved per (plan, mask) inside cp_varlen_attn, from the plan's costs.
        ContextParallelVarlenAttention.__init__(
            self, config.mask(), config.options, softmax_type=config.softmax_type,
            n_heads=config.n_heads or None, track_max_logit=config.track_max_logit)

    def forward(  # pyrefly: ignore[bad-override]
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, PackedBatch):
            raise ValueError("VarlenCPInnerAttention needs attention_masks=PackedBatch(plan) "
                             f"from the varlen_cp trainer, got {type(attention_masks).__name__}")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"VarlenCPInnerAttention expects the packed batch as B=1, got "
                             f"q of shape {tuple(q_BLNH.shape)}")
        q, k, v = q_BLNH[0], k_BLNH[0], v_BLNH[0]
        softmax: dict[str, Any] = {}
        owner_sinks = _gpt_oss_sinks(out_transform)
        if owner_sinks is not None:  # gpt_oss: its sinks are this layer's learnable sink
            softmax = {"softmax_type": "learnable", "sink": _local(owner_sinks).float()}
            out_transform = None
        want_lse = out_transform is not None
        with spmd.no_typecheck():
            out, lse = self.attend(q, k, v, attention_masks.plan, softmax_scale=scale,
                                   return_lse=want_lse, **softmax)
            out = out.unsqueeze(0)
            if want_lse:  # the exact global LSE of each local query, as [1, T_local, Hq]
                out = out_transform(out, lse.transpose(0, 1).unsqueeze(0))
        return out

    def reset_parameters(self) -> None:
        """torchtitan's ``init_states`` hook (models are built on the meta device): the
        learnable sink starts at logit 0, i.e. as "off-by-one"."""
        sink = getattr(self, "sink", None)
        if sink is not None:
            with torch.no_grad():
                sink.zero_()

    def sink_tensor(self) -> torch.Tensor | None:
        """The learnable sink as the op wants it: a plain fp32 tensor. Under FSDP/TP the
        parameter may be a DTensor; its local value is this rank's heads, and the op's
        gradient flows back through ``to_local``."""
        sink = getattr(self, "sink", None)
        return None if sink is None else _local(sink).float()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) per-head parameter; its gradient keeps the
    parameter's placements (as gpt_oss's own sink code does)."""
    return t.to_local(grad_placements=t.placements) if isinstance(t, DTensor) else t


def _gpt_oss_sinks(out_transform: Any) -> torch.Tensor | None:
    """gpt_oss's sink parameter when ``out_transform`` is its ``Attention._apply_sinks``
    (read at call time: FSDP swaps the registered parameter around forward)."""
    if getattr(out_transform, "__func__", None) is not GptOssAttention._apply_sinks:
        return None
    return out_transform.__self__.sinks


def inner_attention_sharding() -> ShardingConfig:
    """q/k/v stay sequence-sharded on CP (the strategy moves K/V itself) and head-sharded on
    TP; gradients come back in the same layout. torchtitan's own inner attention instead
    all-gathers K/V along CP at this boundary."""
    layout = dense_activation_placement(tp=spmd.S(2))
    return ShardingConfig(
        # The learnable sink (one logit per query head) follows the heads on TP and is
        # replicated on DP/CP; layers without it simply have no such parameter.
        state_shardings={"sink": dense_param_placement(tp=spmd.S(0))},
        in_src_shardings={"q_BLNH": layout, "k_BLNH": layout, "v_BLNH": layout},
        in_dst_shardings={"q_BLNH": layout, "k_BLNH": layout, "v_BLNH": layout},
        out_src_shardings=layout,
        local_map=LocalMapConfig(in_grad_placements=(layout, layout, layout)),
    )


def bind_cp_group(model: nn.Module, group: Any) -> int:
    """Give every varlen-CP attention module of ``model`` the CP process group; returns how
    many were bound."""
    n = 0
    for m in model.modules():
        if isinstance(m, ContextParallelVarlenAttention):
            m.group = group
            n += 1
    return n


def layer_max_logits(model: nn.Module) -> dict[int, torch.Tensor]:
    """Layer index (from the module path ``layers.N.``) -> the last max logit [Hq] of that
    layer's varlen-CP attention, for every layer that tracks it and has run a forward."""
    out: dict[int, torch.Tensor] = {}
    for name, m in model.named_modules():
        value = getattr(m, "max_logit", None)
        if not isinstance(m, VarlenCPInnerAttention) or value is None:
            continue
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            out[int(parts[parts.index("layers") + 1])] = value
    return out


def window_to_mask(window_size: tuple[int, int]) -> AttnMask:
    """torchtitan's ``VarlenAttention`` window (flash-attn convention: (-1, 0) causal,
    (W, 0) causal sliding window, (-1, -1) full) as varlen-cp's mask."""
    left, right = window_size
    if right == 0:
        return AttnMask(causal=True, window_size=(left, -1 if left < 0 else 0))
    return AttnMask(causal=False, window_size=(left, right))


@override(target=VarlenAttention.Config,
          description="varlen-cp: context-parallel varlen attention for packed documents")
def varlen_cp_attention(cfg: VarlenAttention.Config, options: AttnOptions | None = None
                        ) -> VarlenCPInnerAttention.Config:
    """torchtitan ``@override``: a layer's ``VarlenAttention.Config`` -> varlen-cp's, with
    the layer's mask from its ``window_size`` and ``options``, a ``varlen_cp.AttnOptions``
    (the override's one keyword, passed whole: ``CPConfig.attn_options``; None: the
    defaults; anything else is a ValueError)."""
    if options is None:
        options = AttnOptions()
    if not isinstance(options, AttnOptions):
        raise ValueError(f"varlen_cp_attention: options must be a varlen_cp.AttnOptions, got "
                         f"{type(options).__name__}")
    mask = window_to_mask(tuple(cfg.window_size))
    return derive(cfg, VarlenCPInnerAttention.Config, causal=mask.causal,
                  window_left=mask.window_size[0], window_right=mask.window_size[1],
                  options=options)


OVERRIDE_TARGET = f"{__name__}.varlen_cp_attention"
"""The ``override.imports`` entry that names ``varlen_cp_attention``."""
