"""torchtitan's own models (llama3, qwen3, gpt_oss, deepseek_v3) with varlen-cp attention.

- Structure: the swap reaches every layer with the layer's own mask (gpt_oss: window 128 on
  its sliding layers), the model's attention shape (DeepSeek MLA: q/k 192, v 128), the
  "no varlen with CP" refusal passes only for varlen-cp's attention, and gpt_oss's sinks
  keep their name and shape.
- CP=1, in process: on the same packed batch (2 rows of documents) the model with
  varlen-cp's attention gives torchtitan's own FlexAttention logits (its varlen path needs
  CUDA; Flex has no CPU backward), and the logits and every parameter gradient of a dense
  reference attention (tests/reference.py), for each model scaled down for CPU
  (tests/helpers/torchtitan_models.py).
- Training: CP=2 (gloo, 2 processes) and CP=1 give the same losses and grad norms (relative
  1e-4, fp32, 3 steps) for p2p, dispatch and a2a (and dispatch on the balanced layout, which
  balances gpt_oss's window and global layers at once), through the real trainer
  (prefetched plans, sharding, FSDP over CP); FSDP x CP (4 processes) matches FSDP (qwen3).
  One launch per parallelism runs its cases one after the other; the launches run at once.
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
from tests.helpers.torchtitan_models import (WINDOW, fp32, packed_documents,  # noqa: E402
                                             run_train_steps, start_torchtitan_worker,
                                             tiny_model_config, with_varlen_cp)

MODELS = ("llama3", "qwen3", "gpt_oss", "deepseek_v3")


# ------------------------------------------------------------------------ structure
def test_stock_debug_flavors_masks_and_shapes():
    """The real debug flavors: each layer's mask from the model config, the shape the plan
    is prepared for, and nothing but varlen-cp attention left."""
    from varlen_cp import AttnMask
    from varlen_cp.integrations.torchtitan.stock import (attention_layers, attention_shape,
                                                         layer_masks, stock_model_spec)

    expect = {
        "llama3": ([(AttnMask(causal=True), 6)], (16, 16, 16, 16)),
        "qwen3": ([(AttnMask(causal=True), 8)], (16, 8, 128, 128)),
        # torchtitan's window 128 = the query and the 127 keys before it
        "gpt_oss": ([(AttnMask(causal=True, window_size=(127, 0)), 2),
                     (AttnMask(causal=True), 2)], (64, 8, 64, 64)),
        "deepseek_v3": ([(AttnMask(causal=True), 6)], (16, 16, 192, 128)),
    }
    for name, (masks, shape) in expect.items():
        model = with_varlen_cp(stock_model_spec(name, "debugmodel").model, strategy="dispatch")
        layers = attention_layers(model)
        assert layer_masks(layers) == masks, name
        s = attention_shape(layers, tp=1, dtype="bfloat16")
        assert (s.n_heads, s.n_kv_heads, s.head_dim, s.value_dim) == shape, name
        assert s.dtype == torch.bfloat16
        if name == "gpt_oss":
            assert [layer.mask.window_size[0] for layer in layers] == [127, -1, 127, -1]
        assert all(a.inner_attention.options.strategy == "dispatch"
                   for a in (layer_cfg.attention for layer_cfg in model.layers))


def test_cp_refusal_bypassed_only_for_varlen_cp():
    """llama3 refuses varlen attention with CP in its own update_from_config; after the
    swap the same check passes, and the attention keeps K/V sequence-sharded on CP."""
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig

    from varlen_cp.integrations.torchtitan.attention import VarlenCPInnerAttention

    cfg = SimpleNamespace(parallelism=ParallelismConfig(context_parallel_degree=2))
    with pytest.raises(NotImplementedError, match="Varlen attention is not supported"):
        tiny_model_config("llama3").update_from_config(config=cfg)
    model = with_varlen_cp(tiny_model_config("llama3"))
    model.update_from_config(config=cfg)  # sets torchtitan's (K/V all-gather) sharding
    inner = model.layers[0].attention.inner_attention.build()
    assert isinstance(inner, VarlenCPInnerAttention)
    kv = inner._sharding_config.in_dst_shardings["k_BLNH"]
    assert str(kv) == str(inner._sharding_config.in_src_shardings["k_BLNH"])  # no gather


# ------------------------------------------------------------------------ CP=1 parity
def _reference_inner(attn_cfg):
    """A dense reference inner attention (tests/reference.py) for one layer's mask."""
    from dataclasses import dataclass

    from torchtitan.protocols.module import Module

    from tests.reference import reference_attn

    class DenseReference(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            mask: object

        def __init__(self, config):
            super().__init__()
            self.mask = config.mask

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None,
                    out_transform=None, **_):
            plan = attention_masks.plan
            m = self.mask
            out, lse = reference_attn(q_BLNH[0], k_BLNH[0], v_BLNH[0], plan.cu_seqlens,
                                      plan.cu_seqlens, softmax_scale=scale, causal=m.causal,
                                      window_size=m.window_size, chunk_size=m.chunk_size,
                                      dtype=torch.float32)
            out = out.unsqueeze(0)
            if out_transform is not None:  # gpt_oss: torchtitan's own sink rescale
                out = out_transform(out, lse.transpose(0, 1).unsqueeze(0))
            return out

    return DenseReference.Config(mask=attn_cfg.inner_attention.mask())


