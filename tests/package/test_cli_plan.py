"""varlen-cp-plan (varlen_cp.cli.plan) and the demo's loss curve: the printed report and its
JSON against the plan's own API, on a lengths file, a JSONL field and TOML job files; the
PNGs; bad input (exit 2); no torchtitan needed. In-process except two subprocesses, ~25 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from varlen_cp import AttnMask
from varlen_cp.cli import jobs, lengths, loss_curve, plan, plots
from varlen_cp.config import CPConfig
from varlen_cp.plan import Topology
from varlen_cp.prefetch import build_plan
from varlen_cp.tables.auto import choose_strategy
from varlen_cp.shape import AttnShape
from varlen_cp.tables.selected import fetched_tokens

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def reference_pack(doc_lengths: list[int], seq_len: int, rows: int) -> list[torch.Tensor]:
    """Documents streamed into rows of seq_len (cut at row ends), rows grouped by ``rows``."""
    all_rows, row, room = [], [], seq_len
    for n in doc_lengths:
        while n:
            take = min(n, room)
            row.append(take)
            n, room = n - take, room - take
            if room == 0:
                all_rows.append(row)
                row, room = [], seq_len
    batches = [sum(all_rows[i * rows:(i + 1) * rows], [])
               for i in range(len(all_rows) // rows)]
    return [torch.tensor([0] + b).cumsum(0) for b in batches]


@pytest.mark.parametrize("rows", [1, 2])
def test_pack_matches_a_token_stream(rows):
    docs = [5, 300, 17, 1, 1, 900, 64, 64, 3000, 2]
    got = lengths.pack(docs, 256, rows)
    want = reference_pack(docs, 256, rows)
    assert len(got) == len(want) == sum(docs) // (256 * rows)
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()


@pytest.mark.parametrize("text,mask,n", [
    ("causal", AttnMask(), 1), ("full:2", AttnMask(causal=False), 2),
    ("chunk=8192:3", AttnMask(chunk_size=8192), 3),
    ("window=4096:5", AttnMask(window_size=(4096, 0)), 5),
    ("full+window=128,64", AttnMask(causal=False, window_size=(128, 64)), 1),
    ("chunk=64+window=16", AttnMask(chunk_size=64, window_size=(16, 0)), 1)])
def test_mask_syntax(text, mask, n):
    assert jobs.parse_mask(text) == (mask, n)


@pytest.mark.parametrize("text", ["chunk", "chunk=x", "causal:0", "window=1,2,3", "sliding:2",
                                  "chunk=0"])
def test_bad_mask_names_the_flag(text):
    with pytest.raises(ValueError, match="--mask"):
        jobs.parse_mask(text)


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch):
    """The planner reads LOCAL_WORLD_SIZE for its default GPUs per node: a launch's value
    left in this process must not change the tests' plans."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = plan.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def check_batch_against_plan(batch: dict, cu: torch.Tensor, cp: int, config: CPConfig,
                             masks: list, kv_row: int, text: str | None = None) -> None:
    """The JSON figures of one batch equal the plan API's, and the text (batch 0's
    tables) shows them."""
    p = build_plan(cu, config, cp_size=cp, cp_rank=0, layer_masks=masks)
    assert batch["tokens"] == [p.num_tokens_of(r) for r in range(cp)]
    assert batch["token_imbalance"] == p.token_imbalance()
    for layer, (mask, n) in zip(batch["layers"], masks):
        assert layer["n_layers"] == n
        assert layer["work"] == p.work_per_rank(mask)
        assert layer["work_imbalance"] == p.work_imbalance(mask)
        assert layer["kv_floor_bytes"] == [t * kv_row for t in fetched_tokens(p, mask)]
        if text is not None:
            row = [line for line in text.splitlines() if line.split()[:1] == [layer["label"]]]
            assert f"{p.work_imbalance(mask):.3f}" in row[0].split(), row


