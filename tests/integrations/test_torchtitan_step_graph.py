"""torchtitan's step CUDA graph (``training.disable_cuda_graphs = false``): which runs with
varlen-cp's attention it may capture, and the per-step inputs our trainer hands it.

torchtitan 0.3.0 captures the forward and backward once and replays them; its wrapper
(``torchtitan.distributed.cudagraph.CUDAGraphWrapper``) copies each step's tensor inputs
into the captured ones and requires every non-tensor input to stay equal. In the
graph-safe mode the batch's ``PackedBatch`` (the ``attention_masks`` keyword) must
therefore compare equal across batches of other documents, and in every other mode it must
not (a replay would keep the first plan). The wrapper's own input check runs here on CPU
tensors (its CUDA set-up skipped).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

from torchtitan.distributed import cudagraph  # noqa: E402

from varlen_cp import CPPlan  # noqa: E402
from varlen_cp.integrations.torchtitan.attention import PackedBatch, graph_key_of  # noqa: E402
from varlen_cp.integrations.torchtitan.trainer import check_step_graph  # noqa: E402


def _plan(lengths, capacity):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return CPPlan.build(cu, cp_size=2, cp_rank=0, capacity=capacity)


def _step_inputs(plan, graph_safe):
    """(inputs, labels, valid tokens, *extra) as torchtitan's wrapper flattens them."""
    extra = {"positions": plan.positions.clamp(min=0).to(torch.int64).view(1, -1),
             "attention_masks": PackedBatch(plan, graph_key_of(plan) if graph_safe else None)}
    spec = cudagraph.CUDAGraphInputSpec(extra)
    n = plan.num_tokens
    return [torch.zeros(1, n, dtype=torch.int64), torch.zeros(1, n, dtype=torch.int64),
            torch.tensor(float(n)), *spec.flatten(extra)], spec


def _wrapper(example, monkeypatch):
    monkeypatch.setattr(cudagraph._manager, "maybe_initialize", lambda: None)
    monkeypatch.setattr(cudagraph._manager, "register", lambda wrapper: None)
    return cudagraph.CUDAGraphWrapper(lambda *a: None, example)


def test_graph_safe_batches_pass_torchtitans_replay_check(monkeypatch):
    first, spec = _step_inputs(_plan([100, 7, 93], 128), True)
    second, _ = _step_inputs(_plan([30, 60, 20, 90], 128), True)
    wrapper = _wrapper(first, monkeypatch)
    wrapper._validate_inputs(tuple(second))       # raises on any change it cannot replay
    spec.flatten(dict(zip(("positions", "attention_masks"), second[3:])))
    # another capacity is another graph
    other, _ = _step_inputs(_plan([100, 7, 93], 192), True)
    with pytest.raises(ValueError, match="must keep the same shape|must remain constant"):
        wrapper._validate_inputs(tuple(other))


def test_dynamic_batches_fail_torchtitans_replay_check(monkeypatch):
    first, _ = _step_inputs(_plan([100, 7, 93], 128), False)
    second, _ = _step_inputs(_plan([30, 60, 20, 90], 128), False)
    wrapper = _wrapper(first, monkeypatch)
    wrapper._validate_inputs(tuple(first))
    with pytest.raises(ValueError, match="non-tensor inputs must remain constant"):
        wrapper._validate_inputs(tuple(second))


@pytest.mark.parametrize("disable, graph_safe, moe, message", [
    (True, False, True, None),
    (False, True, False, None),
    (False, False, False, "set \\[varlen_cp\\] graph_safe = true"),
    (False, True, True, "MoE layers"),
])
def test_step_graph_is_checked_at_launch(disable, graph_safe, moe, message):
    if message is None:
        check_step_graph(disable, graph_safe, moe)
    else:
        with pytest.raises(ValueError, match=message):
            check_step_graph(disable, graph_safe, moe)
