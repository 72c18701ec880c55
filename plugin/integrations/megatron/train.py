"""Train a megatron-core GPT model with varlen_cp attention on synthetic packed data.

    python -m varlen_cp.integrations.megatron.train --config configs/megatron_llama4_debug.toml
    torchrun --nproc_per_node 2 -m varlen_cp.integrations.megatron.train --config ...

The model is megatron's ``GPTModel`` built from its local (TE-free) layer spec with the core
attention swapped for ``VarlenCPCoreAttention``; the data iterator (``PrefetchedTHDBatches``)
builds the NEXT micro-batch's plan and all its tables on a background thread while the
current one runs, so each step only shards its packed batch with a ready plan, inside
megatron-core's own forward/backward schedule (``get_forward_backward_func``) with per-token
loss. Gradients are summed over the
data+context-parallel group and divided by the step's token count in the schedule's
``finalize_model_grads_func`` hook, so a CP=N run reproduces the CP=1 run's steps. MoE
models (``[model] num_moe_experts``): each micro-batch's ``padding_mask`` goes to the model
(the ``te`` layout's padding stays out of the routers' statistics), the hook also runs
megatron's expert-bias update, and the config asks for per-token loss before the model is
built (megatron's routers scale their auxiliary losses by it when they are built).

Each step's plan goes to a ``varlen_cp.report.TrainingReport``: rank 0 prints the plan's
block at the first step and when a choice changes, and a line with its balance, bytes and
planner time every ``log_interval`` steps; those figures also go to ``--log-json``
(``"varlen_cp"``, per logged step). ``[varlen_cp] report = false`` turns both off.

Limits: no pipeline parallelism, no megatron DDP/distributed optimizer (plain AdamW on
all-reduced grads: enough for the demo and the parity tests); CPU runs use gloo and
``cpu_compat``; CUDA runs use NCCL and the Triton kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from ...kernels.flash import activate_flash_impl
from ...host_memory import malloc_tuning
from ...job_file import check_output
from ...report import TrainingReport
from ...resolve import check_launch
from ...report.training import stdout_handler
from .config import MegatronJob, load_config
from .cpu_compat import init_cpu_rng, is_cpu_only, megatron_on_cpu
from .core_attention import check_cuda_graphs, cuda_graph_impl
from .data import synthetic_batch
from .moe import check_exact_under_cp, update_expert_bias
from .options import VarlenCPOptions
from .planning import attn_shape, report_layers
from .prefetch import PrefetchedTHDBatches
from .qk_clip import clip_qk_step
from .spec import get_varlen_cp_layer_spec


def runtime() -> contextlib.AbstractContextManager:
    """Context every megatron call runs in: the CPU shims on CPU, nothing on CUDA."""
    return megatron_on_cpu() if is_cpu_only() else contextlib.nullcontext()


def build_model(config: TransformerConfig, options: VarlenCPOptions, gpt_args: dict[str, Any],
                spec_kwargs: dict[str, Any] | None = None) -> GPTModel:
    """megatron's GPTModel with the varlen_cp core attention in every layer."""
    spec = get_varlen_cp_layer_spec(options, **(spec_kwargs or {}))
    config.calculate_per_token_loss = True  # MoE routers read it when built
    with runtime():
        model = GPTModel(config=config, transformer_layer_spec=spec, **gpt_args)
    return model if is_cpu_only() else model.cuda()


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Per-token loss (megatron's 3-tuple): local sum, local count, values to log."""
    mask = loss_mask.reshape(-1).float()
    total = (output.reshape(-1).float() * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), mask.sum()])}


def forward_step(data_iterator: Iterator, model: GPTModel):
    """megatron's forward_step_func: one (local batch, packed params) micro-batch."""
    batch, packed = next(data_iterator)
    # padding_mask keeps the te layout's padding out of MoE routing statistics (moe.py)
    output = model(batch["tokens"], batch.get("position_ids"), None, labels=batch["labels"],
                   packed_seq_params=packed, padding_mask=batch.get("padding_mask"))
    return output, lambda out: _loss_func(batch["loss_mask"], out)


