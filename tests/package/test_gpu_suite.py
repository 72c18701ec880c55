"""The GPU suite (bench/gpu.sh) on a CPU: its dry run end to end, and the parts it is built
from checked against independent references.

- The CP-rank replay (bench/cp_replay.py) reads a rank's kernel calls from the tables
  ``build_tables`` built; fed the real global K/V instead of random ones, the calls' merged
  output and summed dQ must equal single-device attention on the rank's queries, for every
  rank (so no call is missing, doubled or wrong), with the torch twin (~5 s).
- FLOP counts: visible pairs against a dense count of the mask.
- Budgets: a spent budget skips cases instead of running them.
- The dry run (``bash bench/gpu.sh --dry-run``): the CUDA tests collected and skipped,
  every kernel case and backend recorded, every replay case planned and the cp 8 ones run
  on Triton's interpreter; ~40 s of CPU on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT / "bench"),) if p not in sys.path]

import cp_replay  # noqa: E402  (bench/)
import graph_replay  # noqa: E402  (bench/)
import gpu_cases  # noqa: E402
from gpu_timing import Budget  # noqa: E402
from varlen_cp.kernels import varlen_attn  # noqa: E402
from varlen_cp.kernels.schedule import segment_ids  # noqa: E402
from varlen_cp.masks import AttnMask  # noqa: E402

CPU = torch.device("cpu")


def _dense_pairs(lengths, mask: AttnMask) -> int:
    """Visible pairs by brute force: the dense mask of each document."""
    total = 0
    for n in lengths:
        p = torch.arange(n)
        total += int(mask.visible(p, p).sum())
    return total


@pytest.mark.parametrize("mask", [AttnMask(causal=True), AttnMask(window_size=(5, 0)),
                                  AttnMask(chunk_size=7), AttnMask(causal=False)])
def test_mask_area_flops(mask):
    lengths = (1, 13, 40, 13, 64)
    pairs = gpu_cases.visible_pairs(lengths, mask)
    assert pairs == _dense_pairs(lengths, mask)
    shape = gpu_cases.make_shape(3, 1, 16, 8, torch.float16)
    fwd, bwd = gpu_cases.mask_area_flops(pairs, shape)
    assert fwd == 2 * (16 + 8) * pairs * 3 and bwd == 2.5 * fwd


def test_cuda_marker_rule():
    """conftest's rule: the ``cuda`` marker, or a skipif that holds exactly without CUDA
    and names CUDA / a GPU; not a skip for other reasons, nor one that skips WITH CUDA."""
    from tests.conftest import _cuda_only

    class Item:
        def __init__(self, *marks):
            self.marks = [m.mark for m in marks]

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

        def iter_markers(self, name):
            return (m for m in self.marks if m.name == name)

    no_cuda = not torch.cuda.is_available()
    skipif = pytest.mark.skipif
    assert _cuda_only(Item(skipif(no_cuda, reason="needs CUDA (bf16)")))
    assert _cuda_only(Item(skipif(condition=no_cuda, reason="requires a GPU")))
    assert _cuda_only(Item(pytest.mark.cuda))
    assert not _cuda_only(Item(skipif(not no_cuda, reason="the CUDA tests run the kernels")))
    assert not _cuda_only(Item(skipif(no_cuda, reason="needs megatron")))
    assert not _cuda_only(Item(skipif("sys.platform == 'win32'", reason="CUDA on windows")))
    assert not _cuda_only(Item())


# ------------------------------------------------------------------------------ replay
def _true_kv(k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
    """KV source of the replay that picks each call's keys from the global K/V: key i of
    segment d at position p is global token cu[d] + p (padding: zeros)."""
    def make(call):
        pos = call.k_pos.to(torch.int64)
        doc = segment_ids(call.cu_k, pos.numel())
        idx = cu[doc] + pos.clamp(min=0)
        pad = (pos < 0)[:, None, None]
        return (k[idx].masked_fill(pad, 0), v[idx].masked_fill(pad, 0))
    return make


@pytest.mark.parametrize("strategy,layout,stages", [
    ("p2p", "dual_chunk", None), ("dispatch", "balanced", None), ("dispatch", "balanced", 3),
    ("all_gather", "balanced", 2)])
@pytest.mark.parametrize("mask_name", ["causal", "swa", "chunk"])
def test_replay_calls_make_the_ranks_attention(strategy, layout, stages, mask_name,
                                               one_thread):
    """Every rank's replayed calls, on the real K/V, give that rank's exact attention."""
    mask = {"causal": AttnMask(causal=True), "swa": AttnMask(window_size=(40, 0)),
            "chunk": AttnMask(chunk_size=96)}[mask_name]
    lengths = (600, 5, 33, 1, 190, 17)   # dual_chunk cuts documents of >= 2 * cp * 64
    cp, shape = 4, gpu_cases.make_shape(4, 2, 16, 8, torch.float32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(3)
    t = sum(lengths)
    q = torch.randn(t, 4, 16, generator=g, requires_grad=True)
    k, v = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 8, generator=g)
    dout = torch.randn(t, 4, 8, generator=g)
    ref, ref_lse = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths),
                               backend="torch", return_lse=True, **mask.kernel_kwargs())
    ref.backward(dout)
    case = gpu_cases.ReplayCase("t", cp, "mix", lengths, mask_name, mask, strategy, layout,
                                overlap_stages=stages)
    for rank in range(cp):
        plan, _ = cp_replay.plan_rank(case, shape, CPU, "torch", rank=rank)
        res = cp_replay.replay_rank(plan, case, shape, CPU, "torch", dry_run=True,
                                    q=plan.shard(q.detach()),
                                    kv_source=_true_kv(k, v, cu), dout=plan.shard(dout))
        out, lse, dq = res["tensors"]
        real = plan.positions >= 0
        torch.testing.assert_close(out[real], plan.shard(ref.detach())[real], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(lse[:, real], plan.shard(ref_lse.detach(), dim=1)[:, real],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dq[real], plan.shard(q.grad)[real], atol=1e-5, rtol=1e-5)
        # the calls' pairs, counted from their positions, are the plan's closed-form work
        assert res["visible_pairs"] == res["plan_visible_pairs"] > 0
        assert res["n_calls"] == res["n_calls_run"] >= 1
        if stages is not None and res["n_calls"] > 1:
            assert res["stages"] == stages


def test_replay_reads_only_prepared_tables(one_thread):
    """A plan that build_tables did not prepare is refused, naming the table, instead of
    replaying tables built another way."""
    from varlen_cp.prefetch import build_plan
    from varlen_cp.config import CPConfig

    mask = AttnMask(causal=True)
    cu = torch.tensor([0, 100, 160])
    plan = build_plan(cu, CPConfig(strategy="dispatch"), cp_size=2, cp_rank=0,
                      layer_masks=[(mask, 1)])
    shape = gpu_cases.make_shape(2, 1, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="build_tables did not build"):
        cp_replay.rank_calls(plan, mask, "dispatch", (128, 128), shape, CPU)
    with pytest.raises(ValueError, match="strategy must be one of"):
        cp_replay.rank_calls(plan, mask, "a2a", (128, 128), shape, CPU)


def test_spent_budget_skips_cases(one_thread):
    import gpu_kernels

    spent = Budget("kernels", 0.0)
    shape = gpu_cases.kernel_shape(True)
    case = gpu_cases.kernel_cases(True)[0]
    rows = gpu_kernels.run_case(case, shape, CPU, spent, dry_run=False, log=lambda s: None)
    assert {r["backend"]: r["status"] for r in rows}["varlen_cp"] == "skipped"
    assert all(r["status"] in ("skipped", "unavailable") for r in rows)
    results = cp_replay.run_replays(gpu_cases.replay_cases(True)[:2], gpu_cases.replay_shape(True),
                                    CPU, ("torch",), Budget("replay", 0.0), dry_run=False,
                                    log=lambda s: None)
    assert [r["status"] for r in results] == ["skipped", "skipped"]
    import gpu_suite   # skipped cases and missing baselines are results, not failures
    assert gpu_suite.failures({"kernels": {"rows": rows}, "replay": {"results": results}}) == []
    broken = dict(rows[0], status="error", fwd_error="boom")
    assert gpu_suite.failures({"kernels": {"rows": [broken]}, "tests": {"status": "failed"}}) \
        == ["CUDA tests: failed ", "kernels one_doc_128_causal varlen_cp: boom"]


def test_replay_timed_path(one_thread):
    """The GPU path of the replay (repeated timings, back-to-back sequence), on the twin:
    every call timed, the rank's figures from the sequence. ~2 s."""
    case = next(c for c in gpu_cases.replay_cases(True)
                if c.strategy == "dispatch" and c.overlap_stages == 4 and c.cp == 8)
    res = cp_replay.run_replays([case], gpu_cases.replay_shape(True), CPU, ("torch",),
                                Budget.of("replay", 60), dry_run=False, log=lambda s: None)[0]
    assert res["status"] == "ok" and res["stages"] == 4, res
    assert res["n_calls"] == res["n_calls_run"] >= 2      # the local call and transfers
    assert all(c["fwd_ms"] > 0 and c["bwd_ms"] > 0 for c in res["calls"])
    assert res["fwd_seq_ms"] > 0 and res["bwd_seq_ms"] > 0 and res["fwd_tflops"] > 0
    json.dumps(res)   # what the suite writes


