"""THD batch sharding for megatron-core without TransformerEngine, and the plan it carries.

``get_thd_batch_on_this_cp_rank`` replaces megatron's function of the same name (which calls
``tex.thd_get_partitioned_indices`` and so needs TE): it takes the step's ``CPPlan`` (ready
from ``PrefetchedTHDBatches``, or built here from the HOST ``cu_seqlens`` of the global packed
batch with the model's layer masks when ``config`` is given), cuts this rank's tokens out of
every [1, T] tensor, and returns ``VarlenCPPackedSeqParams``: megatron's ``PackedSeqParams``
(global cu_seqlens; padded cu_seqlens of the plan's layout) plus the plan, which every layer's
core attention reuses: no layer ever plans.

RoPE: megatron's own THD RoPE cuts every padded document into 2*cp chunks (TE's layout).
The layer spec of this plugin routes megatron's RoPE table through the plan instead (each
token takes the row of its position, ``rope.VarlenCPSelfAttention``), so every layout is
correct; for specs without it the core attention refuses layouts other than ``te`` at CP > 1.

The graph-safe mode (``VarlenCPOptions(graph_safe=True)``) makes the packed params equal
for every batch of one job, field by field, as megatron's CUDA graphs (``cuda_graph_impl =
"local"``) require of a replayed layer's arguments: the plan is replaced by its
``GraphKey`` (capacity, cp, rank; the layers find the batch's plan under it), the RoPE
positions are a tensor of ``graph_capacity`` rows (megatron copies it into the graph's input
at each replay), ``max_seqlen_*`` is the constant ``cp * graph_capacity`` (the longest
document any batch can hold, so megatron's RoPE table keeps one shape), and the cu_seqlens
fields and ``cp_group`` are left unset (no layer reads them: the attention's tables are in
the graph-safe buffers, refreshed here for the batch before its step).

Limits: batch size 1 (THD packs everything into one row); the plan is host integer math on
CPU tensors, so ``cu_seqlens`` must be given on the host.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from ...plan import CPPlan, Topology
from ...plan.capacity import GraphKey
from ...plan.agreement import agree_on_plan
from ...sharding import padded_input_rows
from .moe import padding_mask
from .options import VarlenCPOptions
from .planning import (ModelAttention, model_attention, plan_batch, refresh_model_buffers,
                       rope_index)

# Keys megatron's data pipeline puts in a batch that are not per-token tensors.
_META_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cu_seqlens_argmin")
_PACKED_FIELDS = {f.name for f in dataclasses.fields(PackedSeqParams)}


# The plan of the batch being run, per key (the latest one sharded: a micro-batch's forward
# follows its sharding; its backward reads what its forward saw).
_CURRENT: dict[GraphKey, CPPlan] = {}


def plan_of(value: Any, positions: torch.Tensor | None = None) -> CPPlan | None:
    """The plan that packed params' ``varlen_cp_plan`` names: the plan itself, or for a
    ``GraphKey`` the plan their ``positions`` (``varlen_cp_positions``) were sharded for
    (a forward recomputed in the backward, after later micro-batches were sharded, gets
    its own), else the latest plan registered under the key (what a capture, whose
    inputs are megatron's copies, gets); ValueError when none was."""
    if not isinstance(value, GraphKey):
        return value
    plan = getattr(positions, "_varlen_cp_plan", None)
    if plan is not None and GraphKey.of(plan) == value:
        return plan
    plan = _CURRENT.get(value)
    if plan is None:
        raise ValueError(f"packed_seq_params: no plan was sharded for {value}; build the "
                         f"batch with get_thd_batch_on_this_cp_rank (or "
                         f"PrefetchedTHDBatches) in the graph-safe mode")
    return plan


@dataclasses.dataclass
class VarlenCPPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` that also carry the step's ``CPPlan`` to every core attention
    (in the graph-safe mode its ``GraphKey``, see the module doc).

    ``varlen_cp_positions``: int64 [T_local] on the model's device, each local token's
    position in its document (padding: 0), the rows of megatron's RoPE table the tokens
    take. ``varlen_cp_rope`` is set per layer by ``VarlenCPSelfAttention`` (on its own
    copy): the layer's RoPE frequencies per local token, which the core attention applies;
    None when megatron's own RoPE ran (or the model has none)."""

    varlen_cp_plan: CPPlan | GraphKey | None = None
    varlen_cp_positions: torch.Tensor | None = None
    varlen_cp_rope: Any = None


def cp_group_and_rank(cp_group: Any = None) -> tuple[Any, int, int]:
    """(group, size, rank) of the CP group: ``cp_group``, else megatron's parallel_state
    group when model parallelism is initialized, else no group (size 1)."""
    if cp_group is None and parallel_state.model_parallel_is_initialized():
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    if cp_group is None or not dist.is_initialized():
        return None, 1, 0
    return cp_group, dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _check_host_cu(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} must be a CPU (host) tensor, got {where}: the plan is built "
                         f"on the host; keep a CPU copy of cu_seqlens in the data pipeline")


def _check_padded(plan: CPPlan, cu_seqlens_padded: torch.Tensor) -> None:
    """The caller's padded boundaries must be exactly the plan's (TE's) padding."""
    given = cu_seqlens_padded.to(torch.int64).flatten()
    if not torch.equal(given, plan.cu_seqlens_padded):
        raise ValueError(f"cu_seqlens_padded={given.tolist()} differs from the padding of "
                         f"layout {plan.layout!r} ({plan.cu_seqlens_padded.tolist()}); pad "
                         f"each document to a multiple of 2*cp (or set pad_multiple)")


def packed_seq_params_for(plan: CPPlan, device: torch.device | str, cp_group: Any = None,
                          *, graph_safe: bool = False) -> VarlenCPPackedSeqParams:
    """Megatron's THD parameters for ``plan`` (cu_seqlens on ``device``) plus the plan and
    its tokens' RoPE positions. ``graph_safe``: the form that is equal for every batch
    (module doc); ``plan`` must be built at a capacity, and becomes the current plan of its
    ``GraphKey``."""
    positions = rope_index(plan, device)
    if graph_safe:
        if plan.capacity is None:
            raise ValueError("packed_seq_params_for(graph_safe=True) needs a plan built at a "
                             "capacity (CPPlan.build(..., capacity=...), the graph-safe "
                             "plan_batch)")
        key = GraphKey.of(plan)
        _CURRENT[key] = plan
        # a tensor of these params' own, which holds their plan (not the plan's cached
        # copy: no reference cycle), for a forward recomputed after the next sharding
        positions = positions.clone()
        positions._varlen_cp_plan = plan
        longest = plan.cp_size * plan.capacity
        return VarlenCPPackedSeqParams(qkv_format="thd", max_seqlen_q=longest,
                                       max_seqlen_kv=longest, varlen_cp_plan=key,
                                       varlen_cp_positions=positions)
    cu = plan.cu_seqlens.to(torch.int32)
    padded = plan.cu_seqlens_padded.to(torch.int32)
    lengths = padded[1:] - padded[:-1]
    # Megatron's THD RoPE takes max_seqlen positions and cuts each padded document into
    # 2*cp chunks; it must cover the longest padded document.
    max_len = int(lengths.max()) if lengths.numel() else 0
    kwargs: dict[str, Any] = dict(
        qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
        cu_seqlens_q_padded=padded.to(device), cu_seqlens_kv_padded=padded.to(device),
        max_seqlen_q=max_len, max_seqlen_kv=max_len, varlen_cp_plan=plan,
        varlen_cp_positions=positions)
    if "cp_group" in _PACKED_FIELDS and cp_group is not None:
        kwargs["cp_group"] = cp_group
    return VarlenCPPackedSeqParams(**kwargs)


def _shard_tensor(plan: CPPlan, x: torch.Tensor, padded_input: bool) -> torch.Tensor:
    if not padded_input:
        return plan.shard(x, dim=1)  # padding tokens come out as zeros
    return x.index_select(1, padded_input_rows(plan, x.device))


def _check_plan(plan: Any, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> None:
    """A ready plan must be this batch's and this rank's (host compare, no device)."""
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")
    if plan.cp_size != cp_size or plan.cp_rank != cp_rank:
        raise ValueError(f"plan is for cp_size={plan.cp_size}, cp_rank={plan.cp_rank}, but "
                         f"the CP group has size {cp_size} and this rank is {cp_rank}")
    if not torch.equal(plan.cu_seqlens, cu_seqlens.flatten().to(plan.cu_seqlens.dtype)):
        raise ValueError("plan was built for other cu_seqlens than this batch's")


def _model(config: Any, options: VarlenCPOptions) -> ModelAttention | None:
    if config is None or isinstance(config, ModelAttention):
        return config
    return model_attention(config, options)


def get_thd_batch_on_this_cp_rank(
        batch: dict[str, Any], cu_seqlens: torch.Tensor, *, cp_group: Any = None,
        options: VarlenCPOptions | None = None,
        cu_seqlens_padded: torch.Tensor | None = None, config: Any = None,
        plan: CPPlan | None = None, device: Any = None,
) -> tuple[dict[str, Any], VarlenCPPackedSeqParams]:
    """This CP rank's part of a packed batch, and the THD params every layer needs.

    batch: [1, T] tensors ("tokens", "labels", "loss_mask", "position_ids", ...); with
    ``cu_seqlens_padded`` None they are unpadded (T = cu_seqlens[-1]); with it, they are
    megatron's TE-padded batch (T = cu_seqlens_padded[-1]), whose padding must equal the te
    layout's. cu_seqlens (and cu_seqlens_padded): CPU int tensors of the GLOBAL batch.
    plan: the batch's ready plan (``PrefetchedTHDBatches`` builds it ahead of the step);
    None builds it here, with ``config`` (megatron's ``TransformerConfig`` or a
    ``ModelAttention``) for the model's layer masks and every table the layers will need;
    without ``config`` the layout balances causal attention and the tables are built by the
    first layer of each mask. In the graph-safe mode ``config`` is required: the layers'
    device buffers are rewritten in place for this batch here, and the packed params take
    their graph-safe form (module doc). device: where the model runs (tables, packed params'
    cu_seqlens; default: the batch's device).
    Returns a new dict: tokens/labels of padding tokens are 0, their loss_mask 0,
    position_ids the position within the document (0 for padding), attention_mask None
    (THD attention needs none), metadata keys dropped, ``padding_mask`` ([1, T_local] bool,
    True = padding: pass it to ``GPTModel(..., padding_mask=)`` so that MoE routing
    statistics leave padding out, see ``moe.py``); and the packed params.
    """
    options = VarlenCPOptions() if options is None else options
    if not isinstance(options, VarlenCPOptions):
        raise ValueError(f"options must be a VarlenCPOptions, got {type(options).__name__}")
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    _check_host_cu(cu_seqlens, "cu_seqlens")
    group, cp_size, cp_rank = cp_group_and_rank(cp_group)
    padded_input = cu_seqlens_padded is not None
    if padded_input:
        _check_host_cu(cu_seqlens_padded, "cu_seqlens_padded")
    if device is None:   # the batch's device
        device = next((x.device for x in batch.values()
                       if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    model = _model(config, options)
    if options.graph_safe and model is None:
        raise ValueError("config is required in the graph-safe mode (megatron's "
                         "TransformerConfig or a ModelAttention): the layers' buffers are "
                         "rewritten for this batch here, before its step")
    if plan is None:
        plan = plan_batch(cu_seqlens.flatten(), options, cp_size, cp_rank, model=model,
                          device=device, group=group)
    else:
        _check_plan(plan, cu_seqlens, cp_size, cp_rank)
    _check_batch(batch, plan, cu_seqlens_padded)
    if options.validate and cp_size > 1:  # here, on host tensors: the layers find it done
        agree_on_plan(plan, group)
    out = _shard_batch(batch, plan, padded_input)
    # The plan's padding, joined with any padding the caller marked (a te-padded row's
    # padding reads as real data once sharded).
    pad = padding_mask(plan, device if device is not None else "cpu")
    given = out.get("padding_mask")
    if isinstance(given, torch.Tensor):
        pad = given.to(pad.device, non_blocking=True).bool() | pad
    out["padding_mask"] = pad
    device = device if device is not None else "cpu"
    if options.graph_safe:   # on the step's thread and stream, outside any captured layer
        refresh_model_buffers(plan, options, model, device)
    return out, packed_seq_params_for(plan, device, group, graph_safe=options.graph_safe)


def _check_batch(batch: dict[str, Any], plan: CPPlan,
                 cu_seqlens_padded: torch.Tensor | None) -> None:
    """TE-padded input only with the te layout and its padding; every tensor one packed
    row of the global token count."""
    padded_input = cu_seqlens_padded is not None
    if padded_input:
        if plan.layout != "te" and plan.cp_size > 1:
            raise ValueError(f"cu_seqlens_padded (TE-padded input) needs layout 'te', got "
                             f"{plan.layout!r}")
        if plan.cp_size > 1:
            _check_padded(plan, cu_seqlens_padded)
        elif not torch.equal(cu_seqlens_padded.flatten().to(torch.int64), plan.cu_seqlens):
            raise ValueError("cu_seqlens_padded: with one CP rank the batch must be unpadded "
                             "(cu_seqlens_padded equal to cu_seqlens)")
    n_global = int(cu_seqlens_padded.flatten()[-1]) if padded_input else plan.total_tokens
    for key, x in batch.items():
        if key in _META_KEYS or key == "attention_mask" or not isinstance(x, torch.Tensor):
            continue
        if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != n_global:
            raise ValueError(f"batch[{key!r}] must have shape [1, {n_global}, ...] (THD: one "
                             f"packed row), got {tuple(x.shape)}")


def _shard_batch(batch: dict[str, Any], plan: CPPlan, padded_input: bool) -> dict[str, Any]:
    """This rank's entries: metadata dropped, no attention mask, positions from the plan,
    every other tensor sharded (padding: 0, and out of the loss)."""
    out: dict[str, Any] = {}
    for key, x in batch.items():
        if key in _META_KEYS:
            continue
        if key == "attention_mask":
            out[key] = None
        elif key == "position_ids" and isinstance(x, torch.Tensor):
            pos = plan.positions.clamp(min=0).to(device=x.device, dtype=x.dtype,
                                                 non_blocking=True)
            out[key] = pos.unsqueeze(0)
        elif isinstance(x, torch.Tensor):
            local = _shard_tensor(plan, x, padded_input)
            if key == "loss_mask" and padded_input and plan.cp_size > 1:
                local = local * (plan.token_indices >= 0).to(local.device, local.dtype)
            out[key] = local
        else:
            out[key] = x
    return out


def plan_from_packed_seq_params(params: PackedSeqParams, cp_size: int,
                                cp_rank: int) -> CPPlan:
    """The plan of a THD step, attached by the sharding hook. A layer never builds one:
    without it this is a ValueError naming the hook."""
    plan = plan_of(getattr(params, "varlen_cp_plan", None),
                   getattr(params, "varlen_cp_positions", None))
    if plan is None:
        cu, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if (isinstance(cu, torch.Tensor) and isinstance(cu_kv, torch.Tensor)
                and cu.device.type == "cpu" and cu_kv.device.type == "cpu"
                and not torch.equal(cu_kv, cu)):
            raise ValueError("packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q; "
                             "varlen_cp supports self-attention only")
        raise ValueError("packed_seq_params: no varlen_cp plan attached; build the batch with "
                         "varlen_cp.integrations.megatron.get_thd_batch_on_this_cp_rank (or "
                         "PrefetchedTHDBatches), or attach a plan with packed_seq_params_for")
    if plan.cp_size != cp_size or plan.cp_rank != cp_rank:
        raise ValueError(f"packed_seq_params: the plan is for cp_size={plan.cp_size}, "
                         f"cp_rank={plan.cp_rank}, but this layer's CP group has size "
                         f"{cp_size} and rank {cp_rank}")
    return plan


@lru_cache(maxsize=16)
def sbhd_plan(batch_size: int, local_seq_len: int, cp_size: int, cp_rank: int,
              topology: Topology | None = None) -> CPPlan:
    """Plan of an unpacked [s, b] batch sharded by megatron's ``get_batch_on_this_cp_rank``:
    each row is one document of ``local_seq_len * cp_size`` tokens, cut into 2*cp chunks
    with chunks r and 2*cp-1-r on rank r, which is the ``te`` layout without padding.
    ``topology``: the CP group's nodes (for the cost model; ``te`` is not placed).
    Cached: every layer of a step (and every step of one shape) shares it."""
    doc_len = local_seq_len * cp_size
    cu = torch.arange(batch_size + 1, dtype=torch.int64) * doc_len
    if cp_size == 1:
        return CPPlan.build(cu, cp_size=1, cp_rank=0, layout="contiguous")
    if doc_len % (2 * cp_size):
        raise ValueError(f"query: sbhd with context parallelism needs the global sequence "
                         f"length ({doc_len}) to be a multiple of 2*cp={2 * cp_size}")
    return CPPlan.build(cu, cp_size=cp_size, cp_rank=cp_rank, layout="te", topology=topology)
