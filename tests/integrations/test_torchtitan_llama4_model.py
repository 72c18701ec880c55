"""Llama 4 style model: layer structure (iRoPE, masks, QK norm, MoE), shapes, and that each
layer's mask really governs which tokens influence which (checked by perturbation)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from varlen_cp import AttnMask, AttnOptions  # noqa: E402
from varlen_cp.integrations.torchtitan.attention import (PackedBatch,  # noqa: E402
                                                         VarlenCPInnerAttention)
from varlen_cp.integrations.torchtitan.model import (Llama4Args, NoRoPE,  # noqa: E402
                                                     build_llama4_config, layer_masks, uses_rope)
from varlen_cp.plan import CPPlan  # noqa: E402

TINY = dict(dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=64,
            max_seq_len=256)


def build_model(**kw):
    torch.manual_seed(0)
    cfg = build_llama4_config(Llama4Args(**{**TINY, **kw}), AttnOptions(backend="torch"))
    model = cfg.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def forward(model, tokens: torch.Tensor, doc_lengths: list[int]) -> torch.Tensor:
    cu = torch.tensor([0] + doc_lengths).cumsum(0).to(torch.int32)
    plan = CPPlan.build(cu, cp_size=1, cp_rank=0)
    positions = plan.positions.to(torch.int64).unsqueeze(0)
    return model(tokens.unsqueeze(0), positions=positions, attention_masks=PackedBatch(plan))[0]


def test_irope_layer_pattern():
    args = Llama4Args(**TINY, n_layers=8, attention_chunk_size=16, nope_layer_interval=4,
                      use_qk_norm=True)
    cfg = build_llama4_config(args)
    chunked = AttnMask(causal=True, chunk_size=16)
    glob = AttnMask(causal=True)
    assert layer_masks(cfg) == [chunked, chunked, chunked, glob] * 2
    assert uses_rope(cfg) == [True, True, True, False] * 2
    assert [layer.attention.qk_norm is not None for layer in cfg.layers] == \
        [True, True, True, False] * 2
    assert all(layer.attention.n_kv_heads == 2 for layer in cfg.layers)


def test_sliding_window_and_plain_variants():
    swa = build_llama4_config(Llama4Args(**TINY, n_layers=2, attention_chunk_size=0,
                                         sliding_window=5, nope_layer_interval=0))
    assert layer_masks(swa) == [AttnMask(causal=True, window_size=(5, 0))] * 2
    assert uses_rope(swa) == [True, True]
    plain = build_llama4_config(Llama4Args(**TINY, n_layers=2, attention_chunk_size=0,
                                           nope_layer_interval=0))
    assert layer_masks(plain) == [AttnMask(causal=True)] * 2


def test_moe_interleave_uses_torchtitan_moe():
    from torchtitan.models.common import MoE

    cfg = build_llama4_config(Llama4Args(**TINY, n_layers=4, num_experts=4, top_k=1,
                                         interleave_moe_layer_step=2))
    assert [layer.moe is not None for layer in cfg.layers] == [False, True, False, True]
    assert [layer.feed_forward is not None for layer in cfg.layers] == \
        [True, False, True, False]
    moe = cfg.layers[1].moe
    assert isinstance(moe, MoE.Config) and moe.num_experts == 4
    assert moe.shared_experts is not None


@pytest.mark.parametrize("bad, match", [
    (dict(n_heads=6, n_kv_heads=4), "n_kv_heads"),
    (dict(attention_chunk_size=8, sliding_window=4), "exclusive"),
    (dict(num_experts=2, top_k=3), "top_k"),
    (dict(dim=30), "multiple of model.n_heads"),
    (dict(n_layers=0), "n_layers"),
])
def test_args_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        Llama4Args(**{**TINY, **bad})


def test_inner_attention_config_and_protocol():
    model = build_model(n_layers=2, attention_chunk_size=8, nope_layer_interval=2)
    inner = [m for m in model.modules() if isinstance(m, VarlenCPInnerAttention)]
    assert [m.mask for m in inner] == [AttnMask(causal=True, chunk_size=8), AttnMask(causal=True)]
    # the adapter IS the module (its call, its options), not a copy of it
    from varlen_cp import ContextParallelVarlenAttention
    assert all(isinstance(m, ContextParallelVarlenAttention) for m in inner)
    assert all(m.options == AttnOptions(backend="torch") for m in inner)
    assert isinstance(model.layers["1"].attention.rope, NoRoPE)
    model.verify_module_protocol()  # torchtitan's check that every submodule is a Module


def test_forward_backward_shapes_and_finite():
    model = build_model(n_layers=2, attention_chunk_size=8, nope_layer_interval=2,
                        use_qk_norm=True)
    tokens = torch.randint(0, 64, (40,))
    logits = forward(model, tokens, [13, 1, 26])
    assert logits.shape == (40, 64) and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _changed_rows(model, tokens, lengths, pos):
    base = forward(model, tokens, lengths).detach()
    t2 = tokens.clone()
    t2[pos] = (t2[pos] + 1) % 64
    moved = forward(model, t2, lengths).detach()
    return ((moved - base).abs().amax(-1) > 1e-6).nonzero().flatten().tolist()


def test_documents_are_isolated():
    model = build_model(n_layers=2, attention_chunk_size=0, nope_layer_interval=0)
    # Changing token 3 (document 0 = tokens 0..9) moves only document 0's later rows.
    assert _changed_rows(model, torch.randint(0, 64, (30,)), [10, 20], 3) == list(range(3, 10))


def test_chunked_layers_stop_at_chunk_boundaries():
    tokens = torch.randint(0, 64, (32,))
    # All layers chunked (chunk 8): token 2 influences rows 2..7 of its chunk only.
    chunked = build_model(n_layers=2, attention_chunk_size=8, nope_layer_interval=0)
    assert _changed_rows(chunked, tokens, [32], 2) == list(range(2, 8))
    # A global NoPE layer (every 2nd layer) carries it past the chunk, causally.
    irope = build_model(n_layers=2, attention_chunk_size=8, nope_layer_interval=2)
    assert _changed_rows(irope, tokens, [32], 2) == list(range(2, 32))


def test_sliding_window_reach():
    tokens = torch.randint(0, 64, (32,))
    # One layer, window 3: token 5 is seen by rows 5..8 only.
    swa = build_model(n_layers=1, attention_chunk_size=0, sliding_window=3,
                      nope_layer_interval=0)
    assert _changed_rows(swa, tokens, [32], 5) == [5, 6, 7, 8]


def test_moe_model_trains_a_step_on_cpu():
    model = build_model(n_layers=2, num_experts=4, top_k=1, moe_hidden_dim=32,
                        attention_chunk_size=8, nope_layer_interval=2)
    logits = forward(model, torch.randint(0, 64, (40,)), [13, 27])
    assert logits.shape == (40, 64) and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    experts = model.layers["0"].moe
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in experts.parameters() if p.requires_grad)


def test_inner_attention_rejects_missing_plan_and_binds_group():
    from varlen_cp.integrations.torchtitan.attention import bind_cp_group

    model = build_model(n_layers=2)
    tokens = torch.randint(0, 64, (1, 8))
    with pytest.raises(ValueError, match="PackedBatch"):
        model(tokens, positions=torch.arange(8).unsqueeze(0), attention_masks=None)
    sentinel = object()
    assert bind_cp_group(model, sentinel) == 2
    assert all(m.group is sentinel for m in model.modules()
               if isinstance(m, VarlenCPInnerAttention))


# ------------------------------------------------------------ attention sinks, max logit
@pytest.mark.parametrize("bad, match", [
    (dict(softmax_type="softmax1"), "softmax_type"),
    (dict(track_max_logit=1), "track_max_logit"),
])
def test_softmax_args_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        Llama4Args(**{**TINY, **bad})


def test_softmax_fields_reach_every_layer():
    cfg = build_llama4_config(Llama4Args(**TINY, n_layers=2, softmax_type="off-by-one",
                                         track_max_logit=True))
    inner = [layer.attention.inner_attention for layer in cfg.layers]
    assert [(c.softmax_type, c.n_heads, c.track_max_logit) for c in inner] == \
        [("off-by-one", 4, True)] * 2
    model = build_model(n_layers=2, softmax_type="off-by-one")
    assert not [n for n, _ in model.named_parameters() if n.endswith(".sink")]


def _dense_max_logit(q, k, lengths, scale):
    """Max over visible (causal, same document) scaled scores per head, dense fp64."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    best = torch.full((q.shape[1],), float("-inf"), dtype=torch.float64)
    start = 0
    for n in lengths:
        s = torch.einsum("qhd,khd->hqk", q[start:start + n], k[start:start + n]) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        best = torch.maximum(best, s.amax(dim=(1, 2)))
        start += n
    return best