@pytest.mark.parametrize("strategy", ["dispatch", "p2p", "all_gather"])
def test_replay_on_flash_agrees_with_twin(strategy, one_thread):
    """The replay on backend "flash" (the tests' emulator of torch's flash ops) reads the
    FA-form tables build_tables built, puts the rank's work on FA, and gives the twin's
    out / LSE / dq on the same inputs (what the GPU run compares FA2 and Triton with)."""
    from tests import flash_emulator as fe

    was = fe.is_registered()
    fe.register()
    try:
        case = next(c for c in gpu_cases.replay_cases(True) if c.cp == 8
                    and c.strategy == strategy and c.mask_name == "causal"
                    and c.mix == "lognormal_1k")
        res = cp_replay.run_replays([case], gpu_cases.replay_shape(True), CPU,
                                    ("torch", "flash"), Budget.of("replay", 60),
                                    dry_run=True, log=lambda s: None)
    finally:
        if not was:
            fe.unregister()
    twin, flash = res
    assert twin["status"] == flash["status"] == "ok", res
    assert twin["flash_work_share"] == 0 and twin["flash_calls"] == 0
    assert flash["flash_work_share"] == 1.0 and flash["flash_calls"] >= 1
    assert flash["visible_pairs"] == twin["visible_pairs"] == flash["plan_visible_pairs"]
    diff = flash["max_rel_diff_vs"]
    assert diff["backend"] == "torch" and diff["lse_inf_agree"], diff
    assert diff["out"] < 5e-3 and diff["dq"] < 5e-3 and diff["lse_abs"] < 1e-3, diff
    import gpu_suite
    assert gpu_suite.failures({"replay": {"results": res}}) == []
    bad = dict(flash, max_rel_diff_vs=dict(diff, out=0.5))
    assert len(gpu_suite.failures({"replay": {"results": [twin, bad]}})) == 1


