"""One resolution per (plan, mask, options, head shape, device): how a layer's calls run.

``resolve`` is the single place where a CP call is decided: the strategy's head rules (and
``a2a_size``'s), our kernels' backend and tiles, the FlashAttention route for the calls it
expresses exactly (``kernels.flash.resolve_flash``), ``auto``'s strategy (closed-form costs
on the plan), a staged strategy's stage count and the Ulysses group size of "a2a+p2p". Its
result, a frozen :class:`~varlen_cp.strategies.Resolution`, is cached in the plan, so
- ahead of the step (``varlen_cp.prefetch.build_tables`` -> ``attention.build_layer_tables``)
  it decides which host tables the strategy builds;
- per call (eager, and inside the compiled custom op) the same key finds it: a call then
  only checks what depends on its tensors (``cp_call.resolve_call``) and the group
  (:func:`check_group`).
The inputs are the library's own validated types (``AttnMask``, ``AttnOptions``,
``AttnShape``: each checked its fields when built), so nothing here re-checks them; the
public entry points check that they are those types.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .kernels import block_sizes_for
from .kernels.api import resolve_backend
from .kernels.flash import check_available, resolve_flash
from .masks import AttnMask
from .options import AttnOptions
from .plan import CPPlan, LayoutSpec
from .plan.cpplan import check_layout
from .plan.collective import check_group as check_plan_group, check_group_type
from .plan.nodes import Topology, group_mismatch, node_of_ranks
from .tables.auto import choose_strategy
from .tables.flash_form import FlashRoute
from .tables.hybrid import default_a2a_size
from .tables.staged import resolve_stages
from .shape import AttnShape
from .strategies import LOCAL, Resolution, get_strategy
from .strategies.static import get_static_strategy
from .tables.static_rows import capacity_of


def kernel_route(backend: str, device: torch.device, shape: AttnShape
                 ) -> tuple[str, tuple[int, int], FlashRoute | None, str | None]:
    """(our kernels' backend, their tiles, the FlashAttention route or None, why none) of
    ``backend`` for calls of ``shape`` on ``device`` (the part of a resolution that needs
    no plan; the plan report's coverage reads it too)."""
    ours = resolve_backend(backend, device)
    block = tuple(block_sizes_for(ours, device, shape.head_dim, shape.value_dim,
                                  dtype=shape.dtype))
    name, why = resolve_flash(backend, device, shape.dtype, shape.head_dim, shape.value_dim,
                              shape.lse_grad, shape.row_max)
    route = None if name is None else FlashRoute.of(name, shape.dtype, shape.n_heads,
                                                    shape.n_kv_heads, shape.head_dim,
                                                    shape.value_dim)
    return ours, block, route, why


def check_heads(options: AttnOptions, n_heads: int, n_kv_heads: int, cp_size: int) -> None:
    """The strategy's head rule for these options (the Ulysses split of "a2a", and an
    ``a2a_size`` that divides cp and splits the heads for "a2a+p2p"): ValueError
    otherwise. "auto" only considers strategies that fit. Run at every cp, so cp=1
    debugging catches a rule that cp>1 would break."""
    if options.strategy != "auto":
        get_strategy(options.strategy).check_heads(n_heads, n_kv_heads, cp_size,
                                                   options.a2a_size)


def check_launch(options: AttnOptions, shape: AttnShape, cp_size: int,
                 device: torch.device | str, layout: LayoutSpec | None = None) -> None:
    """What a launcher checks from its config and world size before it builds a model: the
    rules the first call would apply, so that a mistake is one config error, not a
    traceback after the model was built. ValueError naming the option and its value for
    - the strategy's head rule at ``cp_size`` (cp 1 included: ``a2a_size`` must divide it);
    - the layout's rules that involve cp (``te``'s ``pad_multiple``), when ``layout`` is
      given;
    - the backend on ``device`` ("triton" on a CPU without the interpreter, "flash" without
      a kernel for the device, "fa4" without its package), asking nothing of a GPU (each
      rank would otherwise make a CUDA context before it picked its device).
    The environment variable the library reads is checked once per process, by
    ``host_memory.malloc_tuning``."""
    check_heads(options, shape.n_heads, shape.n_kv_heads, cp_size)
    if layout is not None:
        check_layout(layout, cp_size)
    device = torch.device(device)
    try:
        resolve_backend(options.backend, device)
    except RuntimeError as e:   # the Triton interpreter cannot run with this numpy
        raise ValueError(f"backend {options.backend!r}: {e}") from None
    check_available(options.backend, device)


def _resolve(plan: CPPlan, mask: AttnMask, options: AttnOptions, shape: AttnShape,
             device: torch.device) -> Resolution:
    if options.graph_safe:
        return _resolve_graph_safe(plan, options, shape, device)
    check_heads(options, shape.n_heads, shape.n_kv_heads, plan.cp_size)
    backend, block, route, _ = kernel_route(options.backend, device, shape)
    name = options.strategy
    if name == "auto" and plan.cp_size > 1:
        name = choose_strategy(plan, mask, shape)
    elif name == "auto":
        name = "p2p"   # cp 1: every strategy is the local op
    strategy = LOCAL if plan.cp_size == 1 else get_strategy(name)
    stages = a2a_size = None
    if strategy.staged:
        stages = resolve_stages(plan, mask, name, shape, options.overlap_stages)
    if strategy.name == "a2a+p2p":
        a2a_size = options.a2a_size
        if a2a_size is None:
            a2a_size = default_a2a_size(shape.n_heads, shape.n_kv_heads, plan.cp_size)
    return Resolution(name, strategy, backend, block, route, shape, stages, a2a_size)


def _resolve_graph_safe(plan: CPPlan, options: AttnOptions, shape: AttnShape,
                        device: torch.device) -> Resolution:
    """The graph-safe mode: the strategy's static form at every cp (cp 1 too: the local op
    reads tile schedules of the batch), its capacity, the row kernels' backend ("auto":
    Triton on CUDA, the dense torch kernel elsewhere; ``kernels.rows``)."""
    backend = resolve_backend(options.backend, device)
    strategy = get_static_strategy(options.strategy)
    a2a_size = None
    if options.strategy == "a2a+p2p":
        a2a_size = options.a2a_size or default_a2a_size(shape.n_heads, shape.n_kv_heads,
                                                        plan.cp_size)
    strategy.check_heads(shape.n_heads, shape.n_kv_heads, plan.cp_size, a2a_size)
    capacity = capacity_of(plan, options.graph_capacity)
    send = None
    if options.strategy == "dispatch":
        send = options.graph_send_capacity or capacity
    return Resolution(options.strategy, strategy, backend, (0, 0), None, shape,
                      a2a_size=a2a_size, capacity=capacity, send_capacity=send)


def resolve(plan: CPPlan, mask: AttnMask, options: AttnOptions, shape: AttnShape,
            device: torch.device) -> Resolution:
    """How calls of ``shape`` with ``mask`` and ``options`` on ``device`` run on ``plan``
    (module docstring); computed once per plan and key, then a dict lookup. ValueError
    (before any communication) for a head rule the options break or a backend the device
    cannot run."""
    return plan.cached(("resolution", mask, options, shape, device),
                       lambda: _resolve(plan, mask, options, shape, device))


def check_group(group: Any, plan: CPPlan) -> Any:
    """The CP process group of a call on ``plan`` (``group``, else the default group; None
    at cp 1 without one), after ``plan.collective.check_group``'s checks: a ProcessGroup
    of the plan's cp_size in which this process is the plan's rank, whose ranks sit on the
    nodes the plan's topology was built for (a group's nodes are read once per group and
    ``gpus_per_node``; a topology without ``gpus_per_node`` is not checked)."""
    check_group_type(group)
    if plan.cp_size == 1 and group is None:
        return None
    check_plan_group(group, plan.cp_size, plan.cp_rank)
    group = dist.group.WORLD if group is None else group
    topology = plan.topology
    if topology is not None and topology.gpus_per_node is not None:
        key = (id(group), topology.gpus_per_node)
        hit = _GROUP_NODES.get(key)
        if hit is None or hit[0] is not group:
            hit = (group, Topology(node_of_ranks(dist.get_process_group_ranks(group),
                                                 topology.gpus_per_node)).nodes)
            _GROUP_NODES[key] = hit
        if hit[1] != topology.nodes:
            raise ValueError(group_mismatch(topology, dist.get_process_group_ranks(group)))
    return group


# The nodes of each CP group's ranks, per gpus_per_node (holding the group keeps its id
# unique): a call compares tuples, the step builds nothing in the plan.
_GROUP_NODES: dict[tuple[int, int], tuple[Any, tuple[int, ...]]] = {}
