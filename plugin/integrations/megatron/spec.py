"""Layer specs: put ``VarlenCPCoreAttention`` into megatron-core GPT layer specs.

``swap_core_attention`` takes any spec object megatron builds GPT models from (a layer
``ModuleSpec``, local or TE; ``TransformerBlockSubmodules`` with per-layer specs; a block
``ModuleSpec``; a list of these) and returns a copy whose every ``core_attention`` is the
plugin's module and whose megatron ``SelfAttention`` is ``VarlenCPSelfAttention`` (the same
module and weights; its RoPE takes THD positions from the plan, so every layout is correct)
and whose MoE router, if megatron's ``TopKRouter``, is ``moe.VarlenCPTopKRouter`` (same
module and weights; padding kept out of its statistics); nothing else changes (TE linears
and norms stay TE). ``get_varlen_cp_layer_spec`` returns a ready local (TE-free) GPT layer
spec with it.

Limits: other self-attention classes (MLA, subclasses) keep megatron's RoPE, so their
layout must be "te" at CP > 1 (the core attention says so); the model still needs the THD
batch from ``get_thd_batch_on_this_cp_rank`` / ``PrefetchedTHDBatches`` (or sbhd rows
sharded by megatron's own hook) for CP.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import VarlenCPCoreAttention
from .moe import VarlenCPTopKRouter
from .options import VarlenCPOptions
from .rope import VarlenCPSelfAttention


def core_attention_spec(options: VarlenCPOptions | None = None, *,
                        rope_from_plan: bool = True) -> ModuleSpec:
    """The ``core_attention`` entry of a self-attention spec (a ModuleSpec is a builder
    megatron calls with its keywords; ``options`` ride along as a param).
    ``rope_from_plan=False`` says that the enclosing self-attention applies megatron's own
    THD RoPE (TE's layout), so the module refuses other layouts at CP > 1 when built."""
    options = VarlenCPOptions() if options is None else options
    if not isinstance(options, VarlenCPOptions):
        raise ValueError(f"options must be a VarlenCPOptions, got {type(options).__name__}")
    if not isinstance(rope_from_plan, bool):
        raise ValueError(f"rope_from_plan must be a bool, got {rope_from_plan!r}")
    params: dict[str, Any] = {"options": options}
    if not rope_from_plan:
        params["rope_from_plan"] = False
    return ModuleSpec(module=VarlenCPCoreAttention, params=params)


_ROUTABLE = (SelfAttention, VarlenCPSelfAttention)


def _swap(node: Any, options: VarlenCPOptions, seen: set[int], rope_from_plan: bool) -> int:
    """Replace every ``core_attention`` below ``node`` in place, and megatron's
    ``SelfAttention`` around it by ``VarlenCPSelfAttention`` when ``rope_from_plan``;
    returns the number of core attentions replaced."""
    if id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, (list, tuple)):
        return sum(_swap(item, options, seen, rope_from_plan) for item in node)
    if isinstance(node, ModuleSpec):
        sub = node.submodules
        if dataclasses.is_dataclass(sub) and hasattr(sub, "core_attention"):
            # a self-attention spec: its class decides who applies RoPE
            routed = rope_from_plan and node.module in _ROUTABLE
            if routed:
                node.module = VarlenCPSelfAttention
            sub.core_attention = core_attention_spec(options, rope_from_plan=routed)
            seen.add(id(sub))
            return 1
        return _swap(sub, options, seen, rope_from_plan)
    count = 0
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            if f.name == "core_attention":  # submodules without their class: unknown RoPE
                setattr(node, f.name, core_attention_spec(options, rope_from_plan=False))
                count += 1
            elif f.name == "router" and getattr(node, f.name) is TopKRouter:
                setattr(node, f.name, VarlenCPTopKRouter)  # MoE: padding kept out (moe.py)
            else:
                count += _swap(getattr(node, f.name), options, seen, rope_from_plan)
    return count


def swap_core_attention(spec: Any, options: VarlenCPOptions | None = None, *,
                        rope_from_plan: bool = True) -> Any:
    """A copy of ``spec`` with every core attention replaced by ``VarlenCPCoreAttention``
    and, with ``rope_from_plan`` (default), megatron's ``SelfAttention`` by
    ``VarlenCPSelfAttention`` (RoPE positions from the plan: every layout is correct).
    Self-attention classes it cannot route (MLA, subclasses) and ``rope_from_plan=False``
    keep megatron's THD RoPE, whose layout is TE's: their core attention then requires
    ``layout="te"`` at CP > 1 (ValueError when the model is built). MoE specs get
    ``VarlenCPTopKRouter`` in place of megatron's ``TopKRouter`` (see ``moe.py``).

    ``spec``: a GPT layer ``ModuleSpec`` (``get_gpt_layer_local_spec()``,
    ``get_gpt_layer_with_transformer_engine_spec()``, MLA variants), a
    ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec(...)``), a block
    ``ModuleSpec`` or a list of them. ValueError when it holds no core attention.
    """
    core_attention_spec(options, rope_from_plan=rope_from_plan)  # validates both
    options = VarlenCPOptions() if options is None else options
    if not isinstance(spec, (ModuleSpec, list, tuple)) and not (
            dataclasses.is_dataclass(spec) and not isinstance(spec, type)):
        raise ValueError(f"spec must be a megatron ModuleSpec, TransformerBlockSubmodules or "
                         f"a list of them, got {type(spec).__name__}")
    # deepcopy copies the spec tree but not the classes it names; the caller's spec (often
    # a cached module-level default) stays untouched.
    new = copy.deepcopy(spec)
    if _swap(new, options, set(), rope_from_plan) == 0:
        raise ValueError(f"spec: no core_attention found in {type(spec).__name__}; pass a "
                         f"GPT layer or block spec")
    return new


def get_varlen_cp_layer_spec(options: VarlenCPOptions | None = None, *,
                             rope_from_plan: bool = True,
                             **local_spec_kwargs: Any) -> ModuleSpec:
    """megatron's local (TE-free) GPT layer spec with the varlen_cp core attention (and
    self-attention, see ``swap_core_attention``); ``local_spec_kwargs`` go to
    ``get_gpt_layer_local_spec`` (e.g. ``qk_layernorm=True``, ``normalization="RMSNorm"``,
    ``num_experts``)."""
    return swap_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs), options,
                               rope_from_plan=rope_from_plan)