def test_replay_passes_layer_stats_once(one_thread, monkeypatch):
    """Kernels with once-per-layer backward terms (``Attn.bwd_stats``): the replay makes
    them once and hands the same ones to every call, as the strategies do."""
    from varlen_cp.strategies.calls import Attn

    made, seen = [], []

    class StatsAttn(Attn):
        def bwd_stats(self, dout, out, lse, dlse=None):
            made.append(object())
            return made[-1]

        def bwd(self, dout, q, k, v, out, lse, c, dlse=None, stats=None):
            seen.append(stats)
            return super().bwd(dout, q, k, v, out, lse, c, dlse)

    monkeypatch.setattr(cp_replay, "Attn", StatsAttn)
    case = next(c for c in gpu_cases.replay_cases(True)
                if c.strategy == "dispatch" and c.overlap_stages == 4 and c.cp == 8)
    plan, _ = cp_replay.plan_rank(case, gpu_cases.replay_shape(True), CPU, "torch")
    res = cp_replay.replay_rank(plan, case, gpu_cases.replay_shape(True), CPU, "torch",
                                dry_run=True)
    assert len(made) == 1 and len(seen) == res["n_calls"] >= 2
    assert all(s is made[0] for s in seen)


# ------------------------------------------------------------------------------ dry run
@pytest.mark.slow  # the whole suite on the CPU (~45 s on 2 cores)
def test_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)   # the suite sets it itself
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=400, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "dry-run-cpu.json").read_text())
    assert report["dry_run"] and report["device"] == "dry-run-cpu"
    assert report["failures"] == []

    # the CUDA-only tests: selected by the conftest marker, skipped on a CPU
    tests = report["tests"]
    names = {c["test"].split("::")[-1].split("[")[0] for c in tests["cases"]}
    assert tests["status"] == "ok" and tests["counts"]["skipped"] == len(tests["cases"]) > 0
    assert {"test_bf16_cuda", "test_large_cuda"} <= names
    assert "test_kernels_compile_for_gpus" not in names   # skipped WITH CUDA, not without

    # kernels: every case x backend has a row; ours ran both ways and agree
    rows = report["kernels"]["rows"]
    cases = gpu_cases.kernel_cases(True)
    shape = gpu_cases.kernel_shape(True)
    assert {(r["case"], r["backend"]) for r in rows} == {
        (c.name, b) for c in cases
        for b in ("varlen_cp", "varlen_cp_schedule", "varlen_cp_flash", "varlen_cp_fa4",
                  "torch_varlen_attn", "flex_attention")}
    for case in cases:
        for r in (r for r in rows if r["case"] == case.name):
            pairs = _dense_pairs(case.lengths, case.mask)
            assert r["visible_pairs"] == pairs
            assert r["fwd_flops"] == 4 * shape.head_dim * pairs * shape.n_heads
            # ours ran, except where the FA backends cannot (chunks; fa4 not installed)
            fa_only = r["backend"] == "varlen_cp_fa4" or (
                r["backend"] == "varlen_cp_flash" and case.mask.chunk_size)
            if r["backend"].startswith("varlen_cp") and not fa_only:
                assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["bwd_ms"] > 0, r
            elif r["backend"].startswith("varlen_cp"):
                assert r["status"] == "unavailable", r
            if r["backend"] in ("varlen_cp_schedule", "varlen_cp_flash") and r.get("fwd_ms") or (
                    r["backend"] == "flex_attention" and r.get("fwd_ms")):
                assert r["max_abs_diff_vs_varlen_cp"] < 1e-2, r
            if r["status"] == "unavailable":
                assert r["note"]
    chunk_row = next(r for r in rows if r["mask"] == "chunk8192"
                     and r["backend"] == "torch_varlen_attn")
    assert chunk_row["status"] == "unavailable" and "chunk" in chunk_row["note"]

    # replay: every case planned from prepared tables; the cp 8 ones ran a call
    results = report["replay"]["results"]
    # each case on our kernels, then on FA ("flash": the emulator), compared
    assert report["replay"]["backends"] == ["triton", "flash"]
    assert [(r["case"], r["backend"]) for r in results] == [
        (c.name, b) for c in gpu_cases.replay_cases(True) for b in ("triton", "flash")]
    for r in results:
        assert r["status"] == "ok", r
        assert r["n_calls"] >= 1 and r["visible_pairs"] == r["plan_visible_pairs"]
        assert r["n_calls_run"] == (1 if r["cp"] == 8 else 0)
        if r["cp"] == 8:
            ran = r["calls"][0]
            assert ran["fwd_ms"] > 0 and ran["bwd_ms"] > 0 and ran["visible_pairs"] > 0
    assert {r["stages"] for r in results if r["case"].endswith("_S4")} == {4}
    assert {r["strategy"] for r in results} == {"p2p", "dispatch", "all_gather"}

    # graph: every case ran (eagerly twice on the CPU) with the other batch's rows
    graph = report["graph"]["results"]
    assert [r["case"] for r in graph] == [c["name"] for c in graph_replay.graph_cases(True)]
    for r in graph:
        assert r["status"] == "ok" and r["eager_ms"] > 0 and r["tokens"][0] != 0, r
    if report["environment"]["matplotlib"]:
        assert sorted(report["plots"]["files"]) == ["dry-run-cpu_kernels.png",
                                                    "dry-run-cpu_replay.png"]
        assert all((tmp_path / f).stat().st_size > 0 for f in report["plots"]["files"])


