"""megatron-core GPT with the varlen_cp core attention: CP=2 vs CP=1 on gloo (CPU).

One launch of 2 processes runs every case: first all CP=1 references (megatron's parallel
state with cp=1; both ranks compute the whole batch), then the same models (same weights)
with CP=2 on the sharded batch; loss and every parameter gradient must match (fp32).
Cases cover causal, SWA (megatron's window_size / window_attn_skip_freq), chunked Llama 4
layers (no_rope_freq), chunked+SWA, every strategy (incl. a per-layer list and auto), the
layouts (balanced by default, te with megatron's own THD RoPE, dual_chunk), THD and sbhd.
THD batches come from ``PrefetchedTHDBatches`` (plan and tables built on its thread); the
forward/backward must then build no plan and no table (every plan cache lookup hits).
The same launch checks the module against megatron's own DotProductAttention (cp=1, sbhd:
an independent reference for the mask semantics), that RoPE routed through the plan equals
megatron's THD RoPE (cp=1), that a layout megatron's RoPE cannot serve is refused when the
model is built, and runs the training entry point.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.dist_utils import run_distributed  # noqa: E402

# Documents: odd lengths, length 1, shorter than 2*cp, one much longer than the rest.
CU_SEQLENS = [0, 7, 8, 11, 60, 73, 96]

BASE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, kv_channels=16, attention_dropout=0.0,
                  hidden_dropout=0.0, normalization="RMSNorm", add_bias_linear=False)

CASES = [
    # name, extra TransformerConfig fields, VarlenCPOptions fields, format
    ("causal_p2p", {}, {"strategy": "p2p", "validate": True}, "thd"),
    ("swa_all_gather", {"window_size": (12, 0), "window_attn_skip_freq": 2},
     {"strategy": "all_gather"}, "thd"),
    ("chunked_a2a", {"no_rope_freq": 2}, {"strategy": "a2a", "chunk_size": 16}, "thd"),
    ("chunked_swa_per_layer", {"window_size": (5, 0)},
     {"strategy": ("a2a+p2p", "p2p"), "chunk_size": 16, "chunk_layers": "all"}, "thd"),
    ("sbhd_causal_p2p", {}, {"strategy": "p2p"}, "sbhd"),
    # megatron's own softmax_type / qk_clip fields: a learnable sink per head (its gradient
    # is compared like every other parameter's) and the recorded max logits
    ("sink_learnable_dispatch", {"softmax_type": "learnable", "qk_clip": True},
     {"strategy": "dispatch"}, "thd"),
    # megatron's own THD RoPE (TE's layout) instead of RoPE positions from the plan
    ("te_megatron_rope_p2p", {"no_rope_freq": 2},
     {"strategy": "p2p", "layout": "te", "chunk_size": 16}, "thd"),
    # balanced with small tiles, so that documents really are cut across the ranks; one
    # GPU per node: the CP group spans two nodes (the plan's topology)
    ("balanced_llama4_dispatch", {"no_rope_freq": 2},
     {"strategy": "dispatch", "chunk_size": 16, "tile_tokens": 8, "gpus_per_node": 1},
     "thd"),
    ("dual_chunk_swa_auto", {"window_size": (12, 0)},
     {"strategy": "auto", "layout": "dual_chunk", "min_chunk_tokens": 4}, "thd"),
    # the graph-safe mode: plans at a capacity per rank, static strategies (the te layout:
    # megatron's padded input with the capacity's padding rows too)
    ("graph_safe_chunked_a2a", {"no_rope_freq": 2},
     {"strategy": "a2a", "chunk_size": 16, "graph_safe": True}, "thd"),
    ("graph_safe_te_dispatch", {},
     {"strategy": "dispatch", "layout": "te", "graph_safe": True}, "thd"),
]
SPEC_KWARGS = {"te_megatron_rope_p2p": {"rope_from_plan": False}}
EXPECTED_MASKS = {  # per case: (causal, window, chunk) of layers 1 and 2
    "graph_safe_chunked_a2a": [(True, (-1, -1), 16), (True, (-1, -1), None)],
    "graph_safe_te_dispatch": [(True, (-1, -1), None)] * 2,
    "causal_p2p": [(True, (-1, -1), None)] * 2,
    "swa_all_gather": [(True, (12, 0), None), (True, (-1, -1), None)],
    "chunked_a2a": [(True, (-1, -1), 16), (True, (-1, -1), None)],
    "chunked_swa_per_layer": [(True, (5, 0), 16)] * 2,
    "sbhd_causal_p2p": [(True, (-1, -1), None)] * 2,
    "sink_learnable_dispatch": [(True, (-1, -1), None)] * 2,
    "te_megatron_rope_p2p": [(True, (-1, -1), 16), (True, (-1, -1), None)],
    "balanced_llama4_dispatch": [(True, (-1, -1), 16), (True, (-1, -1), None)],
    "dual_chunk_swa_auto": [(True, (12, 0), None)] * 2,
}


def _setup_parallel(cp: int) -> None:
    from megatron.core import parallel_state

    from varlen_cp.integrations.megatron.cpu_compat import init_cpu_rng

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    init_cpu_rng(0)


def _build(extra: dict, opts: dict, cp: int, state: dict | None, spec_kwargs=None,
           position_embedding_type: str = "rope"):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from varlen_cp.integrations.megatron import VarlenCPOptions
    from varlen_cp.integrations.megatron.train import build_model

    config = TransformerConfig(**BASE_MODEL, **extra, context_parallel_size=cp,
                               use_cpu_initialization=True)
    torch.manual_seed(7)
    model = build_model(config, VarlenCPOptions(**opts), dict(
        vocab_size=128, max_sequence_length=256,
        position_embedding_type=position_embedding_type),
        {"normalization": "RMSNorm", **(spec_kwargs or {})})
    if state is not None:
        model.load_state_dict(state)
    return model


def _options(model):
    return model.decoder.layers[0].self_attention.core_attention.varlen_options


def _thd_batch():
    import torch

    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    total = CU_SEQLENS[-1]
    gen = torch.Generator().manual_seed(3)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU_SEQLENS, CU_SEQLENS[1:])])
    batch = {"tokens": torch.randint(0, 128, (1, total), generator=gen),
             "labels": torch.randint(0, 128, (1, total), generator=gen),
             "loss_mask": (torch.rand(1, total, generator=gen) > 0.1).float(),
             "position_ids": positions[None]}
    return batch, cu


def _sbhd_batch(cp: int):
    import torch
    from megatron.core.utils import get_batch_on_this_cp_rank

    gen = torch.Generator().manual_seed(5)
    b, s = 2, 32
    batch = {"tokens": torch.randint(0, 128, (b, s), generator=gen),
             "labels": torch.randint(0, 128, (b, s), generator=gen),
             "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).repeat(b, 1)}
    return get_batch_on_this_cp_rank(dict(batch)) if cp > 1 else batch


def _micro_batches(fmt: str, cp: int, model):
    from varlen_cp.integrations.megatron import PrefetchedTHDBatches

    if fmt == "sbhd":
        return [(_sbhd_batch(cp), None)]
    with PrefetchedTHDBatches([_thd_batch()], config=model.config, options=_options(model),
                              device="cpu") as batches:
        return list(batches)


def _run(model, fmt: str, cp: int, misses: list | None = None,
         nodes: set | None = None):
    """Loss and grads of one step; ``misses`` collects the plan cache entries (tables,
    plans) that the step itself had to build, ``nodes`` the plans' topologies' nodes."""
    from varlen_cp.integrations.megatron.train import run_step
    from varlen_cp.plan import CPPlan

    model.zero_grad(set_to_none=True)
    micro_batches = _micro_batches(fmt, cp, model)
    cached, build = CPPlan.__dict__["cached"], CPPlan.__dict__["build"]

    def counting_cached(plan, key, fn):
        if nodes is not None:
            nodes.add(None if plan.topology is None else plan.topology.nodes)
        if key not in plan._cache and misses is not None:
            misses.append(repr(key))
        return cached(plan, key, fn)

    def counting_build(cls, *args, **kwargs):
        if misses is not None:
            misses.append("CPPlan.build")
        return build.__func__(cls, *args, **kwargs)

    CPPlan.cached, CPPlan.build = counting_cached, classmethod(counting_build)
    try:
        loss_sum, count = run_step(model, micro_batches)
    finally:
        CPPlan.cached, CPPlan.build = cached, build
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss_sum / count, grads


def _max_logits(model) -> list | None:
    """Per layer, the max logits recorded by the step (None when not tracked)."""
    out = []
    for layer in model.decoder.layers:
        value = layer.self_attention.core_attention.current_max_attn_logits
        out.append(None if value is None else value.tolist())
    return out if any(v is not None for v in out) else None


def _layer_info(model) -> list:
    out = []
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        m = core.mask
        out.append(((m.causal, m.window_size, m.chunk_size), core.strategy, core.cp_size))
    return out


def _check_against_megatron(rank: int) -> dict:
    """cp=1, sbhd: the plugin spec vs megatron's DotProductAttention (local spec) on the
    same weights, causal and sliding window: an independent check of the mask mapping."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from varlen_cp.integrations.megatron.train import runtime

    diffs = {}
    for name, extra in (("causal", {}), ("swa", {"window_size": (6, 0)})):
        ours = _build(extra, {}, 1, None)
        config = TransformerConfig(**BASE_MODEL, **extra, use_cpu_initialization=True,
                                   masked_softmax_fusion=False)
        with runtime():
            theirs = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                normalization="RMSNorm"), vocab_size=128, max_sequence_length=256,
                position_embedding_type="rope")
        theirs.load_state_dict(ours.state_dict())
        batch = _sbhd_batch(1)
        with runtime():
            a = ours(batch["tokens"], batch["position_ids"], None)
            b = theirs(batch["tokens"], batch["position_ids"], None)
        diffs[name] = float((a - b).abs().max() / b.abs().max())
    return diffs


