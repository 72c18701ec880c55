"""Megatron MoE layers under varlen-cp: padding is kept out of routing statistics.

The ``te`` layout pads each document to a multiple of 2*cp (``CPPlan``: position -1); at
cp = 1 the integration plans ``contiguous`` (no padding), so CP=1 and CP=N see different
padding. megatron-core's own answer is ``GPTModel(..., padding_mask=)`` ([b, s] bool, True
= padding): its router then leaves padding out of the expert-bias token counts
(``local_tokens_per_expert``), of every auxiliary loss (``aux_loss``, ``seq_aux_loss``,
``global_aux_loss``: probabilities, counts and token totals) and of the z-loss. Padding rows
are still dispatched to experts (their output is never read: attention ignores them and
their ``loss_mask`` is 0). ``padding_mask(plan, device)`` is that mask for the plan's local
tokens; the THD sharding hooks put it in every local batch as ``batch["padding_mask"]``, and
``forward_step`` must pass it on, as the training entry point does.

``VarlenCPTopKRouter`` is megatron's ``TopKRouter`` with two fixes that CP=N == CP=1 needs
(``swap_core_attention`` puts it in every MoE spec whose router is ``TopKRouter``):
- 0.16.1 leaves padding out of the expert-bias counts with ``routing_map & ~padding_mask``,
  which broadcasts the [tokens] mask against [tokens, experts] and fails (or, with as many
  tokens as experts, masks the wrong axis); here the mask is applied per token.
- with per-token loss (``calculate_per_token_loss``, which the training entry point sets
  before building the model: routers read it then) megatron divides the z-loss
  coefficient by the TP x CP size although each CP rank already sums over its own tokens
  only: measured, CP=2's z-loss gradient was exactly half of CP=1's, on every layout.
  Here the coefficient is divided by the TP size only. (The load-balancing aux loss is
  CP-exact as megatron computes it: router gradients equal to 3e-9 at CP=2.)

``update_expert_bias(models)``: megatron's own end-of-step expert-bias update (token counts
all-reduced over TP x CP x DP, bias moved by ``moe_router_bias_update_rate``) and the
reset of the counters, which megatron runs inside its ``finalize_model_grads``; a training
loop that replaces that hook (as ``train.finalize_grads`` does) calls this instead.

Refused (``check_exact_under_cp``, when the launcher reads its config and when a router is
built): token dropping (``moe_expert_capacity_factor``) with CP > 1, which decides per CP
rank over that rank's tokens and lets padding take expert capacity.

Compatibility: megatron-core 0.16.1's router names ``te_general_gemm`` even when
TransformerEngine is absent (a NameError at the first MoE forward); importing this module
defines it as None there, which selects megatron's own torch GEMM path.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from ...plan import CPPlan
from ... import sharding

if not hasattr(moe_utils, "te_general_gemm"):  # TE absent: megatron's torch path
    moe_utils.te_general_gemm = None


def check_exact_under_cp(config: Any, cp_size: int, layout: str | None = None) -> None:
    """ValueError for MoE settings with which CP=N cannot train like CP=1: token dropping
    (``moe_expert_capacity_factor``) decides over each CP rank's own tokens, and megatron's
    capacity counts padding tokens too."""
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if has_moe(config) and factor is not None and cp_size > 1:
        where = "" if layout is None else f", layout {layout!r}"
        raise ValueError(
            f"MoE model (num_moe_experts={config.num_moe_experts}) with "
            f"moe_expert_capacity_factor={factor} and context_parallel_size={cp_size}"
            f"{where} is not supported by varlen_cp: token dropping decides per CP rank over "
            f"its own tokens (padding included), so CP={cp_size} cannot train like CP=1; "
            f"leave moe_expert_capacity_factor unset (no token dropping)")


class VarlenCPTopKRouter(TopKRouter):
    """megatron's top-k router whose expert-bias counts leave padding tokens out and whose
    per-token z-loss does not shrink with CP (see the module docstring)."""

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        check_exact_under_cp(config, self.cp_group.size())

    def apply_z_loss(self, logits: torch.Tensor,
                     padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        cp = self.cp_group.size()
        coeff = self.config.moe_z_loss_coeff
        if (cp == 1 or coeff is None or not self.calculate_per_token_loss
                or not self.training or not torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask)
        # Per-token loss: each rank's z-loss is the sum over its own real tokens and the
        # gradient reduction adds the CP ranks up, so the coefficient is split over TP only
        # (megatron also splits it over CP: CP=2 trained with half of CP=1's z-loss).
        coeff = coeff / self.tp_group.size()
        z_loss = moe_utils.z_loss_func(logits, coeff, padding_mask=padding_mask)
        valid = logits.shape[0] if padding_mask is None else (~padding_mask).sum()
        logits = moe_utils.MoEAuxLossAutoScaler.apply(logits, z_loss * valid)
        moe_utils.save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number,
                                             self.config.num_layers
                                             + (self.config.mtp_num_layers or 0))
        return logits

    def _apply_expert_bias(self, routing_map: torch.Tensor,
                           padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:  # [tokens] -> one flag per row of the map
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)


def padding_mask(plan: CPPlan, device: torch.device | str) -> torch.Tensor:
    """bool [1, T_local]: True for this rank's padding tokens (megatron's ``padding_mask``
    convention), built once per plan and device."""
    return sharding.padding_mask(plan, device)


def has_moe(config: Any) -> bool:
    """True when a megatron ``TransformerConfig`` has MoE layers."""
    return bool(getattr(config, "num_moe_experts", None))


def update_expert_bias(models: list[torch.nn.Module]) -> None:
    """After a step's backward: megatron's expert-bias update from the step's token counts
    (when ``moe_router_enable_expert_bias``), then the reset of its per-step MoE counters,
    exactly as megatron's ``finalize_model_grads`` does it."""
    from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                 reset_model_temporary_tensors)

    config = models[0].config
    if not has_moe(config):
        return
    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias(models, config)
    reset_model_temporary_tensors(config, models)
