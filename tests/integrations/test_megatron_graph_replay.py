"""megatron's own CUDA graphs (``cuda_graph_impl = "local"``: one graph per
TransformerLayer) over varlen-cp's graph-safe layers, checked on the CPU at CP=2.

megatron-core 0.16.1 replays a layer's graph only when the call's arguments equal the
captured call's (``_CudaGraphRunner.get_mismatch_errors``: tensors by shape, dtype and
device, other values and dataclass fields by value) and then copies each tensor argument
(top-level tensor fields of dataclasses included) into the graph's input buffers. Two
batches of other documents, at one ``graph_capacity``:

- every TransformerLayer call of the graph-safe model passes megatron's own check against
  the other batch's call (the dynamic model's calls fail it: their packed params carry the
  batch's plan);
- the first layer's forward and backward, recorded for each batch right after its
  sharding (which rewrites the graph-safe buffers in place), with its tensor arguments in
  fixed input buffers refreshed in place as megatron's replay does, issue the identical
  device work on the identical storages with no tensor from outside
  (``tests.helpers.replay.DeviceWork``, the CPU stand-in of a graph), and re-running batch
  A's recording after batch B was written in gives batch B's output and gradients exactly (``p2p``; ``dispatch``, whose send lists and
  received keys are buffers of their own, in the full run);
- the graph-safe model's logits equal the dynamic model's on every real token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.helpers.lanes import fast_first  # noqa: E402

CAPACITY = 64
BATCHES = ([30, 7, 27, 1, 31], [5, 50, 11, 30])   # 96 tokens each, other documents
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=96, kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0,
            normalization="RMSNorm", add_bias_linear=False, no_rope_freq=2)


def _batch(lengths: list[int], seed: int):
    import torch

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {"tokens": torch.randint(0, 128, (1, total), generator=g),
            "labels": torch.randint(0, 128, (1, total), generator=g),
            "loss_mask": torch.ones(1, total), "position_ids": positions[None]}, cu


def _model(options, state=None):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from varlen_cp.integrations.megatron.train import build_model

    config = TransformerConfig(**BASE, context_parallel_size=2, use_cpu_initialization=True)
    torch.manual_seed(7)
    model = build_model(config, options, dict(vocab_size=128, max_sequence_length=256,
                                              position_embedding_type="rope"),
                        {"normalization": "RMSNorm"})
    if state is not None:
        model.load_state_dict(state)
    return model


def _layer_calls(model, local, packed):
    """The logits and every TransformerLayer call's (args, kwargs), as megatron's
    CudaGraphManager receives them."""
    import torch

    from varlen_cp.integrations.megatron.train import runtime

    calls = []
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append((args, dict(kwargs))), with_kwargs=True)
        for layer in model.decoder.layers]
    try:
        with runtime(), torch.no_grad():
            logits = model(local["tokens"], local["position_ids"], None,
                           packed_seq_params=packed)
    finally:
        for h in hooks:
            h.remove()
    return logits, calls


def _mismatches(captured, call) -> list[str]:
    """megatron's own argument check of ``call`` against the ``captured`` call (the metas a
    ``_CudaGraphRunner`` keeps of the call it was made for); an argument type it does not
    support is its assert."""
    from types import SimpleNamespace

    from megatron.core.transformer.cuda_graphs import ArgMetadata, _CudaGraphRunner

    args, kwargs = captured
    runner = SimpleNamespace(
        fwd_graph_input_arg_metas=[ArgMetadata(a) for a in args],
        fwd_graph_input_kwarg_metas={k: ArgMetadata(a) for k, a in kwargs.items()})
    try:
        return _CudaGraphRunner.get_mismatch_errors(runner, *call)
    except AssertionError as e:
        return [f"assert: {e}"]


def _by_token(plan, logits):
    """{global token: logits row} of this rank's real tokens."""
    idx = plan.token_indices[:plan.num_tokens].tolist()
    return {t: logits[0, i] for i, t in enumerate(idx) if t >= 0}


class _LayerSteps:
    """Layer 1's forward and backward, recorded for each batch right after its sharding,
    with its tensor arguments in fixed buffers written in place (megatron's replay copies
    them so) and the graph-safe buffers as the sharding left them."""

    def __init__(self, model, first_packed, first_kwargs) -> None:
        import torch

        from varlen_cp.integrations.megatron.sharding import plan_of
        from varlen_cp.strategies.static import static_buffers
        from varlen_cp.strategies.static.buffers import dispatch_buffers

        self.layer = model.decoder.layers[0]
        self.hidden_in = torch.zeros(CAPACITY, 1, BASE["hidden_size"], requires_grad=True)
        self.positions_in = torch.zeros(CAPACITY, dtype=torch.int64)
        self.table_in = first_kwargs["rotary_pos_emb"].clone()
        self.weight = torch.randn(CAPACITY, 1, BASE["hidden_size"],
                                  generator=torch.Generator().manual_seed(5))
        self.params = list(self.layer.parameters())
        plan, cpu = plan_of(first_packed.varlen_cp_plan), torch.device("cpu")
        self.rows = static_buffers(plan, CAPACITY, cpu).table
        buffers = [self.rows]
        core = self.layer.self_attention.core_attention
        if core.strategy == "dispatch":
            sent = dispatch_buffers(plan, core.mask, CAPACITY, CAPACITY, cpu)
            buffers += [sent.send, sent.recv]
        self.static = ([self.hidden_in, self.positions_in, self.table_in, self.weight]
                       + buffers + self.params)
        self.recordings, self.results, self.rows_seen = [], [], []

    def record(self, packed, kwargs) -> None:
        import dataclasses

        import torch

        from tests.helpers.replay import DeviceWork

        with torch.no_grad():
            self.hidden_in.copy_(torch.randn(self.hidden_in.shape, generator=torch.Generator()
                                             .manual_seed(len(self.recordings))))
            self.positions_in.copy_(packed.varlen_cp_positions)
            self.table_in.copy_(kwargs["rotary_pos_emb"])
        kw = dict(kwargs, rotary_pos_emb=self.table_in, packed_seq_params=dataclasses.replace(
            packed, varlen_cp_positions=self.positions_in))
        kw.pop("hidden_states", None)
        self.hidden_in.grad = None
        for p in self.params:
            p.grad = None
        self.rows_seen.append(self.rows.clone())
        with DeviceWork(self.static) as rec:
            out = self.layer(self.hidden_in, **kw)[0]
            (out * self.weight).sum().backward()
        self.recordings.append(rec)
        self.results.append([out, self.hidden_in.grad] + [p.grad for p in self.params])

    def summary(self) -> dict:
        import torch

        first, second = self.recordings
        outs = first.replay()   # on the buffers as batch B left them
        replayed = [first.replayed(outs, t) for t in self.results[0]]
        return {"same_work": first.signature() == second.signature(),
                "externs": [str(e) for e in first.externs()[:3]],
                "replay_equal": all(torch.equal(got, want.detach())
                                    for got, want in zip(replayed, self.results[1])),
                "rows_refreshed": not torch.equal(*self.rows_seen),
                "batches_differ": not torch.equal(self.results[0][0].detach(),
                                                  self.results[1][0].detach())}


