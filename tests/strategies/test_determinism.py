"""Deterministic dK/dV on CUDA: no ``index_add_`` over duplicate rows in any strategy.

On CUDA ``index_add_`` adds with atomics, so rows that receive several updates in one call
sum in a run-dependent order (bitwise run-to-run differences); the CPU tests cannot see
that, since the CPU kernel is sequential. So the check is on the code path itself: every
strategy's forward + backward runs with ``Tensor.index_add_`` wrapped to fail on a floating
accumulation whose index repeats a row (what dispatch and all_gather did with the dK/dV
rows several ranks returned), and under ``torch.use_deterministic_algorithms(True)``, twice,
bitwise equal; gradients match the single-device reference. The host side: the returns'
``UniqueRounds`` cover every returned row once, no row twice in a round.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.cp_grid import compare_fp32, gather, global_inputs, single_device
from varlen_cp import AttnOptions
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan, DualChunk
from varlen_cp.tables.staged import staged_tables

# A long document cut over every rank (its first keys are fetched by every later rank:
# the same local row comes back from several ranks), short ones, an empty one.
DOCS = [150, 7, 0, 31, 12, 44]
MASKS = {"causal": AttnMask(causal=True), "chunk": AttnMask(causal=True, chunk_size=24)}


def _cu(docs):
    return torch.tensor([0] + docs).cumsum(0)


def _plan(world, rank):
    return CPPlan.build(_cu(DOCS), cp_size=world, cp_rank=rank,
                        layout=DualChunk(min_chunk_tokens=4))


# The torch twin (the CPU kernels, backend "torch") accumulates its own tiles with
# index_add_; CUDA runs the Triton kernels, whose backward has no atomics at all
# (kernels/triton_bwd.py), so the check covers everything else: the strategies.
_TWIN = "torch_attn.py"


@contextlib.contextmanager
def no_duplicate_index_add():
    """``Tensor.index_add_`` raises when it would add two values into one row of a floating
    tensor in one call (atomics racing on that row on CUDA), outside the torch twin."""
    original = torch.Tensor.index_add_

    def checked(self, dim, index, source, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if (self.is_floating_point() and not caller.endswith(_TWIN)
                and index.numel() != torch.unique(index).numel()):
            raise AssertionError(f"index_add_ over duplicate rows ({index.numel()} rows, "
                                 f"{torch.unique(index).numel()} distinct) into "
                                 f"{tuple(self.shape)}")
        return original(self, dim, index, source, *args, **kwargs)

    torch.Tensor.index_add_ = checked
    try:
        yield
    finally:
        torch.Tensor.index_add_ = original


def test_unique_rounds_cover_every_returned_row_once(one_thread):
    """Host tables: at cp 4 some rank gets one row back from several ranks (the case the
    old single index_add_ raced on); the rounds list every return once, rows unique within
    a round, and adding round by round equals the fp64 sum."""
    dup_seen = False
    for name in ("dispatch", "all_gather"):
        for stages in (1, 3):
            for rank in range(4):
                tab = staged_tables(name, _plan(4, rank), MASKS["causal"], rank, (32, 32),
                                    stages)
                for st in tab.stages:
                    rows, rounds = st.in_rows, st.rounds
                    dup_seen |= rows.numel() != torch.unique(rows).numel()
                    perm = torch.arange(rows.numel()) if rounds.perm is None else rounds.perm
                    assert sorted(perm.tolist()) == list(range(rows.numel()))
                    assert torch.equal(rounds.rows, rows[perm])
                    start = 0
                    for end in rounds.ends:
                        part = rounds.rows[start:end]
                        assert part.numel() == torch.unique(part).numel()
                        start = end
                    assert start == rows.numel()
                    vals = torch.randn(rows.numel(), 3, dtype=torch.float64)
                    want = torch.zeros(200, 3, dtype=torch.float64).index_add_(0, rows, vals)
                    with no_duplicate_index_add():
                        got = rounds.add_(torch.zeros(200, 3, dtype=torch.float64), vals)
                    torch.testing.assert_close(got, want)
    assert dup_seen, "the mix must make some rank receive one row from several ranks"


def _run_once(rank, world, strategy, mask, inputs, opts):
    from varlen_cp.attention import cp_varlen_attn
    q, k, v, dout = inputs
    plan = _plan(world, rank)
    ql, kl, vl = (plan.shard(t).requires_grad_() for t in (q, k, v))
    out, lse = cp_varlen_attn(ql, kl, vl, plan, mask, None, AttnOptions(
        strategy=strategy, backend="torch", validate=False, **opts), return_lse=True)
    out.backward(plan.shard(dout))
    return plan, (out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad)


def determinism_worker(rank, world):
    errors, n = [], 0
    cases = [("dispatch", {"overlap_stages": 1}), ("dispatch", {"overlap_stages": 3}),
             ("all_gather", {"overlap_stages": 1}), ("all_gather", {"overlap_stages": 2}),
             ("p2p", {}), ("a2a", {})]
    torch.use_deterministic_algorithms(True)
    try:
        for i, (strategy, opts) in enumerate(cases):
            for mname, mask in MASKS.items():
                inputs = global_inputs(DOCS, 3, 3, seed=i)
                ref = single_device(*inputs, DOCS, mask)
                with no_duplicate_index_add():
                    plan, first = _run_once(rank, world, strategy, mask, inputs, opts)
                    _, second = _run_once(rank, world, strategy, mask, inputs, opts)
                what = f"[{strategy} {opts} {mname}]"
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
                    if not torch.equal(a, b):
                        errors.append(f"{what} {name}: two runs differ")
                errors += compare_fp32(gather(plan, first), ref, what)
                n += 1
    finally:
        torch.use_deterministic_algorithms(False)
    assert not errors, "\n".join(errors)
    return n


@pytest.mark.parametrize("cp", [3])
def test_every_strategy_accumulates_dk_dv_without_duplicate_index_add(cp, tmp_path):
    """dispatch and all_gather (S = 1 and staged), p2p, a2a at cp 3: no duplicate-row
    index_add_, deterministic mode on, two runs bitwise equal, reference gradients."""
    assert run_distributed(determinism_worker, cp, tmp_path, timeout_s=300) == [12] * cp