def test_learnable_sink_trains_and_max_logits_are_reported():
    model = build_model(n_layers=2, attention_chunk_size=0, nope_layer_interval=0,
                        softmax_type="learnable", track_max_logit=True)
    sinks = {n: p for n, p in model.named_parameters() if n.endswith(".sink")}
    assert len(sinks) == 2
    assert all(p.shape == (4,) and p.dtype == torch.float32 and not p.any()
               for p in sinks.values())
    assert model.max_logits() == {}
    captured = {}

    def grab(module, args, kwargs):
        captured["qk"] = (args[0][0].detach(), args[1][0].detach(), kwargs.get("scale"))

    layer0 = model.layers["0"].attention.inner_attention
    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = forward(model, torch.randint(0, 64, (40,)), [13, 27])
    handle.remove()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().gt(0).all()) for p in sinks.values())
    opt.step()
    assert all(bool(p.detach().ne(0).all()) for p in sinks.values())
    got = model.max_logits()
    assert sorted(got) == [0, 1] and all(v.shape == (4,) and not v.requires_grad
                                         for v in got.values())
    q, k, scale = captured["qk"]
    ref = _dense_max_logit(q, k, [13, 27], scale if scale is not None else 8 ** -0.5)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_layer_masks_and_shape_for_the_plan():
    """What the trainer builds each batch's plan with: Llama 4's chunked (RoPE) and global
    (NoPE) layers with their counts, and the attention shape on the rank."""
    from varlen_cp.integrations.torchtitan.stock import (attention_layers, attention_shape,
                                                         layer_masks)

    args = Llama4Args(**TINY, n_layers=8, attention_chunk_size=16, nope_layer_interval=4)
    layers = attention_layers(build_llama4_config(args))
    assert layer_masks(layers) == [(AttnMask(causal=True, chunk_size=16), 6),
                                   (AttnMask(causal=True), 2)]
    shape = attention_shape(layers, tp=2, dtype="float32")
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.value_dim) == (2, 1, 8, 8)
    assert shape.dtype == torch.float32
