"""torchtitan's own language models (llama3, qwen3, gpt_oss, deepseek_v3, ...) under varlen-cp.

A stock model is taken from torchtitan's registry unchanged, built with ``attn_backend =
"varlen"`` so that each layer's inner attention carries the layer's own mask
(``VarlenAttention.Config.window_size``: gpt_oss has (127, 0) on its sliding layers and
(-1, 0) on the others). The trainer then swaps every such inner attention for varlen-cp's
(``attention.varlen_cp_attention``, a torchtitan ``@override``) and reads back what the
plan needs: the model's layer masks with their layer counts and its attention shape.

On CPU, parameter initialisation is made independent of how FSDP x CP shards a parameter
(``cpu_sharding_agnostic_init``): torch's DTensor random ops draw per shard on CPU (measured:
a Shard(0) trunc_normal_ over 2 ranks differs from the 1-rank draw), so without it a CP=2
run would start from other weights than CP=1. On CUDA torch's offset-based RNG already does
this, and materialising full expert tensors per rank would cost memory, so it stays off.

With fp32 parameters (all CPU runs) gpt_oss's routed experts return bf16 into the fp32
residual stream and torchtitan's own combine step then fails ("scatter(): Expected
self.dtype to be equal to src.dtype"; its generic ``GroupedExperts`` casts back, gpt_oss's
does not): ``fp32_expert_outputs`` overrides them with a subclass that casts the output back
to the input dtype (a no-op with bf16 parameters; same parameters, same math).

Limits (each raises ``UnsupportedModel`` naming the model and the reason, before anything
is built): qwen3_5 (its Gated DeltaNet linear-attention layers and vision tower need the
whole sequence; torchtitan refuses CP for it too) and kimi_k2_7 with context parallelism
(torchtitan's parallelize refuses it: the vision scatter needs the full sequence).
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config.override import OverrideConfig, apply_overrides, derive, override
from torchtitan.models.common.attention import BaseAttention
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
from torchtitan.protocols.module import Module

from ...masks import AttnMask
from ...prepare import AttnShape
from .attention import VarlenCPInnerAttention
from .model import sharding_agnostic

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModel(ValueError):
    """A model or model option that varlen-cp cannot train (message says why)."""


def check_supported(name: str, cp: int) -> None:
    """Raise ``UnsupportedModel`` for the stock models varlen-cp cannot run at ``cp``."""
    if name == "qwen3_5":
        raise UnsupportedModel(
            "model.name 'qwen3_5' is not supported by varlen_cp: 3 of its 4 layers are Gated "
            "DeltaNet (linear attention, a recurrence over the whole sequence, with no "
            "context-parallel form here or in torchtitan) and it always builds a vision "
            "tower; train it with torchtitan's own attention and context_parallel_degree = 1")
    if name == "kimi_k2_7" and cp > 1:
        raise UnsupportedModel(
            "model.name 'kimi_k2_7' with context_parallel_degree > 1 is not supported: "
            "torchtitan's parallelize_kimi_k2_5 refuses context parallelism (its vision "
            "scatter needs the full sequence before sharding); use context_parallel_degree = 1")


def stock_model_spec(name: str, flavor: str) -> Any:
    """torchtitan's ``ModelSpec`` for model ``name`` (a ``torchtitan.models`` module) and
    ``flavor``, built with varlen inner attention (swapped for varlen-cp's by the trainer)."""
    module = importlib.import_module(f"torchtitan.models.{name}")
    try:
        return module.model_registry(flavor, attn_backend="varlen")
    except KeyError:
        flavors = sorted({k for v in vars(module).values() if isinstance(v, dict)
                          and "debugmodel" in v for k in v})
        raise ValueError(f"model.flavor {flavor!r} is not a flavor of torchtitan's {name}; "
                         f"known flavors: {', '.join(flavors)}") from None


# ------------------------------------------------------------------------ model structure
@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer of a model config: where it is, its mask and its shape."""

    fqn: str
    mask: AttnMask
    shape: tuple[int, int, int, int]  # (n_heads, n_kv_heads, head_dim, head_dim_v)


def _shape_of(attn: Any) -> tuple[int, int, int, int]:
    """Head counts and dims of an attention config (GQA, gpt_oss, DeepSeek MLA)."""
    n_heads = attn.n_heads
    if getattr(attn, "qk_nope_head_dim", None) is not None:  # MLA: K expanded to every head
        return (n_heads, n_heads, attn.qk_nope_head_dim + attn.qk_rope_head_dim,
                attn.v_head_dim)
    n_kv = getattr(attn, "n_kv_heads", None) or n_heads
    head_dim = getattr(attn, "head_dim", None) or attn.dim // n_heads
    return (n_heads, n_kv, head_dim, head_dim)


def attention_layers(model_config: Any) -> list[AttentionLayer]:
    """Every varlen-cp attention layer of a model config, in model order."""

    out = []
    for fqn, attn, _, _ in model_config.traverse(BaseAttention.Config):
        inner = attn.inner_attention
        if isinstance(inner, VarlenCPInnerAttention.Config):
            out.append(AttentionLayer(fqn, inner.mask(), _shape_of(attn)))
    return out


def layer_masks(layers: list[AttentionLayer]) -> list[tuple[AttnMask, int]]:
    """The model's masks with their layer counts, in first-use order, e.g. Llama 4 debug:
    ``[(AttnMask(chunk_size=C), 3), (AttnMask(), 1)]``; gpt_oss: window vs global."""
    counts = Counter(layer.mask for layer in layers)
    return [(mask, counts[mask]) for mask in dict.fromkeys(layer.mask for layer in layers)]


def attention_shape(layers: list[AttentionLayer], *, tp: int, dtype: str) -> AttnShape:
    """The shape every layer's attention call has on this rank (heads split over TP)."""
    shapes = {layer.shape for layer in layers}
    if len(shapes) != 1:
        raise ValueError(f"varlen_cp: attention layers with different shapes are not supported "
                         f"(found {sorted(shapes)})")
    n_heads, n_kv, head_dim, head_dim_v = shapes.pop()
    return AttnShape(n_heads=max(n_heads // tp, 1), n_kv_heads=max(n_kv // tp, 1),
                     head_dim=head_dim, head_dim_v=head_dim_v,
                     dtype=DTYPES.get(dtype, torch.float32))


# ------------------------------------------------------------------------ fp32 gpt_oss
class Fp32OutGptOssGroupedExperts(GptOssGroupedExperts):
    """gpt_oss's routed experts with the output cast back to the input dtype (fp32 runs)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
                ) -> torch.Tensor:
        return GptOssGroupedExperts.forward(self, x_RD, num_tokens_per_expert_E).type_as(x_RD)


@override(target=GptOssGroupedExperts.Config, exact=True,
          description="gpt_oss experts: bf16 output cast back to the fp32 residual stream")
def gpt_oss_fp32_experts(cfg: GptOssGroupedExperts.Config) -> Fp32OutGptOssGroupedExperts.Config:
    return derive(cfg, Fp32OutGptOssGroupedExperts.Config)


def fp32_expert_outputs(root: Any) -> None:
    """Apply ``gpt_oss_fp32_experts`` to a config tree (a ``Trainer.Config`` or a
    ``ModelSpec``) if it has gpt_oss experts."""
    if any(root.traverse(GptOssGroupedExperts.Config)):
        apply_overrides(OverrideConfig(imports=[f"{__name__}.gpt_oss_fp32_experts"]), root)


# ------------------------------------------------------------------------ CPU init
def cpu_sharding_agnostic_init(model_config: Any) -> int:
    """Wrap every ``param_init`` of a model config so that it draws the full tensor on
    every rank and keeps its shard (see the module docstring); returns how many were
    wrapped. ``skip_param_init`` (tied weights) is left alone."""

    n = 0
    for _, cfg, _, _ in model_config.traverse(Module.Config, recurse=True):
        inits = getattr(cfg, "param_init", None)
        if not isinstance(inits, dict):
            continue
        # A new dict: torchtitan shares one init dict between many configs (and modules).
        wrapped = {name: fn if fn is skip_param_init or getattr(fn, "sharding_agnostic", False)
                   else sharding_agnostic(fn) for name, fn in inits.items()}
        n += sum(wrapped[k] is not inits[k] for k in inits)
        cfg.param_init = wrapped
    return n