def _check_clip_qk() -> dict:
    """cp=1: ``clip_qk_step`` drives megatron's own ``Attention.clip_qk`` from the recorded
    max logits: Q and K rows of each query group scaled by sqrt(tau / max) (alpha 0.5),
    V rows untouched, the record reset. Large weights so every head exceeds tau."""
    from varlen_cp.integrations.megatron import clip_qk_step

    model = _build({"qk_clip": True, "qk_clip_threshold": 0.5, "init_method_std": 1.0},
                   {}, 1, None)
    _run(model, "thd", 1)
    attn = model.decoder.layers[0].self_attention
    ml = attn.core_attention.current_max_attn_logits.clone()
    w = attn.linear_qkv.weight.detach().clone().view(2, 4, 16, -1)  # per group: q q k v
    top = clip_qk_step(model)
    eta = (0.5 / ml.view(2, 2).amax(1)).clamp(max=1.0).sqrt().view(2, 1, 1)
    new = attn.linear_qkv.weight.detach().view(2, 4, 16, -1)
    return {"min_max_logit": float(ml.min()), "top": top, "expected_top": float(ml.max()),
            "q_err": float((new[:, :2] - w[:, :2] * eta[:, None]).abs().max()),
            "k_err": float((new[:, 2] - w[:, 2] * eta).abs().max()),
            "v_err": float((new[:, 3] - w[:, 3]).abs().max()),
            "reset": attn.core_attention.current_max_attn_logits is None}


