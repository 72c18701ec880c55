"""torchtitan inner-attention adapter: ``GQAttention`` -> ``ContextParallelVarlenAttention``.

torchtitan's ``GQAttention`` projects q/k/v, applies RoPE with the batch's positions and calls
``inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=..., enable_gqa=...)``.
``VarlenCPInnerAttention`` is that inner module: its config carries the layer's mask
(causal / window / chunk, so Llama 4's chunked and global layers differ only here), the CP
strategy and the kernel backend; ``attention_masks`` carries a ``PackedBatch`` that holds the
batch's ``CPPlan``, built once per step on the host and shared by every layer.

Inputs arrive as [B=1, T_local, H, D] (the packed batch, this rank's tokens in the plan's
local order); the output is [1, T_local, Hq, Dv]. The CP process group is bound once after
the model is built (``bind_cp_group``); with a cp=1 plan the call is the local varlen op.
Softmax extras (config fields): ``softmax_type`` "vanilla" | "off-by-one" | "learnable"
(the learnable sink is ``self.sink``, one fp32 logit per query head, a parameter of this
module, replicated on CP/DP and head-sharded on TP like the heads), and ``track_max_logit``:
every forward stores the layer's max attention logit over the global batch in
``self.max_logit`` (detached fp32 [Hq], the same on every CP rank) for metrics and QK-clip.
Limits: B must be 1 (the trainer packs the batch's rows into one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.decoder_sharding import (dense_activation_placement,
                                                       dense_param_placement)
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig

from ...attention import ContextParallelVarlenAttention, cp_varlen_attn
from ...masks import AttnMask
from ...plan import CPPlan


@dataclass(frozen=True)
class PackedBatch:
    """What every attention layer needs about the current batch (passed as attention_masks)."""

    plan: CPPlan


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
        strategy: str = "p2p"
        backend: str = "auto"
        validate: bool = False
        softmax_type: str = "vanilla"
        """"vanilla", "off-by-one" (a zero sink logit) or "learnable" (``sink`` parameter)."""
        n_heads: int = 0
        """Query heads of the layer (the learnable sink's size; 0 = unknown)."""
        track_max_logit: bool = False
        """Keep the last forward's max logit per head in ``max_logit``."""

    def __init__(self, config: Config) -> None:
        mask = AttnMask(causal=config.causal,
                        window_size=(config.window_left, config.window_right),
                        chunk_size=config.chunk_size or None)
        # nn.Module.__init__ runs once, through ContextParallelVarlenAttention's super() chain.
        # "auto" is resolved per (plan, mask) inside cp_varlen_attn, from the plan's costs.
        ContextParallelVarlenAttention.__init__(
            self, mask, strategy=config.strategy, group=None, backend=config.backend,
            softmax_type=config.softmax_type, n_heads=config.n_heads or None,
            track_max_logit=config.track_max_logit)
        self.validate = config.validate
        self._validated = False

    def forward(  # pyrefly: ignore[bad-override]
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, PackedBatch):
            raise ValueError("VarlenCPInnerAttention needs attention_masks=PackedBatch(plan) "
                             f"from the varlen_cp trainer, got {type(attention_masks).__name__}")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"VarlenCPInnerAttention expects the packed batch as B=1, got "
                             f"q of shape {tuple(q_BLNH.shape)}")
        plan = attention_masks.plan
        q, k, v = q_BLNH[0], k_BLNH[0], v_BLNH[0]
        # The fingerprint check costs an all-reduce and a host sync: once per module.
        check = self.validate and not self._validated and plan.cp_size > 1
        track = self.track_max_logit
        with spmd.no_typecheck():
            res = cp_varlen_attn(q, k, v, plan, self.mask, self.group, self.strategy,
                                 scale, backend=self.backend, validate=check,
                                 return_max_logit=track, softmax_type=self.softmax_type,
                                 sink=self._sink_arg())
        self._validated = self._validated or check
        out = res[0] if track else res
        if track:
            self.max_logit = res[1].detach()
        return out.unsqueeze(0)

    def reset_parameters(self) -> None:
        """torchtitan's ``init_states`` hook (models are built on the meta device): the
        learnable sink starts at logit 0, i.e. as "off-by-one"."""
        sink = getattr(self, "sink", None)
        if sink is not None:
            with torch.no_grad():
                sink.zero_()

    def _sink_arg(self) -> torch.Tensor | None:
        """The learnable sink as the op wants it: a plain fp32 tensor. Under FSDP/TP the
        parameter may be a DTensor; its local value is this rank's heads, and the op's
        gradient flows back through ``to_local``."""
        sink = getattr(self, "sink", None)
        if sink is None:
            return None
        local = sink.to_local() if isinstance(sink, DTensor) else sink
        return local.float()


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