@pytest.mark.parametrize("name", MODELS)
def test_cp1_matches_torchtitan_attention(name, monkeypatch):
    import torchtitan.models.common.attention as tt_attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from varlen_cp.integrations.torchtitan.attention import PackedBatch
    from varlen_cp.integrations.torchtitan.trainer import packed_cu_seqlens
    from varlen_cp.plan import CPPlan

    # torchtitan compiles flex and its masks; eager is the same math and needs no compiler.
    monkeypatch.setattr(tt_attention.FlexAttention, "_compiled_flex_attn", flex_attention)
    monkeypatch.setattr(tt_attention, "_compiled_create_block_mask", create_block_mask)

    def build(config):
        torch.manual_seed(0)
        model = config.build()
        model.init_weights(buffer_device=torch.device("cpu"))
        return model

    flex = build(fp32(tiny_model_config(name, "flex")))
    ours = build(fp32(with_varlen_cp(tiny_model_config(name), backend="torch")))
    ref_cfg = fp32(with_varlen_cp(tiny_model_config(name)))
    for layer in ref_cfg.layers:
        layer.attention.inner_attention = _reference_inner(layer.attention)
    ref = build(ref_cfg)
    # Same parameter names and shapes (gpt_oss's sinks included): checkpoints load both ways.
    ours.load_state_dict(flex.state_dict(), strict=True)
    flex.load_state_dict(ours.state_dict(), strict=True)
    ref.load_state_dict(flex.state_dict(), strict=True)

    rows, length = 2, 128
    tokens, positions = packed_documents(rows, length, seed=1, max_doc_len=59)
    with torch.no_grad():
        want = flex(tokens, positions=positions,
                    attention_masks=flex.get_attention_masks(positions))
    plan = CPPlan.build(packed_cu_seqlens(positions, (rows, length)), cp_size=1, cp_rank=0)
    batch = {"tokens": tokens.reshape(1, -1), "positions": plan.positions.long()[None],
             "attention_masks": PackedBatch(plan)}
    assert torch.equal(plan.token_indices, torch.arange(rows * length))  # cp=1: in order
    got = ours(**batch)
    torch.testing.assert_close(got.reshape(rows, length, -1), want, rtol=1e-4, atol=1e-4)

    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    (got * weight).sum().backward()
    ref_out = ref(**batch)
    (ref_out * weight).sum().backward()
    torch.testing.assert_close(got, ref_out, rtol=1e-4, atol=1e-4)
    ref_grads = dict(ref.named_parameters())
    for pname, p in ours.named_parameters():
        g_ref = ref_grads[pname].grad
        assert (p.grad is None) == (g_ref is None), pname
        if p.grad is not None:
            torch.testing.assert_close(p.grad, g_ref, rtol=1e-3, atol=2e-5, msg=pname)
    if name == "gpt_oss":  # the sinks are trained through varlen-cp's learnable sink
        sinks = [p.grad for n, p in ours.named_parameters() if n.endswith("attention.sinks")]
        assert len(sinks) == 2 and all(g.abs().sum() > 0 for g in sinks)


