"""torchtitan ``Trainer`` subclass: varlen-cp attention, the per-batch plan (built ahead of
the step), and the sharding hook.

Before torchtitan builds anything (``__init__``), every ``VarlenAttention`` inner attention
of the model config (any of torchtitan's models built with ``attn_backend = "varlen"``) is
replaced by varlen-cp's through torchtitan's own override mechanism
(``attention.varlen_cp_attention``), ahead of ``update_from_config`` so that the model's
"no varlen with CP" check sees varlen-cp's attention. The model's layer masks with their
layer counts (``layer_masks``, e.g. Llama 4 debug: chunked x3, global x1; gpt_oss: window
x2, global x2) and its attention shape (``AttnShape``: heads on this rank, q/k and v head
dims, compute dtype) are read back from that config.

Per batch, on the host and off the critical path: a ``PlanPrefetcher`` wraps the data
iterator; its thread takes the next batch, finds its documents (rows concatenated into one
sequence; a document starts where positions == 0 and at every row start, as torchtitan's
``create_varlen_metadata_for_document`` does), builds the batch's plan with the layer masks
(``varlen_cp.prefetch.build_plan``) and every table each mask's attention will need, with
their device copies (``build_tables``), while the current step runs. The step
(``post_dataloading_process``) checks that the CP ranks built the same plan (``validate``:
one all-reduce of host tensors, before the model runs, so no attention layer syncs) and
shards input, labels and positions with the ready plan (``shard_packed_batch``); RoPE gets
the sharded per-document positions and every attention layer the plan (``PackedBatch``).
``[varlen_cp] prefetch = false`` builds it inline instead. ``[compile] enable = true``: the
blocks compile with the CP attention as one custom op (``varlen_cp.graph_op``); the token
dim of what enters a compiled region is marked dynamic (``mark_dynamic_activations``), so
later batches, with other local token counts, reuse the first batch's graphs.
Each step's plan also goes to a ``varlen_cp.report.TrainingReport``: rank 0 logs the plan
on the ``varlen_cp`` logger at the first step and when a choice changes, and every logged
step adds its ``varlen_cp/...`` figures to torchtitan's metrics (``[varlen_cp] report``).

Padding (the ``te`` layout's, position -1) never reaches a token reduction: its labels
become ``IGNORE_INDEX`` (sharding), its attention rows see nothing and are seen by none,
the MoE layers of any model route only the real tokens (``moe.PaddingFreeMoE``, fed each
step's rows by a forward pre-hook), and ``ntokens_seen`` counts real tokens.

Loss normalisation: torchtitan counts the valid labels of the *unsharded* batch of each
data-parallel rank (all CP ranks of a group see the same batch) and sums that over the
data-parallel ranks, so every CP rank divides its local loss sum by the global token count;
FSDP (over dp_shard x cp) sums the gradients without dividing. CP=N therefore trains exactly
like CP=1. Limits: no pipeline parallelism; the validator is not supported with CP; batches
with inputs other than tokens and positions (images) are refused; with prefetch the data
iterator runs ``depth`` + 1 batches ahead, so a checkpoint's dataloader state is that far
ahead too (resuming skips those batches; set ``prefetch = false`` for exact resumes).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.distributed.spmd_types import annotate_input_spmd_types
from torchtitan.models.common.attention import BaseAttention, VarlenAttention
from torchtitan.models.common.moe import MoE
from torchtitan.trainer import Trainer

from ...kernels.host_copy import one_to_device
from ...plan import CPPlan
from ...plan.cpplan import mark_token_dim
from ...kernels.flash import activate_flash_impl
from ...prefetch import PlanPrefetcher, build_plan, build_tables, refresh_buffers
from ...report import TrainingReport, layer_types
from ...sharding import cu_seqlens_from_positions, shard_packed_batch
from ...strategies.relay_group import prepare_node_groups
from . import cpu_mode
from .attention import (OVERRIDE_TARGET, PackedBatch, VarlenCPInnerAttention, bind_cp_group,
                        graph_key_of, layer_max_logits)
from .moe import feed_real_rows, padding_free_moe_for
from .options import ModelSection, VarlenCPSection
from .stock import (attention_layers, attention_shape, check_supported,
                    cpu_sharding_agnostic_init, fp32_experts_for, layer_masks)

PLAN_KEY = "varlen_cp_plan"
REGISTRY_TO_MODULE = {"kimi_k2_5": "kimi_k2_7"}  # ModelSpec.name -> torchtitan.models module


@dataclass(frozen=True)
class PlannedBatch:
    """The batch's plan, riding in the input dict (not a tensor, so torchtitan's device copy
    leaves it alone)."""

    plan: CPPlan


def packed_cu_seqlens(positions: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """cu_seqlens of a [B, L] batch packed into one sequence of B*L tokens (CPU)."""
    b, length = shape
    if positions is None:
        return torch.arange(0, b * length + 1, length, dtype=torch.int32)
    pos = positions.detach().to("cpu").clone()
    pos[:, 0] = 0  # rows are packed back to back: every row starts a document
    return cu_seqlens_from_positions(pos.reshape(1, -1))


def mark_dynamic_activations(model: torch.nn.Module) -> None:
    """Mark the token dim of what enters torch.compile'd regions as dynamic: every tensor
    argument of each compiled block (x [B, T, D], positions [B, T]; a forward pre-hook that
    runs after FSDP's, whose hook hands the block a new view of its input) and the model's
    output (into the compiled loss). A rank's local token count changes with every batch's
    documents; unmarked, each compiled block would be recompiled at the first batch with
    another count (dynamo's automatic dynamic shapes), and a 0/1-sized dim again."""
    def mark_output(module: Any, args: Any, output: Any) -> Any:
        return mark_token_dim(output, 1) if isinstance(output, torch.Tensor) else output

    # A compiled module's hooks run under dynamo's frame callback (the block's forward is
    # the compiled frame): kept out of it, the marks land on the tensors the frame gets.
    @torch.compiler.disable
    def mark_inputs(module: Any, args: Any, kwargs: Any) -> None:
        for t in list(args) + list(kwargs.values()):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                mark_token_dim(t, 1)

    model.register_forward_hook(mark_output)
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module.register_forward_pre_hook(mark_inputs, with_kwargs=True)


def compile_counters() -> dict[str, int]:
    """Dynamo's counters of this process: compiled graphs and graph breaks so far."""
    from torch._dynamo.utils import counters
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class VarlenCPMetrics(MetricsProcessor):
    """torchtitan's metrics, plus one JSON line per logged step (rank 0) for comparisons,
    plus ``max_logit/layer_N`` (max over heads and over all ranks) when the model tracks
    max logits, plus the plan's ``varlen_cp/...`` figures (``varlen_cp.report.training``;
    off with ``[varlen_cp] report = false``). The max-logit read is one small all-reduce
    and host copy per *logged* step, outside forward/backward. With ``[compile] enable``,
    each row also carries dynamo's counters of this process so far: ``compiled_graphs`` and
    ``graph_breaks``."""

    model_parts: list[torch.nn.Module] = []
    varlen_report: TrainingReport | None = None
    compile_enabled: bool = False

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        loss_file: str = ""
        """Append {step, loss, grad_norm, tps} per logged step to this file ("" = off)."""

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        ntokens = self.ntokens_since_last_log
        elapsed = time.perf_counter() - self.time_last_log
        max_logits = self.max_logit_metrics()
        plan_metrics = self.varlen_report.log_step(step) if self.varlen_report else {}
        extra_metrics = {**(extra_metrics or {}), **max_logits, **plan_metrics}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        path = self.config.loss_file
        if path and (not dist.is_initialized() or dist.get_rank() == 0):
            tps = ntokens / max(elapsed, 1e-9) / self.parallel_dims.non_data_parallel_size
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            row = {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm, "tps": tps}
            if max_logits:
                row["max_logit"] = max_logits
            if self.compile_enabled:
                row.update(compile_counters())
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


def check_step_graph(disable_cuda_graphs: bool, graph_safe: bool, has_moe: bool) -> None:
    """ValueError unless torchtitan's step CUDA graph (``training.disable_cuda_graphs =
    false``, on CUDA: the forward and backward captured once, then replayed) can replay a
    model with varlen-cp's attention: only in the graph-safe mode (every other mode reads
    each batch's plan on the host; replayed, the first batch's would stay) and without MoE
    layers (they route the batch's real rows, a number that changes per batch)."""
    if disable_cuda_graphs:
        return
    if not graph_safe:
        raise ValueError("varlen_cp: torchtitan's step CUDA graph (training.disable_cuda_graphs "
                         "= false) would replay the first batch's plan for every batch: set "
                         "[varlen_cp] graph_safe = true (docs/graph-safe.md) or "
                         "training.disable_cuda_graphs = true")
    if has_moe:
        raise ValueError("varlen_cp: torchtitan's step CUDA graph with MoE layers: they route "
                         "the batch's real rows, a number that changes per batch; set "
                         "training.disable_cuda_graphs = true")


def install_varlen_cp(config: Any) -> None:
    """Swap every ``VarlenAttention`` inner attention of ``config.model_spec`` for
    varlen-cp's (torchtitan's ``apply_overrides`` with ``varlen_cp_attention``); in fp32
    runs keep routed experts' outputs fp32 (and on CPU compute them in fp32), and on CPU
    make parameter init independent of the sharding and FSDP's reductions gloo-friendly
    (see ``stock``). Idempotent. Raises ValueError if a layer keeps another attention
    (Flex, SDPA)."""
    spec, vc = config.model_spec, config.varlen_cp
    model_config = spec.model
    if any(model_config.traverse(VarlenAttention.Config)):
        apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET,
                                                 {"options": vc.attn_options})]), config)
    others = [f"{fqn}.inner_attention ({type(a.inner_attention).__qualname__})"
              for fqn, a, _, _ in model_config.traverse(BaseAttention.Config)
              if not isinstance(a.inner_attention, VarlenCPInnerAttention.Config)]
    if others:
        raise ValueError(f"varlen_cp: every attention layer must be varlen attention (build "
                         f"the model with attn_backend='varlen'); found {', '.join(others)}")
    if config.training.mixed_precision_param == "float32":
        fp32_experts_for(config, compute=cpu_mode.is_cpu_mode())
    if cpu_mode.is_cpu_mode():
        cpu_sharding_agnostic_init(model_config)
        if not getattr(spec.parallelize_fn, "varlen_cp_cpu", False):
            spec.parallelize_fn = cpu_mode.with_sum_reduction(spec.parallelize_fn)


