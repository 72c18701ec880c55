"""The GPU suite (run it with ``bash bench/gpu.sh``): everything a lent GPU should tell us in
one command and at most 10 minutes on an H100.

Parts, each within its own time budget (a case that would start after its part's deadline
is recorded as skipped, and the JSON is rewritten after every part, so a run cut short
still leaves its results):
1. ``tests``: the CUDA-only tests (``pytest -m cuda``: tests/conftest.py marks every test
   that is skipped without CUDA), in a subprocess, results from its JUnit XML (the dry run
   runs it beside the other parts);
2. ``kernels``: ``gpu_kernels``: our kernels vs torch's ``varlen_attn`` and
   ``flex_attention`` on the issue's cases, forward and backward, TFLOP/s of the mask area;
3. ``replay``: ``cp_replay``: the kernel calls of the busiest rank of cp 8 / 64 plans;
4. ``graph``: ``graph_replay``: a graph-safe rank's layer captured in a CUDA graph on one
   batch and replayed on another (its buffers refreshed in place) against the eager step.

Writes ``<out>/<device>.json`` (default ``bench/results/``) and, when matplotlib is there,
``<device>_kernels.png`` and ``<device>_replay.png``. Exits 1 (after writing everything)
when a CUDA test failed, one of our kernels failed a case or a replay failed (see
:func:`failures`).

``--dry-run`` (CPU): the same pipeline with tiny shapes: fp16 on Triton's interpreter,
every case planned (every table built), the first kernel call of every replay run forward
and backward, the CUDA tests collected and skipped; it checks the pipeline, not speed.
Runs on the GPU machines' stack (Python 3.12, torch 2.11, triton 3.6) without downloads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# Budgets in seconds on a GPU. A case starts only while its part has time left, so a part
# can overrun by its last case (a flex_attention compile is the longest, ~30-60 s): the
# total leaves that and a minute of startup and plots inside the 10 minutes.
BUDGETS = {"total": 540.0, "tests": 200.0, "kernels": 160.0, "replay": 110.0, "graph": 80.0}
PARTS = ("tests", "kernels", "replay", "graph")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="The GPU suite: CUDA tests, kernel benchmark, "
                                             "CP-rank replay (run it with bash bench/gpu.sh)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny shapes on Triton's interpreter (checks the pipeline)")
    ap.add_argument("--out", type=Path, default=BENCH / "results",
                    help="folder for <device>.json and the plots (default bench/results)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=BUDGETS["total"],
                    help="seconds for the whole suite (parts get their share, capped by it)")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {list(PARTS)}")
    a.parts = parts
    return a


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # must precede the first import of triton (varlen_cp's kernels import it)
        os.environ["TRITON_INTERPRET"] = "1"
    for p in (str(ROOT), str(BENCH)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch

    import gpu_cases
    from gpu_timing import Budget

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; on a CPU run `bash bench/gpu.sh --dry-run`",
              file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:   # backend "flash" on the CPU: the tests' emulator of torch's flash ops
        from tests import flash_emulator
        flash_emulator.register()
    name = "dry-run-cpu" if args.dry_run else torch.cuda.get_device_name()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{slug}.json"
    total = Budget.of("total", args.budget)
    started = time.monotonic()
    result: dict = {"suite": "bench/gpu.sh", "dry_run": args.dry_run, "device": name,
                    "environment": _environment(), "budgets_s": dict(BUDGETS, total=args.budget),
                    "parts": args.parts, "part_seconds": {}}

    def save() -> None:
        result["seconds"] = time.monotonic() - started
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    def budget(part: str) -> Budget:
        return Budget.of(part, BUDGETS[part] if not args.dry_run else args.budget, total)

    tests = None
    if "tests" in args.parts:
        from gpu_tests import CudaTests
        print("== CUDA-only tests (pytest -m cuda)", flush=True)
        tests = CudaTests(budget("tests"))
    if tests is not None and not args.dry_run:
        result["tests"] = tests.result()
        result["part_seconds"]["tests"] = result["tests"].get("seconds", 0.0)
        save()
    if "kernels" in args.parts:
        from gpu_kernels import run_kernels, target_checks
        t0 = time.monotonic()
        shape, cases = gpu_cases.kernel_shape(args.dry_run), gpu_cases.kernel_cases(args.dry_run)
        print(f"== kernels: {gpu_cases.describe(shape)}, TFLOP/s of the mask area", flush=True)
        rows = run_kernels(cases, shape, device, budget("kernels"), args.dry_run)
        result["kernels"] = {"shape": gpu_cases.describe(shape), "rows": rows,
                             "flops": "forward 2*(d+dv) per visible pair per head; "
                                      "backward 2.5x forward",
                             "targets": target_checks(rows, cases)}
        result["part_seconds"]["kernels"] = time.monotonic() - t0
        save()
    if "replay" in args.parts:
        from cp_replay import run_replays
        t0 = time.monotonic()
        shape = gpu_cases.replay_shape(args.dry_run)
        backends = _replay_backends(args.dry_run)
        print(f"== CP-rank replay: {gpu_cases.describe(shape)}, busiest rank, {backends}",
              flush=True)
        result["replay"] = {"shape": gpu_cases.describe(shape), "backends": backends,
                            "results": run_replays(gpu_cases.replay_cases(args.dry_run),
                                                   shape, device, backends, budget("replay"),
                                                   args.dry_run, _replay_calls(args.dry_run))}
        result["part_seconds"]["replay"] = time.monotonic() - t0
        save()
    if "graph" in args.parts:
        from graph_replay import run_graph_replays
        t0 = time.monotonic()
        shape = gpu_cases.replay_shape(args.dry_run)
        print(f"== graph-safe replay under a CUDA graph: {gpu_cases.describe(shape)}",
              flush=True)
        result["graph"] = {"shape": gpu_cases.describe(shape),
                           "results": run_graph_replays(shape, device, budget("graph"),
                                                        args.dry_run)}
        result["part_seconds"]["graph"] = time.monotonic() - t0
        save()
    if tests is not None and args.dry_run:
        result["tests"] = tests.result()
        result["part_seconds"]["tests"] = result["tests"].get("seconds", 0.0)
    from gpu_plots import plot_all
    result["plots"] = plot_all(result, args.out, slug)
    result["failures"] = failures(result)
    save()
    _print_targets(result)
    for f in result["failures"]:
        print(f"FAILED: {f}")
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return result


def failures(result: dict) -> list[str]:
    """What makes the run fail (exit 1; everything is still written): CUDA tests that
    failed or ran out of time, our kernels failing a case, a replay case failing. Baselines
    failing or missing (torch's varlen_attn on a CPU, flex's backward on a CPU) and cases
    skipped for time are results, not failures."""
    out = []
    tests = result.get("tests", {})
    if tests.get("status") in ("failed", "timeout", "no tests selected"):
        out.append(f"CUDA tests: {tests['status']} {tests.get('counts', '')}")
    for r in result.get("kernels", {}).get("rows", []):
        if r["backend"].startswith("varlen_cp") and r["status"] not in (
                "ok", "skipped", "unavailable"):
            out.append(f"kernels {r['case']} {r['backend']}: "
                       f"{r.get('fwd_error') or r.get('bwd_error') or r['status']}")
    from cp_replay import DIFF_LIMIT
    from graph_replay import failures as graph_failures
    out += graph_failures(result.get("graph", {}).get("results", []))
    for r in result.get("replay", {}).get("results", []):
        if r["status"] == "error":
            out.append(f"replay {r['case']} {r.get('backend')}: {r['error']}")
        diff = r.get("max_rel_diff_vs")
        if diff and (max(diff["out"], diff["dq"]) > DIFF_LIMIT or not diff["lse_inf_agree"]):
            out.append(f"replay {r['case']} {r['backend']} vs {diff['backend']}: {diff}")
    return out


def _replay_backends(dry_run: bool) -> tuple[str, ...]:
    """Our Triton kernels (the interpreter on the dry run's CPU), then torch's flash ops
    (FA2 unless FA3 / FA4 was activated; on the dry run's CPU the tests' emulator of them,
    registered by :func:`main`) and flash-attn-4 where it is installed: each replay runs on
    each."""
    import torch

    from varlen_cp.kernels.flash import fa4_interface, has_flash_kernel

    device = torch.device("cpu" if dry_run else "cuda")
    out = ["triton"]
    if has_flash_kernel(device):
        out.append("flash")
    if not dry_run and fa4_interface() is not None:
        out.append("fa4")
    return tuple(out)


def _replay_calls(dry_run: bool):
    """How many of a rank's calls the replay runs: all on a GPU; in the dry run one call
    per cp 8 case (each strategy x mask x mix: the interpreter takes ~0.1-1 s a call) and
    none at cp 64, whose plans and tables are still built."""
    if not dry_run:
        return lambda case: None
    return lambda case: 1 if case.cp == 8 else 0


def _environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "machine": platform.machine()}
    for mod in ("triton", "numpy", "matplotlib", "pytest"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            env[mod] = None
    for mod in ("varlen_cp", "varlen_cp.kernels"):   # which checkout ran (gpu.sh's shim?)
        try:
            env[mod] = os.path.dirname(importlib.import_module(mod).__file__)
        except Exception as e:  # noqa: BLE001
            env[mod] = f"not importable: {e}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    return env


def _print_targets(result: dict) -> None:
    checks = result.get("kernels", {}).get("targets", [])
    if not checks:
        return
    print("== issue 21 GPU targets" + (" (dry run: not meaningful)" if result["dry_run"]
                                       else ""))
    for c in checks:
        value = "-" if c["value"] is None else f"{c['value']:.3g}"
        state = {True: "met", False: "NOT met", None: "no data"}[c["met"]]
        print(f"  {c['what']:60s} {value:>8s} (target >= {c['target']:g}) {state}")


if __name__ == "__main__":
    raise SystemExit(1 if main()["failures"] else 0)
