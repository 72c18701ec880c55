"""Llama 4 style decoder for torchtitan 0.3.0, built from torchtitan's components.

torchtitan removed its Llama 4 model in June 2026; this brings the architecture back on
its current building blocks (``Decoder``, ``GQAttention``, ``FeedForward``, ``MoE``,
``RMSNorm``, ``ComplexRoPE``) with ``VarlenCPInnerAttention`` as every layer's inner
attention:

- iRoPE: layer i is a global causal layer without RoPE (NoPE) when
  ``(i + 1) % nope_layer_interval == 0`` (Llama 4: every 4th); every other layer uses RoPE
  with chunked causal attention (``attention_chunk_size``, 8192 in Llama 4), or, for
  non-Llama-4 configs, sliding-window causal attention (``sliding_window``) or plain causal
  attention when both are 0.
- GQA (``n_kv_heads``), optional QK norm (RMSNorm over head_dim) on RoPE layers.
- optional MoE feed-forward (torchtitan's MoE: ``num_experts``, ``top_k``, one shared
  expert, every ``interleave_moe_layer_step``-th layer), dense SwiGLU otherwise; padding
  tokens (``te`` layout) are never routed (``moe.PaddingFreeMoE``).
- attention sinks (``softmax_type`` "off-by-one" | "learnable": a trained fp32 logit per
  query head in every layer) and max-logit tracking (``track_max_logit``; read with
  ``Llama4Model.max_logits()``, logged as ``max_logit/layer_N``) for QK-clip.
Every layer's mask is data on its inner-attention config; one ``CPPlan`` per batch serves all.
The ``[model]`` fields (``Llama4Args``) live in ``llama4_args`` (no torchtitan import).
Limits: Llama 4's attention temperature tuning on NoPE layers and its weight-free L2 QK norm
are not reproduced (QK norm here is torchtitan's RMSNorm); torchtitan's experts compute in
bf16 (grouped GEMMs), also on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import spmd_types as spmd
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm, RoPE,
                                      TransformerBlock)
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.common.config_utils import (make_ffn_config, make_gqa_config,
                                                   make_moe_config, make_routed_experts_config,
                                                   make_router_config)
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.decoder_sharding import (dense_activation_placement,
                                                       dense_param_placement,
                                                       norm_config,
                                                       set_decoder_sharding_config,
                                                       set_dense_ffn_sharding,
                                                       set_gqa_attention_sharding)
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.models.utils import (get_dense_model_nparams_and_flops,
                                     get_moe_model_nparams_and_flops)
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.sharding import ShardingConfig

from ...config import SOFTMAX_TYPES
from ...masks import AttnMask
from ...options import AttnOptions
from .attention import VarlenCPInnerAttention, inner_attention_sharding, layer_max_logits
from .llama4_args import Llama4Args
from .moe import padding_free_config




class NoRoPE(RoPE):
    """Identity position embedding for Llama 4's global NoPE layers.

    A ``RoPE`` subclass so that torchtitan's RoPE handling (cache resizing to seq_len,
    sharding of the ``cache`` buffer) applies unchanged; the cache is a single element.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        return torch.zeros(1)

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key


