"""End to end: the launcher trains a few steps with CP=2 (torchrun, gloo, CPU) and with CP=1,
and the per-step losses and gradient norms agree to fp32 rounding, for two CP strategies;
FSDP x CP (4 processes) matches FSDP alone. Each run is the real launcher command
(``python -m varlen_cp.integrations.torchtitan.train``). The same runs' logs and TensorBoard
events carry the plan (``varlen_cp.report``), checked against plans rebuilt here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
# slow: one module fixture runs every training launch (~3 min on 2 cores)
pytestmark = pytest.mark.slow

TOML = """
[job]
dump_folder = "{dump}"
[model]
dim = 64
n_layers = 4
n_heads = 4
n_kv_heads = 2
vocab_size = 256
ffn_hidden_dim = 128
attention_chunk_size = 64
nope_layer_interval = 4
use_qk_norm = true
max_seq_len = 512
[training]
seq_len = 512
steps = 3
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
[dataloader]
min_doc_len = 12
doc_len_alpha = 1.1
alphabet = 128
[metrics]
log_freq = 1
[debug]
seed = 7
deterministic = true
"""


LAUNCHER = "varlen_cp.integrations.torchtitan.train"
SINK = ["--model.softmax_type", "learnable", "--model.track_max_logit", "true"]
COMPILE = ["--compile.enable", "true", "--compile.backend"]
RUNS = {  # name: (processes, overrides)
    "cp1": (1, []),
    "cp2_p2p": (2, ["--parallelism.context_parallel_degree", "2",
                    "--varlen_cp.strategy", "p2p"]),
    "cp2_all_gather": (2, ["--parallelism.context_parallel_degree", "2",
                           "--varlen_cp.strategy", "all_gather", "--varlen_cp.validate"]),
    # one GPU per node: the CP group spans two nodes (the plan's topology, the cost
    # model's two links, the report's cross-node bytes)
    "cp2_dispatch": (2, ["--parallelism.context_parallel_degree", "2",
                         "--varlen_cp.strategy", "dispatch", "--metrics.enable_tensorboard",
                         "--varlen_cp.gpus_per_node", "1"]),
    # 2 GPUs per node at CP=4: nodes (0, 0, 1, 1), dispatch relayed through them
    "cp4_relay": (4, ["--parallelism.context_parallel_degree", "4",
                      "--varlen_cp.strategy", "dispatch", "--varlen_cp.gpus_per_node", "2"]),
    "cp2_a2a": (2, ["--parallelism.context_parallel_degree", "2",
                    "--varlen_cp.strategy", "a2a", "--varlen_cp.layout", "contiguous"]),
    # dp_shard=2 gives each data-parallel rank its own batch; adding CP=2 (4 processes,
    # te layout with padding) must not change anything.
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "fsdp2_cp2": (4, ["--parallelism.data_parallel_shard_degree", "2",
                      "--parallelism.context_parallel_degree", "2",
                      "--varlen_cp.layout", "te"]),
    # learnable attention sinks (a trained parameter per layer, FSDP-sharded over cp) and
    # per-layer max logits in the metrics
    # torch.compile of every block (fullgraph, torchtitan's default) and of the loss: the CP
    # call is one custom op (varlen_cp.graph_op); aot_eager and inductor (C++ on the host);
    # layouts whose local token counts change from batch to batch
    "cp2_compile": (2, ["--parallelism.context_parallel_degree", "2",
                        "--varlen_cp.strategy", "dispatch", "--varlen_cp.layout", "dual_chunk",
                        "--varlen_cp.min_chunk_tokens", "16",
                        *COMPILE, "aot_eager"]),
    "cp2_compile_inductor": (2, ["--parallelism.context_parallel_degree", "2",
                                 "--varlen_cp.strategy", "p2p", "--varlen_cp.layout", "te",
                                 *COMPILE, "inductor"]),
    # the graph-safe mode: every rank's rows at a fixed capacity, static strategies
    "cp2_graph_safe": (2, ["--parallelism.context_parallel_degree", "2",
                           "--varlen_cp.strategy", "p2p", "--varlen_cp.graph_safe"]),
    "cp1_sink": (1, SINK + ["--varlen_cp.report", "false"]),  # and no plan in the log
    "cp2_sink": (2, SINK + ["--parallelism.context_parallel_degree", "2",
                            "--varlen_cp.strategy", "p2p"]),
}


def start(root: Path, name: str, nproc: int, overrides: list[str]):
    out = root / name
    out.mkdir()
    cfg = out / "job.toml"
    cfg.write_text(TOML.format(dump=out / "dump"))
    loss_file = out / "loss.jsonl"
    launcher = [sys.executable, "-m", LAUNCHER]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", "-m", LAUNCHER]
    cmd = launcher + ["--config", str(cfg), "--metrics.loss_file", str(loss_file), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(out / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)
    return proc, log, out, cmd


def finish(proc, log, out: Path, cmd: list[str]) -> list[dict]:
    try:
        proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (out / "log.txt").read_text()
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{text[-8000:]}"
    rows = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return rows


@pytest.fixture(scope="module")
def train_root(tmp_path_factory) -> Path:
    """Where each run's job.toml, log.txt, loss.jsonl and dump folder are."""
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def results(train_root):
    """All runs at once: each is mostly process start-up, so together they take about the
    time of the slowest instead of the sum (~2 min on 2 busy cores instead of ~5)."""
    root = train_root
    started = {name: start(root, name, n, o) for name, (n, o) in RUNS.items()}
    return {name: finish(*s) for name, s in started.items()}