def finalize_grads(models: list[torch.nn.Module], num_tokens: torch.Tensor | None,
                   pg_collection: Any = None, force_all_reduce: bool = False) -> None:
    """The schedule's ``finalize_model_grads_func``: sum grads and token counts over the
    data+context-parallel group (one flat buffer: one collective), then divide by the
    tokens, so every rank holds the gradient of the global per-token mean loss; then, for
    MoE models, megatron's expert-bias update and counter reset."""
    group = getattr(pg_collection, "dp_cp", None) or parallel_state.get_data_parallel_group(
        with_context_parallel=True)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    count = (num_tokens if num_tokens is not None else torch.ones(())).to(flat)
    flat = torch.cat([flat, count.reshape(1)])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat = flat[:-1] / flat[-1].clamp(min=1)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
        offset += n
    update_expert_bias(models)  # megatron's finalize_model_grads does this for MoE


def run_step(model: GPTModel, micro_batches: list[tuple[dict, Any]] | Iterator, *,
             num_microbatches: int | None = None,
             forward_only: bool = False) -> tuple[float, float]:
    """One forward(/backward) over the micro-batches with megatron's schedule; returns
    (global loss sum, global token count) over the data+context-parallel group.
    ``micro_batches``: a list of (local batch, packed params), or an iterator (e.g.
    ``PrefetchedTHDBatches``) the schedule draws ``num_microbatches`` from, one at a time."""
    config = model.config
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_grads
    if isinstance(micro_batches, list):
        num_microbatches = len(micro_batches)
        micro_batches = iter(micro_batches)
    elif num_microbatches is None:
        raise ValueError("num_microbatches is required when micro_batches is an iterator")
    with runtime():
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=micro_batches, model=model,
            num_microbatches=num_microbatches, seq_length=0,  # unused without pipelining
            micro_batch_size=1, forward_only=forward_only)
    stats = torch.stack([s["lm loss"].float() for s in store]).sum(0)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    return float(stats[0]), float(stats[1])


def train_batches(job: MegatronJob, config: TransformerConfig, device: torch.device,
                  first_step: int = 0) -> PrefetchedTHDBatches:
    """This rank's micro-batches from ``first_step`` on: the global synthetic batches,
    planned ahead on a background thread (``job.options.prefetch``) and sharded for its CP
    rank as the schedule draws them."""
    dp_rank = parallel_state.get_data_parallel_rank()
    m = job.training.micro_batches
    source = (synthetic_batch(job.data, i, dp_rank)
              for i in range(first_step * m, job.training.steps * m))
    return PrefetchedTHDBatches(source, config=config, options=job.options, device=device)


def lr_at(job: MegatronJob, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    t = job.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def init_distributed(job: MegatronJob) -> torch.device:
    """Process group (torchrun's env, else a single process) and megatron's model-parallel
    groups; returns the device."""
    if not dist.is_initialized():
        backend = "gloo" if is_cpu_only() else "nccl"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            dist.init_process_group(backend, rank=0, world_size=1)
    device = torch.device("cpu")
    if not is_cpu_only():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=job.tensor_model_parallel_size,
        context_parallel_size=job.context_parallel_size,
        hierarchical_context_parallel_sizes=job.parallel.get(
            "hierarchical_context_parallel_sizes"))
    if is_cpu_only():
        init_cpu_rng(job.training.seed)
    else:
        from megatron.core import tensor_parallel
        torch.manual_seed(job.training.seed)
        # megatron's CudaGraphManager needs an RNG tracker whose states a graph can capture
        graphs = cuda_graph_impl(SimpleNamespace(**job.model)) == "local"
        tensor_parallel.model_parallel_cuda_manual_seed(job.training.seed,
                                                        use_cudagraphable_rng=graphs)
    return device