def _check_rope_routing() -> dict:
    """cp=1, THD: RoPE from the plan (VarlenCPSelfAttention) vs megatron's own THD RoPE
    (rope_from_plan=False) on the same weights, and vs no RoPE at all (which must differ:
    proof that the routed RoPE is applied, not dropped)."""
    import torch

    from varlen_cp.integrations.megatron.train import runtime

    extra, opts = {"no_rope_freq": 2}, {"chunk_size": 16}
    routed = _build(extra, opts, 1, None)
    state = routed.state_dict()
    theirs = _build(extra, {**opts, "layout": "te"}, 1, state, {"rope_from_plan": False})
    nope = _build(extra, opts, 1, state, position_embedding_type="none")
    types = [type(m.self_attention).__name__ for m in (routed.decoder.layers[0],
                                                        theirs.decoder.layers[0])]
    logits = []
    for model in (routed, theirs, nope):
        (local, packed), = _micro_batches("thd", 1, model)
        with runtime(), torch.no_grad():
            logits.append(model(local["tokens"], local["position_ids"], None,
                                packed_seq_params=packed))
    scale = float(logits[1].abs().max())
    return {"types": types, "vs_megatron": float((logits[0] - logits[1]).abs().max()) / scale,
            "vs_nope": float((logits[0] - logits[2]).abs().max()) / scale}


def _check_layout_refused() -> str:
    """cp=2: megatron's own THD RoPE (rope_from_plan=False) with a layout it cannot
    serve is refused when the model is built."""
    try:
        _build({}, {"layout": "balanced"}, 2, None, {"rope_from_plan": False})
    except ValueError as e:
        return str(e)
    return ""


