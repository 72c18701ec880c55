"""The one key under which host tables are cached in a plan, and their device copies.

Every table is memoized in the plan (``CPPlan.cached``) under a :class:`TableKey` made here,
so the keys of different tables can never collide and a prefetch (``varlen_cp.prefetch``)
fills exactly the entries the forward later reads. A mask that acts on the plan's documents
as a simpler one (:func:`table_mask`: a chunk at least as long as the longest document)
shares that mask's entries: Llama 4's chunked layers on a batch of documents shorter than
the chunk reuse the global layers' tables (one build instead of two). Only the table functions themselves
build keys (each makes its own from its arguments, in ``varlen_cp.tables`` or
``varlen_cp.sharding``); strategies and adapters call those functions with a ``device``
to get the copy (:func:`cached_table`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Callable, NamedTuple

import torch

from ..kernels.host_copy import one_to_device
from ..masks import AttnMask
from ..plan import CPPlan
from ..shape import AttnShape


class TableKey(NamedTuple):
    """kind: which table ("ring", "dispatch", ...); mask and block when it depends on them;
    extra: anything else it depends on (rank, group size, ...); route: the FlashAttention
    route its calls were planned for (None: our kernels only)."""

    kind: str
    mask: AttnMask | None
    block: tuple[int, int] | None
    extra: tuple
    device: str | None = None
    route: Any = None


def table_key(kind: str, mask: AttnMask | None = None, block: tuple[int, int] | None = None,
              *extra: Any, route: Any = None) -> TableKey:
    """A head shape among ``extra`` enters as ``AttnShape.costs`` (no softmax extras: no
    table or cost depends on them, the FlashAttention route they choose is ``route``), so
    calls that differ only there share every entry."""
    extra = tuple(x.costs if isinstance(x, AttnShape) else x for x in extra)
    return TableKey(kind, mask, None if block is None else tuple(block), extra, route=route)


def table_mask(plan: CPPlan, mask: AttnMask | None) -> AttnMask | None:
    """The simplest mask that sees exactly what ``mask`` sees on ``plan``'s documents:
    without its chunk when the chunk is at least the longest document (positions within a
    document are then all in chunk 0, so ``k // c == p // c`` always holds), and without a
    window side that reaches the longest document's length - 1 (no key of a document lies
    farther from a query of it: ``p - left <= 0 <= k`` and ``k <= L - 1 <= p + right``).
    Padding positions never reach a table: every holder and run excludes them.
    tests/tables/test_schedule_cache.py checks that the tables built for both are equal."""
    if mask is None or (mask.chunk_size is None and mask.window_size == (-1, -1)):
        return mask
    longest = plan.max_document_length
    chunk = mask.chunk_size if mask.chunk_size is not None and mask.chunk_size < longest \
        else None
    left, right = (w if w < longest - 1 else -1 for w in mask.window_size)
    if (chunk, (left, right)) == (mask.chunk_size, mask.window_size):
        return mask
    return _simplified(mask, chunk, left, right)


@lru_cache(maxsize=64)
def _simplified(mask: AttnMask, chunk: int | None, left: int, right: int) -> AttnMask:
    """``mask`` with that chunk and window, made once per mask (a ``replace`` costs ~2 us
    and every lookup of such a layer's table asks for it)."""
    return replace(mask, window_size=(left, right), chunk_size=chunk)


def _shared(plan: CPPlan, key: TableKey, make: Callable[[], Any]) -> Any:
    """``make()`` once per plan for ``key`` and every key whose mask acts the same
    (:func:`table_mask`): the entry of ``key`` is the simpler mask's entry."""
    simpler = table_mask(plan, key.mask)
    if simpler is key.mask:   # the common lookup: nothing to share
        return plan.cached(key, make)
    same = key._replace(mask=simpler)
    return plan.cached(key, lambda: plan.cached(same, make))


def host_table(plan: CPPlan, key: TableKey, build: Callable[[], Any]) -> Any:
    """``build()`` once per plan and key (shared by masks that act the same)."""
    return _shared(plan, key, build)


def device_table(plan: CPPlan, key: TableKey, device: torch.device | str,
                 build: Callable[[], Any]) -> Any:
    """The host table of ``key`` (built once) and its copy on ``device`` (made once,
    ``non_blocking``; shared as the host table is)."""
    host = host_table(plan, key, build)
    return _shared(plan, key._replace(device=str(torch.device(device))),
                   lambda: table_to_device(host, torch.device(device)))


def cached_table(plan: CPPlan, key: TableKey, build: Callable[[], Any],
                 device: torch.device | str | None = None) -> Any:
    """The host table of ``key`` (None ``device``), or its copy on ``device``; each made
    once per plan."""
    if device is None:
        return host_table(plan, key, build)
    return device_table(plan, key, device, build)


def table_to_device(x: Any, device: torch.device) -> Any:
    """Tensors (and objects with ``.to(device)``) inside ``x`` copied to ``device`` (host
    tensors through pinned staging buffers: ``varlen_cp.kernels.host_copy``). The tables
    compute in numpy; the objects that reach here (ring, Ulysses, staged tables, kernel
    calls) hold tensors exactly where the engine or a kernel reads them, so this is the one
    copy, with no conversion left to do."""
    if isinstance(x, torch.Tensor):
        return one_to_device(x, device)
    if isinstance(x, tuple):
        return tuple(table_to_device(e, device) for e in x)
    if isinstance(x, list):
        return [table_to_device(e, device) for e in x]
    if hasattr(x, "to") and not isinstance(x, (int, float, str)):
        return x.to(device)
    return x
