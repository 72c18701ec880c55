"""Layer specs: put ``VarlenCPCoreAttention`` into megatron-core GPT layer specs.

``swap_core_attention`` takes any spec object megatron builds GPT models from (a layer
``ModuleSpec``, local or TE; ``TransformerBlockSubmodules`` with per-layer specs; a block
``ModuleSpec``; a list of these) and returns a copy whose every ``core_attention`` is the
plugin's module; nothing else changes (TE linears and norms stay TE). ``get_varlen_cp_layer_spec``
returns a ready local (TE-free) GPT layer spec with it.

Limits: only the core attention is swapped; the model still needs the THD batch from
``get_thd_batch_on_this_cp_rank`` (or sbhd rows sharded by megatron's own hook) for CP.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import VarlenCPCoreAttention
from .options import VarlenCPOptions


def core_attention_spec(options: VarlenCPOptions | None = None) -> ModuleSpec:
    """The ``core_attention`` entry of a self-attention spec (a ModuleSpec is a builder
    megatron calls with its keywords; ``options`` ride along as a param)."""
    options = VarlenCPOptions() if options is None else options
    if not isinstance(options, VarlenCPOptions):
        raise ValueError(f"options must be a VarlenCPOptions, got {type(options).__name__}")
    return ModuleSpec(module=VarlenCPCoreAttention, params={"options": options})


def _swap(node: Any, replacement: ModuleSpec, seen: set[int]) -> int:
    """Replace every ``core_attention`` field below ``node`` in place; returns the count."""
    if id(node) in seen:
        return 0
    seen.add(id(node))
    count = 0
    if isinstance(node, (list, tuple)):
        for item in node:
            count += _swap(item, replacement, seen)
        return count
    if isinstance(node, ModuleSpec):
        return _swap(node.submodules, replacement, seen)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            if f.name == "core_attention":
                setattr(node, f.name, replacement)
                count += 1
            else:
                count += _swap(getattr(node, f.name), replacement, seen)
    return count


def swap_core_attention(spec: Any, options: VarlenCPOptions | None = None) -> Any:
    """A copy of ``spec`` with every core attention replaced by ``VarlenCPCoreAttention``.

    ``spec``: a GPT layer ``ModuleSpec`` (``get_gpt_layer_local_spec()``,
    ``get_gpt_layer_with_transformer_engine_spec()``, MLA variants), a
    ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec(...)``), a block
    ``ModuleSpec`` or a list of them. ValueError when it holds no core attention.
    """
    replacement = core_attention_spec(options)
    if not isinstance(spec, (ModuleSpec, list, tuple)) and not (
            dataclasses.is_dataclass(spec) and not isinstance(spec, type)):
        raise ValueError(f"spec must be a megatron ModuleSpec, TransformerBlockSubmodules or "
                         f"a list of them, got {type(spec).__name__}")
    # deepcopy copies the spec tree but not the classes it names; the caller's spec (often
    # a cached module-level default) stays untouched.
    new = copy.deepcopy(spec)
    if _swap(new, replacement, set()) == 0:
        raise ValueError(f"spec: no core_attention found in {type(spec).__name__}; pass a "
                         f"GPT layer or block spec")
    return new


def get_varlen_cp_layer_spec(options: VarlenCPOptions | None = None,
                             **local_spec_kwargs: Any) -> ModuleSpec:
    """megatron's local (TE-free) GPT layer spec with the varlen_cp core attention;
    ``local_spec_kwargs`` go to ``get_gpt_layer_local_spec`` (e.g. ``qk_layernorm=True``,
    ``normalization="RMSNorm"``, ``num_experts``)."""
    return swap_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs), options)
