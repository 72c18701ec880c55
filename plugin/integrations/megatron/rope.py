"""RoPE by the plan's positions: megatron's own rotary table, each local token its row.

Megatron's THD RoPE (``_apply_rotary_pos_emb_thd``) assumes TE's layout: it cuts every padded
document into 2*cp chunks and gives rank r chunks r and 2*cp-1-r (and reads cu_seqlens on
the host in every layer). varlen_cp's plan already knows each local token's position in its
document, whatever the layout, so ``VarlenCPSelfAttention`` (megatron's ``SelfAttention``,
put in the layer spec by ``swap_core_attention``) takes the RoPE table that megatron's model
computed (``RotaryEmbedding`` / YaRN: row p is position p), hands megatron ``rotary_pos_emb=None``
and passes the table's rows at the tokens' positions (the packed params'
``varlen_cp_positions``: a tensor, so megatron's CUDA graphs refresh it at each replay) to
the core attention on its own copy of the packed params; the core attention applies them with megatron's ``apply_rotary_pos_emb``
(its non-packed path: per token, same kernel, same interleaving, YaRN mscale and fusion
setting). Recomputation (``recompute_granularity="selective"``) sees the same packed params,
so it reapplies the same rotation. NoPE layers (``no_rope_freq``) get none, as in megatron.

Limits: THD batches from the sharding hook (sbhd keeps megatron's own RoPE, whose layout is
the sbhd plan's); training and static inference without flash decode; mRoPE
(``mrope_section``) and MLA keep megatron's RoPE, so they need layout "te" at CP > 1.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config)
from megatron.core.transformer.attention import SelfAttention

from ...plan import CPPlan
from ...plan.capacity import GraphKey
from .options import uses_rope
from .planning import rope_index
from .sharding import plan_of


@dataclasses.dataclass(frozen=True)
class PlanRope:
    """One layer's RoPE frequencies per local token ([T, 1, 1, d]) for q and k; None:
    no RoPE on this layer (NoPE layer, or a model without rotary embeddings)."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None


def _rows(plan: CPPlan, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The table's rows at the tokens' positions (``positions``, else the plan's; padding
    tokens: row 0)."""
    if not isinstance(table, torch.Tensor) or table.dim() != 4 or table.shape[1:3] != (1, 1):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"rotary_pos_emb must be megatron's RoPE table [max_seqlen, 1, 1, d] "
                         f"(row p = position p), got {shape}")
    if plan.max_document_length > table.shape[0]:
        raise ValueError(f"rotary_pos_emb has {table.shape[0]} rows but the batch has a "
                         f"document of {plan.max_document_length} tokens: max_seqlen_q of the "
                         f"packed params must cover the longest document")
    if positions is not None and positions.device != table.device:
        positions = None   # sharded for another device: the plan's copy on the table's
    index = rope_index(plan, table.device) if positions is None else positions
    return table.index_select(0, index)


def plan_rope(plan: CPPlan, rotary_pos_emb: Any,
              positions: torch.Tensor | None = None) -> PlanRope:
    """Per-token frequencies of ``rotary_pos_emb`` (a table, or megatron's (q, k) pair) at
    ``positions`` (the packed params' ``varlen_cp_positions``; None: the plan's, cached in
    it). A graph replays the lookup on the positions tensor it was captured with, which
    megatron refreshes at each replay since it is a tensor field of the packed params."""
    if rotary_pos_emb is None:
        return PlanRope()
    q_table, k_table = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                        else (rotary_pos_emb, rotary_pos_emb))
    q = None if q_table is None else _rows(plan, q_table, positions)
    k = q if k_table is q_table else (None if k_table is None
                                      else _rows(plan, k_table, positions))
    return PlanRope(q, k)


def apply_plan_rope(query: torch.Tensor, key: torch.Tensor, rope: PlanRope, config: Any,
                    cp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, hq, d], k [t, hkv, d] rotated by their tokens' frequencies (megatron's
    ``apply_rotary_pos_emb`` on [t, 1, h, d], as its THD path does per document)."""
    mscale = _yarn_get_concentration_factor_from_config(config)

    def rotate(x: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        if freqs is None:
            return x
        return apply_rotary_pos_emb(x.unsqueeze(1), freqs, config=config, cu_seqlens=None,
                                    mscale=mscale, cp_group=cp_group).squeeze(1)

    return rotate(query, rope.q), rotate(key, rope.k)


def check_positions(plan: Any, table: Any, positions: torch.Tensor | None) -> None:
    """In the graph-safe mode (``plan`` a ``GraphKey``) the RoPE lookup must read the packed
    params' positions tensor, the step's input that a replay refreshes: it must be on the
    table's device (ValueError otherwise; the dynamic mode falls back to the plan's)."""
    device = _device(table)
    if isinstance(plan, GraphKey) and device is not None and (
            positions is None or positions.device != device):
        raise ValueError(f"packed_seq_params.varlen_cp_positions must be on the model's "
                         f"device {device} in the graph-safe mode, got "
                         f"{None if positions is None else positions.device}: pass "
                         f"device= to get_thd_batch_on_this_cp_rank")


def _device(table: Any) -> torch.device | None:
    """The device of a RoPE table or of megatron's (q, k) pair of tables (None: none)."""
    tables = table if isinstance(table, tuple) else (table,)
    return next((t.device for t in tables if isinstance(t, torch.Tensor)), None)


_FORWARD = inspect.signature(SelfAttention.forward)


class VarlenCPSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose RoPE, for THD batches carrying a varlen_cp plan,
    takes each token's position from the plan (any layout; see the module doc)."""

    def forward(self, *args: Any, **kwargs: Any):
        bound = _FORWARD.bind(self, *args, **kwargs)
        a = bound.arguments
        params = a.get("packed_seq_params")
        plan = getattr(params, "varlen_cp_plan", None)
        if (plan is None or getattr(params, "qkv_format", None) != "thd"
                or a.get("inference_context") is not None
                or getattr(self.config, "mrope_section", None) is not None):
            return super().forward(*args, **kwargs)
        table = a.get("rotary_pos_emb")
        if not uses_rope(self.config, self.layer_number):
            table = None
        a["rotary_pos_emb"] = None  # megatron's THD RoPE must not run
        positions = getattr(params, "varlen_cp_positions", None)
        check_positions(plan, table, positions)
        rope = plan_rope(plan_of(plan, positions), table, positions)
        a["packed_seq_params"] = dataclasses.replace(params, varlen_cp_rope=rope)
        return super().forward(*bound.args[1:], **bound.kwargs)
