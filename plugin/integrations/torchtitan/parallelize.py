"""Parallelize function of the Llama 4 style model: torchtitan's usual order (sharding
configs -> activation checkpointing -> compile -> FSDP), without torchtitan's own CP wrapping.

torchtitan's ``apply_cp_to_forward`` all-gathers K/V around stock attention; varlen-cp's
inner attention does its own CP communication, so nothing is wrapped here. On CPU (gloo),
FSDP is switched to SUM reductions (``cpu_mode.force_sum_reduction``).
Limits: the DTensor backends (``partial_dtensor``, ``full_dtensor``) are refused with CP,
because varlen-cp's layouts give ranks unequal token counts, which DTensor cannot describe.
"""

from __future__ import annotations

from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, resolve_sparse_fsdp_mesh
from torch import nn

from . import cpu_mode


def parallelize_llama4(model: nn.Module, *, parallel_dims: ParallelDims,
                       training: TrainingConfig, parallelism: ParallelismConfig,
                       compile_config: CompileConfig, ac_config: ActivationCheckpointingConfig,
                       dump_folder: str) -> nn.Module:
    backend = parallelism.spmd_backend
    if parallel_dims.cp_enabled and backend != "spmd_types":
        raise ValueError(f"parallelism.spmd_backend={backend!r} is not supported with "
                         "varlen_cp context parallelism; use 'spmd_types'")
    if backend in ("full_dtensor", "spmd_types"):
        model.parallelize(parallel_dims)
    elif parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)

    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    if backend in ("full_dtensor", "spmd_types"):
        dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
        edp_mesh, edp_mesh_dims = resolve_sparse_fsdp_mesh(parallel_dims)
    else:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        dp_mesh, dp_mesh_dims = parallel_dims.get_mesh(names), None
        edp_mesh = edp_mesh_dims = None
        if parallel_dims.ep_enabled:
            enames = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
            edp_mesh = parallel_dims.get_optional_mesh(enames)
    apply_fsdp_to_decoder(
        model, dp_mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled, cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        ep_degree=parallel_dims.ep, edp_mesh=edp_mesh, dp_mesh_dims=dp_mesh_dims,
        edp_mesh_dims=edp_mesh_dims, enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    if cpu_mode.is_cpu_mode():
        cpu_mode.force_sum_reduction(model)
    return model
