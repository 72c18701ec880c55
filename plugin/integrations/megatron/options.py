"""The ``[varlen_cp]`` options of a megatron-core model and how they resolve per layer.

``VarlenCPOptions`` is ``varlen_cp.CPConfig`` (strategy, layout, backend, a2a_size, validate,
min_chunk_tokens, tile_tokens, pad_multiple, prefetch, report: declared and validated there) plus
what only megatron needs: Llama 4 chunked attention (``chunk_size``, ``chunk_layers``) and a
strategy that may be a per-layer list or None (follow megatron's ``cp_comm_type``).

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

from ...checks import check_choice, check_int, is_int
from ...config import STAGED_STRATEGIES, STRATEGY_NAMES, CPConfig
from ...masks import AttnMask

CHUNK_LAYER_MODES = ("rope", "all")
CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal,
                AttnMaskType.causal_bottom_right)
FULL_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


@dataclass(kw_only=True, frozen=True)
class VarlenCPOptions(CPConfig):
    """``CPConfig`` with megatron's extras (hashable, so plans cache per layer mask).

    Fields that differ from ``CPConfig``:

    strategy:     a name, a per-layer list of names, or None (default) to follow
                  megatron's ``cp_comm_type`` (itself defaulting to "p2p").
    layout:       "balanced" (default): every layer type's attention work and the tokens
                  equal on every rank, no padding. RoPE positions come from the plan (the
                  layer spec routes megatron's RoPE through it), so every layout is correct
                  with ``swap_core_attention`` / ``get_varlen_cp_layer_spec``. Pick "te" for
                  specs whose self-attention is not megatron's ``SelfAttention`` (MLA, custom
                  classes: megatron's own THD RoPE then runs and assumes TE's layout) or to
                  feed TE-padded batches (``cu_seqlens_padded``); "dual_chunk" / "contiguous"
                  for comparisons.
    a2a_size:     "a2a+p2p" Ulysses group size; None: megatron's
                  ``hierarchical_context_parallel_sizes[0]`` if set, else the strategy's
                  default.

    Megatron only:

    chunk_size:   Llama 4 chunked attention size in tokens; 0 = none.
    chunk_layers: where chunking applies: "rope" (layers that use RoPE, see megatron's
                  ``no_rope_freq``), "all", or a per-layer list of bools.
    """

    strategy: str | tuple[str, ...] | None = None
    layout: str = "balanced"
    chunk_size: int = 0
    chunk_layers: str | tuple[bool, ...] = "rope"

    def __post_init__(self) -> None:
        strategy = self._check_strategy()
        if isinstance(strategy, str):
            super().__post_init__()
        else:
            # CPConfig knows one strategy per model: it checks the shared fields with the
            # strategy-bound options set aside; their rules against the layers' strategies
            # (a list, or megatron's cp_comm_type when None) are checked here.
            kept = {"strategy": strategy, "a2a_size": self.a2a_size,
                    "overlap_stages": self.overlap_stages}
            for name, value in (("strategy", "p2p"), ("a2a_size", None),
                                ("overlap_stages", None)):
                object.__setattr__(self, name, value)
            try:
                super().__post_init__()
            finally:
                for name, value in kept.items():
                    object.__setattr__(self, name, value)
            check_int("a2a_size", self.a2a_size, 1, optional=True)
            check_int("overlap_stages", self.overlap_stages, 1, optional=True)
            names = strategy or ()
            if self.overlap_stages is not None and strategy is not None and not (
                    set(names) & set(STAGED_STRATEGIES)):
                raise ValueError(f"overlap_stages applies to strategies "
                                 f"{STAGED_STRATEGIES} only, got overlap_stages="
                                 f"{self.overlap_stages!r} with strategy={strategy!r}")
        check_int("chunk_size", self.chunk_size, 0)
        self._check_chunk_layers()

    def _check_strategy(self) -> str | tuple[str, ...] | None:
        s = self.strategy
        if isinstance(s, (list, tuple)):
            if not s:
                raise ValueError("strategy must not be an empty list")
            s = tuple(check_choice(f"strategy[{i}]", name, STRATEGY_NAMES)
                      for i, name in enumerate(s))
        elif s is not None:
            check_choice("strategy", s, STRATEGY_NAMES)
        names = s if isinstance(s, tuple) else (s,)
        if self.a2a_size is not None and s is not None and "a2a+p2p" not in names:
            raise ValueError(f"a2a_size applies to strategy 'a2a+p2p' only, got "
                             f"a2a_size={self.a2a_size!r} with strategy={s!r}")
        return s

    def _check_chunk_layers(self) -> None:
        c = self.chunk_layers
        if isinstance(c, str):
            if c not in CHUNK_LAYER_MODES:
                raise ValueError(f"chunk_layers must be one of {CHUNK_LAYER_MODES} or a list "
                                 f"of bools, got {c!r}")
            return
        if not isinstance(c, (list, tuple)) or not c or not all(
                isinstance(x, bool) or x in (0, 1) for x in c):
            raise ValueError(f"chunk_layers must be one of {CHUNK_LAYER_MODES} or a "
                             f"non-empty list of bools, got {c!r}")
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
    if is_int(no_rope):  # a config object that skipped megatron's post-init
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
        if len(ws) != 2 or not all(is_int(w) for w in ws):
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
        check_choice(f"config.cp_comm_type[{layer_number - 1}]", name, STRATEGY_NAMES)
        return name
    name = cfg if cfg is not None else cp_comm_type
    if name is None:
        return "p2p"
    check_choice("cp_comm_type", name, STRATEGY_NAMES)
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
