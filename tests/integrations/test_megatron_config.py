"""megatron integration without process groups: spec swap (local, TE-shaped, block, MLA),
per-layer mask/strategy resolution, options/config/module error paths, the sharding hook
and the module's cp=1 output against the dense reference."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from tests.reference import reference_attn  # noqa: E402
from varlen_cp import AttnOptions, CPPlan  # noqa: E402
from varlen_cp.plan import Balanced  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402

import varlen_cp.config as cp_config  # noqa: E402
from varlen_cp.config import CPConfig  # noqa: E402
from varlen_cp.integrations.megatron import (VarlenCPCoreAttention,  # noqa: E402
                                             VarlenCPOptions, VarlenCPSelfAttention,
                                             get_thd_batch_on_this_cp_rank,
                                             get_varlen_cp_layer_spec, layer_mask,
                                             layer_strategy, packed_seq_params_for,
                                             swap_core_attention)
from varlen_cp.integrations.megatron.config import job_from_dict, load_config  # noqa: E402
from varlen_cp.integrations.megatron.cpu_compat import megatron_on_cpu  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0)


def _config(**extra) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **extra})


def _core(spec: ModuleSpec):
    return spec.submodules.self_attention.submodules.core_attention


# ---------------------------------------------------------------------------- spec swap
def test_swap_local_spec_replaces_only_core_attention() -> None:
    local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    opts = VarlenCPOptions(chunk_size=32)
    new = swap_core_attention(local, opts)
    assert _core(local) is DotProductAttention  # the caller's spec is untouched
    assert _core(new).module is VarlenCPCoreAttention and _core(new).params == {
        "options": opts}
    old_sub, new_sub = local.submodules.self_attention.submodules, \
        new.submodules.self_attention.submodules
    for f in dataclasses.fields(old_sub):
        if f.name != "core_attention":
            assert getattr(new_sub, f.name) is getattr(old_sub, f.name), f.name
    assert new.submodules.mlp.submodules.linear_fc1 is local.submodules.mlp.submodules.linear_fc1
    ready = get_varlen_cp_layer_spec(opts, qk_layernorm=True)
    assert _core(ready).module is VarlenCPCoreAttention
    # megatron's SelfAttention becomes the subclass that takes RoPE positions from the plan
    assert local.submodules.self_attention.module is SelfAttention
    assert new.submodules.self_attention.module is VarlenCPSelfAttention
    assert issubclass(VarlenCPSelfAttention, SelfAttention)
    kept = swap_core_attention(local, opts, rope_from_plan=False)
    assert kept.submodules.self_attention.module is SelfAttention
    assert _core(kept).params == {"options": opts, "rope_from_plan": False}
    with pytest.raises(ValueError, match="rope_from_plan must be a bool"):
        swap_core_attention(local, opts, rope_from_plan=1)


class _FakeTE:
    """Stand-in for TransformerEngine's spec provider: TE cannot be installed on CPU, so
    megatron's TE spec function is run with placeholder classes in TE's slots."""

    class TELayerNormColumnParallelLinear:
        pass

    class TERowParallelLinear:
        pass

    class TEDotProductAttention:
        pass

    class TENorm:
        pass

    class TELinear:
        pass

    def linear(self):
        return self.TELinear

    def column_parallel_linear(self):
        return self.TELayerNormColumnParallelLinear

    def row_parallel_linear(self):
        return self.TERowParallelLinear

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return self.TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm=False, for_qk=False):
        return self.TENorm

    def core_attention(self):
        return self.TEDotProductAttention

    def activation_func(self):
        return None


def test_swap_te_spec(monkeypatch) -> None:
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _FakeTE, raising=False)
    for mla in (False, True):
        te = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=True, multi_latent_attention=mla)
        assert _core(te) is _FakeTE.TEDotProductAttention
        new = swap_core_attention(te)
        assert _core(new).module is VarlenCPCoreAttention
        sub = new.submodules.self_attention.submodules
        linear = sub.linear_q_proj if mla else sub.linear_qkv
        assert linear is _FakeTE.TELayerNormColumnParallelLinear  # TE linears stay
        assert sub.linear_proj is _FakeTE.TERowParallelLinear


def test_swap_block_spec_and_lists() -> None:
    # get_gpt_decoder_block_spec needs pipeline process groups; build what it returns
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules)

    layers = [gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
              for _ in range(4)]
    block = TransformerBlockSubmodules(layer_specs=layers)
    new = swap_core_attention(block)
    assert len(new.layer_specs) == 4
    assert all(_core(s).module is VarlenCPCoreAttention for s in new.layer_specs)
    assert all(_core(s) is DotProductAttention for s in block.layer_specs)
    block_spec = swap_core_attention(ModuleSpec(module=TransformerBlock, submodules=block))
    assert all(_core(s).module is VarlenCPCoreAttention
               for s in block_spec.submodules.layer_specs)
    pair = swap_core_attention([gpt_layer_specs.get_gpt_layer_local_spec()] * 2)
    assert all(_core(s).module is VarlenCPCoreAttention for s in pair)
    mla = swap_core_attention(gpt_layer_specs.get_gpt_layer_local_spec(
        multi_latent_attention=True))
    assert _core(mla).module is VarlenCPCoreAttention
    # MLA applies its own RoPE: not routed, so the layout must be te at CP > 1
    assert mla.submodules.self_attention.module is not VarlenCPSelfAttention
    assert _core(mla).params["rope_from_plan"] is False


def test_swap_errors() -> None:
    from megatron.core.transformer.mlp import MLP

    with pytest.raises(ValueError, match="no core_attention"):
        swap_core_attention(ModuleSpec(module=MLP))
    with pytest.raises(ValueError, match="spec must be"):
        swap_core_attention("gpt")
    with pytest.raises(ValueError, match="options must be a VarlenCPOptions"):
        swap_core_attention(gpt_layer_specs.get_gpt_layer_local_spec(), {"chunk_size": 8})


# -------------------------------------------------------------------------------- options
@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ring"}, "strategy must be one of"),
    ({"strategy": ()}, "non-empty tuple"),
    ({"strategy": ("p2p", "nccl")}, r"strategy\[1\]"),
    ({"strategy": ["p2p", "a2a"]}, r"strategy must be .* got a list: pass tuple"),
    ({"layout": "zigzag"}, "layout must be one of"),
    ({"backend": "cuda"}, "backend must be one of"),
    ({"chunk_size": -1}, "chunk_size"),
    ({"chunk_size": 1.5}, "chunk_size"),
    ({"chunk_layers": "nope"}, "chunk_layers"),
    ({"chunk_layers": ()}, "chunk_layers"),
    ({"chunk_layers": (1, 2)}, "chunk_layers"),
    ({"chunk_layers": [True, False]}, r"chunk_layers must be .* got a list: pass tuple"),
    ({"a2a_size": 0}, "a2a_size"),
    ({"validate": 1}, "validate"),
    ({"min_chunk_tokens": 0, "layout": "dual_chunk"}, "min_chunk_tokens"),
    ({"pad_multiple": 0}, "pad_multiple"),
    ({"pad_multiple": 8, "layout": "dual_chunk"}, "pad_multiple applies"),
    ({"tile_tokens": 8, "layout": "te"}, "tile_tokens applies"),
    ({"a2a_size": 2, "strategy": "p2p"}, "a2a_size applies"),
    ({"a2a_size": 2, "strategy": ("p2p", "a2a")}, "a2a_size applies"),
    ({"overlap_stages": 2, "strategy": ("p2p", "a2a")}, "overlap_stages applies"),
    ({"overlap_stages": 0}, "overlap_stages"),
    ({"min_chunk_tokens": 8}, "min_chunk_tokens applies to layout 'dual_chunk' only"),
    ({"prefetch": "yes"}, "prefetch must be a bool"),
])
def test_options_reject(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        VarlenCPOptions(**kwargs)


def test_options_are_cp_config_plus_megatron_extras() -> None:
    """One declaration: every CPConfig field and check, megatron's extras on top."""
    opts = VarlenCPOptions()
    assert isinstance(opts, CPConfig)
    shared = {f.name for f in dataclasses.fields(CPConfig)}
    assert shared < {f.name for f in dataclasses.fields(VarlenCPOptions)}
    assert (opts.strategy, opts.layout, opts.chunk_size, opts.chunk_layers) == \
        (None, "balanced", 0, "rope")
    assert (opts.validate, opts.prefetch) == (CPConfig().validate, CPConfig().prefetch)
    per_layer = VarlenCPOptions(strategy=("a2a+p2p", "dispatch"), a2a_size=2,
                                overlap_stages=3, chunk_layers=(1, 0), layout="balanced",
                                tile_tokens=128)
    assert per_layer.chunk_layers == (True, False)
    assert hash(per_layer) == hash(VarlenCPOptions(strategy=("a2a+p2p", "dispatch"),
                                                   a2a_size=2, overlap_stages=3,
                                                   chunk_layers=(True, False),
                                                   tile_tokens=128))
    assert per_layer.layout_spec() == Balanced(tile_tokens=128)
    # each layer's AttnOptions: the options its strategy takes, the shared ones
    assert per_layer.layer_options("a2a+p2p", 2) == AttnOptions(strategy="a2a+p2p", a2a_size=2)
    assert per_layer.layer_options("dispatch", 2) == AttnOptions(strategy="dispatch",
                                                                 overlap_stages=3)
    with pytest.raises(ValueError, match="layer_options"):
        per_layer.attn_options  # noqa: B018  (per layer only)
    assert VarlenCPOptions(strategy="dispatch", overlap_stages=2).attn_options == \
        AttnOptions(strategy="dispatch", overlap_stages=2)
    import varlen_cp.integrations.megatron.core_attention as core_mod
    import varlen_cp.integrations.megatron.options as opt_mod
    for mod in (opt_mod, core_mod):  # the name lists live in varlen_cp.config only
        for name in ("BACKENDS", "SOFTMAX_TYPES", "LAYOUTS", "STRATEGY_CHOICES"):
            assert getattr(mod, name, None) in (None, getattr(cp_config, name)), name
        assert not hasattr(mod, "_is_int")


