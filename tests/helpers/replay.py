"""A CPU stand-in for a CUDA graph: record the device work of a step, compare two steps'
work, replay a recording on the buffers as they are now.

A captured CUDA graph keeps, of a step, exactly its kernels and copies, their arguments
(the storages they read and write, their sizes, their scalar arguments) and its
collectives; a replay re-runs them on whatever the storages hold then, and runs no Python.
:class:`DeviceWork` records the same thing on a CPU, from the dispatcher (a
``TorchDispatchMode``: every aten op and every c10d collective of the step, in order, with
its arguments; the autograd engine carries the mode into the backward). Each tensor
argument is described by where its memory comes from:

- ``static``: a storage registered as the step's own (its inputs, its device buffers):
  the same storage must be used in every step, since a graph has its addresses baked in;
- ``out``: an earlier op's output (the graph's private pool): named by (op, output);
- ``extern``: anything else (a table made for this batch, a host tensor): its address,
  so a step that reads such a tensor issues different work in another batch.

:meth:`DeviceWork.signature` is that description (op names, shapes, dtypes, strides,
storages, scalar arguments); two steps with equal signatures issue the identical
sequence. :meth:`DeviceWork.replay` re-runs the recorded ops on the static tensors as they
are now (new data written in place), outputs of earlier ops feeding later ones: what a
graph replay computes, with no Python of the library in between.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class DeviceWork(TorchDispatchMode):
    """Records the ops dispatched while active (module docstring). ``static``: the tensors
    whose storages are the step's own (inputs and buffers refreshed in place)."""

    def __init__(self, static: list[torch.Tensor]) -> None:
        super().__init__()
        self.static = {_ptr(t): t for t in static}
        self.calls: list[tuple[Any, tuple, dict, Any]] = []
        self._made: dict[int, tuple[int, int]] = {}     # id(output) -> (call, index)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        # where each tensor argument comes from NOW (an in-place op later re-points it)
        srcs = [self._source(x) if isinstance(x, torch.Tensor) else None for x in flat]
        out = func(*args, **kwargs)
        i = len(self.calls)
        self.calls.append((func, flat, spec, srcs, out))
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = (i, j)
        return out

    # ---- description ---------------------------------------------------------------
    def _source(self, t: torch.Tensor) -> tuple:
        made = self._made.get(id(t))
        layout = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                  str(t.device))
        if made is not None:
            return ("out",) + made + layout
        if t.numel() and _ptr(t) in self.static:
            return ("static", _ptr(t)) + layout
        return ("extern", _ptr(t) if t.numel() else 0) + layout

    def signature(self) -> list[tuple]:
        """Per op: (name, arguments as described in the module docstring)."""
        out = []
        for func, flat, _, srcs, _ in self.calls:
            args = tuple(src if src is not None else
                         (("object", type(x).__name__) if isinstance(x, torch.ScriptObject)
                          else x) for x, src in zip(flat, srcs))
            out.append((str(func), args))
        return out

    def externs(self) -> list[tuple[str, tuple]]:
        """(op, argument) of every tensor argument that is neither static nor made by the
        step (what a graph could not refresh)."""
        return [(name, a) for name, args in self.signature() for a in args
                if isinstance(a, tuple) and a and a[0] == "extern"]

    def index_of(self, t: torch.Tensor) -> tuple[int, int]:
        """(op, output) that made ``t`` last in this recording."""
        return self._made[id(t)]

    # ---- replay --------------------------------------------------------------------
    def replay(self) -> list[Any]:
        """Re-run the recorded ops in order on the static tensors as they are now, each
        op's tensor arguments taken from the replay's own outputs where the recording
        took them from an op (static and extern ones as recorded); the outputs, per op."""
        outs: list[Any] = []
        with torch.no_grad():   # a graph's kernels, not autograd's ops
            self._run(outs)
        return outs

    def _run(self, outs: list[Any]) -> None:
        pending: list[Any] = []   # works of posted collectives: stream order, as a graph
        for func, flat, spec, srcs, _ in self.calls:
            if not _posts_p2p(func):    # P2P ops of one batch are in flight together
                _wait(pending)
            now = [pytree.tree_leaves(outs[src[1]])[src[2]]
                   if src is not None and src[0] == "out" else x
                   for x, src in zip(flat, srcs)]
            args, kwargs = pytree.tree_unflatten(now, spec)
            out = func(*args, **kwargs)
            pending += [x for x in pytree.tree_leaves(out)
                        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait")]
            outs.append(out)
        _wait(pending)

    def replayed(self, outs: list[Any], t: torch.Tensor) -> torch.Tensor:
        """The replay's counterpart of ``t``, a tensor the recorded step made."""
        i, j = self.index_of(t)
        return pytree.tree_leaves(outs[i])[j]


def _posts_p2p(func: Any) -> bool:
    return str(func).startswith(("c10d.send", "c10d.recv"))


def _wait(works: list[Any]) -> None:
    while works:
        works.pop(0).wait()
