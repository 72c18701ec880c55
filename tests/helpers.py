"""Helpers shared by several test modules (no test module imports another; test_layering.py
checks it). ``tests/reference.py`` (the dense fp64 reference) and ``tests/dist_utils.py``
(gloo launches) stay their own modules: the benchmarks and integration tests use them too.

Sections:
- the CP grid's batch, masks, head splits, single-device reference, gathers and comparisons,
  and the guards that count or forbid what a CP call does (host reads of device data,
  bytes posted, all-reduces, any communication);
- the softmax-extras cases (sinks, max logit, a loss on out and LSE) under CP;
- plan invariants (every token once, positions, order) and the balanced layout's counts;
- torchtitan's models scaled down for CPU, and the trainer's shared process mesh (torchtitan
  is imported inside the functions only: the training workers import this module and must
  switch torchtitan to CPU before its first import).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from tests.reference import reference_attn
from varlen_cp import AttnMask, AttnOptions, CPPlan, cp_varlen_attn
from varlen_cp.kernels import varlen_attn
from varlen_cp.plan import layout_spec

# ------------------------------------------------------------------------ the CP grid
DOCS = [1, 2, 37, 9, 0, 130, 5, 23]            # 207 tokens
TINY = [2, 1]                                  # 3 tokens: some ranks hold nothing
D, DV = 32, 16
LAYOUTS = ("dual_chunk", "te", "contiguous", "balanced")
MASKS = {
    "causal": AttnMask(causal=True),
    "full": AttnMask(causal=False),
    "swa": AttnMask(causal=True, window_size=(7, 0)),
    "swa2": AttnMask(causal=False, window_size=(5, 3)),
    "chunk": AttnMask(causal=False, chunk_size=16),
    "chunk_causal": AttnMask(causal=True, chunk_size=12),
}
# (Hq, Hkv) per cp: valid for every strategy (a2a needs Hq % cp == 0 and Hkv | cp or cp | Hkv)
HEADS = {2: [(4, 2), (2, 1)], 3: [(6, 3), (3, 1)], 4: [(8, 2), (4, 4)], 6: [(6, 1), (6, 6)]}
NAMES = ("out", "lse", "dq", "dk", "dv")


def cu(docs: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(docs), dtype=torch.int64).cumsum(0)


def small_plan(docs, world, rank, layout, mask=None, tile_tokens=8):
    """Small cut sizes, so that documents of a tiny batch really span ranks: dual_chunk
    cuts documents of >= 2*cp*4 tokens, balanced (for ``mask``, default causal) cuts on a
    grid of ``tile_tokens``."""
    spec = {"dual_chunk": {"min_chunk_tokens": 4},
            "balanced": {"masks": mask, "tile_tokens": tile_tokens}}.get(layout, {})
    return CPPlan.build(cu(docs), cp_size=world, cp_rank=rank,
                        layout=layout_spec(layout, **spec))


def global_inputs(docs, hq, hkv, seed, d=D, dv=DV):
    """q, k, v and dout of the global batch (fp32); head dims ``d`` (q, k) and ``dv``."""
    g = torch.Generator().manual_seed(seed)
    total = sum(docs)
    return (torch.randn(total, hq, d, generator=g), torch.randn(total, hkv, d, generator=g),
            torch.randn(total, hkv, dv, generator=g), torch.randn(total, hq, dv, generator=g))


def single_device(q, k, v, dout, docs, mask):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32);
    out, lse, dq, dk, dv."""
    c = cu(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, c, c, max(docs), max(docs), None, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True,
                           backend="torch")
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def dense(inputs, docs, mask, dtype, low):
    """tests.reference attention in ``dtype`` (fp64: the truth; ``low``: plain PyTorch),
    from the same ``low``-rounded inputs; returns out, lse, dq, dk, dv."""
    c = cu(docs)
    q, k, v = (t.to(low).to(dtype).requires_grad_() for t in inputs[:3])
    out, lse = reference_attn(q, k, v, c, c, causal=mask.causal,
                              window_size=mask.window_size, chunk_size=mask.chunk_size,
                              dtype=dtype)
    out.backward(inputs[3].to(low).to(dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


def cp_run(rank, world, docs, layout, mask, options: AttnOptions, inputs,
           dtype=torch.float32, no_host_reads=False, return_lse=True):
    """CP forward + backward on this rank with ``options`` (an ``AttnOptions``); returns
    the plan and (out, lse, dq, dk, dv) of the local tokens (lse None without
    ``return_lse``)."""
    q, k, v, dout = inputs
    plan = small_plan(docs, world, rank, layout, mask)
    ql, kl, vl = (plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    dout_l = plan.shard(dout).to(dtype)
    with forbid_host_reads() if no_host_reads else contextlib.nullcontext():
        res = cp_varlen_attn(ql, kl, vl, plan, mask, None, options, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out.backward(dout_l)
    return plan, out.detach(), lse, ql.grad, kl.grad, vl.grad


def check_padding(plan, out, lse, grads):
    """Padding rows (te layout): out 0, lse -inf, zero gradients."""
    pad = plan.token_indices < 0
    if not bool(pad.any()):
        return
    assert bool((out[pad] == 0).all()), "padding rows: out must be 0"
    assert lse is None or bool(torch.isneginf(lse[:, pad]).all()), \
        "padding rows: lse must be -inf"
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert bool((g[pad] == 0).all()), f"padding rows: {name} must be 0"


def gather(plan, local):
    """This rank's (out, lse, dq, dk, dv) gathered to the global order on every rank."""
    out, lse, dq, dk, dv = local
    return (plan.unshard(out.float()),
            None if lse is None else plan.unshard(lse.t().contiguous()).t(),
            plan.unshard(dq.float()), plan.unshard(dk.float()), plan.unshard(dv.float()))


def compare_fp32(got, ref, what):
    """Errors (strings) of (out, lse, dq, dk, dv) vs the reference, fp32 tolerances."""
    errors = []
    for name, g, r in zip(NAMES, got, ref):
        if torch.isnan(g).any():
            errors.append(f"{what} {name}: NaN")
            continue
        try:
            torch.testing.assert_close(g, r.float(), atol=3e-5, rtol=3e-4)
        except AssertionError as e:
            errors.append(f"{what} {name}: {str(e).splitlines()[2:5]}")
    return errors


@contextlib.contextmanager
def forbid_host_reads():
    """Make Tensor.item/tolist/cpu/numpy (and bool/int/float conversions) raise on device
    data. On a CPU-only machine "device data" is every floating tensor (activations, LSE,
    gradients) and anything not on the CPU; host metadata (CPU int tensors) stays
    readable, as the plan's tables must be."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def guard(name):
        orig = saved[name]

        def check(self, *args, **kwargs):
            if self.is_floating_point() or self.device.type != "cpu":
                raise AssertionError(f"host read of device data: Tensor.{name} on "
                                     f"{self.dtype} {self.device} {tuple(self.shape)}")
            return orig(self, *args, **kwargs)
        return check

    for n in names:
        setattr(torch.Tensor, n, guard(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class ByteCounter:
    """Counts the bytes this rank sends through the collectives the strategies call."""

    def __init__(self):
        from varlen_cp.strategies import all_gather
        self.total = 0
        self._ag = all_gather
        self._saved = (dist.batch_isend_irecv, dist.all_to_all_single,
                       all_gather._all_gather_single)

    def __enter__(self):
        p2p_fn, a2a_fn, ag_fn = self._saved

        def p2p(ops):
            self.total += sum(op.tensor.numel() * op.tensor.element_size()
                              for op in ops if op.op is dist.isend)
            return p2p_fn(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kw):
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            me = dist.get_rank(group)
            self.total += row * (sum(input_split_sizes) - input_split_sizes[me])
            return a2a_fn(output, input, output_split_sizes, input_split_sizes, group=group,
                          **kw)

        def ag(output, input, group=None, **kw):
            self.total += (dist.get_world_size(group) - 1) * input.numel() * input.element_size()
            return ag_fn(output, input, group=group, **kw)

        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
        self._ag._all_gather_single = ag
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_to_all_single, self._ag._all_gather_single = \
            self._saved


class AllReduceCounter:
    """Counts dist.all_reduce calls (and their bytes) while active."""

    def __init__(self):
        self.saved, self.calls = dist.all_reduce, []

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.calls.append(tensor.numel() * tensor.element_size())
            return self.saved(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


@contextlib.contextmanager
def no_communication():
    """Every collective and P2P call the strategies (and plan checks) use raises."""
    from varlen_cp.strategies import all_gather
    names = ("all_reduce", "all_to_all_single", "batch_isend_irecv", "all_gather",
             "all_gather_into_tensor", "new_group", "broadcast", "barrier")
    saved = {n: getattr(dist, n) for n in names}
    saved_ag = all_gather._all_gather_single

    def refuse(*_a, **_k):
        raise RuntimeError("communication before validation")

    for n in names:
        setattr(dist, n, refuse)
    all_gather._all_gather_single = refuse
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        all_gather._all_gather_single = saved_ag


# ------------------------------------------------------------------ softmax extras
EXTRAS_MASKS = {name: m for name, m in MASKS.items() if name != "swa2"}
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def extras_inputs(docs, hq, hkv, seed):
    """q, k, v, dout, the LSE's loss weights, and a sink (all global, fp32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(docs)
    return (torch.randn(t, hq, D, generator=g), torch.randn(t, hkv, D, generator=g),
            torch.randn(t, hkv, DV, generator=g), torch.randn(t, hq, DV, generator=g),
            torch.randn(hq, t, generator=g), torch.randn(hq, generator=g))


def extras_loss(out, lse, dout, w_lse):
    """A loss on out and, when returned, lse (its finite entries: padding rows of a
    vanilla softmax have lse -inf)."""
    loss = (out.float() * dout).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
                       * w_lse).sum()
    return loss


def sink_arg(softmax_type, sink):
    """The ``sink`` argument of a call with ``softmax_type`` (a fresh leaf, or None)."""
    if softmax_type != "learnable":
        return None
    return sink.clone().requires_grad_()


def extras_reference(inputs, docs, mask, softmax_type, return_lse):
    """Reference: the local differentiable op on the whole batch (torch backend, fp32),
    with the sink, the max logit and a loss on out (and lse)."""
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    dout, w_lse = inputs[3], inputs[4]
    sink = sink_arg(softmax_type, inputs[5])
    c = cu(docs)
    out, lse, max_logit = varlen_attn(q, k, v, c, c, max(docs), max(docs), None,
                                      mask.causal, mask.window_size,
                                      chunk_size=mask.chunk_size, return_lse=True,
                                      return_max_logit=True, softmax_type=softmax_type,
                                      sink=sink, backend="torch")
    extras_loss(out, lse if return_lse else None, dout, w_lse).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                max_logit=max_logit, dsink=None if sink is None else sink.grad)


def extras_padding_errors(plan, got, softmax_type, sink):
    """Padding rows: out 0, lse -inf (the sink logit with a sink), zero gradients."""
    pad = plan.token_indices < 0
    if not bool(pad.any()):
        return []
    errors = []
    if not bool((got["out"][pad] == 0).all()):
        errors.append("padding out != 0")
    if got["lse"] is not None:
        want = {"vanilla": float("-inf"), "off-by-one": 0.0}.get(softmax_type)
        expect = (sink[:, None] if want is None else torch.full((sink.numel(), 1), want))
        if not torch.equal(got["lse"][:, pad], expect.expand(-1, int(pad.sum()))):
            errors.append("padding lse != sink logit / -inf")
    for name in ("dq", "dk", "dv"):
        if not bool((got[name][pad] == 0).all()):
            errors.append(f"padding {name} != 0")
    return errors


def extras_errors(plan, got, ref, sink_grad, world, what, atol=3e-5, rtol=3e-4):
    """Errors (strings) of this rank's results, gathered to global order, vs ``ref``: the
    max logit must also be the same on every rank, and the sink's gradient summed over the
    ranks the reference's (collective: every rank calls it)."""
    errors = []
    for name in NAMES:
        if name == "lse" and got["lse"] is None:
            continue
        local = got[name].float()
        g = plan.unshard(local.t().contiguous()).t() if name == "lse" else plan.unshard(local)
        if torch.isnan(g).any():
            errors.append(f"{what} {name}: NaN")
            continue
        try:
            torch.testing.assert_close(g, ref[name].float(), atol=atol, rtol=rtol)
        except AssertionError as e:
            errors.append(f"{what} {name}: {str(e).splitlines()[2:5]}")
    m = got["max_logit"]
    if m.dtype != torch.float32 or m.shape != ref["max_logit"].shape:
        errors.append(f"{what} max_logit: {m.dtype} {tuple(m.shape)}")
    else:
        every = [torch.empty_like(m) for _ in range(world)]
        dist.all_gather(every, m)
        if not all(torch.equal(e, m) for e in every):
            errors.append(f"{what} max_logit differs across ranks: {every}")
        if not torch.allclose(m, ref["max_logit"], atol=1e-5, rtol=1e-5):
            errors.append(f"{what} max_logit {m} vs {ref['max_logit']}")
    if ref["dsink"] is not None:
        total = sink_grad.clone()
        dist.all_reduce(total)
        if not torch.allclose(total, ref["dsink"], atol=1e-4, rtol=1e-4):
            errors.append(f"{what} dsink {total} vs {ref['dsink']}")
    return errors


# ------------------------------------------------------------------ plan invariants
FIXED_MIXES = [
    [],  # empty batch
    [0],
    [1],
    [5, 0, 1, 7],  # zero-length doc in the middle
    [2, 3],  # fewer tokens than some cp sizes
    [300, 1, 17, 0, 64, 129],  # one long document, odd lengths
    [1] * 13,
    [97, 96, 95, 33, 2, 1, 250],
]


def check_invariants(plan: CPPlan, lengths: list[int]) -> None:
    """The layout-independent contract of a plan, checked token by token."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    assert plan.total_tokens == total and plan.n_docs == len(lengths)
    held = []
    for r in range(plan.cp_size):
        idx, pos, lcu = plan.token_indices_of(r), plan.positions_of(r), \
            plan.local_cu_seqlens_of(r)
        assert idx.dtype == torch.int64 and pos.dtype == torch.int32 and lcu.dtype == torch.int32
        assert idx.shape == pos.shape == (plan.num_tokens_of(r),)
        assert lcu.shape == (len(lengths) + 1,) and int(lcu[0]) == 0
        assert int(lcu[-1]) == plan.num_tokens_of(r)
        seg = (lcu[1:] - lcu[:-1]).tolist()
        assert min(seg, default=0) >= 0
        assert plan.max_local_seqlen_of(r) == max(seg, default=0)
        for d, (a, b) in enumerate(zip(lcu[:-1].tolist(), lcu[1:].tolist())):
            s_idx, s_pos = idx[a:b].tolist(), pos[a:b].tolist()
            real = [i >= 0 for i in s_idx]
            assert real == sorted(real, reverse=True), "padding must come last in its doc"
            for i, p in zip(s_idx, s_pos):
                if i < 0:
                    assert p == -1
                else:
                    assert starts[d] <= i < starts[d + 1] and p == i - starts[d]
            real_pos = [p for p in s_pos if p >= 0]
            assert all(x < y for x, y in zip(real_pos, real_pos[1:]))
        held += [i for i in idx.tolist() if i >= 0]
    assert sorted(held) == list(range(total)), "every global token exactly once"
    assert plan.padded_total_tokens == sum(plan.num_tokens_of(r) for r in range(plan.cp_size))


def check_balanced(plans: list[CPPlan], lengths: list[int]) -> None:
    """No padding and token counts within 2% of the mean, plus one token (cuts move to
    tile and document boundaries within a token budget; tiny batches cut exactly)."""
    p0 = plans[0]
    total = sum(lengths)
    assert p0.padded_total_tokens == total
    counts = [p0.num_tokens_of(r) for r in range(p0.cp_size)]
    mean = total / p0.cp_size
    assert all(abs(c - mean) <= 0.02 * mean + 1 for c in counts), (counts, mean)


# ------------------------------------------------------------ torchtitan (imported lazily)
VOCAB, DIM, MAX_LEN = 256, 64, 1024


def packed_documents(rows: int, length: int, seed: int, max_doc_len: int):
    """``rows`` rows of packed documents of 1..``max_doc_len`` tokens: random tokens and
    per-document positions, both [rows, length]."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, length), generator=gen)
    positions = torch.empty(rows, length, dtype=torch.long)
    for r in range(rows):
        start = 0
        while start < length:
            n = min(int(torch.randint(1, max_doc_len + 1, (), generator=gen)), length - start)
            positions[r, start:start + n] = torch.arange(n)
            start += n
    return tokens, positions
WINDOW = 24  # gpt_oss's sliding window, scaled down like the rest (the real one is 128)


def tiny_model_config(name: str, attn_backend: str = "varlen"):
    """torchtitan's ``name`` debug model scaled down for CPU, built with torchtitan's own
    builders (same modules, inits and layer pattern as the debug flavor)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    def common(m) -> dict:
        """Embedding, final norm and output head as torchtitan's own builders make them."""
        return dict(dim=DIM, vocab_size=VOCAB,
                    tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                                    param_init=m._EMBEDDING_INIT),
                    norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
                    lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                          param_init=m._output_linear_init(DIM)))

    if name == "llama3":
        from torchtitan.models import llama3 as m
        from torchtitan.models.llama3.model import Llama3Model

        return Llama3Model.Config(
            **common(m),
            layers=m._build_llama3_layers(
                n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=128,
                rope=ComplexRoPE.Config(dim=DIM // 4, max_seq_len=MAX_LEN, theta=500000,
                                        scaling="llama"),
                attn_backend=attn_backend))
    if name == "qwen3":
        from torchtitan.models import qwen3 as m
        from torchtitan.models.qwen3.model import Qwen3Model

        return Qwen3Model.Config(
            dim=DIM, vocab_size=VOCAB, norm=m._qwen3_norm(DIM), enable_weight_tying=True,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=m._EMBEDDING_SKIP_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=m._LINEAR_INIT),
            layers=m._build_qwen3_layers(
                n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
                attn_backend=attn_backend,
                rope=CosSinRoPE.Config(dim=32, max_seq_len=MAX_LEN, theta=1000000.0)))
    if name == "gpt_oss":
        from torchtitan.models import gpt_oss as m
        from torchtitan.models.common.moe import TokenChoiceTopKRouter
        from torchtitan.models.gpt_oss.model import GptOssModel, GptOssTransformerBlock
        from torchtitan.models.gpt_oss.moe import GptOssMoE

        rope = CosSinRoPE.Config(dim=16, max_seq_len=MAX_LEN, theta=150000.0, scaling="yarn",
                                 rope_factor=32, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_seq_len=4096)
        layers = []
        for i in range(2):  # even layers: sliding window; odd layers: global (as the flavor)
            experts = m._make_gptoss_experts_config(dim=DIM, hidden_dim=32, num_experts=4,
                                                    layer_id=i, top_k=2,
                                                    moe_comm_backend="standard")
            router = TokenChoiceTopKRouter.Config(
                num_experts=4, score_func="softmax", route_norm=True, top_k=2,
                gate=Linear.Config(in_features=DIM, out_features=4, bias=True,
                                   param_init=m._depth_init(i)))
            layers.append(GptOssTransformerBlock.Config(
                attention=m._make_gptoss_attn_config(
                    dim=DIM, layer_id=i, attn_backend=attn_backend, n_heads=4, n_kv_heads=2,
                    head_dim=16, sliding_window_size=WINDOW if i % 2 == 0 else None,
                    rope=rope),
                attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
                ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
                moe=GptOssMoE.Config(num_experts=4, load_balance_coeff=1e-3,
                                     routed_experts=experts, router=router)))
        return GptOssModel.Config(
            **common(m),
            layers=layers)
    if name == "deepseek_v3":
        from torchtitan.models import deepseek_v3 as m
        from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

        return DeepSeekV3Model.Config(
            **common(m),
            # MLA with q/k head dim 24 + 8 = 32 and v head dim 16 (the flavor: 192 / 128);
            # layer 0 dense, layer 1 MoE (as the flavor's first dense layers, then MoE).
            layers=m._build_dsv3_layers(
                n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0,
                kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
                mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4,
                num_shared_experts=1, router_top_k=2, router_score_func="softmax",
                attn_backend=attn_backend, moe_comm_backend="standard",
                non_blocking_capacity_factor=None,
                rope=ComplexRoPE.Config(dim=8, max_seq_len=MAX_LEN, theta=10000.0,
                                        scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                                        beta_slow=1.0, original_seq_len=4096)))
    raise ValueError(name)