def assert_same(ref: list[dict], got: list[dict], what: str) -> None:
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (what, ref, got)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6), \
            (what, ref, got)


@pytest.mark.parametrize("strategy", ["p2p", "all_gather", "a2a", "dispatch"])
def test_cp2_matches_cp1(results, strategy):
    got = results[f"cp2_{strategy}"]
    assert_same(results["cp1"], got, strategy)


def test_cp4_relayed_dispatch_matches_cp1(results):
    """CP=4 on two nodes of two GPUs: every dispatch transfer relayed through the nodes."""
    assert_same(results["cp1"], results["cp4_relay"], "cp4 relayed dispatch")


@pytest.mark.parametrize("run", ["cp2_compile", "cp2_compile_inductor"])
def test_compiled_cp2_matches_eager_cp1_without_breaks_or_new_graphs(results, run):
    """[compile] enable = true at CP=2: the same losses and grad norms as eager CP=1, no
    graph break, and every graph compiled in the first step (the Llama 4 style model's
    chunked and global blocks, the loss); later batches, other documents, add none."""
    got = results[run]
    assert_same(results["cp1"], got, run)
    assert all(r["graph_breaks"] == 0 for r in got), got
    assert got[0]["compiled_graphs"] > 0
    assert all(r["compiled_graphs"] == got[0]["compiled_graphs"] for r in got), got


def test_graph_safe_cp2_matches_cp1(results):
    """[varlen_cp] graph_safe = true: plans at a fixed capacity per rank, the batch sharded
    to it, the static ring: the same losses and gradient norms as CP=1."""
    assert_same(results["cp1"], results["cp2_graph_safe"], "cp2 graph-safe")


