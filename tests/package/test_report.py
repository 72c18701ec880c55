"""varlen_cp.report: the plan report against brute-force counts and the plan's own API, the
training block and metrics (TrainingReport), and the prefetcher's timing. Host only, ~3 s."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from varlen_cp import AttnMask
from varlen_cp.config import AttnShape, CPConfig
from varlen_cp.prefetch import PlanPrefetcher, PlanTiming, build_plan, build_tables
from varlen_cp.report import LayerType, TrainingReport, layer_types, mask_label, plan_report
from varlen_cp.report.training import layer_keys
from varlen_cp.tables import catalogue
from varlen_cp.tables.auto import choose_strategy
from varlen_cp.tables.staged import resolve_stages

CU = torch.tensor([0, 37, 40, 140, 200, 330])
MASKS = [(AttnMask(chunk_size=32), 3), (AttnMask(), 1)]
SHAPE = AttnShape(n_heads=8, n_kv_heads=2, head_dim=16, head_dim_v=8, dtype=torch.float16)
KV_ROW = 2 * (16 + 8) * 2  # Hkv x (D + Dv) x fp16 bytes


def _tokens(plan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document, position) of the rank's real tokens, from its global token indices."""
    cu = plan.cu_seqlens
    idx = plan.token_indices_of(rank)
    idx = idx[idx >= 0]
    doc = torch.searchsorted(cu, idx, right=True) - 1
    return doc, idx - cu[doc]


def brute_force(plan, mask: AttnMask) -> tuple[list[int], list[int]]:
    """Per rank: visible pairs of its queries against whole documents, and the number of
    other ranks' keys that one of its queries sees (dense visibility per document)."""
    cp, cu = plan.cp_size, plan.cu_seqlens
    toks = [_tokens(plan, r) for r in range(cp)]
    work, floor = [], []
    for s in range(cp):
        qd, qp = toks[s]
        pairs = 0
        for d in qd.unique().tolist():
            length = int(cu[d + 1] - cu[d])
            pairs += int(mask.visible(qp[qd == d], torch.arange(length)).sum())
        seen = 0
        for o in range(cp):
            if o == s:
                continue
            kd, kp = toks[o]
            for d in kd.unique().tolist():
                q = qp[qd == d]
                if q.numel():
                    seen += int(mask.visible(q, kp[kd == d]).any(0).sum())
        work.append(pairs)
        floor.append(seen)
    return work, floor


@pytest.mark.parametrize("layout", ["balanced", "dual_chunk", "contiguous"])
def test_report_matches_brute_force_and_plan_api(one_thread, layout):
    config = CPConfig(layout=layout, min_chunk_tokens=8 if layout == "dual_chunk" else None)
    plan = build_plan(CU, config, cp_size=3, cp_rank=0, layer_masks=MASKS)
    rep = plan_report(plan, layer_types(MASKS, "p2p"), SHAPE)
    assert rep.tokens == [plan.num_tokens_of(r) for r in range(3)]
    assert rep.token_imbalance == plan.token_imbalance()
    assert (rep.cp, rep.layout, rep.n_docs, rep.total_tokens) == (3, layout, 5, 330)
    for r, (mask, n) in zip(rep.layers, MASKS):
        work, floor = brute_force(plan, mask)
        assert r.work == work == plan.work_per_rank(mask)
        assert r.work_imbalance == pytest.approx(max(work) * 3 / sum(work))
        assert r.work_imbalance == plan.work_imbalance(mask)
        assert r.kv_floor_bytes == [f * KV_ROW for f in floor]
        sent = catalogue.bytes_sent("p2p", plan, mask, AttnShape(
            n_heads=8, n_kv_heads=2, head_dim=16, head_dim_v=8, dtype=torch.bfloat16))
        assert r.sent_bytes == [f + b for f, b in zip(sent["fwd"], sent["bwd"])]
        assert (r.layer.n_layers, r.strategy, r.stages, r.estimates) == (n, "p2p", None, None)