# ------------------------------------------------------------------------ training CP=2
TOML = """
[training]
local_batch_size = 2
seq_len = 128
steps = 3
max_norm = 1.0
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
[dataloader]
min_doc_len = 8
doc_len_alpha = 1.1
alphabet = 128
[metrics]
log_freq = 1
[debug]
seed = 7
deterministic = true
"""
STEPS = 3
CP2 = ["--parallelism.context_parallel_degree", "2"]
CASES = {  # name: (model, overrides), at CP=2 on 2 processes
    **{f"{m}/{s}": (m, [*CP2, "--varlen_cp.strategy", s])
       for m in MODELS for s in ("p2p", "dispatch", "a2a")},
    "gpt_oss/dispatch/balanced": ("gpt_oss", [*CP2, "--varlen_cp.strategy", "dispatch",
                                              "--varlen_cp.layout", "balanced"]),
}
FSDP = ["--parallelism.data_parallel_shard_degree", "2"]
LAUNCHES = {  # name: (processes, cases); all launched at once
    "cp1": (1, {m: (m, []) for m in MODELS}),
    "cp2": (2, CASES),
    # FSDP x CP: FSDP over 2 data-parallel ranks (each its own batch), without and with
    # CP=2 (4 processes, te layout with its padding)
    "fsdp": (2, {"qwen3/fsdp": ("qwen3", FSDP)}),
    "fsdp_cp2": (4, {"qwen3/fsdp": ("qwen3", [*FSDP, *CP2, "--varlen_cp.layout", "te"])}),
}


def train_worker(rank: int, world: int, cases: dict, tmp: str) -> dict:
    """Train each case with the real trainer (``train_step``, as ``Trainer.train`` calls
    it, minus checkpointing and the final 2 s sleep) on a tiny model; rank 0 returns each
    case's logged {loss, grad_norm} per step."""
    toml = start_torchtitan_worker(rank, world, tmp, TOML)  # before torchtitan imports
    from varlen_cp.integrations.torchtitan.config import load_config

    out = {}
    for name, (model, overrides) in cases.items():
        loss_file = Path(tmp) / f"{name.replace('/', '_')}.jsonl"
        config = load_config(["--config", str(toml), "--model.name", model,
                              "--metrics.loss_file", str(loss_file),
                              "--job.dump_folder", str(Path(tmp) / "dump"), *overrides],
                             cpu=True)
        config.model_spec.model = tiny_model_config(model)
        trainer = config.build()
        run_train_steps(trainer, STEPS)
        if rank == 0:
            out[name] = [json.loads(line) for line in loss_file.read_text().splitlines()]
            # what the plans were built for: the model's masks, balanced by "balanced"
            plan = trainer.make_plan(*trainer.dataloader.batch(0))
            out[f"{name}:masks"] = (repr(trainer.layer_masks),
                                    repr(getattr(plan.layout_spec, "masks", ())))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every launch at the same time (mostly process start-up and imports); the losses
    of each case, by launch."""
    tmp = tmp_path_factory.mktemp("stock_train")

    def launch(name: str):
        world, cases = LAUNCHES[name]
        (tmp / name).mkdir()
        return run_distributed(train_worker, world, tmp / name, cases, str(tmp / name),
                               timeout_s=480, collective_timeout_s=300)[0]

    return launch_concurrently({name: (lambda n=name: launch(n)) for name in LAUNCHES})


def assert_same(ref: list[dict], rows: list[dict], what: str) -> None:
    assert [r["step"] for r in ref] == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for a, b in zip(ref, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (what, ref, rows)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (what, ref, rows)
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in rows)


@pytest.mark.slow  # the trained fixture: every CP=2 / CP=1 / FSDP launch
@pytest.mark.parametrize("case", sorted(CASES))
def test_cp2_matches_cp1(trained, case):
    assert_same(trained["cp1"][CASES[case][0]], trained["cp2"][case], case)


@pytest.mark.slow
def test_plans_balance_gpt_oss_window_and_global_layers(trained):
    from varlen_cp import AttnMask

    window, glob = AttnMask(causal=True, window_size=(WINDOW - 1, 0)), AttnMask(causal=True)
    layer_masks, plan_masks = trained["cp2"]["gpt_oss/dispatch/balanced:masks"]
    assert layer_masks == repr([(window, 1), (glob, 1)])
    assert plan_masks == repr(((window, 1.0), (glob, 1.0)))
    # the default layout (balanced) is built with the model's masks too
    assert trained["cp2"]["gpt_oss/p2p:masks"][1] == repr(((window, 1.0), (glob, 1.0)))


@pytest.mark.slow
def test_fsdp_x_cp_matches_fsdp(trained):
    assert_same(trained["fsdp"]["qwen3/fsdp"], trained["fsdp_cp2"]["qwen3/fsdp"], "fsdp x cp")