def _worker(rank: int, world: int, strategy: str) -> dict:
    import torch
    from megatron.core import parallel_state

    from varlen_cp.integrations.megatron import (VarlenCPOptions,
                                                 get_thd_batch_on_this_cp_rank)
    from varlen_cp.integrations.megatron.cpu_compat import init_cpu_rng
    from varlen_cp.integrations.megatron.sharding import plan_of
    from varlen_cp.strategies.static import static_buffers
    from varlen_cp.tables.static_rows import static_rows

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    init_cpu_rng(0)
    common = dict(strategy=strategy, chunk_size=16, backend="torch")
    graph_opts = VarlenCPOptions(**common, graph_safe=True, graph_capacity=CAPACITY)
    dyn_opts = VarlenCPOptions(**common)
    graph_safe = _model(graph_opts)
    dynamic = _model(dyn_opts, graph_safe.state_dict())
    out: dict = {"graph": [], "dynamic": [], "logit_err": [], "tokens": [], "refreshed": []}
    steps, rows = None, None
    for seed, lengths in enumerate(BATCHES):
        batch, cu = _batch(lengths, seed)
        local, packed = get_thd_batch_on_this_cp_rank(batch, cu, options=graph_opts,
                                                      config=graph_safe.config)
        # the sharding rewrote the buffers: no layer (captured by megatron) copies a table
        plan = plan_of(packed.varlen_cp_plan)
        if rows is None:
            rows = static_buffers(plan, CAPACITY, torch.device("cpu")).table
        out["refreshed"].append(torch.equal(
            rows, torch.from_numpy(static_rows(plan, CAPACITY))))
        logits, calls = _layer_calls(graph_safe, local, packed)
        out["graph"].append(calls)
        if steps is None:
            steps = _LayerSteps(graph_safe, packed, calls[0][1])
        steps.record(packed, calls[0][1])
        got = _by_token(plan, logits)
        d_local, d_packed = get_thd_batch_on_this_cp_rank(batch, cu, options=dyn_opts,
                                                          config=dynamic.config)
        d_logits, d_calls = _layer_calls(dynamic, d_local, d_packed)
        out["dynamic"].append(d_calls)
        want = _by_token(d_packed.varlen_cp_plan, d_logits)
        out["tokens"].append((sorted(got), sorted(want)))
        out["logit_err"].append(max(float((got[t] - want[t]).abs().max()) for t in want))
    result = {
        "graph_mismatch": [_mismatches(a, b) for a, b in zip(*out["graph"])],
        "dynamic_mismatch": [_mismatches(a, b) for a, b in zip(*out["dynamic"])],
        "layers": len(out["graph"][0]),
        "logit_err": out["logit_err"], "tokens": out["tokens"],
        "refreshed": out["refreshed"],
        "replay": steps.summary(),
    }
    parallel_state.destroy_model_parallel()
    return result


@pytest.fixture(scope="module", params=fast_first(["p2p", "dispatch"]))
def graphs(request, tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, 2, tmp_path_factory.mktemp("megatron_graphs"),
                           request.param, timeout_s=300.0, collective_timeout_s=120.0)


def test_layer_calls_pass_megatrons_replay_check(graphs) -> None:
    for res in graphs:
        assert res["layers"] == BASE["num_layers"]
        assert res["graph_mismatch"] == [[]] * BASE["num_layers"], res["graph_mismatch"]
        # the dynamic packed params carry the plan: megatron refuses to replay them
        assert all(res["dynamic_mismatch"]), res["dynamic_mismatch"]


def test_layer_replays_another_batch(graphs) -> None:
    for res in graphs:
        assert res["refreshed"] == [True] * len(BATCHES)
        r = res["replay"]
        assert r["same_work"] and not r["externs"], r
        assert r["replay_equal"] and r["batches_differ"] and r["rows_refreshed"], r


def test_graph_safe_logits_equal_dynamic(graphs) -> None:
    for res in graphs:
        for got, want in res["tokens"]:
            assert got == want and got
        assert max(res["logit_err"]) < 1e-4, res["logit_err"]
