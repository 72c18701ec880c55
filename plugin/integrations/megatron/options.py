"""The ``[varlen_cp]`` options of a megatron-core model and how they resolve per layer.

Megatron's own config says what it can: causal or not (the layer's ``attn_mask_type``),
sliding windows (``window_size``, ``window_attn_skip_freq``), RoPE-free layers
(``no_rope_freq``) and the CP strategy (``cp_comm_type``). Megatron has no field for Llama 4
chunked attention, so the chunk size and which layers use it live here; by default chunked
attention goes on the RoPE layers and the NoPE layers stay global, as in Llama 4.

Limits: ``cp_comm_type`` given as a per-layer list crashes megatron-core 0.16.1 itself with
CP > 1 (TransformerLayer indexes the list with the 1-based layer number); put a per-layer
list in ``VarlenCPOptions.strategy`` instead, which is indexed correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from ...masks import AttnMask
from ...plan import LAYOUTS
from ...strategies import STRATEGIES

BACKENDS = ("auto", "torch", "triton")
CHUNK_LAYER_MODES = ("rope", "all")
CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal,
                AttnMaskType.causal_bottom_right)
FULL_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_strategy(value: Any, what: str) -> None:
    if value != "auto" and value not in STRATEGIES:
        raise ValueError(f"{what} must be one of {(*STRATEGIES, 'auto')}, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class VarlenCPOptions:
    """Plugin settings shared by every layer (hashable, so plans cache per layer mask).

    strategy:     CP strategy: a name, a per-layer list of names, or None to follow
                  megatron's ``cp_comm_type`` (default "p2p").
    layout:       the batch layout the sharding hook produces. "te" (default) is the one
                  megatron's THD RoPE assumes; "dual_chunk" / "contiguous" balance better but
                  need RoPE applied from explicit positions (not megatron's THD RoPE).
    backend:      kernel backend: "auto" (triton on CUDA, torch on CPU), "torch", "triton".
    chunk_size:   Llama 4 chunked attention size in tokens; 0 = none.
    chunk_layers: where chunking applies: "rope" (layers that use RoPE, see megatron's
                  ``no_rope_freq``), "all", or a per-layer list of bools.
    a2a_size:     Ulysses group size of "a2a+p2p"; None: megatron's
                  ``hierarchical_context_parallel_sizes[0]`` if set, else the strategy's default.
    validate:     check once per batch that all CP ranks built the same plan (a host sync).
    min_chunk_tokens: "dual_chunk" layout only: documents shorter than 2*cp*this stay whole.
    pad_multiple: "te" layout only: pad each document to a multiple of it (None: 2*cp; use
                  2*cp*tp with sequence parallelism).
    """

    strategy: str | tuple[str, ...] | None = None
    layout: str = "te"
    backend: str = "auto"
    chunk_size: int = 0
    chunk_layers: str | tuple[bool, ...] = "rope"
    a2a_size: int | None = None
    validate: bool = False
    min_chunk_tokens: int = 64
    pad_multiple: int | None = None

    def __post_init__(self) -> None:
        s = self.strategy
        if isinstance(s, (list, tuple)):
            if not s:
                raise ValueError("VarlenCPOptions.strategy must not be an empty list")
            for i, name in enumerate(s):
                _check_strategy(name, f"VarlenCPOptions.strategy[{i}]")
            object.__setattr__(self, "strategy", tuple(s))
        elif s is not None:
            _check_strategy(s, "VarlenCPOptions.strategy")
        if self.layout not in LAYOUTS:
            raise ValueError(f"VarlenCPOptions.layout must be one of {LAYOUTS}, got "
                             f"{self.layout!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"VarlenCPOptions.backend must be one of {BACKENDS}, got "
                             f"{self.backend!r}")
        if not _is_int(self.chunk_size) or self.chunk_size < 0:
            raise ValueError(f"VarlenCPOptions.chunk_size must be an int >= 0, got "
                             f"{self.chunk_size!r}")
        self._check_chunk_layers()
        if self.a2a_size is not None and (not _is_int(self.a2a_size) or self.a2a_size < 1):
            raise ValueError(f"VarlenCPOptions.a2a_size must be None or an int >= 1, got "
                             f"{self.a2a_size!r}")
        if not isinstance(self.validate, bool):
            raise ValueError(f"VarlenCPOptions.validate must be a bool, got {self.validate!r}")
        if not _is_int(self.min_chunk_tokens) or self.min_chunk_tokens < 1:
            raise ValueError(f"VarlenCPOptions.min_chunk_tokens must be an int >= 1, got "
                             f"{self.min_chunk_tokens!r}")
        p = self.pad_multiple
        if p is not None and (not _is_int(p) or p < 1):
            raise ValueError(f"VarlenCPOptions.pad_multiple must be None or an int >= 1, got "
                             f"{p!r}")
        if p is not None and self.layout != "te":
            raise ValueError(f"VarlenCPOptions.pad_multiple applies to layout 'te' only, got "
                             f"pad_multiple={p!r} with layout={self.layout!r}")

    def _check_chunk_layers(self) -> None:
        c = self.chunk_layers
        if isinstance(c, str):
            if c not in CHUNK_LAYER_MODES:
                raise ValueError(f"VarlenCPOptions.chunk_layers must be one of "
                                 f"{CHUNK_LAYER_MODES} or a list of bools, got {c!r}")
            return
        if not isinstance(c, (list, tuple)) or not c or not all(
                isinstance(x, bool) or x in (0, 1) for x in c):
            raise ValueError(f"VarlenCPOptions.chunk_layers must be one of "
                             f"{CHUNK_LAYER_MODES} or a non-empty list of bools, got {c!r}")
        object.__setattr__(self, "chunk_layers", tuple(bool(x) for x in c))

    def check_num_layers(self, num_layers: int) -> None:
        """Per-layer lists must have one entry per transformer layer."""
        for name in ("strategy", "chunk_layers"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_layers:
                raise ValueError(f"VarlenCPOptions.{name} has {len(value)} entries, but the "
                                 f"model has num_layers={num_layers}")


def _per_layer(value: Any, layer_number: int, what: str) -> Any:
    """Entry of a per-layer list for the 1-based ``layer_number``."""
    if not 1 <= layer_number <= len(value):
        raise ValueError(f"layer_number={layer_number} is outside {what} "
                         f"({len(value)} entries)")
    return value[layer_number - 1]


def uses_rope(config: Any, layer_number: int) -> bool:
    """Whether megatron applies RoPE on this layer (``no_rope_freq``, a list after
    TransformerConfig's post-init, marks the RoPE-free layers)."""
    no_rope = getattr(config, "no_rope_freq", None)
    if not no_rope:
        return True
    if _is_int(no_rope):  # a config object that skipped megatron's post-init
        return layer_number % no_rope != 0
    return not bool(_per_layer(no_rope, layer_number, "config.no_rope_freq"))


def layer_is_chunked(config: Any, options: VarlenCPOptions, layer_number: int) -> bool:
    if options.chunk_size == 0:
        return False
    if options.chunk_layers == "all":
        return True
    if options.chunk_layers == "rope":
        return uses_rope(config, layer_number)
    return _per_layer(options.chunk_layers, layer_number, "VarlenCPOptions.chunk_layers")


def layer_mask(config: Any, options: VarlenCPOptions, layer_number: int,
               attn_mask_type: AttnMaskType) -> AttnMask:
    """The mask of one layer: causality from ``attn_mask_type``, the window from megatron's
    ``window_size`` / ``window_attn_skip_freq``, the chunk from the options."""
    if attn_mask_type in CAUSAL_TYPES:
        causal = True
    elif attn_mask_type in FULL_TYPES:
        causal = False
    else:
        raise ValueError(f"attn_mask_type {attn_mask_type!r} is not supported: varlen_cp "
                         f"masks come from positions (causal / window / chunk), not from a "
                         f"mask tensor")
    window = (-1, -1)
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                 layer_number):
        ws = tuple(config.window_size)
        if len(ws) != 2 or not all(_is_int(w) for w in ws):
            raise ValueError(f"config.window_size must be a pair of ints, got "
                             f"{config.window_size!r}")
        window = (int(ws[0]), int(ws[1]))
    chunk = options.chunk_size if layer_is_chunked(config, options, layer_number) else None
    return AttnMask(causal=causal, window_size=window, chunk_size=chunk)


def layer_strategy(config: Any, options: VarlenCPOptions, layer_number: int,
                   cp_comm_type: str | None) -> str:
    """The CP strategy of one layer: the options' choice, else megatron's ``cp_comm_type``
    (read from the config with the right index), else "p2p"."""
    if isinstance(options.strategy, tuple):
        return _per_layer(options.strategy, layer_number, "VarlenCPOptions.strategy")
    if options.strategy is not None:
        return options.strategy
    cfg = getattr(config, "cp_comm_type", None)
    if isinstance(cfg, (list, tuple)):
        name = _per_layer(cfg, layer_number, "config.cp_comm_type")
        _check_strategy(name, f"config.cp_comm_type[{layer_number - 1}]")
        return name
    name = cfg if cfg is not None else cp_comm_type
    if name is None:
        return "p2p"
    _check_strategy(name, "cp_comm_type")
    return name


def layer_a2a_size(config: Any, options: VarlenCPOptions, strategy: str) -> int | None:
    """Ulysses group size for "a2a+p2p": the options', else megatron's
    ``hierarchical_context_parallel_sizes[0]``, else None (the strategy's default)."""
    if strategy != "a2a+p2p":
        return None
    if options.a2a_size is not None:
        return options.a2a_size
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    return int(sizes[0]) if sizes else None
