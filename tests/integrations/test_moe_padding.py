"""Padding never reaches torchtitan's MoE layers: CP=2 trains exactly like CP=1 on ``te``.

The ``te`` layout pads each document to a multiple of 2*cp, so CP=1 and CP=2 pad the same
batch differently. Before the fix the padding was routed like real tokens and counted in
``tokens_per_expert_E``, which moves ``expert_bias_E`` after every step (torchtitan's
auxiliary-loss-free load balancing): the biases, then the routing, then the losses of CP=2
drifted from CP=1.

- In process, cp=1: on a ``te`` plan (with padding) every MoE layer of gpt_oss, an all-MoE
  deepseek_v3 and the Llama 4 style model with experts counts exactly what the same batch
  without padding counts (top_k x real tokens), gives padding rows a zero MoE output, and
  the logits of the real tokens are those of the unpadded batch.
- Training through the real trainer (gloo, fp32, 8 steps, many short documents): CP=2 on
  ``te`` (a2a, as in the issue) and on the other layouts matches CP=1 on ``te``: losses
  (relative 1e-5), grad norms (1e-4), every ``expert_bias_E`` (exactly) and the tokens seen.
  ``load_balance_coeff`` is 1e-2 (torchtitan's default is 1e-3) so that 8 steps of a tiny
  model show the drift in the losses too: before the fix CP=2 was 2e-5 (deepseek_v3, Llama 4
  style) to 7e-3 (gpt_oss) away and the biases up to 1.75e-2 apart.
Run time: 50-65 s on 2 shared cores (two launches at once, mostly process start-up).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

from tests.dist_utils import launch_concurrently, run_distributed  # noqa: E402
from tests.helpers.torchtitan_models import DIM, MAX_LEN, VOCAB, packed_documents  # noqa: E402

STEPS = 8
LOAD_BALANCE_COEFF = 1e-2
LLAMA4 = dict(dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden_dim=128,
              num_experts=4, top_k=2, moe_hidden_dim=32, attention_chunk_size=32,
              nope_layer_interval=2, max_seq_len=512, load_balance_coeff=LOAD_BALANCE_COEFF)
MODELS = ("gpt_oss", "deepseek_v3", "llama4_style")


def tiny_moe_config(name: str):
    """The tiny model ``name`` with MoE layers whose load balancing moves 1e-2 a step."""
    from torchtitan.models.common.moe import MoE

    if name == "llama4_style":
        from varlen_cp import AttnOptions
        from varlen_cp.integrations.torchtitan.model import Llama4Args, build_llama4_config

        return build_llama4_config(Llama4Args(**LLAMA4), AttnOptions(strategy="a2a"))
    if name == "deepseek_v3":
        # The debug flavor's router (8 experts, top 3, one shared expert) on both layers.
        from torchtitan.models import deepseek_v3 as m
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

        config = DeepSeekV3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=m._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=m._output_linear_init(DIM)),
            layers=m._build_dsv3_layers(
                n_layers=2, n_dense_layers=0, dim=DIM, n_heads=4, q_lora_rank=0,
                kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
                mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=8,
                num_shared_experts=1, router_top_k=3, router_score_func="softmax",
                attn_backend="varlen", moe_comm_backend="standard",
                non_blocking_capacity_factor=None,
                rope=ComplexRoPE.Config(dim=8, max_seq_len=MAX_LEN, theta=10000.0,
                                        scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                                        beta_slow=1.0, original_seq_len=4096)))
    else:
        from tests.helpers.torchtitan_models import tiny_model_config

        config = tiny_model_config(name)
    for _, moe, _, _ in config.traverse(MoE.Config):
        moe.load_balance_coeff = LOAD_BALANCE_COEFF
    return config


# ------------------------------------------------------------------------ in process, cp=1
def _moe_layers(model) -> dict:
    from torchtitan.models.common.moe import MoE

    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_padding_is_not_routed(name):
    from tests.helpers.torchtitan_models import fp32, model_spec, with_varlen_cp
    from varlen_cp.integrations.torchtitan.attention import PackedBatch
    from varlen_cp.integrations.torchtitan.moe import feed_real_rows, padding_free_moe_for
    from varlen_cp.integrations.torchtitan.trainer import packed_cu_seqlens
    from varlen_cp.plan import CPPlan, layout_spec

    config = tiny_moe_config(name)
    if name != "llama4_style":
        config = with_varlen_cp(config, backend="torch")
    config = fp32(config)  # routed experts in fp32, as the trainer runs them on CPU
    holder = model_spec(config)
    padding_free_moe_for(holder)  # what the trainer does to every model's MoE configs
    torch.manual_seed(0)
    model = holder.model.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    assert feed_real_rows(model) == len(_moe_layers(model)) == 2
    model.train()

    rows, length = 2, 96
    tokens, positions = packed_documents(rows, length, seed=4, max_doc_len=12)
    cu = packed_cu_seqlens(positions, (rows, length))
    flat = tokens.reshape(1, -1)

    def run(layout: str, **kwargs):
        plan = CPPlan.build(cu, cp_size=1, cp_rank=0, layout=layout_spec(layout, **kwargs))
        outputs = {}
        hooks = [m.register_forward_hook(lambda mod, args, out, key=key: outputs.update(
            {key: out.detach()})) for key, m in _moe_layers(model).items()]
        try:
            logits = model(plan.shard(flat, dim=1), attention_masks=PackedBatch(plan),
                           positions=plan.positions.clamp(min=0).long()[None])
        finally:
            for h in hooks:
                h.remove()
        counts = {}
        for key, m in _moe_layers(model).items():
            counts[key] = m.tokens_per_expert_E.clone()
            m.tokens_per_expert_E.zero_()
        return plan, logits.detach(), counts, outputs

    padded, logits_p, counts_p, moe_out_p = run("te", pad_multiple=8)  # much padding
    plain, logits, counts, _ = run("contiguous")
    n_real = rows * length
    pad = padded.token_indices < 0
    assert plain.num_real_tokens == plain.num_tokens == n_real
    assert padded.num_real_tokens == n_real and int(pad.sum()) > n_real // 4
    top_k = {"gpt_oss": 2, "deepseek_v3": 3, "llama4_style": 2}[name]
    for key, count in counts_p.items():
        assert int(count.sum()) == top_k * n_real, (key, count)
        assert torch.equal(count, counts[key]), (key, count, counts[key])
        assert torch.all(moe_out_p[key][0, pad] == 0), key
    real = padded.token_indices[~pad]
    torch.testing.assert_close(logits_p[0, ~pad], logits[0, real], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ training CP=2
TOML = """
[training]
local_batch_size = 2
seq_len = 128
max_norm = 1.0
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
[dataloader]
min_doc_len = 3
max_doc_len = 20
doc_len_alpha = 1.1
alphabet = 128
[varlen_cp]
layout = "te"
strategy = "a2a"
[metrics]
log_freq = 1
[debug]
seed = 7
deterministic = true
"""
CP2 = ["--parallelism.context_parallel_degree", "2"]
LAUNCHES = {  # name: (processes, {case: (model, overrides)}); both launched at once
    "cp1": (1, {m: (m, []) for m in MODELS}),
    "cp2": (2, {
        **{f"{m}/te/a2a": (m, CP2) for m in MODELS},
        "gpt_oss/balanced/dispatch": ("gpt_oss", [*CP2, "--varlen_cp.layout", "balanced",
                                                  "--varlen_cp.strategy", "dispatch"]),
        "deepseek_v3/dual_chunk/p2p": ("deepseek_v3", [*CP2, "--varlen_cp.layout", "dual_chunk",
                                                       "--varlen_cp.strategy", "p2p"]),
        # compiled blocks: the real rows' count changes per batch (and some batches may need
        # no padding on a rank): still one set of graphs, made at step 1
        "gpt_oss/te/a2a/compiled": ("gpt_oss", [*CP2, "--compile.enable", "true",
                                                "--compile.backend", "aot_eager"]),
    }),
}
CP2_CASES = sorted(LAUNCHES["cp2"][1])


def train_worker(rank: int, world: int, cases: dict, tmp: str) -> dict:
    """Train each case for ``STEPS`` steps with the real trainer; every rank returns the
    tokens it counted as seen, rank 0 also the logged losses and every expert bias."""
    from tests.helpers.torchtitan_models import run_train_steps, start_torchtitan_worker

    toml = start_torchtitan_worker(rank, world, tmp, TOML)  # before torchtitan imports
    from varlen_cp.integrations.torchtitan.config import load_config

    out: dict = {}
    for name, (model, overrides) in cases.items():
        loss_file = Path(tmp) / f"{name.replace('/', '_')}.jsonl"
        args = ["--config", str(toml), "--training.steps", str(STEPS), "--metrics.loss_file",
                str(loss_file), "--job.dump_folder", str(Path(tmp) / "dump"), *overrides]
        if model == "llama4_style":
            args += [a for k, v in LLAMA4.items() for a in (f"--model.{k}", str(v))]
        else:
            args += ["--model.name", model]
        config = load_config(args, cpu=True)
        if model != "llama4_style":
            config.model_spec.model = tiny_moe_config(model)
        trainer = config.build()
        run_train_steps(trainer, STEPS)
        out[f"{name}:tokens_seen"] = trainer.ntokens_seen
        if rank == 0:
            out[name] = [json.loads(line) for line in loss_file.read_text().splitlines()]
            out[f"{name}:bias"] = {n: b.tolist() for n, b in
                                   trainer.model_parts[0].named_buffers()
                                   if n.endswith("expert_bias_E")}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Both launches at the same time; per launch, every rank's results."""
    tmp = tmp_path_factory.mktemp("moe_padding")

    def launch(name: str):
        world, cases = LAUNCHES[name]
        (tmp / name).mkdir()
        return run_distributed(train_worker, world, tmp / name, cases, str(tmp / name),
                               timeout_s=560, collective_timeout_s=300)

    return launch_concurrently({name: (lambda n=name: launch(n)) for name in LAUNCHES})