def test_learnable_sink_cp2_matches_cp1(results):
    ref, got = results["cp1_sink"], results["cp2_sink"]
    assert_same(ref, got, "learnable sink")
    # the sink changes training (it trains from 0 = off-by-one, unlike vanilla)
    assert ref[-1]["loss"] != pytest.approx(results["cp1"][-1]["loss"], rel=1e-6)
    for a, b in zip(ref, got):
        assert sorted(a["max_logit"]) == [f"max_logit/layer_{i}" for i in range(4)]
        for key, value in a["max_logit"].items():
            assert b["max_logit"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert "max_logit" not in results["cp1"][0]


def test_fsdp_x_cp_matches_fsdp(results):
    assert_same(results["fsdp2"], results["fsdp2_cp2"], "fsdp x cp")


def test_loss_is_finite_and_falls(results):
    losses = [r["loss"] for r in results["cp1"]]
    assert all(x == x and abs(x) < 1e6 for x in losses)
    assert losses[-1] < losses[0]


# ---- what the log and the metrics say about the plan (varlen_cp.report) ---------------------
def reference_plans(root: Path, run: str) -> tuple[list, list]:
    """The plans of the run's three batches, rebuilt here from its job file and the
    synthetic data loader (batch i is step i + 1), and the model's layer masks."""
    from varlen_cp.integrations.torchtitan.config import load_config
    from varlen_cp.integrations.torchtitan.data import SyntheticPackedDataLoader
    from varlen_cp.integrations.torchtitan.stock import attention_layers, layer_masks
    from varlen_cp.integrations.torchtitan.trainer import packed_cu_seqlens
    from varlen_cp.prefetch import build_plan

    n, overrides = RUNS[run]
    cfg = load_config(["--config", str(root / run / "job.toml"), *overrides], cpu=True)
    masks = layer_masks(attention_layers(cfg.model_spec.model))
    data = SyntheticPackedDataLoader(cfg.dataloader, seq_len=cfg.training.seq_len)
    plans = []
    for i in range(3):
        inputs, _ = data.batch(i)
        cu = packed_cu_seqlens(inputs["positions"], tuple(inputs["input"].shape))
        plans.append(build_plan(cu, cfg.varlen_cp, cp_size=cfg.parallelism
                                .context_parallel_degree, cp_rank=0, layer_masks=masks))
    return plans, masks


def plan_lines(log: str) -> list[str]:
    return [line.split(" - varlen_cp - INFO - ", 1)[1] for line in log.splitlines()
            if " - varlen_cp - INFO - " in line]


def test_log_states_the_plan(results, train_root):
    from varlen_cp.report import mask_label

    plans, masks = reference_plans(train_root, "cp2_p2p")
    lines = plan_lines((train_root / "cp2_p2p" / "log.txt").read_text())
    heads = [line for line in lines if line.startswith("plan at step")]
    assert len(heads) == 1, lines  # rank 0 only; p2p and the layout never change
    p = plans[0]
    assert heads[0].startswith(f"plan at step 1: cp 2, layout balanced, 512 tokens in "
                               f"{p.n_docs} documents, 4 query / 2 K/V heads of dim 16, "
                               f"float32")
    table = [line.strip() for line in lines]
    start, ranks = table.index(next(x for x in table if x.startswith("layer type"))), \
        table.index(next(x for x in table if x.startswith("per rank")))
    rows = {line.split()[0]: line.split() for line in table[start + 1:ranks]}
    tokens = next(x for x in table[ranks:] if x.startswith("tokens ")).split()
    assert tokens[1:] == [str(p.num_tokens_of(r)) for r in range(2)]
    for mask, n in masks:
        label = mask_label(mask)
        assert rows[label][1:5] == [str(n), "p2p", "-", f"{p.work_imbalance(mask):.3f}"]
    assert any(line.strip().startswith("planner ") for line in lines)
    for step, plan in enumerate(plans, 1):  # every logged step: the batch's balance
        line = next(x for x in lines if x.startswith(f"step {step}: "))
        for mask, _ in masks:
            assert f"{mask_label(mask)} work {plan.work_imbalance(mask):.3f}" in line, line


def test_metrics_reach_tensorboard(results, train_root):
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from varlen_cp.report import mask_label
    from varlen_cp.tables import catalogue
    from varlen_cp.shape import AttnShape

    plans, masks = reference_plans(train_root, "cp2_dispatch")
    (events,) = (train_root / "cp2_dispatch" / "dump" / "tb").iterdir()
    acc = EventAccumulator(str(events))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
               for tag in acc.Tags()["scalars"] if tag.startswith("varlen_cp/")}
    shape = AttnShape(n_heads=4, n_kv_heads=2, head_dim=16, head_dim_v=16, dtype=torch.float32)
    for mask, _ in masks:
        key = mask_label(mask)
        work = scalars[f"varlen_cp/work_imbalance/{key}"]
        assert [s for s, _ in work] == [1, 2, 3]
        for (_, value), plan in zip(work, plans):
            assert value == pytest.approx(plan.work_imbalance(mask), rel=1e-6)
        for (_, value), plan in zip(scalars[f"varlen_cp/sent_bytes/{key}"], plans):
            sent = catalogue.bytes_sent("dispatch", plan, mask, shape)
            assert value == max(f + b for f, b in zip(sent["fwd"], sent["bwd"]))
        assert all(v >= 1 for _, v in scalars[f"varlen_cp/stages/{key}"])
        # two nodes of one rank: every byte a rank sends leaves its node
        assert scalars[f"varlen_cp/cross_node_bytes/{key}"] == \
            scalars[f"varlen_cp/sent_bytes/{key}"]
        # the step's backend reached the report: on CPUs "auto" is the PyTorch twin, no FA
        for what in ("work", "call"):
            assert scalars[f"varlen_cp/fa_{what}_share/{key}"] == [(1, 0.0), (2, 0.0),
                                                                    (3, 0.0)]
    assert all(v > 0 for _, v in scalars["varlen_cp/plan_ms"])
    assert [s for s, _ in scalars["varlen_cp/plan_wait_ms"]] == [1, 2, 3]


def test_report_switch(results, train_root):
    assert not plan_lines((train_root / "cp1_sink" / "log.txt").read_text())
    lines = plan_lines((train_root / "cp1" / "log.txt").read_text())
    assert sum(line.startswith("plan at step 1: cp 1,") for line in lines) == 1
