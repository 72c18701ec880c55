"""Build a batch's plan and every host table its attention calls need, ahead of the step.

A training step must never wait for the host (docs/design.md). ``cp_varlen_attn`` builds a
strategy's host tables lazily, at the first layer call of each mask, inside the step; the
integrations instead call :func:`build_plan` + :func:`build_tables` for the NEXT batch while
the current step runs (:class:`PlanPrefetcher`, a background thread fed by the data
iterator), so the forward finds everything cached in the plan, device copies included
(``non_blocking`` copies from pinned, reused staging buffers: ``varlen_cp.kernels.host_copy``,
so the planner thread never waits for the GPU).

Limits: the background thread shares the GIL with the training loop, so host planning still
costs the loop a share of one core while it runs (milliseconds per batch); it never waits
for it. Collectives are never issued from the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

import torch

from .checks import check_bool, check_int
from .config import AttnShape, CPConfig
from .host_memory import keep_freed_host_memory
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan, Topology
from .plan.balanced import normalize_masks

T = TypeVar("T")


LayerMasks = Sequence[tuple[AttnMask, int]]


def build_plan(cu_seqlens: torch.Tensor, config: CPConfig, *, cp_size: int, cp_rank: int,
               layer_masks: LayerMasks | None = None,
               topology: Topology | None = None) -> CPPlan:
    """The batch's plan for ``config`` (host integer math, the same on every rank).
    ``layer_masks``: the model's masks with their layer counts, which the ``balanced``
    layout balances one by one (others ignore them). ``topology``: which CP ranks share a
    node (``config.topology(global ranks of the CP group)``; None: one node). The
    graph-safe mode (``config.graph_safe``) builds it at ``graph_capacity`` rows per
    rank."""
    if not isinstance(config, CPConfig):
        raise ValueError(f"config must be a varlen_cp.CPConfig, got {type(config).__name__}")
    masks = None if layer_masks is None else list(layer_masks)
    if masks is not None and config.layout != "balanced":
        normalize_masks(masks)  # checked only: balanced's spec checks (and keeps) its own
    return CPPlan.build(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank,
                        layout=config.layout_spec(masks), topology=topology,
                        capacity=config.plan_capacity)


def build_tables(plan: CPPlan, config: CPConfig, layer_masks: LayerMasks, shape: AttnShape,
                 device: torch.device | str,
                 options: Sequence[AttnOptions] | None = None) -> CPPlan:
    """Build (and cache in ``plan``) every host table, and its copy on ``device``, that
    ``cp_varlen_attn`` will need for each mask of ``layer_masks`` with
    ``config.attn_options`` (for models with per-layer strategies: ``options[i]``, an
    ``AttnOptions``, for mask i). Returns ``plan``. Pure host work plus non-blocking
    copies: no collective, no sync."""
    from .attention import build_layer_tables  # the attention floor owns strategy choice

    if not isinstance(config, CPConfig):
        raise ValueError(f"config must be a varlen_cp.CPConfig, got {type(config).__name__}")
    masks = [m for m, _ in normalize_masks(list(layer_masks))]
    if options is None:
        options = [config.attn_options] * len(masks)
    elif len(options) != len(masks):
        raise ValueError(f"options must have one entry per mask ({len(masks)}), got "
                         f"{len(options)}")
    for mask, opts in zip(masks, options):
        build_layer_tables(plan, mask, opts, shape, device)
    return plan


def refresh_buffers(plan: CPPlan, config: CPConfig, layer_masks: LayerMasks,
                    shape: AttnShape, device: torch.device | str) -> None:
    """The graph-safe mode (``config.graph_safe``): every mask's device buffers rewritten in
    place for ``plan`` (``attention.refresh_layer_buffers``), on the calling thread's
    current stream: call it before the step, after the previous step was issued (its
    tables were staged by :func:`build_tables` on the planner thread)."""
    from .attention import refresh_layer_buffers

    for mask, _ in normalize_masks(list(layer_masks)):
        refresh_layer_buffers(plan, mask, config.attn_options, shape, device)


_DONE = object()


@dataclass(frozen=True)
class PlanTiming:
    """How one item's plan was made and met (``PlanPrefetcher.last_timing``).

    plan_s: wall time of ``make_plan`` for the item (on the planner thread, sharing the GIL
    with the training loop). wait_s: how long the consumer waited for it (0 when it was
    ready; None: prefetch off, planned inline). lead_s: how long it had been ready when the
    consumer asked (0 when the consumer waited; None inline)."""

    plan_s: float
    wait_s: float | None
    lead_s: float | None


class PlanPrefetcher(Generic[T]):
    """Iterate ``source`` with each item's plan built ``depth`` items ahead in a thread.

    ``make_plan(item) -> CPPlan`` builds (and should prepare) the plan of one item; it runs
    on the background thread while the consumer works on earlier items. Iterating yields
    ``(item, plan)``. An exception in ``source`` or ``make_plan`` is re-raised in the
    consumer at the item it belongs to. ``enabled=False`` runs ``make_plan`` inline (same
    results, no thread), for debugging. ``last_timing`` (a :class:`PlanTiming`) says how the
    last yielded plan was made: the planner's time, and whether it was ready when asked
    (how long before) or how long the consumer waited. Starting one keeps freed host memory
    in the heap for the next batch's tables (``varlen_cp.host_memory``; opt out with
    ``VARLEN_CP_MALLOC_TUNING=0``).
    """

    def __init__(self, source: Iterable[T], make_plan: Callable[[T], CPPlan], *,
                 depth: int = 1, enabled: bool = True) -> None:
        check_int("depth", depth, 1)
        check_bool("enabled", enabled)
        if not callable(make_plan):
            raise ValueError(f"make_plan must be callable, got {type(make_plan).__name__}")
        keep_freed_host_memory()  # every batch's tables reuse the last one's freed memory
        self._source, self._make_plan = iter(source), make_plan
        self._enabled = enabled
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_timing: PlanTiming | None = None
        if enabled:  # start now: the first item is planned while the caller sets up
            self._thread = threading.Thread(target=self._work, name="varlen-cp-planner",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            for item in self._source:
                if self._stop.is_set():
                    return
                start = time.perf_counter()
                plan = self._make_plan(item)
                done = time.perf_counter()
                self._put((item, plan, None, (done - start, done)))
        except BaseException as e:  # handed to the consumer, raised there
            self._put((None, None, e, None))
            return
        self._put(_DONE)

    def _put(self, entry: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[T, CPPlan]]:
        if not self._enabled:
            for item in self._source:
                start = time.perf_counter()
                plan = self._make_plan(item)
                self.last_timing = PlanTiming(time.perf_counter() - start, None, None)
                yield item, plan
            return
        while True:
            asked = time.perf_counter()
            entry = self._queue.get()
            got = time.perf_counter()
            if entry is _DONE:
                return
            item, plan, error, made = entry
            if error is not None:
                raise error
            plan_s, done = made
            ready = done <= asked
            self.last_timing = PlanTiming(plan_s, 0.0 if ready else got - asked,
                                          asked - done if ready else 0.0)
            yield item, plan

    def close(self) -> None:
        """Stop the thread after the item it is planning (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
