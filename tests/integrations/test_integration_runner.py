"""The integration runner's own logic: registry, PASS/FAIL/SKIP lines, cross-rank agreement,
exit codes, the per-test watchdog (in-process and with a real ``os._exit``), launcher
detection, and the parity checks' comparison code at world size 1 (no process group).
The multi-process and two-node runs are integration_tests/ci_slurm/run_cluster.sh's job.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from integration_tests import harness
from integration_tests.harness import FAIL, PASS, SKIP, Skip, Suite

REPO = Path(__file__).resolve().parents[2]


def _table(**fns):
    reg: dict = {}
    for name, fn in fns.items():
        harness.register(name, timeout_s=30, registry=reg)(fn)
    return reg


def _run(reg, rank=0, agree=lambda s: s, **kw):
    out, err = io.StringIO(), io.StringIO()
    suite = Suite(rank=rank, agree=agree, out=out, err=err, **kw)
    code = suite.run(list(reg.values()), ctx=None)
    return code, out.getvalue().splitlines(), err.getvalue()


def _ok(ctx):
    return "fine"


def _boom(ctx):
    raise AssertionError("boom\nsecond line")


def _skip(ctx):
    raise Skip("no torchtitan")


def test_register_rejects_duplicates_and_bad_timeouts():
    reg = _table(a=_ok)
    with pytest.raises(ValueError, match="registered twice"):
        harness.register("a", registry=reg)(_ok)
    with pytest.raises(ValueError, match="timeout_s"):
        harness.register("b", timeout_s=0, registry=reg)


def test_select_globs_keep_registry_order_and_reject_typos():
    reg = _table(**{"job/x": _ok, "cp/p2p": _ok, "cp/a2a": _ok})
    assert [t.name for t in harness.select(reg, ["cp/*"])] == ["cp/p2p", "cp/a2a"]
    assert [t.name for t in harness.select(reg, None)] == ["job/x", "cp/p2p", "cp/a2a"]
    with pytest.raises(ValueError, match="'cp/ring' matches no test"):
        harness.select(reg, ["cp/*", "cp/ring"])


def test_all_pass_exit_zero_and_summary():
    code, lines, _ = _run(_table(a=_ok, b=_ok))
    assert code == harness.EXIT_OK
    assert lines[0].startswith("PASS  a  (fine)") and lines[1].startswith("PASS  b")
    assert lines[-1].startswith("integration: 2 passed, 0 failed, 0 skipped in ")


def test_failure_is_reported_and_the_suite_goes_on():
    code, lines, err = _run(_table(a=_boom, b=_ok, c=_skip))
    assert code == harness.EXIT_FAILED
    assert lines[0].startswith("FAIL  a  (AssertionError: boom)")
    assert lines[1].startswith("PASS  b")
    assert lines[2].startswith("SKIP  c  (no torchtitan)")
    assert lines[-1].startswith("integration: 1 passed, 1 failed, 1 skipped")
    assert "Traceback" in err and "[rank 0] a failed" in err


def test_skip_only_is_success():
    code, lines, _ = _run(_table(a=_skip))
    assert code == harness.EXIT_OK
    assert lines[-1].startswith("integration: 0 passed, 0 failed, 1 skipped")


def test_agreement_worst_status_wins():
    # Another rank failed (the MAX over ranks is FAIL) although this one passed.
    code, lines, _ = _run(_table(a=_ok, b=_ok), agree=lambda s: FAIL)
    assert code == harness.EXIT_FAILED
    assert lines[0].startswith("FAIL  a  (failed on another rank")
    code, lines, _ = _run(_table(a=_ok), agree=lambda s: max(s, SKIP))
    assert code == harness.EXIT_OK and lines[0].startswith("SKIP  a  (skipped on another rank)")


def test_a_failed_agreement_ends_the_run():
    def agree(status):
        raise RuntimeError("Connection reset by peer")
    code, lines, _ = _run(_table(a=_ok, b=_ok), agree=agree)
    assert code == harness.EXIT_FAILED
    assert lines[0].startswith("FAIL  a  (cross-rank agreement failed: RuntimeError: Connection")
    assert lines[1].startswith("integration: 0 passed, 1 failed, 0 skipped, 1 not run")


def test_only_rank0_prints_results():
    code, lines, err = _run(_table(a=_boom), rank=1)
    assert code == harness.EXIT_FAILED and lines == []
    assert "[rank 1] a failed" in err


def test_watchdog_fires_on_a_stuck_test_in_process():
    release, codes = threading.Event(), []

    def stuck(ctx):
        assert release.wait(20), "the watchdog never fired"

    def exit_fn(code):  # the real one is os._exit; here: record and unblock the test
        codes.append(code)
        release.set()

    reg = _table(first=_ok, stuck=stuck, never=_ok)
    out = io.StringIO()
    suite = Suite(rank=0, agree=lambda s: s, out=out, err=io.StringIO(), exit_fn=exit_fn,
                  timeout_override_s=0.3)
    suite.run(list(reg.values()), ctx=None)  # goes on here only because exit_fn returns
    text = out.getvalue()
    assert codes == [harness.EXIT_TIMEOUT]
    assert "FAIL  stuck  (timeout after 0.3 s on rank 0" in text
    assert "integration: 1 passed, 1 failed, 0 skipped, 1 not run" in text


def test_watchdog_ends_the_process_with_exit_3():
    """The real path: os._exit from the watchdog thread while the main thread is blocked."""
    script = textwrap.dedent("""
        import threading
        from integration_tests import harness
        reg = {}
        harness.register("ok", timeout_s=30, registry=reg)(lambda ctx: None)
        harness.register("hang", timeout_s=0.5, registry=reg)(
            lambda ctx: threading.Event().wait())
        harness.register("after", timeout_s=30, registry=reg)(lambda ctx: None)
        suite = harness.Suite(rank=0, agree=lambda s: s)
        raise SystemExit(suite.run(list(reg.values()), None))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == harness.EXIT_TIMEOUT, proc.stdout + proc.stderr
    assert "PASS  ok" in proc.stdout
    assert "FAIL  hang  (timeout after 0.5 s on rank 0" in proc.stdout
    assert "integration: 1 passed, 1 failed, 0 skipped, 1 not run" in proc.stdout
    assert "stacks at the timeout of hang" in proc.stderr