def train(job: MegatronJob, *, log_json: str | None = None) -> list[float]:
    """Train ``job.training.steps`` steps; returns the per-step losses (every rank)."""
    activate_flash_impl(job.options.flash_impl)  # before anything is built
    device = init_distributed(job)
    config = job.transformer_config(use_cpu_initialization=is_cpu_only())
    model = build_model(config, job.options, job.gpt, job.spec_kwargs)
    t = job.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas,
                                  weight_decay=t.weight_decay)
    rank0 = dist.get_rank() == 0
    report = TrainingReport(report_layers(config, job.options), attn_shape(config),
                            overlap_stages=job.options.overlap_stages,
                            enabled=job.options.report, log_block=rank0,
                            backend=job.options.backend, device=device)
    stdout_handler()
    losses: list[float] = []
    step_s: list[float] = []
    plan_metrics: list[dict[str, Any]] = []
    with train_batches(job, config, device) as batches:
        for step in range(t.steps):
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(job, step)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, count = run_step(model, batches, num_microbatches=t.micro_batches)
            report.on_batch(batches.last_plan, batches.last_timing, step)
            if t.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
            optimizer.step()
            max_logit = ""
            if config.qk_clip or config.log_max_attention_logit:
                value = clip_qk_step(model, log_only=not config.qk_clip)
                max_logit = f"  max logit {value:.2f}"
            losses.append(loss_sum / max(count, 1.0))
            step_s.append(time.perf_counter() - start)
            if rank0 and (step % t.log_interval == 0 or step == t.steps - 1):
                print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {lr_at(job, step):.2e}  "
                      f"{step_s[-1]:.2f} s{max_logit}", flush=True)
                plan_metrics.append({"step": step, **report.log_step(step)})
    if rank0 and log_json:
        Path(log_json).parent.mkdir(parents=True, exist_ok=True)
        with open(log_json, "w") as f:
            json.dump({"losses": losses, "step_s": step_s, "cp": job.context_parallel_size,
                       "world": dist.get_world_size(), "varlen_cp": plan_metrics}, f)
    return losses


def check_before_build(job: MegatronJob) -> None:
    """What the job file and CP size decide, checked before any process group or model:
    megatron's ``TransformerConfig`` checks, the MoE rule of CP, and each layer type's
    ``varlen_cp.resolve.check_launch`` (its strategy's head rule at this cp, cp 1
    included; the backend on this machine's device) and ``VARLEN_CP_MALLOC_TUNING``."""
    malloc_tuning()
    cp = job.context_parallel_size
    with warnings.catch_warnings():   # its notes come again when the model is built; a
        warnings.simplefilter("ignore")   # refused config stays one line
        config = job.transformer_config(use_cpu_initialization=True)
    check_exact_under_cp(SimpleNamespace(**job.model), cp, job.options.layout)
    check_cuda_graphs(config, job.options)
    if cuda_graph_impl(config) != "none" and is_cpu_only():
        raise ValueError(f"config.cuda_graph_impl={cuda_graph_impl(config)!r} needs CUDA "
                         f"devices (megatron's CudaGraphManager); this run is on the CPU")
    shape = attn_shape(config)
    device = "cpu" if is_cpu_only() else "cuda"
    for layer in report_layers(config, job.options):
        try:
            check_launch(job.options.layer_options(layer.strategy, layer.a2a_size), shape, cp,
                         device, job.options.layout_spec())
        except ValueError as e:
            raise ValueError(f"[varlen_cp] on {device}, context_parallel_size {cp}, layers "
                             f"of strategy {layer.strategy!r}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="TOML job file")
    parser.add_argument("--steps", type=int, default=None, help="override training.steps")
    parser.add_argument("--context-parallel-size", type=int, default=None,
                        help="override parallel.context_parallel_size")
    parser.add_argument("--log-json", default=None, help="write the losses here (rank 0)")
    args = parser.parse_args(argv)
    try:  # a config that cannot run: one line and status 2, before anything starts
        job = load_config(args.config)
        if args.steps is not None:
            job.training = dataclasses.replace(job.training, steps=args.steps)
        if args.context_parallel_size is not None:
            if args.context_parallel_size < 1:
                raise ValueError(f"--context-parallel-size must be an int >= 1, got "
                                 f"{args.context_parallel_size}")
            job.parallel["context_parallel_size"] = args.context_parallel_size
        if args.log_json:
            check_output("--log-json", args.log_json, folder=False)
        check_before_build(job)
    except (ValueError, AssertionError) as e:   # AssertionError: TransformerConfig's checks
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(job.training.seed)
    try:
        train(job, log_json=args.log_json)
    finally:
        if dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