def test_layer_masks_follow_megatron_config() -> None:
    cfg = _config(window_size=(16, 0), window_attn_skip_freq=2, no_rope_freq=4)
    opts = VarlenCPOptions(chunk_size=32)
    masks = [layer_mask(cfg, opts, n, AttnMaskType.causal) for n in (1, 2, 3, 4)]
    assert [m.window_size for m in masks] == [(16, 0), (-1, -1), (16, 0), (-1, -1)]
    assert [m.chunk_size for m in masks] == [32, 32, 32, None]  # layer 4 is NoPE: global
    all_layers = VarlenCPOptions(chunk_size=32, chunk_layers="all")
    assert layer_mask(cfg, all_layers, 4, AttnMaskType.causal).chunk_size == 32
    listed = VarlenCPOptions(chunk_size=8, chunk_layers=(True, False, False, True))
    assert [layer_mask(cfg, listed, n, AttnMaskType.causal).chunk_size
            for n in (1, 2, 3, 4)] == [8, None, None, 8]
    assert not layer_mask(cfg, opts, 1, AttnMaskType.no_mask).causal
    assert layer_mask(cfg, opts, 1, AttnMaskType.padding_causal).causal
    with pytest.raises(ValueError, match="attn_mask_type"):
        layer_mask(cfg, opts, 1, AttnMaskType.arbitrary)
    with pytest.raises(ValueError, match="layer_number=5"):
        layer_mask(cfg, listed, 5, AttnMaskType.causal)


