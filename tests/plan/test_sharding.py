"""Sharding hooks and CPPlan.shard / unshard: round trips for every layout and cp 1..5,
unshard over a real gloo group (one launch of 3 forked processes: cp 3 on the world group,
cp 2 on a sub-group), torchtitan-style batch sharding and cu_seqlens recovery."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import time
import traceback

import pytest
import torch

from tests.helpers.plan_checks import mix_id
from varlen_cp.plan import LAYOUTS, CPPlan, DualChunk
from varlen_cp.sharding import cu_seqlens_from_positions, shard_packed_batch

MIXES = [[5, 0, 1, 7], [300, 1, 17, 0, 64, 129], [2, 3], [1] * 9, []]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(0, dtype=torch.int64)])


def _plans(lengths, cp, layout) -> list[CPPlan]:
    spec = DualChunk(min_chunk_tokens=4) if layout == "dual_chunk" else layout
    return [CPPlan.build(_cu(lengths), cp_size=cp, cp_rank=r, layout=spec)
            for r in range(cp)]


@pytest.mark.parametrize("lengths", MIXES, ids=mix_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_shard_unshard_round_trip(layout: str, cp: int, lengths: list[int]) -> None:
    total = sum(lengths)
    plans = _plans(lengths, cp, layout)
    for dim, shape in ((0, (total, 2, 3)), (1, (2, total, 3)), (-1, (2, total))):
        x = torch.randn(shape, dtype=torch.float64)
        parts = [p.shard(x, dim=dim) for p in plans]
        for p, part in zip(plans, parts):
            idx = p.token_indices
            expect = x.movedim(dim, 0)[idx.clamp(min=0)].clone()
            expect[idx < 0] = 0  # padding tokens (te) are zeros
            assert torch.equal(part.movedim(dim, 0), expect)
        assert torch.equal(plans[0].unshard_parts(parts, dim=dim), x)
    if cp == 1:  # no communication needed: group may be None
        x = torch.randn(total, 4)
        assert torch.equal(plans[0].unshard(plans[0].shard(x)), x)


def test_shard_rejects_bad_input() -> None:
    plan = _plans([5, 3], 2, "dual_chunk")[0]
    with pytest.raises(ValueError, match="8"):
        plan.shard(torch.zeros(7, 2))
    with pytest.raises(ValueError, match="dim"):
        plan.shard(torch.zeros(8, 2), dim=2)
    with pytest.raises(ValueError, match="parts"):
        plan.unshard_parts([torch.zeros(plan.num_tokens_of(0))])
    with pytest.raises(ValueError, match="x_local"):
        plan.unshard(torch.zeros(plan.num_tokens + 1))
    with pytest.raises(ValueError, match="group"):  # cp 2 without a process group
        plan.unshard(torch.zeros(plan.num_tokens))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_packed_batch(layout: str) -> None:
    lengths = [300, 1, 17, 64, 129]
    total = sum(lengths)
    positions = _positions(lengths).unsqueeze(0)
    tokens = torch.randint(1, 1000, (1, total))
    labels = torch.randint(0, 1000, (1, total))
    batch = {"input": tokens, "labels": labels, "positions": positions.to(torch.int32),
             "cu_seqlens": _cu(lengths), "name": "doc-batch"}
    for plan in _plans(lengths, 3, layout):
        out = shard_packed_batch(batch, plan, ignore_index=-7)
        idx = plan.token_indices
        pad = idx < 0
        assert out["name"] == "doc-batch" and out["cu_seqlens"] is batch["cu_seqlens"]
        assert out["positions"].dtype == torch.int32 and out["positions"].shape == (1, len(idx))
        assert torch.equal(out["positions"][0], plan.positions)
        assert torch.equal(out["positions"][0][~pad], positions[0][idx[~pad]].to(torch.int32))
        assert torch.equal(out["input"][0][~pad], tokens[0][idx[~pad]])
        assert bool((out["input"][0][pad] == 0).all())
        assert torch.equal(out["labels"][0][~pad], labels[0][idx[~pad]])
        assert bool((out["labels"][0][pad] == -7).all())
        assert bool(pad.any()) == (layout == "te")
    assert torch.equal(batch["input"], tokens), "input batch left unmodified"


def test_shard_packed_batch_rejects_bad_input() -> None:
    plan = _plans([5, 3], 2, "contiguous")[0]
    with pytest.raises(ValueError, match="'labels'"):
        shard_packed_batch({"labels": torch.zeros(1, 9)}, plan)
    with pytest.raises(ValueError, match="plan"):
        shard_packed_batch({"labels": torch.zeros(1, 8)}, "plan")
    with pytest.raises(ValueError, match="batch"):
        shard_packed_batch([torch.zeros(1, 8)], plan)
    with pytest.raises(ValueError, match="seq_dim"):
        shard_packed_batch({"labels": torch.zeros(1, 8)}, plan, seq_dim=-1)


def test_cu_seqlens_from_positions() -> None:
    for lengths in ([5, 1, 7], [1], [3, 3, 1, 1], []):
        pos = _positions(lengths)
        for p in (pos, pos.unsqueeze(0), pos.to(torch.int32)):
            cu = cu_seqlens_from_positions(p)
            assert cu.dtype == torch.int32 and cu.tolist() == _cu(lengths).tolist()
    # A sample cut mid-document: token 0 still starts a segment.
    assert cu_seqlens_from_positions(torch.tensor([3, 4, 5, 0, 1])).tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="shape"):
        cu_seqlens_from_positions(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="CPU"):
        cu_seqlens_from_positions(torch.zeros(1, 4, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="integer"):
        cu_seqlens_from_positions(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="torch.Tensor"):
        cu_seqlens_from_positions([0, 1, 2])


def test_positions_to_plan_pipeline() -> None:
    """torchtitan flow: positions -> cu_seqlens -> plan -> sharded batch."""
    lengths = [40, 3, 1, 77]
    positions = _positions(lengths).unsqueeze(0)
    cu = cu_seqlens_from_positions(positions)
    for layout in ("dual_chunk", "contiguous"):
        plan = CPPlan.build(cu, cp_size=2, cp_rank=1, layout=DualChunk(min_chunk_tokens=4)
                            if layout == "dual_chunk" else layout)
        out = shard_packed_batch({"positions": positions}, plan)
        assert torch.equal(out["positions"], plan.shard(positions, dim=1))


# ---- unshard over a real gloo group -----------------------------------------------------
def _unshard_cases(rank: int, world: int, group_cp2) -> None:
    """Every layout and mix: shard the same global tensor, unshard, compare."""
    for layout in LAYOUTS:
        for lengths in MIXES:
            total = sum(lengths)
            gen = torch.Generator().manual_seed(total)
            x = torch.randn(total, 3, generator=gen)
            seq = torch.randn(2, total, 4, generator=gen)
            plan = _plans(lengths, world, layout)[rank]
            assert torch.equal(plan.unshard(plan.shard(x)), x)
            assert torch.equal(plan.unshard(plan.shard(seq, dim=1), None, dim=1), seq)
            if group_cp2 is not None:
                plan2 = _plans(lengths, 2, layout)[rank]
                assert torch.equal(plan2.unshard(plan2.shard(x), group_cp2), x)
    # Group checks raise before any communication.
    wrong_size = _plans([5, 3], 2, "dual_chunk")[0]
    try:
        wrong_size.unshard(torch.zeros(wrong_size.num_tokens))
        raise AssertionError("group size mismatch not detected")
    except ValueError as e:
        assert "size" in str(e)
    wrong_rank = _plans([5, 3], world, "contiguous")[(rank + 1) % world]
    try:
        wrong_rank.unshard(torch.zeros(wrong_rank.num_tokens))
        raise AssertionError("rank mismatch not detected")
    except ValueError as e:
        assert "cp_rank" in str(e)


def _worker(rank: int, world: int, store: str, results) -> None:
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
        sub = dist.new_group([0, 1])  # every rank must take part in creating it
        _unshard_cases(rank, world, sub if rank < 2 else None)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # report everything, the parent turns it into a test failure
        results.put((rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(0)  # skip pytest's atexit handlers inherited through fork


def test_unshard_gloo(tmp_path) -> None:
    world = 3
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "store"), results))
             for r in range(world)]
    for p in procs:
        p.start()
    errors = {}
    deadline = time.monotonic() + 60  # a hung collective fails the test, never hangs it
    try:
        for _ in range(world):
            rank, err = results.get(timeout=max(0.1, deadline - time.monotonic()))
            errors[rank] = err
    except queue.Empty:
        errors["timeout"] = "a worker did not report within 60 s"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = {k: v for k, v in errors.items() if v}
    assert not failed, "\n".join(f"rank {k}:\n{v}" for k, v in failed.items())