@pytest.mark.slow
@pytest.mark.parametrize("case", CP2_CASES)
def test_cp2_matches_cp1_on_every_layout(trained, case):
    model = LAUNCHES["cp2"][1][case][0]
    ref, got = trained["cp1"][0][model], trained["cp2"][0][case]
    assert [r["step"] for r in ref] == [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (case, ref, got)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (case, ref, got)
    # the load balancing saw the same token counts at every step
    ref_bias, bias = trained["cp1"][0][f"{model}:bias"], trained["cp2"][0][f"{case}:bias"]
    assert len(ref_bias) == 2 and ref_bias == bias, (case, ref_bias, bias)
    assert any(v != 0 for values in bias.values() for v in values)  # balancing did move
    if case.endswith("/compiled"):
        assert all(r["graph_breaks"] == 0 for r in got), got
        assert {r["compiled_graphs"] for r in got} == {got[0]["compiled_graphs"]}, got
    # tokens seen: real tokens only, summed over the CP ranks
    seen = sum(rank[f"{case}:tokens_seen"] for rank in trained["cp2"])
    assert seen == trained["cp1"][0][f"{model}:tokens_seen"] == STEPS * 2 * 128


def test_every_moe_of_the_debug_flavors_is_padding_free():
    """The swap reaches every MoE config of torchtitan's MoE flavors (their own subclasses,
    e.g. gpt_oss's, kept as the parent), once; parameter and buffer names are unchanged."""
    from torchtitan.models.common.moe import MoE

    from tests.helpers.torchtitan_models import model_spec
    from varlen_cp.integrations.torchtitan.moe import padding_free_moe_for
    from varlen_cp.integrations.torchtitan.stock import stock_model_spec

    for name, flavor, n_moe in (("gpt_oss", "debugmodel", 4), ("deepseek_v3", "debugmodel", 5),
                                ("qwen3", "debugmodel_moe", 8)):
        spec = stock_model_spec(name, flavor)
        before = [type(cfg) for _, cfg, _, _ in spec.model.traverse(MoE.Config)]
        assert padding_free_moe_for(spec) == n_moe, name
        assert padding_free_moe_for(spec) == 0, name  # idempotent
        after = [type(cfg) for _, cfg, _, _ in spec.model.traverse(MoE.Config)]
        assert [issubclass(a, b) and a._owner.padding_free for a, b in zip(after, before)] \
            == [True] * n_moe, name
    tiny = tiny_moe_config("gpt_oss")
    plain = tiny.layers[0].moe.build()
    padding_free_moe_for(model_spec(tiny))
    ours = tiny.layers[0].moe.build()
    assert type(ours).__name__ == "PaddingFreeGptOssMoE"
    assert list(ours.state_dict()) == list(plain.state_dict())
