"""torchtitan's models scaled down for CPU, packed documents, and the trainer's shared
process mesh. torchtitan is imported inside the functions only: the training workers import
this module and must switch torchtitan to CPU before its first import."""

from __future__ import annotations

from pathlib import Path

import torch

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

    from varlen_cp import AttnOptions
    from varlen_cp.integrations.torchtitan.attention import OVERRIDE_TARGET

    holder = model_spec(model_config)
    apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, {"options": AttnOptions(**cp)})]),
                    holder)
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
