"""torchtitan ``Trainer`` subclass: the ``[varlen_cp]`` / ``[model]`` sections and the per-step
sharding hook.

Per step, on the host, before the batch reaches the device (``batch_generator``): the
document boundaries of the packed batch (rows concatenated into one sequence, a document
starting where positions == 0 and at every row start) give the global ``cu_seqlens``.
Then (``post_dataloading_process``) one ``CPPlan`` is built for this CP rank, and input,
labels and positions are sharded with ``varlen_cp.sharding.shard_packed_batch``; RoPE gets
the sharded per-document positions and every attention layer the plan (``PackedBatch``).

Loss normalisation: torchtitan counts the valid labels of the *unsharded* batch of each
data-parallel rank (all CP ranks of a group see the same batch) and sums that over the
data-parallel ranks, so every CP rank divides its local loss sum by the global token count;
FSDP (over dp_shard x cp) sums the gradients without dividing. CP=N therefore trains exactly
like CP=1. Limits: no pipeline parallelism; the validator is not supported with CP.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.distributed.spmd_types import annotate_input_spmd_types
from torchtitan.trainer import Trainer

from ...plan import CPPlan
from ...sharding import cu_seqlens_from_positions, shard_packed_batch
from .attention import PackedBatch, bind_cp_group, layer_max_logits
from .config import VarlenCPConfig
from .model import Llama4Args


@dataclass(frozen=True)
class HostBatchMeta:
    """Host-side facts about a batch, computed before it moves to the device (not a tensor,
    so torchtitan's device copy leaves it alone)."""

    cu_seqlens: torch.Tensor  # int32, CPU: documents of the batch packed into one sequence


def packed_cu_seqlens(positions: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """cu_seqlens of a [B, L] batch packed into one sequence of B*L tokens (CPU)."""
    b, length = shape
    if positions is None:
        return torch.arange(0, b * length + 1, length, dtype=torch.int32)
    pos = positions.detach().to("cpu").clone()
    pos[:, 0] = 0  # rows are packed back to back: every row starts a document
    return cu_seqlens_from_positions(pos.reshape(1, -1))


class VarlenCPMetrics(MetricsProcessor):
    """torchtitan's metrics, plus one JSON line per logged step (rank 0) for comparisons,
    plus ``max_logit/layer_N`` (max over heads and over all ranks) when the model tracks
    max logits. The max-logit read is one small all-reduce and host copy per *logged* step,
    outside forward/backward."""

    model_parts: list[torch.nn.Module] = []

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        loss_file: str = ""
        """Append {step, loss, grad_norm, tps} per logged step to this file ("" = off)."""

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        ntokens = self.ntokens_since_last_log
        elapsed = time.perf_counter() - self.time_last_log
        max_logits = self.max_logit_metrics()
        extra_metrics = {**(extra_metrics or {}), **max_logits}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        path = self.config.loss_file
        if path and (not dist.is_initialized() or dist.get_rank() == 0):
            tps = ntokens / max(elapsed, 1e-9) / self.parallel_dims.non_data_parallel_size
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            row = {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm, "tps": tps}
            if max_logits:
                row["max_logit"] = max_logits
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def max_logit_metrics(self) -> dict[str, float]:
        """``{"max_logit/layer_N": value}``: each tracking layer's max logit of the last
        step (max over heads; max over all ranks, as data-parallel ranks see other batches).
        Every rank calls ``log``, so the all-reduce is matched."""
        per_layer: dict[int, torch.Tensor] = {}
        for part in self.model_parts:
            per_layer.update(layer_max_logits(part))
        if not per_layer:
            return {}
        layers = sorted(per_layer)
        values = torch.stack([per_layer[i].amax() for i in layers])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {f"max_logit/layer_{i}": float(v) for i, v in zip(layers, values.tolist())}


class VarlenCPTrainer(Trainer):
    """Trainer with varlen-cp context parallelism for packed documents."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: Llama4Args = field(default_factory=Llama4Args)
        varlen_cp: VarlenCPConfig = field(default_factory=VarlenCPConfig)

    def __init__(self, config: Config) -> None:
        if config.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("varlen_cp: pipeline parallelism is not supported")
        super().__init__(config)
        pd = self.parallel_dims
        self.cp_group: Any = None
        self.cp_size, self.cp_rank = 1, 0
        if pd.cp_enabled:
            mesh = pd.get_mesh("cp")
            self.cp_group = mesh.get_group()
            self.cp_size, self.cp_rank = mesh.size(), mesh.get_local_rank()
        for part in self.model_parts:
            bind_cp_group(part, self.cp_group)
        if isinstance(self.metrics_processor, VarlenCPMetrics):
            self.metrics_processor.model_parts = list(self.model_parts)

    def batch_generator(self, data_iterable):
        for input_dict, labels in super().batch_generator(data_iterable):
            inputs = input_dict["input"]
            input_dict["host_meta"] = HostBatchMeta(
                packed_cu_seqlens(input_dict.get("positions"), tuple(inputs.shape)))
            yield input_dict, labels

    def build_plan(self, cu_seqlens: torch.Tensor) -> CPPlan:
        vc = self.config.varlen_cp
        return CPPlan.build(cu_seqlens, cp_size=self.cp_size, cp_rank=self.cp_rank,
                            layout=vc.layout, min_chunk_tokens=vc.min_chunk_tokens)

    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        inputs = input_dict["input"]
        meta = input_dict.get("host_meta")
        if not isinstance(meta, HostBatchMeta):  # e.g. a caller that bypassed batch_generator
            meta = HostBatchMeta(packed_cu_seqlens(input_dict.get("positions"),
                                                   tuple(inputs.shape)))
        plan = self.build_plan(meta.cu_seqlens)
        n = inputs.numel()
        batch = {"input": inputs.reshape(1, n), "labels": labels.reshape(1, n),
                 "positions": torch.zeros(1, n, dtype=torch.int64, device=inputs.device)}
        local = shard_packed_batch(batch, plan, ignore_index=IGNORE_INDEX)
        inputs, labels = local["input"], local["labels"]
        # RoPE reads a cache row per position: padding tokens (-1, te layout) read row 0,
        # their attention rows see nothing anyway.
        positions = local["positions"].clamp(min=0)
        self.ntokens_seen += labels.numel()
        extra_kwargs: dict[str, Any] = {"positions": positions,
                                        "attention_masks": PackedBatch(plan)}
        if self.config.parallelism.spmd_backend == "spmd_types":
            inputs, labels, extra_kwargs = annotate_input_spmd_types(
                self.parallel_dims, inputs, labels, extra_kwargs)
        return inputs, labels, extra_kwargs