def test_lengths_file_with_flags(capsys, tmp_path, one_thread):
    docs = [int(x) for x in torch.randint(1, 3000, (200,), generator=torch.Generator()
                                          .manual_seed(3))]
    path = tmp_path / "lengths.txt"
    path.write_text("# doc lengths\n" + "\n".join(", ".join(map(str, docs[i:i + 7]))
                                                 for i in range(0, len(docs), 7)))
    args = ["--lengths", str(path), "--cp", "4", "--heads", "16", "--kv-heads", "4",
            "--head-dim", "64", "--mask", "chunk=1024:3", "--mask", "causal:1",
            "--seq-len", "16384", "--strategy", "auto", "--batches", "3",
            "--sweep", "2,4,8", "--out", str(tmp_path / "png"), "--json",
            str(tmp_path / "rep.json")]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep.json").read_text())
    cus = reference_pack(docs, 16384, 1)
    assert rep["n_batches"] == len(cus) and len(rep["batches"]) == min(3, len(cus))
    masks = [(AttnMask(chunk_size=1024), 3), (AttnMask(), 1)]
    config = CPConfig(strategy="auto")
    kv_row = 4 * (64 + 64) * 2
    for i, (batch, cu) in enumerate(zip(rep["batches"], cus)):
        check_batch_against_plan(batch, cu, 4, config, masks, kv_row, out if i == 0 else None)
    p0 = build_plan(cus[0], config, cp_size=4, cp_rank=0, layer_masks=masks)
    for layer, (mask, _) in zip(rep["batches"][0]["layers"], masks):
        pick = choose_strategy(p0, mask, AttnShape(n_heads=16, n_kv_heads=4, head_dim=64))
        assert layer["strategy"] == layer["auto_pick"] == pick
        assert f"{layer['label']} -> {pick}" in out
    # per-rank table of batch 0: one row per rank, tokens first
    rows = out.split("per rank:\n")[1].splitlines()[1:5]
    assert [r.split()[:2] for r in rows] == [[str(i), str(p0.num_tokens_of(i))]
                                             for i in range(4)]
    assert set(rep["sweep"]) == {"2", "4", "8"} and "auto" in rep["sweep"]["4"]
    if plots.have_matplotlib():
        for name in ("plan_work.png", "plan_traffic.png", "plan_strategies.png"):
            png = tmp_path / "png" / name
            assert png.read_bytes()[:8] == PNG_MAGIC and f"png: {png}" in out


def test_without_matplotlib_prints_the_report_and_the_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    rc, out, _ = run_cli(capsys, "--mix", "short_4k", "--cp", "2", "--heads", "4",
                         "--seq-len", "1024", "--sweep", "2", "--out", str(tmp_path / "png"))
    assert rc == 0 and "per rank:" in out and plots.INSTALL_HINT in out
    assert not (tmp_path / "png").exists()


def test_jsonl_length_field(capsys, tmp_path, one_thread):
    rows = [{"id": i, "n_tokens": [0] * n} if i % 2 else {"id": i, "n_tokens": n}
            for i, n in enumerate([700, 90, 1500, 3, 2048, 611, 400, 40, 1100, 880])]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc, out, err = run_cli(capsys, "--jsonl", str(path), "--length-field", "n_tokens",
                           "--cp", "2", "--heads", "8", "--kv-heads", "2", "--seq-len", "2048",
                           "--layout", "dual_chunk", "--sweep", "2", "--json",
                           str(tmp_path / "rep.json"))
    assert rc == 0, err
    docs = [r["n_tokens"] if isinstance(r["n_tokens"], int) else len(r["n_tokens"])
            for r in rows]
    rep = json.loads((tmp_path / "rep.json").read_text())
    cus = reference_pack(docs, 2048, 1)
    for i, (batch, cu) in enumerate(zip(rep["batches"], cus)):
        check_batch_against_plan(batch, cu, 2, CPConfig(layout="dual_chunk"),
                                 [(AttnMask(), 1)], 2 * 256 * 2, out if i == 0 else None)
    rc, _, err = run_cli(capsys, "--jsonl", str(path), "--cp", "2", "--heads", "8")
    assert rc == 2 and "docs.jsonl:1: no field 'length'" in err


def test_torchtitan_job_file(capsys, tmp_path, one_thread):
    config = REPO / "configs" / "llama4_debug_cp2.toml"
    job = jobs.read_job(config)
    assert (job.cp, job.config.layout, job.config.strategy, job.seq_len) == \
        (2, "balanced", "p2p", 1024)
    assert [(t.mask, t.n_layers, t.strategy) for t in job.layers] == \
        [(AttnMask(chunk_size=128), 3, "p2p"), (AttnMask(), 1, "p2p")]
    s = job.shape
    assert (s.n_heads, s.n_kv_heads, s.head_dim, s.dtype) == (8, 2, 16, torch.float32)
    rc, out, err = run_cli(capsys, "--config", str(config), "--mix", "lognormal_1k",
                           "--sweep", "2", "--json", str(tmp_path / "rep.json"))
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep.json").read_text())
    cus = lengths.pack(lengths.mix_lengths("lognormal_1k", 4 * 1024), 1024)
    check_batch_against_plan(rep["batches"][0], cus[0], 2,
                             CPConfig(layout="balanced"),
                             [(AttnMask(chunk_size=128), 3), (AttnMask(), 1)],
                             2 * 32 * 4, out)
    assert "llama4_debug_cp2.toml (torchtitan, model llama4_style)" in out
    # flags override the file
    job = jobs.with_flags(job, plan.build_parser().parse_args(
        ["--cp", "4", "--strategy", "dispatch", "--mask", "window=64:2"]))
    assert (job.cp, job.config.strategy) == (4, "dispatch")
    assert [(t.mask, t.n_layers, t.strategy) for t in job.layers] == \
        [(AttnMask(window_size=(64, 0)), 2, "dispatch")]