class Llama4TransformerBlock(TransformerBlock):
    """Pre-norm block: x + attn(norm(x)); x + (moe | ffn)(norm(x))."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()
        self.attention = config.attention.build()
        self.moe_enabled = config.moe is not None
        if config.moe is not None:
            self.moe = config.moe.build()
        else:
            assert config.feed_forward is not None
            self.feed_forward = config.feed_forward.build()
        self.attention_norm = config.attention_norm.build()
        self.ffn_norm = config.ffn_norm.build()

    def forward(self, x: torch.Tensor, attention_masks: AttentionMasksType | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), attention_masks, positions)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))


_GROUPED_EXPERTS_PARAM_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


class Llama4Model(Decoder):
    """Llama 4 style decoder (see the module docstring)."""

    def max_logits(self) -> dict[int, torch.Tensor]:
        """Layer index -> that layer's max attention logit per query head (fp32 [Hq],
        detached, max over the global batch of the last forward; the same on every CP rank,
        not reduced over data parallelism). Empty unless ``model.track_max_logit``."""
        return layer_max_logits(self)

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        dim: int = 256
        vocab_size: int = 2048

        def update_from_config(self, *, config, **kwargs) -> None:
            Decoder.Config.update_from_config(self, config=config, **kwargs)
            parallelism = config.parallelism
            set_llama4_sharding_config(self, enable_sp=parallelism.enable_sequence_parallel,
                                       enable_ep=parallelism.expert_parallel_degree > 1)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            attn = self.first_attention
            head_dim = attn.head_dim or self.dim // attn.n_heads
            if any(layer.moe is not None for layer in self.layers):
                return get_moe_model_nparams_and_flops(self, model, attn.n_heads,
                                                       2 * head_dim, seq_len)
            return get_dense_model_nparams_and_flops(
                model, n_layers=len(self.layers), n_heads=attn.n_heads,
                head_dims=2 * head_dim, seq_len=seq_len,
                enable_weight_tying=self.enable_weight_tying)


def set_llama4_sharding_config(config: Llama4Model.Config, *, enable_sp: bool,
                               enable_ep: bool) -> None:
    """torchtitan's standard TP/FSDP sharding for every sub-config, except that the inner
    attention keeps K/V sequence-sharded on CP (varlen-cp moves K/V itself)."""
    set_decoder_sharding_config(config, enable_sp=enable_sp)
    norm = norm_config(enable_sp=enable_sp)
    for layer in config.layers:
        layer.attention_norm.sharding_config = norm
        layer.ffn_norm.sharding_config = norm
        set_gqa_attention_sharding(layer.attention, enable_sp=enable_sp)
        layer.attention.inner_attention.sharding_config = inner_attention_sharding()
        if layer.attention.qk_norm is not None:
            head_layout = dense_activation_placement(tp=spmd.S(2))
            layer.attention.qk_norm.sharding_config = ShardingConfig(
                state_shardings={"weight": dense_param_placement(tp=spmd.R)},
                in_src_shardings={"input": head_layout},
                in_dst_shardings={"input": head_layout},
                out_src_shardings=head_layout,
                out_dst_shardings=head_layout,
            )
        if layer.feed_forward is not None:
            x_layout = norm.out_src_shardings
            set_dense_ffn_sharding(layer.feed_forward, attn_x_layout=x_layout,
                                   enable_sp=enable_sp)
        if layer.moe is not None:
            set_moe_sharding_config(layer.moe, enable_ep=enable_ep, enable_sp=enable_sp,
                                    expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)


# ------------------------------------------------------------------------ config builders
def sharding_agnostic(fn: Callable) -> Callable:
    """Wrap a parameter initializer so it draws the full tensor on every rank (same seed,
    same draws) and keeps this rank's shard: the weights do not depend on how FSDP x CP
    shards them, so a CP=N run starts from exactly the CP=1 weights. (Random ops on sharded
    DTensors draw per shard on CPU, which would differ.)"""

    def init(t: torch.Tensor) -> None:
        if not isinstance(t, DTensor):
            fn(t)
            return
        full = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        fn(full)
        shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
        with torch.no_grad():
            t.to_local().copy_(shard.to_local())

    init.sharding_agnostic = True  # type: ignore[attr-defined]
    return init


def _agnostic(inits: dict[str, Callable]) -> dict[str, Callable]:
    return {name: sharding_agnostic(fn) for name, fn in inits.items()}


def _normal(std: float) -> Callable:
    return sharding_agnostic(partial(nn.init.trunc_normal_, std=std))


def _linear_init(std: float = 0.02) -> dict[str, Callable]:
    return {"weight": _normal(std), "bias": nn.init.zeros_}


_NORM_INIT = {"weight": nn.init.ones_}


def _depth_std(layer_id: int) -> float:
    return 0.02 / (2 * (layer_id + 1)) ** 0.5


def _rope_config(args: Llama4Args, nope: bool) -> RoPE.Config:
    cls = NoRoPE if nope else ComplexRoPE
    return cls.Config(dim=args.head_dim_, max_seq_len=args.max_seq_len, theta=args.rope_theta,
                      scaling=args.rope_scaling, scaling_factor=args.rope_scaling_factor,
                      original_max_position_embeddings=args.rope_original_max_position)


def _inner_attention(mask: AttnMask, args: Llama4Args, options: AttnOptions
                     ) -> VarlenCPInnerAttention.Config:
    return VarlenCPInnerAttention.Config(
        causal=mask.causal, window_left=mask.window_size[0], window_right=mask.window_size[1],
        chunk_size=mask.chunk_size or 0, options=options, softmax_type=args.softmax_type,
        n_heads=args.n_heads, track_max_logit=args.track_max_logit)


def _moe_config(args: Llama4Args, layer_id: int) -> object:
    hidden = args.moe_hidden_dim or args.ffn_hidden_dim_
    experts_init = {"w1_EFD": _normal(0.02), "w2_EDF": _normal(_depth_std(layer_id)),
                    "w3_EFD": _normal(_depth_std(layer_id))}
    shared = None
    if args.shared_expert:
        shared = make_ffn_config(dim=args.dim, hidden_dim=hidden, w1_param_init=_linear_init(),
                                 w2w3_param_init=_linear_init(_depth_std(layer_id)))
    # Padding (the te layout's) is never routed: see moe.py.
    return padding_free_config(make_moe_config(
        num_experts=args.num_experts,
        router=make_router_config(dim=args.dim, num_experts=args.num_experts,
                                  gate_param_init=_linear_init(), top_k=args.top_k,
                                  score_func=args.score_func),
        routed_experts=make_routed_experts_config(
            dim=args.dim, hidden_dim=hidden, num_experts=args.num_experts, top_k=args.top_k,
            param_init=experts_init, comm_backend="standard"),
        shared_experts=shared,
        load_balance_coeff=args.load_balance_coeff or None,
    ))


def build_llama4_config(args: Llama4Args, options: AttnOptions = AttnOptions()
                        ) -> Llama4Model.Config:
    """The torchtitan model config for ``args``, with varlen-cp attention in every layer,
    run with ``options`` (``CPConfig.attn_options``)."""
    layers = []
    for i in range(args.n_layers):
        nope = args.is_nope_layer(i)
        qk_norm = None
        if args.use_qk_norm and not nope:
            qk_norm = RMSNorm.Config(normalized_shape=args.head_dim_, eps=args.norm_eps,
                                     param_init=_NORM_INIT)
        attention = make_gqa_config(
            dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim or None, wqkv_param_init=_linear_init(),
            wo_param_init=_linear_init(_depth_std(i)),
            inner_attention=_inner_attention(args.layer_mask(i), args, options),
            fuse_qkv=True, rope=_rope_config(args, nope), qk_norm=qk_norm)
        wqkv = attention.qkv_linear.wqkv
        wqkv.param_init = _agnostic(wqkv.param_init)  # torchtitan's fused init, unsharded
        feed_forward = moe = None
        if args.is_moe_layer(i):
            moe = _moe_config(args, i)
        else:
            feed_forward = make_ffn_config(dim=args.dim, hidden_dim=args.ffn_hidden_dim_,
                                           w1_param_init=_linear_init(),
                                           w2w3_param_init=_linear_init(_depth_std(i)))
        layers.append(Llama4TransformerBlock.Config(
            attention=attention, feed_forward=feed_forward, moe=moe,
            attention_norm=RMSNorm.Config(normalized_shape=args.dim, eps=args.norm_eps,
                                          param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=args.dim, eps=args.norm_eps,
                                    param_init=_NORM_INIT)))
    out_std = args.dim ** -0.5
    return Llama4Model.Config(
        dim=args.dim, vocab_size=args.vocab_size, enable_weight_tying=args.enable_weight_tying,
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab_size, embedding_dim=args.dim,
                                        param_init={"weight": sharding_agnostic(
                                            partial(nn.init.normal_, std=1.0))}),
        norm=RMSNorm.Config(normalized_shape=args.dim, eps=args.norm_eps,
                            param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=args.dim, out_features=args.vocab_size,
                              param_init={"weight": sharding_agnostic(partial(
                                  nn.init.trunc_normal_, std=out_std, a=-3 * out_std,
                                  b=3 * out_std)), "bias": nn.init.zeros_}),
        layers=layers,
    )


def llama4_model_spec(args: Llama4Args, options: AttnOptions = AttnOptions()) -> ModelSpec:
    """The torchtitan ``ModelSpec`` ("registration") of the Llama 4 style model, its
    attention run with ``options``."""
    from .parallelize import parallelize_llama4

    return ModelSpec(
        name=args.name,
        flavor=f"{args.n_layers}L-{args.dim}d",
        model=build_llama4_config(args, options),
        parallelize_fn=parallelize_llama4,
        pipelining_fn=None,
        post_optimizer_build_fn=register_moe_load_balancing_hook if args.num_experts else None,
        state_dict_adapter=None,
    )


def layer_masks(model_config: Llama4Model.Config) -> list[AttnMask]:
    """The AttnMask of each layer of a built config (for tests and logging)."""
    return [layer.attention.inner_attention.mask() for layer in model_config.layers]


def uses_rope(model_config: Llama4Model.Config) -> list[bool]:
    return [not isinstance(layer.attention.rope, NoRoPE.Config) for layer in model_config.layers]


__all__ = ["SOFTMAX_TYPES", "Llama4Args", "Llama4Model", "Llama4TransformerBlock", "NoRoPE",
           "build_llama4_config", "llama4_model_spec", "layer_masks", "uses_rope",
           "set_llama4_sharding_config"]
