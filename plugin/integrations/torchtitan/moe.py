"""Padding never reaches torchtitan's MoE layers: they route the batch's real tokens only.

The ``te`` layout pads every document to a multiple of 2*cp (``CPPlan``: position -1), and
CP=1 and CP=N pad differently (e.g. 300 real tokens in 47 documents: 332 at CP=1, 352 at
CP=2). Attention already ignores padding, the loss ignores its labels, but torchtitan's
``MoE`` routes every row it gets: padding rows were counted in ``tokens_per_expert_E``, from
which the auxiliary-loss-free load balancing moves ``expert_bias_E`` after each step, so the
biases, then the routing, then the losses of CP=2 drifted from CP=1 (gpt_oss debug model:
5e-4 relative after 3 steps).

``PaddingFreeMoE`` (a subclass made for each MoE class: torchtitan's ``MoE`` and every
subclass, e.g. ``GptOssMoE``; same parameters, buffers and state-dict names) gathers the
rows of real tokens before the router (``CPPlan.real_rows``, host-built and copied ahead of
the step), runs the parent's forward on them, and puts the result back in place; padding
rows get 0 (their hidden state never reaches a real token: attention does not read them and
their labels are ignored). So padding is not routed at all: it is not counted in
``tokens_per_expert_E``, not scored by the router, not computed by any expert (with the
``te`` layout at cp 64, padding can triple the token count) and not in any statistic a
future router adds. Batches without padding (every other layout) run the parent's forward
unchanged: no gather, no copy.

The rows arrive per forward: ``feed_real_rows(model)`` registers a forward pre-hook on the
model that reads the batch's ``PackedBatch`` (the ``attention_masks`` keyword every
varlen-cp model call carries) and hands each ``PaddingFreeMoE`` its rows (None without a
plan). ``padding_free_moe_for(root)`` swaps every MoE config of a model or trainer config
through torchtitan's ``@override`` (``padding_free_moe``).

Limits: the gather works on local tensors with the sequence on dim 1 and B = 1 (the
trainer's packed batch), which is what CP and FSDP give; under ``torch.compile`` a batch
with padding has a data-dependent number of real rows (dynamo marks that dim dynamic after
the first recompile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.config.override import OverrideConfig, apply_overrides, derive, override
from torchtitan.models.common.moe import MoE

from .attention import PackedBatch

_CLASSES: dict[type, type] = {}


def _padding_free(parent: type) -> type:
    """``parent`` (an ``MoE`` class) whose forward routes only the rows in ``real_rows``."""
    if getattr(parent, "padding_free", False):
        return parent
    if parent in _CLASSES:
        return _CLASSES[parent]

    class PaddingFreeMoE(parent):
        padding_free = True

        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):
            pass

        def __init__(self, config: Any) -> None:
            parent.__init__(self, config)
            self.real_rows: torch.Tensor | None = None
            """Local rows of the current batch's real tokens (None: all rows are real)."""

        def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
            rows = self.real_rows
            if rows is None:
                return parent.forward(self, x_BLD)
            if x_BLD.dim() != 3 or x_BLD.shape[0] != 1:
                raise ValueError(f"{type(self).__name__}: padding is dropped from the packed "
                                 f"batch [1, T, D]; got input of shape {tuple(x_BLD.shape)}")
            out_real = parent.forward(self, x_BLD.index_select(1, rows))
            out_shape = (*x_BLD.shape[:2], out_real.shape[-1])
            return out_real.new_zeros(out_shape).index_copy(1, rows, out_real)

    PaddingFreeMoE.__name__ = PaddingFreeMoE.__qualname__ = f"PaddingFree{parent.__name__}"
    _CLASSES[parent] = PaddingFreeMoE
    return PaddingFreeMoE


def padding_free_config(cfg: Any) -> Any:
    """``cfg`` (any ``MoE.Config``) as its padding-free subclass's config (same fields)."""
    cls = _padding_free(type(cfg)._owner)
    return cfg if type(cfg) is cls.Config else derive(cfg, cls.Config)


@override(target=MoE.Config,
          description="varlen-cp: MoE layers that never route padding tokens")
def padding_free_moe(cfg: Any) -> Any:
    return padding_free_config(cfg)


def padding_free_moe_for(root: Any) -> int:
    """Swap every MoE config below ``root`` (a model config, ``ModelSpec`` or
    ``Trainer.Config``) for its padding-free subclass; returns how many were swapped."""
    todo = sum(not getattr(type(cfg)._owner, "padding_free", False)
               for _, cfg, _, _ in root.traverse(MoE.Config))
    if todo:
        apply_overrides(OverrideConfig(imports=[f"{__name__}.padding_free_moe"]), root)
    return todo


def _padding_free_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(type(m), "padding_free", False)]


def feed_real_rows(model: nn.Module) -> int:
    """Register the forward pre-hook that gives every ``PaddingFreeMoE`` of ``model`` the
    rows of the batch's real tokens (from ``attention_masks=PackedBatch(plan)``, on the
    input's device). Returns the number of such layers (0: nothing registered)."""
    layers = _padding_free_layers(model)
    if not layers or getattr(model, "_varlen_cp_real_rows_hook", None) is not None:
        return len(layers)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        packed = kwargs.get("attention_masks")
        rows = None
        if isinstance(packed, PackedBatch):
            tokens = args[0] if args else kwargs.get("tokens")
            device = tokens.device if isinstance(tokens, torch.Tensor) else "cpu"
            rows = packed.plan.real_rows(device)
        for layer in layers:
            layer.real_rows = rows

    model._varlen_cp_real_rows_hook = model.register_forward_pre_hook(hook, with_kwargs=True)
    return len(layers)
