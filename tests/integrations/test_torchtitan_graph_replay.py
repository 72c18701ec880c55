"""A torchtitan model's whole forward and backward in the graph-safe mode replays with
another batch's documents: the CPU stand-in (``tests.helpers.replay.DeviceWork``) of the
step CUDA graph torchtitan captures (``training.disable_cuda_graphs = false``).

A tiny llama3 (torchtitan's own model, varlen-cp's attention, ``graph_safe=True``, cp 1)
gets two packed batches of other documents at one capacity, each written IN PLACE into the
same token and position inputs, the attention's row buffer refreshed in place (what the
trainer does before each step). Both steps (logits, a weighted sum, backward) must issue
the identical ops on the identical storages with no tensor from outside the step, and
re-running batch A's recording after batch B was written in gives batch B's logits and
gradients exactly. Both batches' logits equal the dynamic mode's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

from tests.helpers.replay import DeviceWork  # noqa: E402
from tests.helpers.torchtitan_models import (fp32, packed_documents, tiny_model_config,  # noqa: E402
                                             with_varlen_cp)
from varlen_cp import CPPlan  # noqa: E402
from varlen_cp.integrations.torchtitan.attention import PackedBatch, graph_key_of  # noqa: E402
from varlen_cp.integrations.torchtitan.trainer import packed_cu_seqlens  # noqa: E402
from varlen_cp.strategies.static import static_buffers  # noqa: E402

ROWS, LENGTH = 1, 192


def _model(**options):
    torch.manual_seed(0)
    model = fp32(with_varlen_cp(tiny_model_config("llama3"), **options)).build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _plans(seed: int, capacity):
    tokens, positions = packed_documents(ROWS, LENGTH, seed=seed, max_doc_len=70)
    cu = packed_cu_seqlens(positions, (ROWS, LENGTH))
    return tokens.reshape(-1), CPPlan.build(cu, cp_size=1, cp_rank=0, capacity=capacity)


def test_llama3_step_replays_with_other_documents():
    graph_safe = _model(strategy="p2p", graph_safe=True, backend="torch")
    dynamic = _model(strategy="p2p", backend="torch")
    dynamic.load_state_dict(graph_safe.state_dict())
    batches = [_plans(seed, "auto") for seed in (1, 2)]
    cap = max(plan.capacity for _, plan in batches)
    batches = [_plans(seed, cap) for seed in (1, 2)]
    assert batches[0][1].token_indices.tolist() != batches[1][1].token_indices.tolist() or \
        batches[0][1].cu_seqlens.tolist() != batches[1][1].cu_seqlens.tolist()
    tokens_in = torch.zeros(1, cap, dtype=torch.int64)       # the step's static inputs
    positions_in = torch.zeros(1, cap, dtype=torch.int64)
    weight = torch.randn(1, cap, 256, generator=torch.Generator().manual_seed(3))
    params = [p for p in graph_safe.parameters()]
    static = ([tokens_in, positions_in, weight] + params
              + [b for b in graph_safe.buffers()])

    recordings, results = [], []
    for tokens, plan in batches:
        with torch.no_grad():
            tokens_in.copy_(plan.shard(tokens).clamp(min=0).view(1, -1))
            positions_in.copy_(plan.positions.clamp(min=0).view(1, -1))
        rows = static_buffers(plan, cap, torch.device("cpu"))   # refreshed in place
        static.append(rows.table)
        for p in params:
            p.grad = None
        masks = PackedBatch(plan, graph_key_of(plan))
        with DeviceWork(static) as rec:
            logits = graph_safe(tokens_in, positions=positions_in, attention_masks=masks)
            (logits * weight).sum().backward()
        recordings.append(rec)
        results.append([logits] + [p.grad for p in params])   # (as the ops made them)
        # the dynamic mode on the batch's real tokens: the same logits
        n = plan.num_tokens
        dyn_plan = CPPlan.build(plan.cu_seqlens, cp_size=1, cp_rank=0)
        want = dynamic(tokens.view(1, -1), positions=dyn_plan.positions.long().view(1, -1),
                       attention_masks=PackedBatch(dyn_plan))
        real = plan.token_indices[:n] >= 0
        torch.testing.assert_close(logits[0, :n][real], want[0][plan.token_indices[:n][real]],
                                   rtol=1e-4, atol=1e-4)
    first, second = recordings
    assert first.signature() == second.signature()
    assert not first.externs(), first.externs()[:3]
    outs = first.replay()
    for got, want in zip((first.replayed(outs, t) for t in results[0]), results[1]):
        assert torch.equal(got, want.detach())
    assert not torch.equal(results[0][0].detach(), results[1][0].detach())
