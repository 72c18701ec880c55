"""Hooks that shard a packed batch for one CP rank, and gather sequence tensors back.

For torchtitan-style batches of [B=1, L] tensors ("input"/"tokens", "labels", "positions"):
every tensor is cut along its sequence dim by a ``CPPlan``; positions are replaced by the
plan's (position within the document, what RoPE and the kernels need); labels of padding
tokens (``te`` layout only) become ``ignore_index``. ``cu_seqlens_from_positions`` recovers
the global ``cu_seqlens`` from torchtitan's per-document positions. Per-plan index tables of
the local tokens that adapters read in the step (rows of a padded input, the padding mask,
RoPE positions) are built here once per plan and copied once per device. With ``validate`` the
step checks here, before the model runs, that every CP rank built the same plan (host
tensors only: no device sync in the step); the attention layers then find it checked.

Limits: host-side metadata only from CPU tensors; a batch dim > 1 is sharded with the same
plan for every row (only meaningful when all rows share one document structure).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .kernels.host_copy import one_to_device
from .plan import CPPlan
from .checks import check_bool
from .plan.agreement import agree_on_plan
from .plan.collective import check_group, check_group_type
from .plan.cpplan import mark_token_dim
from .tables.cache import cached_table, table_key

POSITION_KEYS = ("positions", "position_ids")
LABEL_KEYS = ("labels",)


def _check_plan(plan: Any) -> None:
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a varlen_cp.CPPlan, got {type(plan).__name__}")


def _plan_positions_like(x: torch.Tensor, plan: CPPlan, seq_dim: int) -> torch.Tensor:
    """plan.positions broadcast to the sharded shape of ``x`` (x's dtype and device)."""
    shape = [1] * x.dim()
    shape[seq_dim] = plan.num_tokens
    out_shape = list(x.shape)
    out_shape[seq_dim] = plan.num_tokens
    pos = one_to_device(plan.positions.to(x.dtype), x.device)
    return mark_token_dim(pos.view(shape).expand(out_shape).contiguous(), seq_dim)


def shard_packed_batch(batch: dict[str, Any], plan: CPPlan, *, seq_dim: int = 1,
                       ignore_index: int = -100, validate: bool = False,
                       group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """This rank's part of a packed batch: a new dict, the input is not modified.

    Tensors with more than ``seq_dim`` dims are sharded along ``seq_dim`` (their size there
    must be the plan's ``total_tokens``; the sharded token dim is marked dynamic for
    torch.compile); other values (scalars, metadata, 1-D tensors such as cu_seqlens when
    seq_dim=1) are passed through unchanged. ``validate``: first check that every rank of
    ``group`` (the CP group; the default group when None) built the same plan
    (``varlen_cp.plan.agreement``: host tensors only, once per plan), so that the model's
    attention calls find it checked; ranks that disagree get a ValueError here, before the
    model runs.
    """
    _check_plan(plan)
    check_bool("validate", validate)
    check_group_type(group)
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or seq_dim < 0:
        raise ValueError(f"seq_dim must be an int >= 0, got {seq_dim!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        # index_fill_ would cast 1.5 to 1 and train on the padding labels
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    tensors = [x for x in batch.values() if isinstance(x, torch.Tensor)]
    if tensors and not any(x.dim() > seq_dim for x in tensors):
        # Nothing would be sharded: every rank would silently keep the whole batch.
        raise ValueError(f"seq_dim={seq_dim}: no tensor of the batch has that dim (shapes "
                         f"{[tuple(x.shape) for x in tensors]})")
    for key, x in batch.items():
        if isinstance(x, torch.Tensor) and x.dim() > seq_dim \
                and x.shape[seq_dim] != plan.total_tokens:
            raise ValueError(f"batch[{key!r}] has {x.shape[seq_dim]} tokens along seq_dim="
                             f"{seq_dim}, but the plan has total_tokens={plan.total_tokens}")
    if validate and plan.cp_size > 1:
        check_group(group, plan.cp_size, plan.cp_rank)
        agree_on_plan(plan, group)
    padding = plan.token_indices < 0
    out: dict[str, Any] = {}
    for key, x in batch.items():
        if not isinstance(x, torch.Tensor) or x.dim() <= seq_dim:
            out[key] = x
        elif key in POSITION_KEYS:
            out[key] = _plan_positions_like(x, plan, seq_dim)
        elif key in LABEL_KEYS and bool(padding.any()):
            local = plan.shard(x, dim=seq_dim)
            pad = one_to_device(torch.nonzero(padding).flatten(), x.device)
            out[key] = local.index_fill_(seq_dim, pad, ignore_index)
        else:
            out[key] = plan.shard(x, dim=seq_dim)
    return out


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Global cu_seqlens (int32, CPU) of a packed sequence from its per-document positions
    ([1, L] or [L], CPU): a document starts where the position is 0 (and at token 0)."""
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.device.type != "cpu":
        raise ValueError(f"positions must be a CPU (host) tensor, got device "
                         f"{positions.device}")
    if positions.dim() == 2 and positions.shape[0] == 1:
        positions = positions[0]
    if positions.dim() != 1:
        raise ValueError(f"positions must have shape [1, L] or [L], got "
                         f"{tuple(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    n = positions.numel()
    # A negative position (a padding marker such as -1) is no position within a document:
    # counted as a continuation of the document before it, it would silently join that
    # document. (Jumps are accepted: torchtitan's trainer resets each row's first position
    # to 0, so a row that starts mid-document reads 0, 38, 39, ...)
    if n and bool((positions < 0).any()):
        i = int(torch.nonzero(positions < 0)[0])
        raise ValueError(f"positions must be >= 0, got positions[{i}]={int(positions[i])}")
    starts = positions == 0
    if n:
        starts[0] = True  # a sample cut mid-document still starts a segment at token 0
    bounds = torch.nonzero(starts).flatten()
    return torch.cat([bounds, torch.tensor([n])]).to(torch.int32)


# ---- index tables of the local tokens, once per plan and device -------------------------
def padded_input_rows(plan: CPPlan, device: torch.device | str) -> torch.Tensor:
    """int64 [T_local]: the row of each local token in the padded global sequence (the
    ``te`` layout's padded input, ``cu_seqlens_padded``), on ``device`` (cached)."""
    # (a plan at a capacity: its padding rows read row 0, masked out as padding)
    return cached_table(plan, table_key("padded_input_rows", None, None, plan.cp_rank),
                        lambda: plan.padded_token_indices_of(plan.cp_rank).clamp(min=0),
                        device)


def padding_mask(plan: CPPlan, device: torch.device | str) -> torch.Tensor:
    """bool [1, T_local]: True for this rank's padding tokens, on ``device`` (cached)."""
    return cached_table(plan, table_key("padding_mask", None, None, plan.cp_rank),
                        lambda: (plan.token_indices < 0).unsqueeze(0), device)


def rope_positions(plan: CPPlan, device: torch.device | str) -> torch.Tensor:
    """int64 [T_local]: each local token's position in its document (padding: 0), on
    ``device``: the rows of a RoPE table the tokens take (cached)."""
    return cached_table(plan, table_key("rope_positions", None, None, plan.cp_rank),
                        lambda: plan.positions.clamp(min=0).to(torch.int64), device)
