"""Guards that forbid or count what a CP call does: host reads of device data, bytes
posted by the collectives, all-reduces, any communication at all."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def forbid_host_reads():
    """Make Tensor.item/tolist/cpu/numpy (and bool/int/float conversions) raise on device
    data. On a CPU-only machine "device data" is every floating tensor (activations, LSE,
    gradients) and anything not on the CPU; host metadata (CPU int tensors) stays
    readable, as the plan's tables must be."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def guard(name):
        orig = saved[name]

        def check(self, *args, **kwargs):
            if self.is_floating_point() or self.device.type != "cpu":
                raise AssertionError(f"host read of device data: Tensor.{name} on "
                                     f"{self.dtype} {self.device} {tuple(self.shape)}")
            return orig(self, *args, **kwargs)
        return check

    for n in names:
        setattr(torch.Tensor, n, guard(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class ByteCounter:
    """Counts the bytes this rank sends through the collectives the strategies call:
    ``total``, and ``by_peer`` (global rank of the receiver -> bytes); ``a2a_sizes``: the
    size of the group of each all-to-all, in call order."""

    def __init__(self):
        from varlen_cp.strategies import all_gather
        self.total = 0
        self.by_peer: dict[int, int] = {}
        self.a2a_sizes: list[int] = []
        self._ag = all_gather
        self._saved = (dist.batch_isend_irecv, dist.all_to_all_single,
                       all_gather._all_gather_single)

    def __enter__(self):
        p2p_fn, a2a_fn, ag_fn = self._saved

        def add(peer: int, n: int) -> None:
            self.total += n
            self.by_peer[peer] = self.by_peer.get(peer, 0) + n

        def global_of(group, index: int) -> int:
            return index if group is None else dist.get_global_rank(group, index)

        def p2p(ops):
            for op in ops:
                if op.op is dist.isend:
                    add(op.peer, op.tensor.numel() * op.tensor.element_size())
            return p2p_fn(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kw):
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            me = dist.get_rank(group)
            self.a2a_sizes.append(dist.get_world_size(group))
            for j, rows in enumerate(input_split_sizes):
                if j != me:
                    add(global_of(group, j), row * rows)
            return a2a_fn(output, input, output_split_sizes, input_split_sizes, group=group,
                          **kw)

        def ag(output, input, group=None, **kw):
            me = dist.get_rank(group)
            for j in range(dist.get_world_size(group)):
                if j != me:
                    add(global_of(group, j), input.numel() * input.element_size())
            return ag_fn(output, input, group=group, **kw)

        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
        self._ag._all_gather_single = ag
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_to_all_single, self._ag._all_gather_single = \
            self._saved


class AllReduceCounter:
    """Counts dist.all_reduce calls (and their bytes) while active."""

    def __init__(self):
        self.saved, self.calls = dist.all_reduce, []

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.calls.append(tensor.numel() * tensor.element_size())
            return self.saved(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


@contextlib.contextmanager
def no_communication():
    """Every collective and P2P call the strategies (and plan checks) use raises."""
    from varlen_cp.strategies import all_gather
    from varlen_cp.strategies.static import all_gather as static
    names = ("all_reduce", "all_to_all_single", "batch_isend_irecv", "all_gather",
             "all_gather_into_tensor", "new_group", "broadcast", "barrier")
    saved = {n: getattr(dist, n) for n in names}
    saved_ag = all_gather._all_gather_single, static._all_gather_single

    def refuse(*_a, **_k):
        raise RuntimeError("communication before validation")

    for n in names:
        setattr(dist, n, refuse)
    all_gather._all_gather_single = static._all_gather_single = refuse
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        all_gather._all_gather_single, static._all_gather_single = saved_ag
