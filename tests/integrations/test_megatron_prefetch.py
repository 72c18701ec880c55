"""Planning ahead for megatron: the layer masks the planner derives from megatron's config,
``PrefetchedTHDBatches`` (the plan and tables of the next batch built on a thread), and the
trainer's overlap of planning with the step.

The overlap test slows the planner by DELAY_S per batch (monkeypatched ``build_plan``) and
the step by STEP_S (a sleep after megatron's schedule, so it outlasts the planner) in the
real trainer at CP=2; the mean step time (first step excluded: nothing to overlap it with)
may grow by less than half the planner's delay with prefetch, and must grow by more than
half of it with prefetch disabled. Sleeps dominate both, so CPU load from other processes
moves the three runs alike.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402
from varlen_cp.tables.cache import table_key  # noqa: E402
from varlen_cp import AttnMask, AttnOptions  # noqa: E402
from varlen_cp.integrations.megatron import (PrefetchedTHDBatches,  # noqa: E402
                                             VarlenCPOptions, get_thd_batch_on_this_cp_rank,
                                             model_attention)

DELAY_S = 0.2   # added to the planning of every batch
STEP_S = 0.35   # added to every step: longer than the planner's delay
STEPS = 8

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0)


def _packed(lengths: list[int], seed: int = 0):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(n) for n in lengths])
    batch = {"tokens": torch.randint(0, 64, (1, total), generator=g),
             "labels": torch.randint(0, 64, (1, total), generator=g),
             "loss_mask": torch.ones(1, total), "position_ids": positions[None]}
    return batch, cu


# ------------------------------------------------------------------------ layer masks
def test_model_attention_from_megatron_config() -> None:
    """Llama 4 style: SWA on odd layers, NoPE (global) every 4th, chunked RoPE layers."""
    cfg = TransformerConfig(**BASE, window_size=(16, 0), window_attn_skip_freq=2,
                            no_rope_freq=4, bf16=True)
    opts = VarlenCPOptions(chunk_size=32, strategy=("dispatch", "p2p", "dispatch", "a2a+p2p"),
                           a2a_size=2, overlap_stages=3)
    model = model_attention(cfg, opts)
    swa_chunk = AttnMask(window_size=(16, 0), chunk_size=32)
    assert model.layer_masks == ((swa_chunk, 2), (AttnMask(chunk_size=32), 1),
                                 (AttnMask(), 1))
    # each layer's options: a2a_size and overlap_stages only where its strategy takes them
    assert model.calls == ((swa_chunk, AttnOptions(strategy="dispatch", overlap_stages=3)),
                           (AttnMask(chunk_size=32), AttnOptions(strategy="p2p")),
                           (AttnMask(), AttnOptions(strategy="a2a+p2p", a2a_size=2)))
    s = model.shape
    assert (s.n_heads, s.n_kv_heads, s.head_dim, s.value_dim, s.dtype) == \
        (4, 2, 16, 16, torch.bfloat16)
    # no per-layer strategy: megatron's cp_comm_type decides
    listed = TransformerConfig(**BASE, cp_comm_type="all_gather")
    assert {c[1].strategy for c in model_attention(listed).calls} == {"all_gather"}


def test_hook_balances_the_models_layer_masks() -> None:
    """With the config, the hook's balanced plan weighs each layer mask by its layer
    count; without it, causal only."""
    cfg = TransformerConfig(**BASE, no_rope_freq=4)
    opts = VarlenCPOptions(chunk_size=8)
    batch, cu = _packed([30, 7, 27])
    _, packed = get_thd_batch_on_this_cp_rank(batch, cu, options=opts, config=cfg)
    plan = packed.varlen_cp_plan
    assert plan.cp_size == 1  # no process group: one rank, the identity layout
    # cp > 1 needs a group; the planner itself shows the masks it balances
    from varlen_cp.integrations.megatron import plan_batch

    two = plan_batch(cu, opts, 2, 0, model=model_attention(cfg, opts))
    assert two.layout == "balanced"
    assert two.layout_spec.masks == ((AttnMask(chunk_size=8), 3.0), (AttnMask(), 1.0))
    assert plan_batch(cu, opts, 2, 0).layout_spec.masks == ((AttnMask(), 1.0),)


# ------------------------------------------------------------------- PrefetchedTHDBatches
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetched_batches_equal_the_hook(prefetch: bool) -> None:
    cfg = TransformerConfig(**BASE)
    opts = VarlenCPOptions(prefetch=prefetch)
    source = [_packed([5, 12, 3], 1), _packed([20], 2), _packed([1, 1, 9, 9], 3)]
    with PrefetchedTHDBatches(iter(source), config=cfg, options=opts,
                              device="cpu") as batches:
        got = list(batches)
    assert len(got) == 3
    for (local, packed), (batch, cu) in zip(got, source):
        ref, ref_packed = get_thd_batch_on_this_cp_rank(batch, cu, options=opts)
        assert local.keys() == ref.keys()
        assert all(torch.equal(local[k], ref[k]) for k in ref)
        assert torch.equal(packed.cu_seqlens_q, ref_packed.cu_seqlens_q)
        plan = packed.varlen_cp_plan
        assert torch.equal(plan.cu_seqlens, cu.long())
        # the RoPE rows and the local attention tables were built on the planner's side
        assert table_key("rope_positions", None, None, 0)._replace(device="cpu") in plan._cache
        assert any(isinstance(k, tuple) and k[0] == "local" for k in plan._cache)


def test_prefetched_batches_errors() -> None:
    cfg = TransformerConfig(**BASE)
    with pytest.raises(ValueError, match=r"\(batch, cu_seqlens\) pairs"):
        next(PrefetchedTHDBatches([{"tokens": torch.zeros(1, 4)}], config=cfg, device="cpu"))
    batch, cu = _packed([4])
    with pytest.raises(ValueError, match="cu_seqlens must be a CPU"):
        next(PrefetchedTHDBatches([(batch, [0, 4])], config=cfg, device="cpu"))
    with pytest.raises(ValueError, match="options must be a VarlenCPOptions"):
        PrefetchedTHDBatches([], config=cfg, options={"layout": "te"})
    with pytest.raises(ValueError, match="plan was built for other cu_seqlens"):
        other = get_thd_batch_on_this_cp_rank(*_packed([2, 2]))[1].varlen_cp_plan
        get_thd_batch_on_this_cp_rank(batch, cu, plan=other)


# ------------------------------------------------------------------------ the overlap
TRAIN_DOC = {
    "model": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, kv_channels=16, activation="swiglu",
                  normalization="RMSNorm", no_rope_freq=2, attention_dropout=0.0,
                  hidden_dropout=0.0),
    "gpt": dict(vocab_size=64, max_sequence_length=128, position_embedding_type="rope"),
    "parallel": dict(context_parallel_size=2, cp_comm_type="p2p"),
    "varlen_cp": dict(chunk_size=16),
    "training": dict(steps=STEPS, lr=1e-3),
    "data": dict(seq_len=96, min_doc_len=4, alphabet=64),
}


def _overlap_worker(rank: int, world: int, tmp: str) -> dict:
    import time

    from megatron.core import parallel_state

    import varlen_cp.prefetch as planner
    from varlen_cp.integrations.megatron import train as trainer
    from varlen_cp.integrations.megatron.config import job_from_dict

    real_build, real_step = planner.build_plan, trainer.run_step
    delay = {"s": 0.0}

    def slow_build(*args, **kwargs):  # the planner: every batch's plan costs DELAY_S more
        time.sleep(delay["s"])
        return real_build(*args, **kwargs)

    def slow_step(*args, **kwargs):  # the step draws its batch first, then outlasts DELAY_S
        out = real_step(*args, **kwargs)
        time.sleep(STEP_S)
        return out

    planner.build_plan, trainer.run_step = slow_build, slow_step
    runs = {}
    try:
        for name, planner_delay, prefetch in (("base", 0.0, True), ("prefetch", DELAY_S, True),
                                              ("inline", DELAY_S, False)):
            delay["s"] = planner_delay
            doc = {k: dict(v) for k, v in TRAIN_DOC.items()}
            doc["varlen_cp"]["prefetch"] = prefetch
            log = f"{tmp}/{name}.json"
            losses = trainer.train(job_from_dict(doc), log_json=log)
            parallel_state.destroy_model_parallel()
            runs[name] = {"losses": losses}
            if rank == 0:
                with open(log) as f:
                    runs[name]["step_s"] = json.load(f)["step_s"]
    finally:
        planner.build_plan, trainer.run_step = real_build, real_step
    return runs


@pytest.fixture(scope="module")
def overlap(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("megatron_prefetch")
    return run_distributed(_overlap_worker, 2, tmp, str(tmp), timeout_s=300.0,
                           collective_timeout_s=120.0)


def _mean_step(run: dict) -> float:
    steps = run["step_s"][1:]  # step 0 waits for the first plan in every mode
    return sum(steps) / len(steps)


@pytest.mark.slow  # the overlap fixture: trainers with a slowed planner
def test_planning_overlaps_the_step(overlap) -> None:
    runs = overlap[0]
    base, ahead, inline = (_mean_step(runs[n]) for n in ("base", "prefetch", "inline"))
    info = {"base": base, "prefetch": ahead, "inline": inline,
            "steps": {n: runs[n]["step_s"] for n in runs}}
    assert base >= STEP_S, info
    assert ahead - base < 0.5 * DELAY_S, info    # the planner's time is hidden
    assert inline - base > 0.5 * DELAY_S, info   # and without prefetch it is not


@pytest.mark.slow
def test_prefetch_changes_no_result(overlap) -> None:
    for runs in overlap:
        ref = runs["base"]["losses"]
        assert len(ref) == STEPS and all(math.isfinite(x) for x in ref)
        for name in ("prefetch", "inline"):
            assert runs[name]["losses"] == pytest.approx(ref, rel=1e-6, abs=1e-7), name
