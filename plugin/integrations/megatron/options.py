"""The ``[varlen_cp]`` options of a megatron-core model and how they resolve per layer.

``VarlenCPOptions`` is ``varlen_cp.CPConfig`` (strategy, layout, backend, a2a_size,
overlap_stages, validate, min_chunk_tokens, tile_tokens, pad_multiple, prefetch, report:
declared and validated there) plus what only megatron needs: Llama 4 chunked attention
(``chunk_size``, ``chunk_layers``) and a strategy that may be a per-layer tuple or None
(follow megatron's ``cp_comm_type``). Each layer runs with its own ``varlen_cp.AttnOptions``
(``VarlenCPOptions.layer_options``): the layer's strategy, and the strategy-bound options
(``a2a_size``, ``overlap_stages``) only where that strategy takes them.

Megatron's own config says what it can: causal or not (the layer's ``attn_mask_type``),
sliding windows (``window_size``, ``window_attn_skip_freq``), RoPE-free layers
(``no_rope_freq``) and the CP strategy (``cp_comm_type``). Megatron has no field for Llama 4
chunked attention, so the chunk size and which layers use it live here; by default chunked
attention goes on the RoPE layers and the NoPE layers stay global, as in Llama 4.

Limits: ``cp_comm_type`` given as a per-layer list crashes megatron-core 0.16.1 itself with
CP > 1 (TransformerLayer indexes the list with the 1-based layer number); put a per-layer
tuple in ``VarlenCPOptions.strategy`` instead, which is indexed correctly (the TOML loader
moves a ``cp_comm_type`` list there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from ...checks import check_int, is_int
from ...config import CPConfig
from ...masks import AttnMask
from ...options import TAKES, AttnOptions, check_strategy, check_taken, takes

CHUNK_LAYER_MODES = ("rope", "all")
CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal,
                AttnMaskType.causal_bottom_right)
FULL_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


@dataclass(kw_only=True, frozen=True)
class VarlenCPOptions(CPConfig):
    """``CPConfig`` with megatron's extras (hashable, so plans cache per layer mask).

    Fields that differ from ``CPConfig``:

    strategy:     a name, a per-layer tuple of names, or None (default) to follow
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
                  ``no_rope_freq``), "all", or a per-layer tuple of bools.
    """

    strategy: str | tuple[str, ...] | None = None
    layout: str = "balanced"
    chunk_size: int = 0
    chunk_layers: str | tuple[bool, ...] = "rope"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 0)
        self._check_chunk_layers()

    def _check_attention(self) -> None:
        """One strategy: ``CPConfig``'s rules. A per-layer tuple, or None (megatron's
        ``cp_comm_type``, known when the model is built): each strategy-bound option must
        be taken by one of the layers' strategies (None: any may), and the shared options
        hold for every layer."""
        if isinstance(self.strategy, str):
            super()._check_attention()
            return
        names = self.per_layer_strategies()
        for option in TAKES:
            check_taken(option, getattr(self, option), names)
        for name in dict.fromkeys(names or ("p2p",)):
            self.layer_options(name)

    def per_layer_strategies(self) -> tuple[str, ...] | None:
        """The per-layer strategy names (checked), or None for megatron's ``cp_comm_type``."""
        s = self.strategy
        if s is None:
            return None
        if isinstance(s, str):
            return (check_strategy(s),)
        if not isinstance(s, tuple) or not s:
            got = f"a {type(s).__name__}" if isinstance(s, list) else repr(s)
            raise ValueError(f"strategy must be a strategy name, a non-empty tuple of names "
                             f"(one per layer; hashable, as the options are) or None, got "
                             f"{got}" + (": pass tuple(...)" if isinstance(s, list) else ""))
        return tuple(check_strategy(name, f"strategy[{i}]") for i, name in enumerate(s))

    @property
    def attn_options(self) -> AttnOptions:
        """The options of every layer, when they share one strategy (else ValueError: ask
        ``layer_options`` per layer)."""
        if not isinstance(self.strategy, str):
            raise ValueError(f"VarlenCPOptions.strategy={self.strategy!r} is resolved per "
                             f"layer: use layer_options(strategy) for each layer")
        return super().attn_options

    def layer_options(self, strategy: str, a2a_size: int | None = None) -> AttnOptions:
        """The ``AttnOptions`` of a layer that runs ``strategy``: the shared options, plus
        ``a2a_size`` (this layer's, see ``layer_a2a_size``), ``overlap_stages`` and
        ``graph_send_capacity`` where ``strategy`` takes them."""
        return AttnOptions(strategy=strategy, backend=self.backend, validate=self.validate,
                           a2a_size=a2a_size if takes(strategy, "a2a_size") else None,
                           overlap_stages=(self.overlap_stages
                                           if takes(strategy, "overlap_stages") else None),
                           graph_safe=self.graph_safe, graph_capacity=self.graph_capacity,
                           graph_send_capacity=(self.graph_send_capacity
                                                if strategy == "dispatch" else None))

    def _check_chunk_layers(self) -> None:
        c = self.chunk_layers
        if isinstance(c, str):
            if c not in CHUNK_LAYER_MODES:
                raise ValueError(f"chunk_layers must be one of {CHUNK_LAYER_MODES} or a tuple "
                                 f"of bools, got {c!r}")
            return
        if not isinstance(c, tuple) or not c or not all(
                isinstance(x, bool) or x in (0, 1) for x in c):
            got = f"a {type(c).__name__}" if isinstance(c, list) else repr(c)
            raise ValueError(f"chunk_layers must be one of {CHUNK_LAYER_MODES} or a non-empty "
                             f"tuple of bools (one per layer), got {got}"
                             + (": pass tuple(...)" if isinstance(c, list) else ""))

    def check_num_layers(self, num_layers: int) -> None:
        """Per-layer tuples must have one entry per transformer layer."""
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
    return bool(_per_layer(options.chunk_layers, layer_number,
                           "VarlenCPOptions.chunk_layers"))


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
        return check_strategy(name, f"config.cp_comm_type[{layer_number - 1}]")
    name = cfg if cfg is not None else cp_comm_type
    if name is None:
        return "p2p"
    return check_strategy(name, "cp_comm_type")


def layer_a2a_size(config: Any, options: VarlenCPOptions, strategy: str) -> int | None:
    """Ulysses group size for "a2a+p2p": the options', else megatron's
    ``hierarchical_context_parallel_sizes[0]``, else None (the strategy's default)."""
    if not takes(strategy, "a2a_size"):
        return None
    if options.a2a_size is not None:
        return options.a2a_size
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    return int(sizes[0]) if sizes else None