def test_megatron_job_file():
    pytest.importorskip("megatron.core")
    job = jobs.read_job(REPO / "configs" / "megatron_llama4_debug.toml")
    assert (job.cp, job.config.layout, job.seq_len) == (2, "balanced", 1024)
    assert [(t.mask, t.n_layers, t.strategy) for t in job.layers] == \
        [(AttnMask(chunk_size=128), 3, "p2p"), (AttnMask(), 1, "p2p")]
    assert (job.shape.n_heads, job.shape.n_kv_heads, job.shape.head_dim) == (8, 2, 16)


def test_stock_torchtitan_model():
    pytest.importorskip("torchtitan")
    job = jobs.read_job(REPO / "configs" / "gpt_oss_debug_cp2.toml")
    # gpt_oss debugmodel: a 128-token sliding window on layers 0 and 2, global on 1 and 3
    assert {(t.mask, t.n_layers) for t in job.layers} == \
        {(AttnMask(window_size=(127, 0)), 2), (AttnMask(), 2)}
    assert (job.shape.n_heads, job.shape.n_kv_heads) == (64, 8)
    assert (job.cp, job.config.strategy, job.config.layout) == (2, "dispatch", "balanced")


@pytest.mark.parametrize("args,message", [
    (["--mix", "short_4k", "--cp", "0", "--heads", "4"], "--cp must be an int >= 1"),
    (["--mix", "nope", "--cp", "2", "--heads", "4"], "--mix must be one of"),
    (["--mix", "short_4k", "--cp", "2"], "--heads is required"),
    (["--lengths", "/nonexistent", "--cp", "2", "--heads", "4"], "no such file"),
    (["--mix", "short_4k", "--lengths", "x", "--cp", "2", "--heads", "4"],
     "exactly one of --lengths, --jsonl, --mix"),
    (["--mix", "short_4k", "--cp", "3", "--heads", "4", "--strategy", "a2a"], "a2a"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--mask", "chunk=-1"], "--mask"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--seq-len", "100000000",
      "--tokens", "1000"], "fewer than one batch"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--a2a-size", "2"], "--a2a-size"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--backend", "cuda"],
     "--backend: backend must be one of"),
    (["--config", str(REPO / "README.md"), "--mix", "short_4k"], "not valid TOML"),
    # contradictory or repeated mask terms, head dims the kernels refuse (issue 29)
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--mask", "causal+full"],
     "'full' repeats or contradicts 'causal'"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--mask", "chunk=8192+chunk=64"],
     "'chunk=64' repeats or contradicts 'chunk=8192'"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--mask", "window=8+window=16"],
     "'window=16' repeats or contradicts 'window=8'"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--head-dim", "300"],
     "--head-dim must be at most 256"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--head-dim-v", "512"],
     "--head-dim-v must be at most 256"),
    # sizes a plan's memory grows with: refused before anything is built (issue 29)
    (["--mix", "short_4k", "--cp", "100000", "--heads", "4"], "--cp must be at most 4096"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--sweep", "2,1000000"],
     "--sweep values must be at most 4096"),
    # every error names the flag, and cp 1 is checked as the launchers check it (issue 29)
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--flops", "0"],
     "--flops: CostModel.flops_per_s must be a finite number > 0, got 0.0"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--bandwidth", "nan"],
     "--bandwidth: CostModel.bytes_per_s must be a finite number > 0, got nan"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "8", "--kv-heads", "3"],
     "--heads 8 --kv-heads 3: AttnShape: n_heads=8 must be a multiple of n_kv_heads=3"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "0"], "--heads 0: AttnShape.n_heads"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--layout", "te", "--pad-multiple",
      "3"], "--layout te: pad_multiple must be a positive multiple of 2*cp_size=4, got 3"),
    (["--mix", "short_4k", "--cp", "1", "--heads", "4", "--strategy", "a2a+p2p",
      "--a2a-size", "3"], "strategy 'a2a+p2p' at cp 1: a2a_size must be a positive divisor"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--gpus-per-node", "0"],
     "--gpus-per-node must be an int >= 1, got 0"),
    (["--mix", "short_4k", "--cp", "2", "--heads", "4", "--cross-node-bandwidth", "0"],
     "--cross-node-bandwidth: CostModel.cross_node_bytes_per_s must be a finite number > 0"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--strategy", "ring"])
    assert e.value.code == 2


NO_TORCHTITAN = """
import sys
sys.modules["torchtitan"] = None  # as if not installed: importing it raises ImportError
from varlen_cp.cli import plan
rc = plan.main(sys.argv[1:])
assert sys.modules["torchtitan"] is None and "megatron" not in sys.modules
sys.exit(rc)
"""


def test_runs_without_torchtitan(tmp_path):
    run = [sys.executable, "-c", NO_TORCHTITAN]
    ok = subprocess.run(run + ["--config", str(REPO / "configs" / "llama4_debug_cp2.toml"),
                               "--mix", "short_4k", "--sweep", "2"],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "layer types:" in ok.stdout
    stock = subprocess.run(run + ["--config", str(REPO / "configs" / "qwen3_debug_cp2.toml"),
                                  "--mix", "short_4k"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert stock.returncode == 2 and "needs torchtitan" in stock.stderr, stock.stderr


def test_loss_curve(capsys, tmp_path):
    files = []
    for name, shift in (("cp2", 1e-6), ("cp1", 0.0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"step": s, "loss": 6.0 / s + shift}) + "\n"
                                for s in range(1, 11)))
        files.append(str(path))
    out_png = tmp_path / "curve" / "loss_curve.png"
    rc = loss_curve.main(files + ["--out", str(out_png)])
    printed = capsys.readouterr().out
    if plots.have_matplotlib():
        assert rc == 0 and out_png.read_bytes()[:8] == PNG_MAGIC
        assert printed.strip() == f"loss curve: {out_png}"
    assert loss_curve.main([files[0], str(tmp_path / "missing.jsonl"), "--out",
                            str(out_png)]) == 2
    assert "no such loss file" in capsys.readouterr().err


def test_corpus_size_costs_linear_time(tmp_path, capsys):
    """varlen-cp-plan reads a lengths file once and packs only the batches it analyses:
    10x the corpus costs no more than ~20x the time (the CLI used to build and scan every
    batch: 1e7 tokens 0.25 s, 1e8 ~16 s). Minima of thread time over two runs; the
    1e12-token single document plans too (it used to ask torch.arange for 7.8 GB)."""
    import time as time_mod

    rng = np.random.default_rng(0)

    def corpus(tokens: int) -> Path:
        n = tokens // 1500
        x = np.exp(rng.normal(0.0, 1.0, n))
        lengths_ = np.maximum(1, (x * (tokens - n) / x.sum()).astype(np.int64) + 1)
        lengths_[0] += tokens - int(lengths_.sum())
        path = tmp_path / f"corpus_{tokens}.txt"
        np.savetxt(path, lengths_, fmt="%d")
        return path

    def cost(path: Path) -> float:
        best = float("inf")
        for _ in range(2):
            start = time_mod.thread_time()
            rc, _, err = run_cli(capsys, "--lengths", str(path), "--cp", "4", "--heads", "4",
                                 "--head-dim", "64", "--seq-len", "1024", "--batches", "1",
                                 "--sweep", "2")
            best = min(best, time_mod.thread_time() - start)
            assert rc == 0, err
        return best

    small, large = cost(corpus(10 ** 7)), cost(corpus(10 ** 8))
    assert large <= 20 * small, (small, large)
    one = tmp_path / "one.txt"
    one.write_text(f"{10 ** 12}\n")
    rc, out, err = run_cli(capsys, "--lengths", str(one), "--cp", "4", "--heads", "4",
                           "--head-dim", "64", "--seq-len", "1024", "--batches", "1",
                           "--sweep", "2")
    assert rc == 0 and "976562500 batches" in out, (err, out[:400])


def test_bad_outputs_and_undecodable_inputs_exit_2_before_planning(tmp_path, capsys,
                                                                   monkeypatch):
    """--json naming a folder, --out naming a file, an output under a file, and a lengths /
    JSONL file with a byte that is not UTF-8: one line naming the flag and the file, exit
    2, and no planning done (issue 29: these were tracebacks after the whole analysis)."""
    job = ["--mix", "short_4k", "--cp", "2", "--heads", "4"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    planned = []
    monkeypatch.setattr(plan, "analyse", lambda *a, **k: planned.append(1))
    for args, message in (
            (["--json", str(tmp_path)], f"--json: {tmp_path} is a folder"),
            (["--out", str(a_file)], f"--out: {a_file} exists and is not a folder"),
            (["--json", str(a_file / "rep.json")], f"--json: cannot make the folder "
                                                    f"{a_file}")):
        rc, out, err = run_cli(capsys, *job, *args)
        assert rc == 2 and out == "" and message in err and err.count("\n") == 1, err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"100\n200\n\xff\xfe\n")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_bytes(b'{"length": 5}\n\xff\n')
    for flag, path in (("--lengths", bad), ("--jsonl", bad_jsonl)):
        rc, out, err = run_cli(capsys, flag, str(path), "--cp", "2", "--heads", "4")
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert f"{flag}: {path}: not UTF-8 text" in err, err
    assert not planned


def test_lengths_from_a_pipe(capsys, tmp_path):
    """``--lengths <(zcat lengths.gz)``: a pipe is an input like a file."""
    read, write = os.pipe()
    with os.fdopen(write, "w") as f:
        f.write("64\n" * 8)
    try:
        rc, out, err = run_cli(capsys, "--lengths", f"/dev/fd/{read}", "--cp", "2", "--heads",
                               "4", "--seq-len", "128")
    finally:
        os.close(read)
    assert rc == 0 and "8 lengths from /dev/fd/" in out, err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_cross_node_bytes(capsys, tmp_path, monkeypatch, how):
    """Two GPUs per node at cp 4: the bytes each rank's strategy sends to the other node, as
    a loop over the strategy's traffic matrix counts them; the report shows them."""
    from varlen_cp.tables import catalogue

    node = ["--gpus-per-node", "2"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rc, out, err = run_cli(capsys, "--mix", "short_4k", "--cp", "4", "--heads", "4",
                           "--strategy", "p2p", "--seq-len", "4096", "--batches", "1",
                           "--json", str(tmp_path / "rep.json"), *node)
    assert rc == 0, err
    assert "2 CP ranks per node" in out and "cross-node (max rank)" in out
    rep = json.loads((tmp_path / "rep.json").read_text())
    cu = lengths.pack(lengths.mix_lengths("short_4k", 4 * 4096), 4096)[0]
    p = build_plan(cu, CPConfig(), cp_size=4, cp_rank=0, layer_masks=[(AttnMask(), 1)],
                   topology=Topology((0, 0, 1, 1)))   # placed on the nodes, as a run's
    m = catalogue.traffic_of("p2p", p, AttnMask(), AttnShape(n_heads=4, n_kv_heads=4,
                                                           head_dim=128))
    want = [sum(int(m[ph][s, d]) for ph in ("fwd", "bwd") for d in range(4) if d // 2 != s // 2)
            for s in range(4)]
    assert rep["batches"][0]["layers"][0]["cross_node_bytes"] == want and max(want) > 0


def test_machine_keys_of_the_job_file_and_the_flags_over_them(monkeypatch):
    """Without flags the job's [varlen_cp] gpus_per_node, node_bandwidth and
    cross_node_bandwidth set the model (what a run of that job uses); flags win."""
    import dataclasses
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = CPConfig(gpus_per_node=2, node_bandwidth=1e11, cross_node_bandwidth=2e10)
    job = dataclasses.replace(jobs.with_flags(None, plan.build_parser().parse_args(
        ["--heads", "4"])), config=cfg)
    model = plan.cost_model(plan.build_parser().parse_args(["--heads", "4"]), job)
    assert (model.ranks_per_node, model.bytes_per_s, model.cross_node_bytes_per_s) == \
        (2, 1e11, 2e10)
    flags = plan.build_parser().parse_args(["--heads", "4", "--gpus-per-node", "4",
                                            "--bandwidth", "3e11",
                                            "--cross-node-bandwidth", "5e10"])
    model = plan.cost_model(flags, job)
    assert (model.ranks_per_node, model.bytes_per_s, model.cross_node_bytes_per_s) == \
        (4, 3e11, 5e10)
    model = plan.cost_model(plan.build_parser().parse_args(["--heads", "4"]),
                            dataclasses.replace(job, config=CPConfig()))
    assert (model.ranks_per_node, model.bytes_per_s) == (8, CPConfig().node_bandwidth)


def test_gpus_per_node_over_tensor_parallelism():
    """A node of 8 GPUs with TP 2 holds 4 consecutive CP ranks."""
    args = plan.build_parser().parse_args(["--heads", "4"])
    job = jobs.with_flags(None, args)
    assert plan.cost_model(args, job).ranks_per_node == 8
    import dataclasses
    assert plan.cost_model(args, dataclasses.replace(job, tp=2)).ranks_per_node == 4
    assert plan.cost_model(args, dataclasses.replace(job, tp=16)).ranks_per_node == 1
