"""``PrefetchedTHDBatches``: megatron's data iterator with each batch's plan built ahead.

Wraps an iterable of GLOBAL packed batches ``(batch, cu_seqlens)`` (``batch``: [1, T]
tensors, ``cu_seqlens``: host int tensor) and yields ``(local_batch, packed_seq_params)``
for this CP rank, ready for ``model(..., packed_seq_params=...)`` and megatron's
schedules (``next(data_iterator)`` in ``forward_step``). A background thread
(``varlen_cp.prefetch.PlanPrefetcher``) builds the NEXT batch's plan with the model's layer
masks and every table its attention layers and RoPE lookup need (``planning.plan_batch``)
while the current step runs; the step itself only cuts its tokens out with the ready plan
(``get_thd_batch_on_this_cp_rank(..., plan=...)``; in the graph-safe mode it also rewrites
the layers' buffers for the batch) and copies them to the device.

Limits: ``depth`` batches are planned ahead (one is enough when a micro-batch's compute
outlasts its planning); the thread shares the GIL with the training loop, so host planning
still costs the loop a share of one core while it runs; it never issues collectives.
``options.prefetch=False`` plans inline (same results, no thread). Call ``close()`` (or use
it as a context manager) to stop the thread early.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from megatron.core.transformer.enums import AttnMaskType

from ...prefetch import PlanPrefetcher
from .options import VarlenCPOptions
from .planning import ModelAttention, model_attention, plan_batch, resolve_device
from .sharding import (VarlenCPPackedSeqParams, _check_host_cu, cp_group_and_rank,
                       get_thd_batch_on_this_cp_rank)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class PrefetchedTHDBatches:
    """Iterator of this rank's ``(local_batch, packed_seq_params)`` (see module doc).

    source: iterable of ``(batch, cu_seqlens)``. config: megatron's ``TransformerConfig``
    (or a ``planning.ModelAttention``): layer masks, strategies, head shape. options: the
    model's ``VarlenCPOptions`` (layout, strategies, ``prefetch``). device: where the model
    runs (default: the current CUDA device, else CPU). cp_group: default megatron's.
    ``last_plan`` / ``last_timing``: the plan of the last batch handed out and its
    ``varlen_cp.prefetch.PlanTiming`` (for ``varlen_cp.report.TrainingReport``).
    """

    def __init__(self, source: Iterable[tuple[dict[str, Any], torch.Tensor]], *, config: Any,
                 options: VarlenCPOptions | None = None, device: Any = None,
                 cp_group: Any = None, depth: int = 1,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
        self.options = VarlenCPOptions() if options is None else options
        if not isinstance(self.options, VarlenCPOptions):
            raise ValueError(f"options must be a VarlenCPOptions, got "
                             f"{type(self.options).__name__}")
        self.model = config if isinstance(config, ModelAttention) else model_attention(
            config, self.options, attn_mask_type)
        # Resolved here, on the caller's thread: the planner thread has its own CUDA device.
        self.device = resolve_device(_default_device() if device is None else device)
        self.cp_group, self.cp_size, self.cp_rank = cp_group_and_rank(cp_group)
        self._prefetcher = PlanPrefetcher(source, self._make_plan, depth=depth,
                                          enabled=self.options.prefetch)
        self._items: Iterator | None = None
        self.last_plan: Any = None  # the plan of the last batch handed out, and its timing
        self.last_timing: Any = None

    def _make_plan(self, item: Any):
        """Runs on the planner thread: host planning and non-blocking copies only."""
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"source must yield (batch, cu_seqlens) pairs, got "
                             f"{type(item).__name__}")
        _check_host_cu(item[1], "cu_seqlens")
        return plan_batch(item[1].flatten(), self.options, self.cp_size, self.cp_rank,
                          model=self.model, device=self.device, group=self.cp_group)

    def __iter__(self) -> "PrefetchedTHDBatches":
        return self

    def __next__(self) -> tuple[dict[str, Any], VarlenCPPackedSeqParams]:
        if self._items is None:
            self._items = iter(self._prefetcher)
        (batch, cu_seqlens), plan = next(self._items)
        self.last_plan, self.last_timing = plan, self._prefetcher.last_timing
        local, packed = get_thd_batch_on_this_cp_rank(
            batch, cu_seqlens, cp_group=self.cp_group, options=self.options, plan=plan,
            config=self.model, device=self.device)
        local = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in local.items()}
        return local, packed

    def close(self) -> None:
        """Stop the planner thread (idempotent)."""
        self._prefetcher.close()

    def __enter__(self) -> "PrefetchedTHDBatches":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