def test_layer_strategy_resolution() -> None:
    cfg = _config()
    assert layer_strategy(cfg, VarlenCPOptions(), 1, None) == "p2p"
    assert layer_strategy(cfg, VarlenCPOptions(), 1, "a2a") == "a2a"
    assert layer_strategy(cfg, VarlenCPOptions(strategy="all_gather"), 1, "a2a") == \
        "all_gather"
    per_layer = VarlenCPOptions(strategy=("p2p", "a2a", "all_gather", "a2a+p2p"))
    assert [layer_strategy(cfg, per_layer, n, None) for n in (1, 2, 3, 4)] == \
        ["p2p", "a2a", "all_gather", "a2a+p2p"]
    listed = _config(cp_comm_type=["a2a", "p2p", "p2p", "all_gather"])
    # indexed with the 1-based layer number minus one (megatron 0.16.1 is off by one)
    assert layer_strategy(listed, VarlenCPOptions(), 1, "p2p") == "a2a"
    assert layer_strategy(listed, VarlenCPOptions(), 4, None) == "all_gather"
    with pytest.raises(ValueError, match="cp_comm_type"):
        layer_strategy(_config(cp_comm_type="ring"), VarlenCPOptions(), 1, None)


# ------------------------------------------------------------------- module build errors
@pytest.mark.parametrize("cfg_extra, kwargs, match", [
    ({"attention_dropout": 0.1}, {}, "attention_dropout"),
    ({"softmax_type": "softmax-plus"}, {}, "softmax_type must be one of"),
    ({}, {"attention_type": "cross"}, "attention_type"),
    ({}, {"options": {"chunk_size": 8}}, "options must be"),
    ({}, {"options": VarlenCPOptions(strategy=("p2p", "a2a"))}, "num_layers=4"),
    ({"context_parallel_size": 2}, {}, "context_parallel_size=2"),
    ({"context_parallel_size": 2}, {"rope_from_plan": False}, "megatron's own THD RoPE"),
    ({"cuda_graph_impl": "local"}, {}, r"cuda_graph_impl='local' needs \[varlen_cp\] graph_safe"),
    ({"cuda_graph_impl": "transformer_engine"}, {}, "cuda_graph_impl='transformer_engine'"),
    ({"cuda_graph_impl": "local"}, {"options": VarlenCPOptions(graph_safe=True,
                                                               graph_capacity=64),
                                    "rope_from_plan": False}, "megatron's own THD RoPE"),
    ({}, {"options": VarlenCPOptions(graph_safe=True), "rope_from_plan": False},
     r"graph_safe=True: this layer's self-attention applies megatron's own THD RoPE"),
    ({"mrope_section": [2, 2, 4]}, {"options": VarlenCPOptions(graph_safe=True)},
     "mrope_section"),
])
def test_module_build_errors(cfg_extra, kwargs, match) -> None:
    cfg = _config(**cfg_extra)
    args = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                attention_type="self", cp_comm_type=None, softmax_scale=None,
                pg_collection=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        VarlenCPCoreAttention(**args)