def _parity_worker(rank: int, world: int, config_path: str, log_path: str) -> dict:
    import os

    import torch

    # The default gpus_per_node reads LOCAL_WORLD_SIZE (an in-process CPU launch in an
    # earlier test sets it to 1): unset, both ranks share one node of 8.
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    result: dict = {"cases": {}}
    _setup_parallel(1)
    result["megatron_ref"] = _check_against_megatron(rank)
    result["clip_qk"] = _check_clip_qk()
    result["rope_routing"] = _check_rope_routing()
    refs = {}
    for name, extra, opts, fmt in CASES:
        model = _build(extra, opts, 1, None, SPEC_KWARGS.get(name))
        refs[name] = (model.state_dict(), *_run(model, fmt, 1), _max_logits(model))
    _setup_parallel(2)
    result["refused"] = _check_layout_refused()
    for name, extra, opts, fmt in CASES:
        state, ref_loss, ref_grads, ref_max = refs[name]
        model = _build(extra, opts, 2, state, SPEC_KWARGS.get(name))
        misses: list = []
        nodes: set = set()
        loss, grads = _run(model, fmt, 2, misses, nodes)
        result.setdefault("misses", {})[name] = misses
        result.setdefault("nodes", {})[name] = sorted(nodes, key=repr)
        result.setdefault("max_logits", {})[name] = (_max_logits(model), ref_max)
        result.setdefault("grads", {})[name] = {n: float(g.abs().max())
                                                for n, g in grads.items()}
        grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                       for n, g in ref_grads.items())
        result["cases"][name] = {"loss": loss, "ref_loss": ref_loss, "grad_rel_err": grad_err,
                                 "layers": _layer_info(model),
                                 "finite": all(bool(torch.isfinite(g).all())
                                               for g in grads.values())}
    result["train_rc"] = _train_entry_point(config_path, log_path)
    return result


TRAIN_TOML = """
[model]
num_layers = 2
hidden_size = 64
num_attention_heads = 4
num_query_groups = 2
ffn_hidden_size = 96
kv_channels = 16
activation = "swiglu"
normalization = "RMSNorm"
no_rope_freq = 2
attention_dropout = 0.0
hidden_dropout = 0.0
softmax_type = "learnable"
qk_clip = true

[gpt]
vocab_size = 64
max_sequence_length = 128
position_embedding_type = "rope"

[parallel]
context_parallel_size = 2
cp_comm_type = "p2p"

[varlen_cp]
chunk_size = 16

[training]
steps = 2
lr = 1e-3

[data]
seq_len = 96
min_doc_len = 4
alphabet = 64
"""


def _train_entry_point(config_path: str, log_path: str) -> int:
    """The CLI entry point (TOML -> model -> megatron schedule) on a tiny job, CP=2; it
    tears the process groups down itself, so it runs last."""
    from megatron.core import parallel_state

    from varlen_cp.integrations.megatron.train import main

    parallel_state.destroy_model_parallel()
    return main(["--config", config_path, "--log-json", log_path])


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("megatron")
    (tmp / "job.toml").write_text(TRAIN_TOML)
    results = run_distributed(_parity_worker, 2, tmp, str(tmp / "job.toml"),
                              str(tmp / "losses.json"), timeout_s=400.0,
                              collective_timeout_s=120.0)
    for res in results:
        res["log"] = str(tmp / "losses.json")
    return results


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_cp2_matches_cp1(parity, case: str) -> None:
    for rank, res in enumerate(parity):
        r = res["cases"][case]
        assert r["finite"], (case, rank)
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (case, rank, r)
        assert r["grad_rel_err"] < 1e-4, (case, rank, r["grad_rel_err"])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_layers_resolve_masks_and_strategies(parity, case: str) -> None:
    opts = next(c[2] for c in CASES if c[0] == case)
    strategies = opts["strategy"]
    strategies = list(strategies) if isinstance(strategies, tuple) else [strategies] * 2
    for res in parity:
        layers = res["cases"][case]["layers"]
        assert [m for m, _, _ in layers] == EXPECTED_MASKS[case]
        assert [s for _, s, _ in layers] == strategies
        assert all(cp == 2 for _, _, cp in layers)


