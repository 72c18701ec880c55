"""Host -> device copies of tables from pinned, reused staging buffers (kernels/host_copy.py).

No GPU here (``pin_memory`` itself needs a CUDA driver), so the CUDA path runs with the
stager's three factories replaced by CPU fakes that record what they are asked for: a
pinned allocation, a device buffer, an event with a completion flag the test controls.
Checked: a CUDA target takes the pinned path (one pinned buffer, one copy per call's
tables, results equal the host tables); a buffer whose copy is still in flight is never
handed out again (a second one is made), and is reused once its event completed; a CPU
target is a no-op (the host tensors themselves). Then every strategy's ``prepare`` for a
CUDA device, and the plan's shard/unshard index copies: every host table must go through
the stager (with the fake installed, any other ``.to("cuda")`` raises here).
"""

from __future__ import annotations

import pytest
import torch

from varlen_cp.config import AttnShape, CPConfig
from varlen_cp.kernels import host_copy
from varlen_cp.kernels.host_copy import HostStager, to_device
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan, DualChunk
from varlen_cp.prefetch import build_tables


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeCuda:
    """The stager's factories, on the CPU, with a log."""

    def __init__(self) -> None:
        self.pinned: list[torch.Tensor] = []
        self.events: list[FakeEvent] = []
        self.device_buffers = 0

    def pin(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.append(buf)
        return buf

    def on_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        assert device.type == "cuda"
        self.device_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def event(self, device: torch.device) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def stager(self) -> HostStager:
        return HostStager(self.pin, self.on_device, self.event)


CUDA = torch.device("cuda", 0)


def _tables():
    return [torch.arange(7, dtype=torch.int32), None, torch.tensor([[3, -1], [5, 9]]),
            torch.empty(0, dtype=torch.int64), torch.tensor([True, False, True])]


def test_cuda_target_copies_through_one_pinned_buffer():
    fake = FakeCuda()
    got = fake.stager().copy(_tables(), CUDA)
    assert len(fake.pinned) == 1 and fake.device_buffers == 1 and len(fake.events) == 1
    for a, b in zip(got, _tables()):
        assert (a is None) == (b is None)
        if b is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_buffer_in_flight_is_not_reused_until_its_event_completes():
    fake = FakeCuda()
    stager = fake.stager()
    stager.copy(_tables(), CUDA)
    first = fake.pinned[0]
    stager.copy(_tables(), CUDA)                    # first copy still in flight
    assert len(fake.pinned) == 2, "a staging buffer was reused while its copy was in flight"
    fake.events[0].done = True                      # the first copy has read its buffer
    before = first.clone()
    got = stager.copy([torch.full((5,), 42)], CUDA)
    assert len(fake.pinned) == 2, "a completed buffer must be reused"
    assert not torch.equal(first[:40], before[:40]), "the completed buffer takes the new copy"
    assert torch.equal(got[0], torch.full((5,), 42))
    fake.events[1].done = fake.events[2].done = True
    stager.copy([torch.zeros(1 << 17, dtype=torch.uint8)], CUDA)   # bigger than both: new
    assert len(fake.pinned) == 3 and fake.pinned[-1].numel() >= 1 << 17


def test_cpu_target_is_a_no_op():
    tables = _tables()
    got = to_device(tables, "cpu")
    assert all(a is b for a, b in zip(got, tables))


@pytest.fixture
def fake_cuda_stager(monkeypatch):
    """The fake stager as the process-wide one, and any direct host -> CUDA copy an error
    (without a driver it would raise something less clear)."""
    from varlen_cp.kernels import triton_common
    fake = FakeCuda()
    # block sizes ask the device for its architecture: an H100 stands in for the fake one
    monkeypatch.setattr(triton_common, "_cuda_arch", lambda index: 90)
    old = host_copy.set_stager(fake.stager())
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            raise AssertionError("a host table bypassed the pinned staging buffers")
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    try:
        yield fake
    finally:
        host_copy.set_stager(old)


DOCS = [40, 3, 0, 77, 12]
MASKS = [(AttnMask(causal=True, chunk_size=16), 3), (AttnMask(causal=True), 1)]


@pytest.mark.parametrize("strategy", ["p2p", "all_gather", "a2a", "a2a+p2p", "dispatch"])
def test_every_strategys_tables_reach_cuda_through_the_stager(strategy, fake_cuda_stager,
                                                              one_thread):
    """build_tables for a CUDA device (the fake one): every device table comes from the
    stager, one pinned copy per table object (not one per tensor)."""
    config = CPConfig(strategy=strategy, layout="dual_chunk", min_chunk_tokens=4)
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=16, head_dim_v=16,
                      dtype=torch.float16)
    plan = CPPlan.build(torch.tensor([0] + DOCS).cumsum(0), cp_size=4, cp_rank=1,
                        layout=config.layout_spec(MASKS))
    import varlen_cp.attention as attention
    real_check = attention._check_device
    attention._check_device = torch.device   # the fake CUDA device passes
    try:
        build_tables(plan, config, MASKS, shape, CUDA)
    finally:
        attention._check_device = real_check
    assert fake_cuda_stager.device_buffers > 0
    # each copy moved several tables at once
    assert fake_cuda_stager.device_buffers == len(fake_cuda_stager.events)


def test_plan_index_and_kernel_metadata_copies_go_through_the_stager(fake_cuda_stager,
                                                                     one_thread):
    """The plan's shard / unshard indices and the public op's host metadata (cu_seqlens,
    positions cast to int32) for a CUDA device: staged, values unchanged."""
    from varlen_cp.kernels.api import _to_device_int32
    plan = CPPlan.build(torch.tensor([0] + DOCS).cumsum(0), cp_size=2, cp_rank=0,
                        layout="te")
    n0 = fake_cuda_stager.device_buffers
    index = plan._on("shard", CUDA, lambda: plan.token_indices.clamp(min=0))
    assert torch.equal(index, plan.token_indices.clamp(min=0))
    cu = _to_device_int32(torch.tensor([0, 5, 9]), CUDA)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 9]
    assert fake_cuda_stager.device_buffers == n0 + 2


def test_kernel_call_copy_keeps_every_schedule_table(fake_cuda_stager, one_thread):
    """A CP kernel call's device copy holds every table of its tile schedule (ranges, full
    ranges, work lists, the padding flag), equal to the host's, in one staged copy: a table
    left behind would make the kernels fall back to masked tiles or a device-built list."""
    import dataclasses

    from varlen_cp.tables.holders import rank_holder, kernel_call
    plan = CPPlan.build(torch.tensor([0] + DOCS).cumsum(0), cp_size=2, cp_rank=0,
                        layout=DualChunk(min_chunk_tokens=4))
    holder = rank_holder(plan, 0)
    host = kernel_call(holder, rank_holder(plan, 1), AttnMask(causal=True), (32, 32))
    n0 = fake_cuda_stager.device_buffers
    dev = host.to(CUDA)
    assert fake_cuda_stager.device_buffers == n0 + 1
    for f in dataclasses.fields(host.schedule):
        a, b = getattr(host.schedule, f.name), getattr(dev.schedule, f.name)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    assert host.schedule.q_tiles is not None and host.schedule.kv_full is not None
    for name in ("cu_q", "cu_k", "q_pos", "k_pos"):
        assert torch.equal(getattr(host, name), getattr(dev, name))
