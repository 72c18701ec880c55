"""What the training logs' plan report costs the host (``varlen_cp.report.training``).

Usage: ``python bench/report_cost.py [--quick]``.

For a Llama 4 style model (chunked 8192 x 36 and global causal x 12 layers, 40 query / 8 K/V
heads of 128, bf16) on 128K-token batches of the ``lognormal_1k`` and ``lognormal_long``
mixes, balanced layout, after ``build_tables`` (as the prefetcher leaves a plan), thread CPU
time in ms, minimum of repeats, each on a fresh prepared plan:

- ``choices``: the per-batch check whether the block must be logged again
  (``TrainingReport.choices``: cache lookups);
- ``step``: one logged step's figures (``plan_report`` without estimates: work, K/V floor,
  bytes sent per layer type);
- ``block``: the block (``plan_report`` with ``auto``'s estimates for ``auto`` layers), at the
  first step and when a choice changes.

Writes bench/results/report_cost.json (report_cost_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from varlen_cp import AttnMask  # noqa: E402
from varlen_cp.config import AttnShape, CPConfig  # noqa: E402
from varlen_cp.mixes import MIXES  # noqa: E402
from varlen_cp.prefetch import build_plan, build_tables  # noqa: E402
from varlen_cp.report import TrainingReport, layer_types, plan_report  # noqa: E402

MASKS = [(AttnMask(chunk_size=8192), 36), (AttnMask(), 12)]
SHAPE = AttnShape(n_heads=40, n_kv_heads=8, head_dim=128)
TOKENS = 131072


def cpu_ms(fn) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def measure(mix: str, cp: int, strategy: str, repeats: int) -> dict[str, float]:
    cu = torch.tensor([0] + MIXES[mix](TOKENS)).cumsum(0)
    config = CPConfig(strategy=strategy)
    layers = layer_types(MASKS, strategy)
    out: dict[str, list[float]] = {"choices": [], "step": [], "block": []}
    for _ in range(repeats):
        plan = build_plan(cu, config, cp_size=cp, cp_rank=0, layer_masks=MASKS)
        build_tables(plan, config, MASKS, SHAPE, "cpu")
        report = TrainingReport(layers, SHAPE, log_block=False)
        out["choices"].append(cpu_ms(lambda: report.choices(plan)))
        out["step"].append(cpu_ms(lambda: plan_report(plan, layers, SHAPE)))
        out["block"].append(cpu_ms(lambda: plan_report(plan, layers, SHAPE,
                                                        with_estimates="auto")))
    return {k: min(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="cp 8 only, 2 repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cps, repeats = ((8,), 2) if args.quick else ((8, 64), 3)
    rows = []
    print(f"{'mix':15} {'cp':>3} {'strategy':9} {'choices':>8} {'step':>8} {'block':>8}  (ms)")
    for mix in ("lognormal_1k", "lognormal_long"):
        for cp in cps:
            for strategy in ("p2p", "dispatch", "auto"):
                r = measure(mix, cp, strategy, repeats)
                rows.append({"mix": mix, "cp": cp, "strategy": strategy, **r})
                print(f"{mix:15} {cp:3d} {strategy:9} {r['choices']:8.2f} {r['step']:8.2f} "
                      f"{r['block']:8.2f}", flush=True)
    name = "report_cost_quick.json" if args.quick else "report_cost.json"
    path = ROOT / "bench" / "results" / name
    path.write_text(json.dumps({"tokens": TOKENS, "masks": "chunk8192 x36, causal x12",
                                "heads": "40/8 x 128, bf16", "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
