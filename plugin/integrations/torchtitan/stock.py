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

Routed experts in fp32 runs (``fp32_experts_for``, torchtitan ``@override``s of the experts'
configs with subclasses: same parameters, same math). torchtitan computes them in bf16 even
with fp32 parameters, and gpt_oss's return bf16 into the fp32 residual stream, where
torchtitan's own combine step then fails ("scatter(): Expected self.dtype to be equal to
src.dtype"); their output is cast back. On CPU (fp32 end to end) they also compute in fp32:
in bf16 each rank's expert weight gradient is rounded to bf16 before FSDP sums the ranks, so
CP=2 (two rounded partial sums) drifts from CP=1 (one): the gpt_oss debug model's losses
were 7e-3 apart after 10 steps (Adam flips the sign of near-zero updates, the router
follows); in fp32 they agree to 1e-5.

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
from torch.overrides import TorchFunctionMode
from torchtitan.config.override import OverrideConfig, apply_overrides, derive, override
from torchtitan.models.common.attention import BaseAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.gpt_oss.model import Attention as GptOssAttention
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
from torchtitan.protocols.module import Module

from ...masks import AttnMask
from ...prefetch import AttnShape
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
    lse_grad: bool = False            # a sink (ours, or gpt_oss's out_transform)
    row_max: bool = False             # the layer tracks its max logit


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
            sinks = inner.softmax_type != "vanilla" or isinstance(attn, GptOssAttention.Config)
            out.append(AttentionLayer(fqn, inner.mask(), _shape_of(attn), sinks,
                                      inner.track_max_logit))
    return out


def layer_masks(layers: list[AttentionLayer]) -> list[tuple[AttnMask, int]]:
    """The model's masks with their layer counts, in first-use order, e.g. Llama 4 debug:
    ``[(AttnMask(chunk_size=C), 3), (AttnMask(), 1)]``; gpt_oss: window vs global."""
    counts = Counter(layer.mask for layer in layers)
    return [(mask, counts[mask]) for mask in dict.fromkeys(layer.mask for layer in layers)]


def attention_shape(layers: list[AttentionLayer], *, tp: int, dtype: str) -> AttnShape:
    """The shape every layer's attention call has on this rank (heads split over TP), with
    the softmax extras its layers ask for (so that the resolution made ahead of the step
    is the one each call looks up; a model whose layers differ there resolves the others
    at their first call of each batch)."""
    shapes = {layer.shape for layer in layers}
    if len(shapes) != 1:
        raise ValueError(f"varlen_cp: attention layers with different shapes are not supported "
                         f"(found {sorted(shapes)})")
    return rank_shape(shapes.pop(), tp=tp, dtype=dtype,
                      lse_grad=any(layer.lse_grad for layer in layers),
                      row_max=any(layer.row_max for layer in layers))


def rank_shape(shape: tuple[int, int, int, int], *, tp: int, dtype: str,
               lse_grad: bool = False, row_max: bool = False) -> AttnShape:
    """The ``AttnShape`` of one rank for a model's (n_heads, n_kv_heads, head_dim,
    head_dim_v): heads split over ``tp``, the dtype of ``mixed_precision_param``."""
    n_heads, n_kv, head_dim, head_dim_v = shape
    return AttnShape(n_heads=max(n_heads // tp, 1), n_kv_heads=max(n_kv // tp, 1),
                     head_dim=head_dim, head_dim_v=head_dim_v,
                     dtype=DTYPES.get(dtype, torch.float32), lse_grad=lse_grad,
                     row_max=row_max)


# ------------------------------------------------------------------------ fp32 experts
class _NoBf16(TorchFunctionMode):
    """``Tensor.bfloat16()`` returns the tensor itself (inside fp32 experts only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0]
        return func(*args, **(kwargs or {}))


def _fp32_grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` in fp32, one expert at a time (torch's fp32 grouped GEMM has no
    CPU backward); rows past the last offset (gpt_oss's padding) are 0. CPU only: reads
    the offsets on the host."""
    rows, start = [], 0
    for e, end in enumerate(offs.tolist()):
        rows.append(A[start:end].float() @ B_t[e].float())
        start = end
    rows.append(A.new_zeros(A.shape[0] - start, B_t.shape[-1], dtype=torch.float32))
    return torch.cat(rows)


def _fp32_experts(parent: type) -> type:
    """``parent`` (torchtitan's routed experts) with its output cast back to the input
    dtype, and with ``fp32_compute`` the whole computation in fp32 (its bf16 casts become
    no-ops and the grouped GEMM runs in fp32)."""

    class Fp32Experts(parent):
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):
            fp32_compute: bool = False

        def __init__(self, config: Any) -> None:
            parent.__init__(self, config)
            self.fp32_compute = config.fp32_compute

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
                    ) -> torch.Tensor:
            if not self.fp32_compute:
                return parent.forward(self, x_RD, num_tokens_per_expert_E).type_as(x_RD)
            with _NoBf16():
                return parent.forward(self, x_RD, num_tokens_per_expert_E).type_as(x_RD)

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor
                        ) -> torch.Tensor:
            if self.fp32_compute:
                return _fp32_grouped_mm(A, B_t, offs)
            return parent._grouped_mm(self, A=A, B_t=B_t, offs=offs)

    Fp32Experts.__name__ = Fp32Experts.__qualname__ = f"Fp32{parent.__name__}"
    return Fp32Experts


Fp32GroupedExperts = _fp32_experts(GroupedExperts)
Fp32GptOssGroupedExperts = _fp32_experts(GptOssGroupedExperts)


@override(target=GroupedExperts.Config, exact=True,
          description="routed experts computed in fp32 (CPU fp32 runs)")
def fp32_experts(cfg: Any, *, fp32_compute: bool = True) -> Any:
    return derive(cfg, Fp32GroupedExperts.Config, fp32_compute=fp32_compute)


@override(target=GptOssGroupedExperts.Config, exact=True,
          description="gpt_oss experts: output in the input dtype, optionally fp32 compute")
def fp32_gpt_oss_experts(cfg: Any, *, fp32_compute: bool = False) -> Any:
    return derive(cfg, Fp32GptOssGroupedExperts.Config, fp32_compute=fp32_compute)


def fp32_experts_for(root: Any, *, compute: bool) -> None:
    """In an fp32 run: gpt_oss's experts return fp32 (``compute`` False), or every routed
    expert computes in fp32 (``compute`` True, CPU). ``root``: a ``Trainer.Config`` or a
    ``ModelSpec``."""
    found = {type(cfg) for _, cfg, _, _ in root.traverse(GroupedExperts.Config)}
    imports: list[Any] = []
    if GptOssGroupedExperts.Config in found:
        imports.append((f"{__name__}.fp32_gpt_oss_experts", {"fp32_compute": compute}))
    if compute and GroupedExperts.Config in found:
        imports.append(f"{__name__}.fp32_experts")
    if imports:
        apply_overrides(OverrideConfig(imports=imports), root)


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