def test_sink_gets_gradient_and_max_logit_matches_cp1(parity) -> None:
    for res in parity:
        grads = res["grads"]["sink_learnable_dispatch"]
        sinks = [n for n in grads if n.endswith("core_attention.softmax_offset")]
        assert len(sinks) == 2 and all(grads[n] > 0 for n in sinks), grads
        got, ref = res["max_logits"]["sink_learnable_dispatch"]
        assert ref is not None and len(got) == 2 and all(len(h) == 4 for h in got)
        for layer_got, layer_ref in zip(got, ref):
            assert layer_got == pytest.approx(layer_ref, rel=1e-5, abs=1e-5)
        assert res["max_logits"]["causal_p2p"] == (None, None)


def test_plans_carry_the_group_topology(parity) -> None:
    """``gpus_per_node`` reaches every plan of the step as its topology (the CP group's
    global ranks // it); unset, both ranks share a node (LOCAL_WORLD_SIZE unset: 8)."""
    for res in parity:
        assert res["nodes"]["balanced_llama4_dispatch"] == [(0, 1)]
        assert res["nodes"]["causal_p2p"] == [(0, 0)]
        assert res["nodes"]["sbhd_causal_p2p"] == [(0, 0)]   # the sbhd plans too


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] == "thd"
                                  and not c[2].get("validate")])
def test_forward_builds_no_plan_and_no_table(parity, case: str) -> None:
    """PrefetchedTHDBatches built the plan and every table: the step only looks them up."""
    for res in parity:
        assert res["misses"][case] == [], res["misses"][case]


def test_rope_from_plan_equals_megatrons_thd_rope(parity) -> None:
    for res in parity:
        r = res["rope_routing"]
        assert r["types"] == ["VarlenCPSelfAttention", "SelfAttention"], r
        assert r["vs_megatron"] < 1e-5 and r["vs_nope"] > 1e-3, r


def test_megatron_rope_refuses_other_layouts(parity) -> None:
    for res in parity:
        assert "megatron's own THD RoPE" in res["refused"], res["refused"]
        assert "layout='te'" in res["refused"], res["refused"]


def test_clip_qk_step_uses_megatrons_clip(parity) -> None:
    for res in parity:
        r = res["clip_qk"]
        assert r["min_max_logit"] > 0.5 and r["reset"], r
        assert r["top"] == pytest.approx(r["expected_top"]), r
        assert max(r["q_err"], r["k_err"], r["v_err"]) < 1e-5, r


def test_matches_megatron_dot_product_attention(parity) -> None:
    for res in parity:
        for name, rel in res["megatron_ref"].items():
            assert rel < 1e-5, (name, rel)


def test_train_entry_point_cp2(parity) -> None:
    import json
    import math

    assert [res["train_rc"] for res in parity] == [0, 0]
    with open(parity[0]["log"]) as f:
        log = json.load(f)
    assert log["cp"] == 2 and log["world"] == 2
    assert len(log["losses"]) == 2 and all(math.isfinite(x) for x in log["losses"])
    # an untrained model over a 64-token alphabet starts near ln(64)
    assert abs(log["losses"][0] - math.log(64)) < 1.0
    # the plan's figures per logged step (varlen_cp.report), vs plans rebuilt here
    from pathlib import Path

    from varlen_cp import AttnMask
    from varlen_cp.integrations.megatron.config import load_config
    from varlen_cp.integrations.megatron.data import synthetic_batch
    from varlen_cp.integrations.megatron.planning import model_attention
    from varlen_cp.prefetch import build_plan
    from varlen_cp.report import mask_label

    job = load_config(str(Path(parity[0]["log"]).parent / "job.toml"))
    model = model_attention(job.transformer_config(use_cpu_initialization=True), job.options)
    assert [m for m, _ in model.layer_masks] == [AttnMask(chunk_size=16), AttnMask()]
    assert [row["step"] for row in log["varlen_cp"]] == [0, 1]
    for step, row in enumerate(log["varlen_cp"]):
        cu = synthetic_batch(job.data, step, 0)[1]
        plan = build_plan(cu, job.options, cp_size=2, cp_rank=0,
                          layer_masks=model.layer_masks)
        assert row["varlen_cp/token_imbalance"] == plan.token_imbalance()
        for mask, _ in model.layer_masks:
            key = mask_label(mask)
            assert row[f"varlen_cp/work_imbalance/{key}"] == plan.work_imbalance(mask), key
            assert row[f"varlen_cp/fa_work_share/{key}"] == 0.0   # CPU: no FA backend
        assert row["varlen_cp/plan_ms"] > 0
