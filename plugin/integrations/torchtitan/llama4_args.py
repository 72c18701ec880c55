"""The Llama 4 style model's ``[model]`` fields (``Llama4Args``) and its layer masks.

Its own module without torchtitan imports (only ``ffn_hidden_dim_`` imports torchtitan, when
read), so that ``varlen-cp-plan`` can read a job file's model (layer masks, heads, head dim)
where torchtitan is not installed; ``model`` builds the model from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import SOFTMAX_TYPES
from ...masks import AttnMask


@dataclass(kw_only=True)
class Llama4Args:
    """The ``[model]`` section."""

    name: str = "llama4_style"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 0
    """0: dim // n_heads."""
    vocab_size: int = 2048
    ffn_hidden_dim: int = 0
    """Dense SwiGLU width; 0: Llama's 8/3 * dim * ffn_dim_multiplier rounded to multiple_of."""
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Literal["none", "llama"] = "none"
    rope_scaling_factor: float = 8.0
    rope_original_max_position: int = 8192
    max_seq_len: int = 131072
    attention_chunk_size: int = 8192
    """Chunked attention on RoPE layers (Llama 4: 8192); 0 = off."""
    nope_layer_interval: int = 4
    """Every n-th layer is global causal without RoPE (Llama 4: 4); 0 = none."""
    sliding_window: int = 0
    """RoPE layers see themselves and this many previous keys (not with chunking); 0 = off."""
    use_qk_norm: bool = False
    num_experts: int = 0
    """0: dense feed-forward everywhere."""
    top_k: int = 1
    moe_hidden_dim: int = 0
    """Per-expert width; 0: the dense width."""
    shared_expert: bool = True
    interleave_moe_layer_step: int = 1
    """MoE on every n-th layer (Scout: 1, Maverick: 2)."""
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    load_balance_coeff: float = 1e-3
    enable_weight_tying: bool = False
    softmax_type: str = "vanilla"
    """Attention sink: "off-by-one" adds 1 to the softmax denominator (a zero logit),
    "learnable" one trained logit per query head and layer (gpt-oss style)."""
    track_max_logit: bool = False
    """Record each layer's max attention logit per head every step (``max_logits()``,
    logged as ``max_logit/layer_N``) for QK-clip."""

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len",
                    "top_k", "interleave_moe_layer_step", "multiple_of")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "ffn_hidden_dim", "attention_chunk_size",
                     "nope_layer_interval", "sliding_window", "num_experts", "moe_hidden_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                             f"model.n_kv_heads ({self.n_kv_heads})")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be a multiple of model.n_heads "
                             f"({self.n_heads}) unless model.head_dim is set")
        if self.head_dim_ % 2:
            raise ValueError(f"head dim must be even for RoPE, got {self.head_dim_}")
        if self.attention_chunk_size and self.sliding_window:
            raise ValueError("model.attention_chunk_size and model.sliding_window are "
                             "exclusive (set one to 0)")
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"model.softmax_type must be one of {SOFTMAX_TYPES}, got "
                             f"{self.softmax_type!r}")
        if not isinstance(self.track_max_logit, bool):
            raise ValueError(f"model.track_max_logit must be a bool, got "
                             f"{self.track_max_logit!r}")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be <= model.num_experts "
                             f"({self.num_experts})")

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden_dim_(self) -> int:
        from torchtitan.models.common import compute_ffn_hidden_dim

        return self.ffn_hidden_dim or compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier)

    def is_nope_layer(self, i: int) -> bool:
        return self.nope_layer_interval > 0 and (i + 1) % self.nope_layer_interval == 0

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and (i + 1) % self.interleave_moe_layer_step == 0

    def layer_mask(self, i: int) -> AttnMask:
        """Layer i's attention mask (all causal; NoPE layers global)."""
        if self.is_nope_layer(i):
            return AttnMask(causal=True)
        if self.attention_chunk_size:
            return AttnMask(causal=True, chunk_size=self.attention_chunk_size)
        if self.sliding_window:
            return AttnMask(causal=True, window_size=(self.sliding_window, 0))
        return AttnMask(causal=True)