def _module(layer_number=1, **cfg_extra) -> VarlenCPCoreAttention:
    return VarlenCPCoreAttention(config=_config(**cfg_extra), layer_number=layer_number,
                                 attn_mask_type=AttnMaskType.causal, attention_type="self",
                                 cp_comm_type=None, softmax_scale=None, pg_collection=None,
                                 options=VarlenCPOptions(chunk_size=8))


def _qkv(total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(total, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(total, 2, 16, generator=g, requires_grad=True)
    return q, k, v


def test_graph_safe_packed_params_name_the_plan_by_key() -> None:
    """The graph-safe packed params: equal for two batches of other documents (megatron's
    replay compares them field by field), the plan found under its key, the RoPE positions
    those of the plan; refused without the model (the buffers are refreshed there), for a
    plan without a capacity, and for a key nobody sharded."""
    from varlen_cp.integrations.megatron.sharding import GraphKey, plan_of

    cfg = _config(num_layers=2)
    opts = VarlenCPOptions(graph_safe=True, strategy="p2p", graph_capacity=64)
    params = []
    for cu in ([0, 20, 27, 50], [0, 3, 50]):
        cu = torch.tensor(cu, dtype=torch.int32)
        batch = {"tokens": torch.arange(50)[None], "position_ids": torch.zeros(1, 50)}
        local, packed = get_thd_batch_on_this_cp_rank(batch, cu, options=opts, config=cfg)
        plan = plan_of(packed.varlen_cp_plan)
        assert plan.capacity == 64 and torch.equal(plan.cu_seqlens, cu.long())
        assert torch.equal(packed.varlen_cp_positions, plan.positions.clamp(min=0).long())
        assert local["tokens"].shape == (1, 64)
        params.append(packed)
    a, b = params
    assert a.varlen_cp_plan == b.varlen_cp_plan == GraphKey(64, 1, 0)
    assert (a.max_seqlen_q, a.max_seqlen_kv, a.cu_seqlens_q, a.cp_group) == (64, 64, None,
                                                                            None)
    assert [f for f in dataclasses.fields(a) if not isinstance(getattr(a, f.name),
                                                                torch.Tensor)
            and getattr(a, f.name) != getattr(b, f.name)] == []
    batch = {"tokens": torch.arange(50)[None]}
    with pytest.raises(ValueError, match="config is required in the graph-safe mode"):
        get_thd_batch_on_this_cp_rank(batch, torch.tensor([0, 50]), options=opts)
    with pytest.raises(ValueError, match="needs a plan built at a capacity"):
        packed_seq_params_for(CPPlan.build(torch.tensor([0, 50]), cp_size=1, cp_rank=0),
                              "cpu", graph_safe=True)
    with pytest.raises(ValueError, match="no plan was sharded for GraphKey"):
        plan_of(GraphKey(128, 4, 3))
    # a forward recomputed after the next batch was sharded finds its own plan through
    # its positions tensor; megatron's copy of that tensor (a capture) finds the latest
    first, latest = (plan_of(x.varlen_cp_plan, x.varlen_cp_positions) for x in (a, b))
    assert first.cu_seqlens.tolist() == [0, 20, 27, 50] and latest.cu_seqlens[1] == 3
    assert plan_of(a.varlen_cp_plan, a.varlen_cp_positions.clone()) is latest


def test_rope_positions_on_another_device() -> None:
    """The packed params' positions on another device than megatron's RoPE table: the
    dynamic mode looks the plan's positions up on the table's device (same rows as the
    positions tensor gives), the graph-safe mode refuses (a replay reads that tensor)."""
    from varlen_cp.integrations.megatron.rope import check_positions, plan_rope
    from varlen_cp.plan.capacity import GraphKey

    plan = CPPlan.build(torch.tensor([0, 7, 20]), cp_size=1, cp_rank=0)
    table = torch.randn(32, 1, 1, 8)
    on_meta = plan.positions.long().to("meta")
    want = table.index_select(0, plan.positions.clamp(min=0).long())
    assert torch.equal(plan_rope(plan, table, on_meta).q, want)
    assert torch.equal(plan_rope(plan, table, plan.positions.long()).q, want)
    check_positions(plan, table, on_meta)
    check_positions(GraphKey(64, 1, 0), None, None)          # a NoPE layer: no lookup
    check_positions(GraphKey(64, 1, 0), table, plan.positions.long())
    for positions in (on_meta, None):
        with pytest.raises(ValueError, match="varlen_cp_positions must be on the model's"):
            check_positions(GraphKey(64, 1, 0), (table, table), positions)


def test_module_forward_errors() -> None:
    core = _module()
    q, k, v = _qkv(10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=6, max_seqlen_kv=6)
    with pytest.raises(ValueError, match="attention_bias"):
        core(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=thd)
    with pytest.raises(ValueError, match="qkv_format"):
        core(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="no varlen_cp plan attached"):
        core(q, k, v, None, packed_seq_params=thd)  # a layer never plans
    with pytest.raises(ValueError, match="cu_seqlens_kv differs"):
        core(q, k, v, None, packed_seq_params=dataclasses.replace(
            thd, cu_seqlens_kv=torch.tensor([0, 5, 10], dtype=torch.int32)))
    other = CPPlan.build(cu, cp_size=2, cp_rank=1, layout="te")
    with pytest.raises(ValueError, match="cp_size=2"):
        core(q, k, v, None, packed_seq_params=_with_plan(thd, other))
    with pytest.raises(ValueError, match="THD input"):
        core(q[None], k[None], v[None], None, packed_seq_params=thd)
    with pytest.raises(ValueError, match="mask tensors"):
        core(q[:, None], k[:, None], v[:, None], torch.ones(1, 1, 10, 10, dtype=torch.bool),
             attn_mask_type=AttnMaskType.padding)


def _with_plan(params: PackedSeqParams, plan: CPPlan):
    from varlen_cp.integrations.megatron import VarlenCPPackedSeqParams

    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(PackedSeqParams)}
    return VarlenCPPackedSeqParams(**fields, varlen_cp_plan=plan)


# --------------------------------------------------------------- cp=1 module vs reference
@pytest.mark.parametrize("layer_number", [1, 2, 4])
def test_module_thd_and_sbhd_match_reference(layer_number: int) -> None:
    """Layer 1: SWA + chunk; layer 2: chunk only (window skipped); layer 4: NoPE, global."""
    core = _module(layer_number, window_size=(5, 0), window_attn_skip_freq=2, no_rope_freq=4)
    expect = {1: ((5, 0), 8), 2: ((-1, -1), 8), 4: ((-1, -1), None)}[layer_number]
    assert (core.mask.window_size, core.mask.chunk_size) == expect
    cu = torch.tensor([0, 3, 4, 21, 30], dtype=torch.int32)
    q, k, v = _qkv(30, layer_number)
    batch = {"tokens": torch.zeros(1, 30, dtype=torch.long)}
    _, params = get_thd_batch_on_this_cp_rank(batch, cu)
    out = core(q, k, v, None, packed_seq_params=params)
    ref, _ = reference_attn(q.detach(), k.detach(), v.detach(), cu, cu, causal=True,
                            window_size=expect[0], chunk_size=expect[1])
    assert out.shape == (30, 64)
    torch.testing.assert_close(out.double().view(30, 4, 16), ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    # sbhd: two rows of 15 tokens, each row one sequence
    s_q = q.detach().view(2, 15, 4, 16).transpose(0, 1)
    s_k = k.detach().view(2, 15, 2, 16).transpose(0, 1)
    s_v = v.detach().view(2, 15, 2, 16).transpose(0, 1)
    with megatron_on_cpu():
        out_s = core(s_q, s_k, s_v, None)
    rows = torch.tensor([0, 15, 30], dtype=torch.int32)
    ref_s, _ = reference_attn(q.detach(), k.detach(), v.detach(), rows, rows, causal=True,
                              window_size=expect[0], chunk_size=expect[1])
    assert out_s.shape == (15, 2, 64)
    torch.testing.assert_close(out_s.transpose(0, 1).reshape(30, 4, 16).double(), ref_s,
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------- softmax sink and max logit
def _dense_sink_reference(q, k, v, cu, sink, scale):
    """Dense fp64 causal attention per document with a sink logit per head, and the max
    over the visible scaled scores per head (independent of the kernels)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.zeros_like(q)
    row_max = torch.full((q.shape[1],), float("-inf"), dtype=torch.float64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        row_max = torch.maximum(row_max, s.amax(dim=(1, 2)))
        # the sink is one more logit in each row's softmax, with no value attached
        full = torch.cat([s, sink.double()[:, None, None].expand(-1, b - a, 1)], dim=2)
        p = full.softmax(dim=2)[..., :-1]
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v[a:b])
    return out, row_max


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_module_sink_and_max_logit_match_dense(softmax_type: str) -> None:
    core = VarlenCPCoreAttention(config=_config(softmax_type=softmax_type, qk_clip=True),
                                 layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", cp_comm_type=None,
                                 softmax_scale=None, pg_collection=None)
    # the adapter IS the module: its call, the layer's options, megatron's sink parameter
    from varlen_cp import ContextParallelVarlenAttention
    assert isinstance(core, ContextParallelVarlenAttention) and core.sink is None
    assert core.options == AttnOptions() and core.softmax_type == softmax_type
    if softmax_type == "learnable":
        assert core.softmax_offset.shape == (4,) and core.softmax_offset.dtype == torch.float32
        assert [n for n, _ in core.named_parameters()] == ["softmax_offset"]
        with torch.no_grad():
            core.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
        sink = core.softmax_offset.detach()
    else:
        assert core.softmax_offset is None
        sink = torch.zeros(4)
    cu = torch.tensor([0, 3, 4, 21, 30], dtype=torch.int32)
    q, k, v = _qkv(30, 1)
    _, params = get_thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 30, dtype=torch.long)},
                                              cu)
    out = core(q, k, v, None, packed_seq_params=params)
    ref, ref_max = _dense_sink_reference(q, k, v, cu, sink, 16 ** -0.5)
    torch.testing.assert_close(out.double().view(30, 4, 16), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(core.max_logit.double(), ref_max, rtol=1e-5, atol=1e-5)
    first = core.current_max_attn_logits.clone()
    out.sum().backward()
    if softmax_type == "learnable":
        assert core.softmax_offset.grad is not None
        assert bool(core.softmax_offset.grad.abs().gt(0).all())
    # a second micro-batch max-accumulates, as megatron's clip_qk expects
    core(q * 2, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(core.current_max_attn_logits,
                               torch.maximum(first, core.max_logit))


# -------------------------------------------------------------------------- sharding hook
def test_sharding_hook_cp1() -> None:
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    batch = {"tokens": torch.arange(12)[None], "labels": torch.arange(1, 13)[None],
             "loss_mask": torch.ones(1, 12), "position_ids": torch.arange(12)[None],
             "attention_mask": torch.ones(1, 1, 12, 12), "cu_seqlens": cu, "note": "x"}
    local, params = get_thd_batch_on_this_cp_rank(batch, cu)
    assert torch.equal(local["tokens"], batch["tokens"])
    assert torch.equal(local["position_ids"][0], torch.tensor(
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]))
    assert local["attention_mask"] is None and "cu_seqlens" not in local
    assert local["note"] == "x"
    assert params.qkv_format == "thd" and params.max_seqlen_q == 7
    assert torch.equal(params.cu_seqlens_q, cu) and torch.equal(params.cu_seqlens_q_padded, cu)
    assert params.varlen_cp_plan.cp_size == 1
    # for GPTModel(padding_mask=): no padding in this plan; a caller's own mask is kept
    assert local["padding_mask"].dtype == torch.bool and not local["padding_mask"].any()
    mine = torch.zeros(1, 12, dtype=torch.bool)
    mine[0, 4] = True
    local, _ = get_thd_batch_on_this_cp_rank({**batch, "padding_mask": mine}, cu)
    assert torch.equal(local["padding_mask"], mine)


def test_sharding_hook_errors() -> None:
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    batch = {"tokens": torch.zeros(1, 12, dtype=torch.long)}
    with pytest.raises(ValueError, match="cu_seqlens must be a CPU"):
        get_thd_batch_on_this_cp_rank(batch, [0, 5, 12])
    with pytest.raises(ValueError, match=r"batch\['tokens'\] must have shape \[1, 12"):
        get_thd_batch_on_this_cp_rank({"tokens": torch.zeros(2, 6)}, cu)
    with pytest.raises(ValueError, match="batch must be a dict"):
        get_thd_batch_on_this_cp_rank([batch], cu)
    with pytest.raises(ValueError, match="options must be"):
        get_thd_batch_on_this_cp_rank(batch, cu, options={"layout": "te"})
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        get_thd_batch_on_this_cp_rank(batch, cu, cu_seqlens_padded=torch.tensor([0, 6, 12]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        get_thd_batch_on_this_cp_rank(batch, torch.tensor([0, 7, 5]))


def test_te_layout_plan_matches_megatron_padding() -> None:
    """The plan behind the hook pads like TE (multiple of 2*cp) and puts chunks r and
    2*cp-1-r on rank r, which megatron's THD RoPE assumes."""
    from varlen_cp.integrations.megatron.planning import plan_batch
    from varlen_cp.integrations.megatron.sharding import packed_seq_params_for

    cu = torch.tensor([0, 5, 13])
    plans = [plan_batch(cu, VarlenCPOptions(layout="te"), 2, r) for r in (0, 1)]
    assert plans[0].cu_seqlens_padded.tolist() == [0, 8, 16]
    # doc 0 padded to 8 -> chunks of 2: rank 0 holds positions 0,1 and 6,7 (padding)
    assert plans[0].positions_of(0).tolist()[:4] == [0, 1, -1, -1]
    assert plans[1].positions_of(1).tolist()[:4] == [2, 3, 4, -1]
    params = packed_seq_params_for(plans[0], "cpu")
    assert params.max_seqlen_q == 8
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 16]


# --------------------------------------------------------------------------------- config
def _doc(**sections) -> dict:
    doc = {"model": dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                         attention_dropout=0.0),
           "gpt": {"vocab_size": 128, "max_sequence_length": 128}}
    for name, table in sections.items():
        doc[name] = {**doc.get(name, {}), **table} if isinstance(table, dict) else table
    return doc


def test_shipped_config_loads() -> None:
    job = load_config(REPO / "configs" / "megatron_llama4_debug.toml")
    assert job.context_parallel_size == 2 and job.options.chunk_size == 128
    assert job.spec_kwargs == {"qk_layernorm": True, "normalization": "RMSNorm"}
    cfg = job.transformer_config(use_cpu_initialization=True)
    assert cfg.gated_linear_unit and cfg.no_rope_freq == [0, 0, 0, 1]
    assert cfg.context_parallel_size == 2 and cfg.cp_comm_type == "p2p"


def test_config_moe_layers_reach_the_spec() -> None:
    """[model] num_moe_experts builds MoE layers (megatron picks them in the layer spec),
    with the router that keeps padding out of its statistics."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from varlen_cp.integrations.megatron import VarlenCPTopKRouter

    job = job_from_dict(_doc(model={"num_moe_experts": 4, "moe_router_topk": 2}))
    assert job.spec_kwargs["num_experts"] == 4
    spec = get_varlen_cp_layer_spec(job.options, **job.spec_kwargs)
    assert spec.submodules.mlp.module is MoELayer
    assert spec.submodules.mlp.submodules.router is VarlenCPTopKRouter
    assert "num_experts" not in job_from_dict(_doc()).spec_kwargs


def test_launcher_refuses_token_dropping_with_cp(tmp_path, capsys) -> None:
    """Token dropping decides per CP rank (padding included): exit 2 with one line naming
    the model, the setting and the layout, before any process group exists."""
    from varlen_cp.integrations.megatron.train import main

    toml = tmp_path / "moe.toml"
    toml.write_text("[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n"
                    "num_moe_experts = 4\nmoe_expert_capacity_factor = 1.5\n"
                    "[gpt]\nvocab_size = 128\nmax_sequence_length = 64\n"
                    "[varlen_cp]\nlayout = \"te\"\n")
    assert main(["--config", str(toml), "--context-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: MoE model (num_moe_experts=4)") and "\n" not in err
    assert "moe_expert_capacity_factor=1.5" in err and "layout 'te'" in err
    assert not torch.distributed.is_initialized()


def test_graph_safe_layer_accepts_local_cuda_graphs() -> None:
    """megatron's per-layer CUDA graphs with the graph-safe mode build (the capture itself
    needs CUDA: tests/integrations/test_megatron_graph_replay.py checks the replay)."""
    module = VarlenCPCoreAttention(
        config=_config(cuda_graph_impl="local"), layer_number=1,
        attn_mask_type=AttnMaskType.causal, attention_type="self", cp_comm_type=None,
        softmax_scale=None, pg_collection=None,
        options=VarlenCPOptions(graph_safe=True, strategy="p2p", graph_capacity=64))
    assert module.options.graph_safe


@pytest.mark.parametrize("fields, graph_safe, match", [
    ({}, True, None),
    ({"cuda_graph_impl": "local"}, True, None),
    ({"cuda_graph_impl": "local", "cuda_graph_scope": []}, True, None),
    ({"enable_cuda_graph": True}, True, None),            # deprecated spelling of "local"
    ({"cuda_graph_impl": "local"}, "no capacity", r"needs \[varlen_cp\] graph_capacity"),
    ({"cuda_graph_impl": "local", "recompute_granularity": "full"}, True, None),
    ({"cuda_graph_impl": "local", "recompute_granularity": "selective",
      "pipeline_model_parallel_size": 2}, True, "recompute_granularity='selective'"),
    ({"cuda_graph_impl": "local", "pipeline_model_parallel_size": 2}, True, None),
    ({"enable_cuda_graph": True}, False, r"'local' needs \[varlen_cp\] graph_safe"),
    ({"cuda_graph_impl": "local"}, False, r"'local' needs \[varlen_cp\] graph_safe"),
    ({"external_cuda_graph": True}, True, "TransformerEngine's CUDA graphs refuse"),
    ({"cuda_graph_impl": "transformer_engine"}, True, "refuse packed_seq_params"),
    ({"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}, True,
     "full_iteration"),
    ({"cuda_graph_impl": "local", "num_moe_experts": 4}, True, "num_moe_experts=4"),
    ({"cuda_graph_impl": "local", "qk_clip": True}, True, "qk_clip"),
    ({"cuda_graph_impl": "local", "log_max_attention_logit": True}, True, "max logit"),
])
def test_cuda_graph_settings(fields, graph_safe, match) -> None:
    from types import SimpleNamespace

    from varlen_cp.integrations.megatron.core_attention import check_cuda_graphs

    config = SimpleNamespace(**fields)
    options = VarlenCPOptions(graph_safe=bool(graph_safe), strategy="p2p",
                              graph_capacity=64 if graph_safe is True else None)
    if match is None:
        check_cuda_graphs(config, options)
    else:
        with pytest.raises(ValueError, match=match):
            check_cuda_graphs(config, options)


@pytest.mark.parametrize("graph_safe, match", [
    (True, "needs CUDA devices"),
    (False, r"needs \[varlen_cp\] graph_safe = true"),
])
def test_launcher_checks_cuda_graphs(tmp_path, capsys, graph_safe, match) -> None:
    """megatron's CUDA graphs need the graph-safe mode, and CUDA: exit 2 with one line,
    before any process group exists."""
    from varlen_cp.integrations.megatron.train import main

    toml = tmp_path / "graphs.toml"
    toml.write_text("[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n"
                    "cuda_graph_impl = \"local\"\n"
                    "[gpt]\nvocab_size = 128\nmax_sequence_length = 64\n"
                    f"[varlen_cp]\ngraph_safe = {str(graph_safe).lower()}\n"
                    + ("graph_capacity = 64\n" if graph_safe else "")
                    + "strategy = \"p2p\"\n")
    assert main(["--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: config.cuda_graph_impl='local'") and "\n" not in err
    assert re.search(match, err), err
    assert not torch.distributed.is_initialized()


def test_config_per_layer_cp_comm_type_moves_to_options() -> None:
    job = job_from_dict(_doc(parallel={"cp_comm_type": ["a2a", "p2p"]}))
    assert job.options.strategy == ("a2a", "p2p") and "cp_comm_type" not in job.parallel
    job = job_from_dict(_doc(model={"window_size": [8, 0]}))
    assert job.transformer_config().window_size == (8, 0)


@pytest.mark.parametrize("doc, match", [
    (_doc(extra={"a": 1}), r"unknown section \[extra\]"),
    ({"gpt": {"vocab_size": 8, "max_sequence_length": 8}}, "required"),
    (_doc(model={"num_layer": 2}), r"unknown key 'num_layer' in \[model\]"),
    (_doc(model={"context_parallel_size": 2}), "belong elsewhere"),
    (_doc(model={"activation": "tanh"}), "activation must be one of"),
    (_doc(gpt={"dropout": 0.1}), r"unknown key 'dropout' in \[gpt\]"),
    ({"model": {"num_layers": 2, "hidden_size": 64}, "gpt": {"vocab_size": 8,
                                                            "max_sequence_length": 8}},
     "num_attention_heads"),
    ({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
      "gpt": {"vocab_size": 8}}, "max_sequence_length is required"),
    (_doc(parallel={"context_parallel_size": 0}), "context_parallel_size must be"),
    (_doc(parallel={"pipeline_model_parallel_size": 2}), r"unknown key 'pipeline_model_parallel_size' in \[parallel\]"),
    (_doc(parallel={"cp_comm_type": ["p2p", "a2a"]}, varlen_cp={"strategy": "p2p"}),
     "give only one"),
    (_doc(varlen_cp={"strategy": ["p2p"]}), "num_layers=2"),
    (_doc(varlen_cp={"chunk": 8}), r"unknown key 'chunk' in \[varlen_cp\]"),
    (_doc(varlen_cp={"layout": "zigzag"}), "layout must be one of"),
    (_doc(training={"steps": 0}), "training.steps"),
    (_doc(training={"lr": -1.0}), "training.lr"),
    (_doc(training={"betas": [0.9]}), "training.betas"),
    (_doc(data={"seq_len": 0}), "data.seq_len"),
    (_doc(data={"noise": 2.0}), "data.noise"),
    (_doc(data={"alphabet": 256}), "exceeds"),
    (_doc(model="x"), "must be inside a \\[section\\]"),
])
def test_config_errors(doc, match) -> None:
    with pytest.raises(ValueError, match=match):
        job_from_dict(doc)


def test_load_config_file_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 2")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_synthetic_data_is_deterministic_and_packed() -> None:
    from varlen_cp.integrations.megatron.data import SyntheticDataConfig, synthetic_batch

    cfg = SyntheticDataConfig(seq_len=200, min_doc_len=4, alphabet=32)
    (b1, cu1), (b2, cu2) = synthetic_batch(cfg, 3), synthetic_batch(cfg, 3)
    assert torch.equal(cu1, cu2) and torch.equal(b1["tokens"], b2["tokens"])
    assert int(cu1[-1]) == 200 and b1["tokens"].shape == (1, 200)
    starts = cu1[:-1].long()
    assert bool((b1["position_ids"][0, starts] == 0).all())
    assert bool((b1["loss_mask"][0, cu1[1:].long() - 1] == 0).all())
    assert not torch.equal(synthetic_batch(cfg, 4)[0]["tokens"], b1["tokens"])