def model_spec(model_config):
    from torchtitan.protocols.model_spec import ModelSpec

    return ModelSpec(name="x", flavor="x", model=model_config, parallelize_fn=None,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)


def fp32(model_config):
    """Routed experts in fp32, as the trainer runs them on CPU (torchtitan's own gpt_oss
    experts return bf16, which its combine step refuses in an fp32 model)."""
    from varlen_cp.integrations.torchtitan.stock import fp32_experts_for

    holder = model_spec(model_config)
    fp32_experts_for(holder, compute=True)
    return holder.model


def with_varlen_cp(model_config, **cp):
    """``model_config`` with every varlen inner attention swapped for varlen-cp's, through
    the same torchtitan override the trainer applies."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from varlen_cp.integrations.torchtitan.attention import OVERRIDE_TARGET

    holder = model_spec(model_config)
    apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, cp)]), holder)
    return holder.model


def reuse_parallel_dims() -> None:
    """Every trainer of this process gets the first one's ``ParallelDims`` (and device
    mesh), as in one torchtitan run: a new mesh per trainer trips FSDP's "same mesh" check,
    through torch's global mesh caches. The cases of one launch share their parallelism."""
    from torchtitan.trainer import Trainer

    from varlen_cp.integrations.torchtitan.trainer import VarlenCPTrainer

    dims = []

    def init_distributed(trainer):
        if not dims:
            dims.append(Trainer.init_distributed(trainer))
        return dims[0]

    VarlenCPTrainer.init_distributed = init_distributed


def start_torchtitan_worker(rank: int, world: int, tmp: str, toml_text: str) -> Path:
    """In a launched worker, before its trainers: torchtitan in CPU mode with this rank's
    environment, warnings-only logs, one ``ParallelDims`` for every trainer of the launch
    (:func:`reuse_parallel_dims`), and the job TOML written once by rank 0: its path."""
    import logging
    import os

    from varlen_cp.integrations.torchtitan import cpu_mode

    cpu_mode.enable_cpu_mode()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    logging.getLogger().setLevel(logging.WARNING)
    reuse_parallel_dims()
    toml = Path(tmp) / "job.toml"
    if rank == 0:
        toml.write_text(toml_text)
    torch.distributed.barrier()
    return toml


def run_train_steps(trainer, steps: int) -> None:
    """Steps 1..``steps`` of ``trainer`` as ``Trainer.train`` runs them (minus checkpoints
    and the final sleep), closing the trainer even when a step fails."""
    try:
        batches = trainer.batch_generator(trainer.dataloader)
        for step in range(1, steps + 1):
            trainer.step = step
            trainer.train_step(batches)
    finally:
        trainer.close()