def test_auto_and_stages_resolve_as_the_op_does(one_thread):
    config = CPConfig(strategy="auto")
    plan = build_plan(CU, config, cp_size=2, cp_rank=0, layer_masks=MASKS)
    build_tables(plan, config, MASKS, SHAPE, "cpu")
    rep = plan_report(plan, layer_types(MASKS, "auto"), SHAPE, with_estimates="auto")
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=16, head_dim_v=8, dtype=torch.bfloat16)
    for r, (mask, _) in zip(rep.layers, MASKS):
        picked = choose_strategy(plan, mask, shape)
        assert r.strategy == r.auto_pick == picked
        assert set(r.estimates) >= {"p2p", "dispatch", "all_gather"}
        staged = picked in ("dispatch", "all_gather")
        assert r.stages == (resolve_stages(plan, mask, picked, shape, None) if staged else None)
    assert TrainingReport(layer_types(MASKS, "auto"), SHAPE).choices(plan) == rep.choices()
    assert rep.model_seconds() == pytest.approx(
        sum(n * r.estimates[r.strategy].seconds for r, (_, n) in zip(rep.layers, MASKS)))
    # fixed strategies get no estimates with "auto", every one with True
    fixed = plan_report(plan, layer_types(MASKS, "dispatch"), SHAPE, with_estimates="auto")
    assert all(r.estimates is None for r in fixed.layers) and fixed.model_seconds() is None
    full = plan_report(plan, layer_types(MASKS, "dispatch"), SHAPE, overlap_stages=2,
                       with_estimates=True)
    assert all(r.stages == 2 and r.estimates for r in full.layers)


def test_cp1_reports_the_local_op(one_thread):
    plan = build_plan(CU, CPConfig(), cp_size=1, cp_rank=0, layer_masks=MASKS)
    rep = plan_report(plan, layer_types(MASKS, "auto"), SHAPE, with_estimates=True)
    assert [r.strategy for r in rep.layers] == ["local", "local"]
    assert all(r.sent_bytes == [0] and r.kv_floor_bytes == [0] for r in rep.layers)


def test_bad_arguments_name_the_field(one_thread):
    plan = build_plan(CU, CPConfig(), cp_size=2, cp_rank=0, layer_masks=MASKS)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        plan_report(plan, [], SHAPE)
    with pytest.raises(ValueError, match="shape must be"):
        plan_report(plan, layer_types(MASKS, "p2p"), "8x2")
    with pytest.raises(ValueError, match="with_estimates"):
        plan_report(plan, layer_types(MASKS, "p2p"), SHAPE, with_estimates="yes")


@pytest.mark.parametrize("mask,label", [
    (AttnMask(), "causal"), (AttnMask(causal=False), "full"),
    (AttnMask(chunk_size=8192), "chunk8192"), (AttnMask(window_size=(4096, 0)), "window4096"),
    (AttnMask(causal=False, window_size=(4, 4)), "full+window(4,4)"),
    (AttnMask(chunk_size=64, window_size=(16, 0)), "chunk64+window(16,0)")])
def test_mask_labels(mask, label):
    assert mask_label(mask) == label


def test_layer_keys_tell_strategies_apart():
    layers = [LayerType(AttnMask(), 2, "p2p"), LayerType(AttnMask(), 1, "a2a"),
              LayerType(AttnMask(chunk_size=8), 1, "p2p")]
    assert layer_keys(layers) == ["causal@p2p", "causal@a2a", "chunk8"]


# ---- training logs and metrics --------------------------------------------------------------
def _block(records) -> list[str]:
    return [r.getMessage() for r in records if r.name == "varlen_cp"]