def test_launch_env_detection():
    from integration_tests.dist_env import launch_env
    assert launch_env({"RANK": "1", "WORLD_SIZE": "4"}) == ("torchrun", {})
    name, env = launch_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                            "MASTER_ADDR": "node7"})
    assert name == "srun" and env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                       "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    # A batch script's own single task (SLURM_NTASKS=1) runs alone, like a plain launch.
    name, env = launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert name == "single" and env["WORLD_SIZE"] == "1" and int(env["MASTER_PORT"]) > 0


def test_cli_lists_tests_and_rejects_unknown_patterns(capsys):
    from integration_tests import run
    assert run.main(["--list"]) == harness.EXIT_OK
    listed = capsys.readouterr().out
    for name in ("job/collectives", "cp_parity/p2p", "cp_parity/all_gather", "cp_parity/a2a",
                 "cp_parity/a2a+p2p", "training_parity/llama4_debug"):
        assert name in listed
    assert run.main(["--tests", "cp_parity/ring"]) == harness.EXIT_USAGE
    assert "matches no test" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--timeout", "-1"])


def test_training_loss_comparison():
    from integration_tests.training_parity import STEPS, compare_losses
    ref = [6.5 - 0.1 * i for i in range(STEPS)]
    assert "max rel diff" in compare_losses(ref, [x * (1 + 1e-6) for x in ref])
    bad = list(ref)
    bad[2] *= 1.01
    with pytest.raises(AssertionError, match="step 3"):
        compare_losses(ref, bad)
    with pytest.raises(AssertionError, match="logged losses"):
        compare_losses(ref, ref[:-1])


def _cpu_ctx():
    from integration_tests.dist_env import JobContext
    return JobContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"),
                      backend="gloo", launcher="single")


def test_cp_parity_plumbing_at_world_1_passes_and_catches_a_wrong_result(monkeypatch):
    """World size 1 (cp == 1 is the local op): the comparison passes on the real op and
    fails when the op's output is off by 0.1%."""
    from integration_tests import cp_parity
    every = cp_parity.masks()
    monkeypatch.setattr(cp_parity, "LAYOUTS", ("dual_chunk",))
    monkeypatch.setattr(cp_parity, "masks",
                        lambda: {k: every[k] for k in ("causal", "chunk_swa")})
    assert "2 cases" in cp_parity.run_strategy(_cpu_ctx(), "p2p")

    import varlen_cp.attention as attention
    real = attention.cp_varlen_attn

    def off(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.001, lse
    monkeypatch.setattr(attention, "cp_varlen_attn", off)
    with pytest.raises(AssertionError, match=r"out: max err .* > allowed"):
        cp_parity.run_strategy(_cpu_ctx(), "p2p")


def test_a2a_sizes_and_documents():
    from integration_tests.cp_parity import a2a_sizes, documents
    assert a2a_sizes(2) == [1, 2] and a2a_sizes(4) == [1, 2, 4] and a2a_sizes(6) == [1, 2, 6]
    docs = documents(3)
    assert 0 in docs and 1 in docs and max(docs) >= 2 * 3 * 4  # dual_chunk cuts the longest