def test_graph_replay_failures_name_the_case():
    """A replay that differs from the eager step on its batch (the same launches on the
    same data: any difference), or that raised, fails the suite; a bit-equal one does
    not."""
    ok = {"case": "a", "status": "ok", "max_rel_diff": {"out": 0.0, "dq": 0.0}}
    off = {"case": "b", "status": "ok", "max_rel_diff": {"out": 0.0, "dq": 1e-3}}
    err = {"case": "c", "status": "error", "error": "RuntimeError: x"}
    import gpu_suite
    got = gpu_suite.failures({"graph": {"results": [ok, off, err]}})
    assert got == ["graph replay b: {'out': 0.0, 'dq': 0.001}", "graph replay c: RuntimeError: x"]


def test_gpu_sh_without_an_install(tmp_path):
    """The lent GPU machines have torch but not varlen_cp: gpu.sh then maps the package
    onto this checkout for the run. Simulated with ``python -S`` (no site, so no installed
    or editable varlen_cp) and torch's folder on PYTHONPATH. ~5 s."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}'
                       f'{sysconfig.get_paths()["purelib"]}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    probe = subprocess.run([str(wrapper), "-c", "import importlib.util as u; "
                            "print(u.find_spec('varlen_cp'), u.find_spec('torch') is None)"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.split() != ["None", "False"]:
        pytest.skip(f"cannot hide the install here: {probe.stdout + probe.stderr}"[:300])
    env = dict(os.environ, PYTHON=str(wrapper))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--parts", "",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "not installed here" in proc.stdout
    got = json.loads((tmp_path / "dry-run-cpu.json").read_text())["environment"]
    assert "varlen_cp_path." in got["varlen_cp"], got
    assert got["varlen_cp.kernels"] == got["varlen_cp"] + "/kernels", got
    assert not Path(got["varlen_cp"]).parent.exists()   # the mapping lived for the run only
