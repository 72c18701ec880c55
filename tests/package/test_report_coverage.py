"""The plan report's backend coverage (issue 27, item 4): per layer type the share of the
reporting rank's visible pairs and kernel calls on FlashAttention, against
``flash_coverage`` called directly and against independent counts (a dense per-document
count of the pairs; every call exact in FA's form for causal / full / chunked masks, none
without a route); the training report's route, tiles and cache hits; its text and
metrics; ``varlen-cp-plan --backend``; the offline rules against the kernels' own. Host
only (the FA stand-ins of tests/flash_emulator.py and tests/fa4_standin.py where the step's
route needs a registered kernel), ~10 s."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.helpers.cp_grid import DOCS, small_plan
from varlen_cp import AttnMask
from varlen_cp.cli import lengths
from varlen_cp.cli import plan as cli
from varlen_cp.config import AttnShape, CPConfig
from varlen_cp.prefetch import build_plan, build_tables
from varlen_cp.report import Backends, TrainingReport, layer_types, plan_report
from varlen_cp.report.coverage import planned_reason
from varlen_cp.report.text import block_lines
from varlen_cp.tables.coverage import flash_coverage, rank_calls

CU = torch.tensor([0, 37, 40, 140, 200, 330])
MASKS = [(AttnMask(chunk_size=32), 3), (AttnMask(), 1), (AttnMask(causal=False), 2)]
SHAPE = AttnShape(n_heads=6, n_kv_heads=2, head_dim=16, dtype=torch.float16)  # a2a+p2p
# at cp 4: default group size 2 (6 heads do not split over 4)
FLASH = Backends.planned("flash", SHAPE)
NONE = Backends.planned("triton", SHAPE)


def dense_work(plan, mask: AttnMask, rank: int) -> int:
    """Visible pairs of ``rank``'s real queries against their whole documents, counted
    with the dense mask (independent of the plan's closed forms and of the tables)."""
    cu = plan.cu_seqlens
    idx = plan.token_indices_of(rank)
    idx = idx[idx >= 0]
    doc = torch.searchsorted(cu, idx, right=True) - 1
    pos = idx - cu[doc]
    total = 0
    for d in doc.unique().tolist():
        keys = torch.arange(int(cu[d + 1] - cu[d]))
        total += int(mask.visible(pos[doc == d], keys).sum())
    return total


@pytest.mark.parametrize("layout", ["balanced", "dual_chunk", "contiguous"])
@pytest.mark.parametrize("strategy,cp,a2a", [("p2p", 2, None), ("all_gather", 2, None),
                                             ("dispatch", 2, None), ("a2a", 2, None),
                                             ("a2a+p2p", 4, 2), ("a2a+p2p", 4, None)])
def test_shares_equal_flash_coverage_and_independent_counts(one_thread, layout, strategy,
                                                            cp, a2a):
    config = CPConfig(layout=layout, min_chunk_tokens=8 if layout == "dual_chunk" else None)
    for rank in range(cp):
        plan = build_plan(CU, config, cp_size=cp, cp_rank=rank, layer_masks=MASKS)
        layers = layer_types(MASKS, strategy, a2a)
        on = plan_report(plan, layers, SHAPE, backends=FLASH)
        off = plan_report(plan, layers, SHAPE, backends=NONE)
        # the queries the rank's calls cover: its own, every rank's (a2a) or its group's
        size = {"a2a": cp, "a2a+p2p": 2}.get(strategy, 1)
        group = range(rank // size * size, rank // size * size + size)
        for r, q, (mask, _) in zip(on.layers, off.layers, MASKS):
            direct = flash_coverage(plan, mask, strategy, FLASH.route, FLASH.block, r.stages,
                                    2 if strategy == "a2a+p2p" else None)
            assert r.coverage == direct and r.flash_backend == "flash"
            want = sum(dense_work(plan, mask, g) for g in group)
            assert direct.total_pairs == want == sum(plan.work_per_rank(mask)[g]
                                                     for g in group) > 0
            # causal / full / chunked: every call exact in FA's form, so all on FA
            assert (r.coverage.pair_share, r.coverage.call_share) == (1.0, 1.0)
            assert r.coverage.flash_pairs == want and r.coverage.other_calls == 0
            assert r.coverage.fa_calls >= r.coverage.flash_calls >= 1
            # no route: the same calls, every one on our kernels
            c = q.coverage
            assert q.flash_backend is None and c.total_pairs == want
            assert (c.flash_pairs, c.flash_calls, c.fa_calls) == (0, 0, 0)
            assert c.other_calls == r.coverage.flash_calls
            assert (c.pair_share, c.call_share) == (0.0, 0.0)


def test_tiles_do_not_change_the_coverage(one_thread):
    """The claim in schedules/coverage.py: which calls exist and their FA forms depend on
    positions only, so any tile size gives the same counts, with a route or without."""
    for mask in (AttnMask(window_size=(7, 0)), AttnMask(chunk_size=12, window_size=(5, 0))):
        for strategy in ("p2p", "dispatch"):
            for rank in range(4):
                plan = small_plan(DOCS, 4, rank, "dual_chunk", mask)
                got = {b: flash_coverage(plan, mask, strategy, FLASH.route, b)
                       for b in ((16, 16), (64, 32), (128, 128))}
                assert len(set(got.values())) == 1, got
                calls = {b: len(rank_calls(plan, mask, strategy, None, b)) for b in got}
                assert len(set(calls.values())) == 1


def test_cp1_reports_the_single_device_op(one_thread):
    plan = build_plan(CU, CPConfig(), cp_size=1, cp_rank=0, layer_masks=MASKS)
    for backends, share in ((FLASH, 1.0), (NONE, 0.0)):
        rep = plan_report(plan, layer_types(MASKS, "dispatch"), SHAPE, backends=backends)
        for r, (mask, _) in zip(rep.layers, MASKS):
            c = r.coverage
            assert (r.strategy, c.strategy, c.flash_calls + c.other_calls) == \
                ("local", "local", 1)
            assert c.total_pairs == plan.work_per_rank(mask)[0] == dense_work(plan, mask, 0)
            assert c.pair_share == share


def test_unknown_strategies_and_group_sizes():
    plan = build_plan(CU, CPConfig(), cp_size=4, cp_rank=1, layer_masks=MASKS)
    mask = AttnMask()
    for size in (None, 3, 0, True):
        with pytest.raises(ValueError, match="a2a_size"):
            flash_coverage(plan, mask, "a2a+p2p", FLASH.route, a2a_size=size)
    with pytest.raises(ValueError, match="single-device"):
        flash_coverage(plan, mask, "local", FLASH.route)
    # group sizes 1 and cp are plain p2p and a2a, as the strategy runs them
    for size, plain in ((1, "p2p"), (4, "a2a")):
        got = flash_coverage(plan, mask, "a2a+p2p", FLASH.route, a2a_size=size)
        want = flash_coverage(plan, mask, plain, FLASH.route)
        assert (got.flash_pairs, got.total_pairs, got.flash_calls) == \
            (want.flash_pairs, want.total_pairs, want.flash_calls)
    with pytest.raises(ValueError, match="backends must be"):
        plan_report(plan, layer_types(MASKS, "p2p"), SHAPE, backends="flash")
    with pytest.raises(ValueError, match="backend must be one of"):
        TrainingReport(layer_types(MASKS, "p2p"), SHAPE, backend="cuda")


# ---- the step's route: training logs and metrics ---------------------------------------------
@pytest.fixture
def stand_ins():
    """CPU stand-ins for torch's flash ops and flash-attn-4 in this process, undone after
    (as tests/strategies/test_cp_flash.py's fixture)."""
    from tests import fa4_standin, flash_emulator
    from varlen_cp.kernels import flash

    registered = flash_emulator.is_registered()
    flash_emulator.register()
    fa4_standin.install()
    flash.fa4_interface.cache_clear()
    yield
    fa4_standin.uninstall()
    flash.fa4_interface.cache_clear()
    if not registered:
        flash_emulator.unregister()


@pytest.mark.parametrize("backend,share", [("flash", 1.0), ("auto", 0.0), ("torch", 0.0),
                                           ("triton", 0.0)])  # triton: 64-row tiles here
@pytest.mark.parametrize("strategy,cp", [("p2p", 2), ("dispatch", 2), ("a2a+p2p", 4),
                                         ("auto", 2), ("p2p", 1)])
def test_training_report_reads_the_steps_tables(one_thread, stand_ins, caplog, backend,
                                                share, strategy, cp):
    """After the step's prepare, the report's coverage adds no table to the plan (same
    route, tiles, stages and group size as the step): a cache hit. Its block shows the
    coverage line, its metrics the shares."""
    caplog.set_level(logging.INFO, logger="varlen_cp")
    config = CPConfig(strategy=strategy, backend=backend)
    masks = MASKS[:2]
    plan = build_plan(CU, config, cp_size=cp, cp_rank=cp - 1, layer_masks=masks)
    build_tables(plan, config, masks, SHAPE, "cpu")
    layers = layer_types(masks, strategy)
    plan_report(plan, layers, SHAPE)    # the closed forms any log step reads
    before = set(plan._cache)
    report = TrainingReport(layers, SHAPE, backend=backend, device="cpu")
    report.on_batch(plan, None, 1)
    metrics = report.log_step(1)
    assert set(plan._cache) == before, set(plan._cache) - before
    b = report.backends()
    assert b.flash == (None if share == 0.0 else backend)
    rep = report.report()
    lines = [r.getMessage() for r in caplog.records if r.name == "varlen_cp"]
    for key, r in zip(("chunk32", "causal"), rep.layers):
        c = r.coverage
        assert c == flash_coverage(plan, r.layer.mask, "local" if cp == 1 else r.strategy,
                                   b.route, b.block, r.stages,
                                   2 if r.strategy == "a2a+p2p" else None)
        assert c.pair_share == share
        assert metrics[f"varlen_cp/fa_work_share/{key}"] == c.pair_share
        assert metrics[f"varlen_cp/fa_call_share/{key}"] == c.call_share
        n = c.flash_calls + c.other_calls
        text = (f"FA 100% of work, {n}/{n} calls ({backend})" if share else
                f"FA 0% of work, 0/{n} calls (no FA backend)")
        assert f"  backends ({key}, {r.strategy}, rank {cp - 1}): {text}" in \
            [line.split("; FA calls")[0] for line in lines]
    if share == 0.0:
        assert any(line.startswith("  no FlashAttention backend: ") for line in lines)
    assert lines[-1].startswith("step 1: chunk32 work ") and \
        f"FA {'100%' if share else '0%'}, causal" in lines[-1]


def test_without_a_backend_no_coverage(one_thread, caplog):
    caplog.set_level(logging.INFO, logger="varlen_cp")
    plan = build_plan(CU, CPConfig(), cp_size=2, cp_rank=0, layer_masks=MASKS)
    report = TrainingReport(layer_types(MASKS, "p2p"), SHAPE)
    report.on_batch(plan, None, 1)
    metrics = report.log_step(1)
    assert not [k for k in metrics if "/fa_" in k]
    assert all(r.coverage is None for r in report.report().layers)
    assert not [r for r in caplog.records if "backends (" in r.getMessage()]
    rep = plan_report(plan, layer_types(MASKS, "p2p"), SHAPE, backends=FLASH)
    assert sum(line.startswith("  backends (") for line in block_lines(rep, step=3)) == 3


# ---- the offline route (varlen-cp-plan) --------------------------------------------------------
SHAPES = [AttnShape(n_heads=4, n_kv_heads=2, head_dim=d, head_dim_v=dv, dtype=dt,
                    lse_grad=lse, row_max=mx)
          for d, dv in ((16, 16), (128, 128), (192, 128), (12, 12), (264, 264), (8, 256),
                        (256, 256))
          for dt in (torch.bfloat16, torch.float32)
          for lse, mx in ((False, False), (True, False), (False, True))]


@pytest.mark.parametrize("backend", ["flash", "fa4"])
def test_offline_rules_are_the_kernels_rules(stand_ins, backend):
    """``planned_reason`` applies the machine-independent rules of
    ``kernels.flash.unsupported``: with the stand-ins registered on a CPU (a flash kernel,
    the package, no sm check) both must say the same."""
    from varlen_cp.kernels.flash import unsupported

    cpu = torch.device("cpu")
    for s in SHAPES:
        want = unsupported(backend, cpu, s.dtype, s.head_dim, s.value_dim, s.lse_grad,
                           s.row_max)
        assert planned_reason(backend, s) == want, s
        b = Backends.step(backend, cpu, s)    # what a run would route, rows included
        assert b.route == Backends.planned(backend, s).route
    assert Backends.planned("auto", SHAPES[0]).route == \
        Backends.planned("fa4", SHAPES[0]).route


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


JOB = ["--mix", "lognormal_1k", "--cp", "4", "--heads", "8", "--kv-heads", "2",
       "--head-dim", "64", "--mask", "chunk=512:3", "--mask", "causal:1", "--seq-len",
       "4096", "--batches", "2", "--sweep", "2"]


@pytest.mark.parametrize("backend,strategy", [("flash", "dispatch"), ("auto", "a2a+p2p"),
                                              ("triton", "p2p"), (None, "p2p")])
def test_cli_backend_flag(capsys, tmp_path, one_thread, backend, strategy):
    flag = [] if backend is None else ["--backend", backend]
    size = ["--a2a-size", "2"] if strategy == "a2a+p2p" else []
    rc, out, err = run_cli(capsys, *JOB, "--strategy", strategy, *flag, *size,
                           "--json", str(tmp_path / "rep.json"))
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep.json").read_text())
    flash = {"flash": "flash", "auto": "fa4", None: "fa4"}.get(backend)   # default: auto
    assert rep["backend"]["backend"] == (backend or "auto")
    assert rep["backend"]["flash"] == flash
    cu = lengths.pack(lengths.mix_lengths("lognormal_1k", 4 * 4096), 4096)[0]
    masks = [(AttnMask(chunk_size=512), 3), (AttnMask(), 1)]
    plan = build_plan(cu, CPConfig(strategy=strategy), cp_size=4, cp_rank=0,
                      layer_masks=masks)
    shape = AttnShape(n_heads=8, n_kv_heads=2, head_dim=64)
    route = Backends.planned(backend or "auto", shape).route
    for layer, (mask, _) in zip(rep["batches"][0]["layers"], masks):
        c = flash_coverage(plan, mask, strategy, route, (128, 128), layer["stages"],
                           2 if strategy == "a2a+p2p" else None)
        assert layer["coverage"] == {
            "rank": 0, "flash_backend": flash, "flash_pairs": c.flash_pairs,
            "total_pairs": c.total_pairs, "pair_share": c.pair_share,
            "flash_calls": c.flash_calls, "other_calls": c.other_calls,
            "call_share": c.call_share, "fa_calls": c.fa_calls}
        group = range(2 if strategy == "a2a+p2p" else 1)   # rank 0's queries, its group's
        assert c.total_pairs == sum(dense_work(plan, mask, g) for g in group) > 0
        assert c.pair_share == (0.0 if flash is None else 1.0)
        n = c.flash_calls + c.other_calls
        line = (f"FA 100% of work, {n}/{n} calls ({flash})" if flash else
                f"FA 0% of work, 0/{n} calls (no FA backend)")
        assert f"backends ({layer['label']}, {strategy}, rank 0): {line}" in out
    assert f"kernels: --backend {backend or 'auto'} (offline: " in out


def test_cli_fp32_takes_no_flash_attention(capsys, one_thread):
    # fp32: FlashAttention takes none of it, whatever the backend; the reason is printed
    rc, out, err = run_cli(capsys, *JOB, "--dtype", "float32", "--backend", "fa4")
    assert rc == 0, err
    assert "FA 0% of work" in out and "no FlashAttention backend: torch.float32" in out


@pytest.mark.parametrize("value", ["cuda", "FLASH", ""])
def test_cli_bad_backend_exits_2_with_one_line(capsys, value):
    rc, out, err = run_cli(capsys, *JOB, "--backend", value)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--backend" in err and repr(value) in err