class VarlenCPTrainer(Trainer):
    """Trainer with varlen-cp context parallelism for packed documents."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelSection = field(default_factory=ModelSection)
        varlen_cp: VarlenCPSection = field(default_factory=VarlenCPSection)

    def __init__(self, config: Config) -> None:
        par, vc = config.parallelism, config.varlen_cp
        if par.pipeline_parallel_degree > 1:
            raise ValueError("varlen_cp: pipeline parallelism is not supported")
        if par.context_parallel_degree > 1 and not vc.enable:
            raise ValueError("varlen_cp: context_parallel_degree > 1 needs [varlen_cp] "
                             "enable = true (torchtitan refuses varlen attention with CP)")
        name = config.model_spec.name
        check_supported(REGISTRY_TO_MODULE.get(name, name), par.context_parallel_degree)
        if vc.enable:
            activate_flash_impl(vc.flash_impl)   # before the model: a missing package fails here
            install_varlen_cp(config)
        # The Llama 4 style model always has varlen-cp's attention (cp=1 with enable=false).
        self.attn_layers = attention_layers(config.model_spec.model)
        self.layer_masks = layer_masks(self.attn_layers)
        self.attn_shape = None
        if self.attn_layers:
            # (torchtitan captures on CUDA only: a CPU run's step is never a graph)
            check_step_graph(config.training.disable_cuda_graphs or cpu_mode.is_cpu_mode(),
                             vc.graph_safe,
                             any(True for _ in config.model_spec.model.traverse(MoE.Config)))
            padding_free_moe_for(config)  # the plan's padding is never routed (moe.py)
            self.attn_shape = attention_shape(self.attn_layers, tp=par.tensor_parallel_degree,
                                              dtype=config.training.mixed_precision_param)
        self._prefetcher: PlanPrefetcher | None = None
        super().__init__(config)
        pd = self.parallel_dims
        self.cp_group: Any = None
        self.cp_size, self.cp_rank = 1, 0
        if pd.cp_enabled:
            mesh = pd.get_mesh("cp")
            self.cp_group = mesh.get_group()
            self.cp_size, self.cp_rank = mesh.size(), mesh.get_local_rank()
        # Which CP ranks share a node (global rank // [varlen_cp] gpus_per_node): the same
        # on every rank; the balanced layout and the cost model read it from each plan.
        self.cp_topology = (config.varlen_cp.topology(dist.get_process_group_ranks(
            self.cp_group)) if self.cp_size > 1 else None)
        # dispatch's relay through nodes: its in-node groups, made here on every rank
        prepare_node_groups(self.cp_group, self.cp_topology)
        for part in self.model_parts:
            bind_cp_group(part, self.cp_group)
            feed_real_rows(part)
            if config.compile.enable and self.attn_layers:
                mark_dynamic_activations(part)
        self.varlen_report = self.make_report()
        if isinstance(self.metrics_processor, VarlenCPMetrics):
            self.metrics_processor.model_parts = list(self.model_parts)
            self.metrics_processor.varlen_report = self.varlen_report
            self.metrics_processor.compile_enabled = config.compile.enable

    def make_report(self) -> TrainingReport:
        """The plan's logs (rank 0) and metrics (``[varlen_cp] report``)."""
        vc = self.config.varlen_cp
        layers = layer_types(self.layer_masks, vc.strategy, vc.a2a_size)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # the step's backend and device: the report's coverage reads the tables that
        # build_tables (make_plan) caches for them
        return TrainingReport(layers, self.attn_shape, overlap_stages=vc.overlap_stages,
                              enabled=vc.report and bool(self.attn_layers), log_block=rank0,
                              backend=vc.backend, device=self.device)

    # ------------------------------------------------------------------ the batch's plan
    def make_plan(self, input_dict: dict[str, Any], labels: torch.Tensor) -> CPPlan:
        """This batch's plan for this CP rank, with every table the model's masks need
        built and copied to the training device (host work; no collective)."""
        vc = self.config.varlen_cp
        inputs = input_dict["input"]
        cu = packed_cu_seqlens(input_dict.get("positions"), tuple(inputs.shape))
        plan = build_plan(cu, vc, cp_size=self.cp_size, cp_rank=self.cp_rank,
                          layer_masks=self.layer_masks, topology=self.cp_topology)
        plan.real_rows(self.device)  # the MoE layers' rows of real tokens (te padding)
        return build_tables(plan, vc, self.layer_masks, self.attn_shape, self.device)

    def batch_generator(self, data_iterable):
        """torchtitan's batch generator (token and data-time accounting on this thread),
        with each batch's plan built one batch ahead by a ``PlanPrefetcher``."""
        if not self.attn_layers:
            yield from super().batch_generator(data_iterable)
            return
        prefetcher = PlanPrefetcher(data_iterable, lambda b: self.make_plan(*b), depth=1,
                                    enabled=self.config.varlen_cp.prefetch)
        self._prefetcher = prefetcher
        planned = iter(prefetcher)
        while True:
            start = time.perf_counter()
            try:
                (input_dict, labels), plan = next(planned)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
            input_dict[PLAN_KEY] = PlannedBatch(plan)
            self.varlen_report.on_batch(plan, prefetcher.last_timing, self.step)
            yield input_dict, labels

    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self.attn_layers:
            return super().post_dataloading_process(input_dict, labels)
        extra = sorted(set(input_dict) - {"input", "positions", PLAN_KEY})
        if extra:
            raise ValueError(f"varlen_cp: batches with inputs other than tokens and positions "
                             f"are not supported (got {extra})")
        inputs = input_dict["input"]
        planned = input_dict.get(PLAN_KEY)
        # A caller that bypassed batch_generator (e.g. a validator) plans here, inline.
        plan = planned.plan if isinstance(planned, PlannedBatch) else \
            self.make_plan(input_dict, labels)
        n = inputs.numel()
        # The plan-agreement check runs here, on host tensors, before the model: the
        # attention layers find it done (no collective or host read inside the forward).
        local = shard_packed_batch({"input": inputs.reshape(1, n), "labels": labels.reshape(1, n)},
                                   plan, ignore_index=IGNORE_INDEX,
                                   validate=self.config.varlen_cp.validate and self.cp_size > 1,
                                   group=self.cp_group)
        inputs, labels = local["input"], local["labels"]
        graph_key = None
        if self.config.varlen_cp.graph_safe:   # the step's device buffers, in place, here
            graph_key = graph_key_of(plan)
            refresh_buffers(plan, self.config.varlen_cp, self.layer_masks, self.attn_shape,
                            inputs.device)
        # RoPE takes the plan's per-document positions (no placeholder to shard). It reads
        # a cache row per position: padding tokens (-1, te layout) read row 0, their
        # attention rows see nothing anyway.
        positions = one_to_device(plan.positions.clamp(min=0).to(torch.int64), inputs.device)
        positions = mark_token_dim(positions.view(1, -1), 1)   # per-batch length (compile)
        # Real tokens only: the te layout's padding differs between CP=1 and CP=N.
        self.ntokens_seen += plan.num_real_tokens
        extra_kwargs: dict[str, Any] = {"positions": positions,
                                        "attention_masks": PackedBatch(plan, graph_key)}
        if self.config.parallelism.spmd_backend == "spmd_types":
            inputs, labels, extra_kwargs = annotate_input_spmd_types(
                self.parallel_dims, inputs, labels, extra_kwargs)
        return inputs, labels, extra_kwargs

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        super().close()