def test_training_report_block_and_metrics(one_thread, caplog):
    caplog.set_level(logging.INFO, logger="varlen_cp")
    config = CPConfig(strategy="auto")
    plans = [build_plan(cu, config, cp_size=2, cp_rank=0, layer_masks=MASKS)
             for cu in (CU, torch.tensor([0, 100, 330]))]
    report = TrainingReport(layer_types(MASKS, "auto"), SHAPE)
    timing = PlanTiming(plan_s=0.012, wait_s=0.0, lead_s=0.25)
    report.on_batch(plans[0], timing, step=1)
    lines = _block(caplog.records)
    assert lines[0].startswith("plan at step 1: cp 2, layout balanced, 330 tokens in 5 "
                               "documents, 8 query / 2 K/V heads of dim 16/8, float16")
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    for mask, n in MASKS:
        row = rows[mask_label(mask)]
        picked = choose_strategy(plans[0], mask, AttnShape(n_heads=8, n_kv_heads=2,
                                                           head_dim=16, head_dim_v=8))
        assert row[1:5] == [str(n), "auto", "->", picked]
        assert f"{plans[0].work_imbalance(mask):.3f}" in row
    tokens = [line for line in lines if line.strip().startswith("tokens ")][0].split()
    assert tokens[1:] == [str(plans[0].num_tokens_of(r)) for r in range(2)]
    assert any(line.strip().startswith("estimates (chunk32") for line in lines)
    assert lines[-1].strip() == "planner 12.0 ms for this batch; ready 250 ms before the " \
        "step asked"
    assert report.blocks == 1

    caplog.clear()
    report.on_batch(plans[1], PlanTiming(0.02, 0.005, 0.0), step=2)  # same choices: silent?
    changed = report.choices(plans[1]) != report.choices(plans[0])
    assert bool(_block(caplog.records)) == changed and report.blocks == 1 + changed

    caplog.clear()
    metrics = report.log_step(2)
    assert metrics["varlen_cp/token_imbalance"] == plans[1].token_imbalance()
    for mask, _ in MASKS:
        key = mask_label(mask)
        assert metrics[f"varlen_cp/work_imbalance/{key}"] == plans[1].work_imbalance(mask)
        floor = max(brute_force(plans[1], mask)[1])
        assert metrics[f"varlen_cp/kv_floor_bytes/{key}"] == floor * KV_ROW
    assert metrics["varlen_cp/plan_ms"] == pytest.approx(20.0)
    assert metrics["varlen_cp/plan_wait_ms"] == pytest.approx(2.5)   # (0 + 5 ms) / 2 steps
    assert metrics["varlen_cp/plans_late"] == 1.0
    assert _block(caplog.records)[0].startswith("step 2: chunk32 work ")
    assert report.log_step(3)["varlen_cp/plans_late"] == 0.0   # reset per interval


def test_choice_change_logs_a_new_block(one_thread, caplog):
    caplog.set_level(logging.INFO, logger="varlen_cp")
    report = TrainingReport(layer_types(MASKS, "p2p"), SHAPE)
    for step, layout in enumerate(("balanced", "balanced", "contiguous"), 1):
        config = CPConfig(layout=layout)
        report.on_batch(build_plan(CU, config, cp_size=2, cp_rank=0, layer_masks=MASKS),
                        None, step)
    lines = _block(caplog.records)
    assert [line.split(":")[0] for line in lines if line.startswith("plan at")] == \
        ["plan at step 1", "plan at step 3"]
    assert "the plan's choices changed at step 3" in lines


def test_switched_off_and_other_ranks(one_thread, caplog):
    caplog.set_level(logging.INFO, logger="varlen_cp")
    plan = build_plan(CU, CPConfig(), cp_size=2, cp_rank=0, layer_masks=MASKS)
    off = TrainingReport(layer_types(MASKS, "p2p"), SHAPE, enabled=False)
    off.on_batch(plan, None, 1)
    assert off.log_step(1) == {} and not _block(caplog.records)
    quiet = TrainingReport(layer_types(MASKS, "p2p"), SHAPE, log_block=False)
    quiet.on_batch(plan, None, 1)
    metrics = quiet.log_step(1)
    assert not _block(caplog.records)
    assert metrics["varlen_cp/work_imbalance/causal"] == plan.work_imbalance(AttnMask())
    assert "varlen_cp/plan_ms" not in metrics   # no timing given


# ---- prefetch timing ------------------------------------------------------------------------
def test_prefetcher_records_plan_time_wait_and_lead():
    def make_plan(item):
        time.sleep(0.05)
        return item

    prefetcher = PlanPrefetcher(range(3), make_plan)
    timings = []
    for i, (item, plan) in enumerate(prefetcher):
        assert item == plan == i
        timings.append(prefetcher.last_timing)
        time.sleep(0.3)  # a step much longer than planning: the next plan is ready
    prefetcher.close()
    assert all(t.plan_s >= 0.045 for t in timings)
    assert timings[0].wait_s > 0.0 and timings[0].lead_s == 0.0   # nothing ready at start
    for t in timings[1:]:
        assert t.wait_s == 0.0 and t.lead_s > 0.1, timings   # ready for >= one step
    inline = PlanPrefetcher(range(2), make_plan, enabled=False)
    for _ in inline:
        t = inline.last_timing
        assert t.wait_s is None and t.lead_s is None and t.plan_s >= 0.045
