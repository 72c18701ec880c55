"""Host planning time: what the integrations run for each batch, per strategy.

Usage: ``python bench/host_tables.py [--quick] [--layouts balanced,dual_chunk]
[--backend triton|flash] [--gpus-per-node N] [--repeats N] [--out FILE]``.

Timed, for one rank: ``varlen_cp.prefetch.build_plan`` + ``build_tables`` exactly as the
integrations call them, on the topology a CP group of global ranks 0..cp-1 has with
``--gpus-per-node`` GPUs per node (default 8: cp 64 spans 8 nodes, so ``balanced`` places
its ranks on the nodes and ``dispatch`` relays through them, as a run builds its plans;
0: one node, what this bench timed before issue 30) (``CPConfig(strategy=..., layout=..., backend="triton")``, Llama 4's
two masks ``[(chunked 8192, 3), (causal, 1)]``, ``AttnShape(32, 8, 128, bf16)``): the layout,
the token tables, ``auto``'s choice, the stage count of the staged strategies and every host
table each mask's attention will read. ``backend="triton"`` gives the GPU's tile sizes
(64 x 64); the device is the CPU, so the device copies are no-ops (on a GPU they are
non-blocking copies from pinned buffers, issued by the same code). Thread CPU time, one torch
thread, freed host memory kept as the integrations keep it (``varlen_cp.host_memory``;
``VARLEN_CP_MALLOC_TUNING=0`` for glibc's defaults), minimum of ``--repeats`` runs with a
fresh plan each (the machine is shared: minima are the figure that does not depend on the
neighbours), maximum over three ranks (first,
middle, last: each rank plans its own tables, and a layer waits for the slowest).

Batches: every document-length mix of ``varlen_cp.mixes`` at 128K tokens (1000 log-normal
documents, a heavy tail, TE's 24-32K buckets, one 128K document, 5000 short ones, a few
long among many short); cp 8 and 64. ``--quick``: three mixes, three repeats.

``--backend flash``: the same with FlashAttention's forms built wherever they are exact
(``flash_form``; what a GPU run with torch's flash ops, FA3 / FA4 activated, or
flash-attn-4 plans), our tile schedules for the rest; the tests' CPU emulator of torch's
flash ops is registered only so that the backend resolves on this CPU (no kernel runs).

Budget (issue 22, item 4): every strategy's plan + tables <= 15 ms at cp 8 and <= 50 ms at
cp 64 on the integrations' default layout (``balanced``); other layouts are reported.

Writes bench/results/host_tables.json and prints one table per layout and a PASS/FAIL line
per budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

# backend='triton' sizes the tables with the GPU's tiles; on a CPU it resolves only under
# the interpreter (no kernel runs here), which must be set before varlen_cp is imported
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # the package from a checkout
    sys.path.insert(0, str(ROOT))

from varlen_cp import AttnMask  # noqa: E402
from varlen_cp.config import STRATEGY_CHOICES, AttnShape, CPConfig  # noqa: E402
from varlen_cp.host_memory import keep_freed_host_memory  # noqa: E402
from varlen_cp.mixes import MIXES, TOTAL  # noqa: E402
from varlen_cp.plan import Topology  # noqa: E402
from varlen_cp.prefetch import build_plan, build_tables  # noqa: E402
from varlen_cp.strategies import get_strategy  # noqa: E402

LLAMA4 = [(AttnMask(chunk_size=8192), 3), (AttnMask(), 1)]
SHAPE = AttnShape(n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
BUDGET_MS = {8: 15.0, 64: 50.0}
BUDGET_LAYOUT = "balanced"
QUICK_MIXES = ("lognormal_1k", "te_buckets", "one_128k")
BACKEND = "triton"   # --backend
GPUS_PER_NODE = 8    # --gpus-per-node (0: one node)


def ranks_of(cp: int) -> tuple[int, ...]:
    """First, middle and last rank."""
    return tuple(sorted({0, cp // 2 - 1, cp - 1}))


def topology_of(config: CPConfig, cp: int) -> Topology | None:
    """The topology of a CP group of global ranks 0..cp-1 (None: one node)."""
    if not GPUS_PER_NODE:
        return None
    return replace(config, gpus_per_node=GPUS_PER_NODE).topology(range(cp))


def plan_and_tables(cu: torch.Tensor, config: CPConfig, cp: int, rank: int,
                    topology: Topology | None) -> None:
    """What an integration's planner runs for one batch on ``rank`` (the topology: made
    once per run, as the integrations make it from the CP group)."""
    plan = build_plan(cu, config, cp_size=cp, cp_rank=rank, layer_masks=LLAMA4,
                      topology=topology)
    build_tables(plan, config, LLAMA4, SHAPE, torch.device("cpu"))


def applies(name: str, cp: int) -> bool:
    """Whether the heads allow strategy ``name`` at ``cp`` (a2a needs cp | Hq)."""
    if name in ("auto", "a2a+p2p"):
        return True
    try:
        get_strategy(name).check_heads(SHAPE.n_heads, SHAPE.n_kv_heads, cp)
    except ValueError:
        return False
    return True


def min_ms(fn, repeats: int) -> float:
    """Minimum thread CPU time of ``repeats`` calls, in ms."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


def measure(layout: str, mix: str, cp: int, repeats: int) -> dict:
    """One row: per strategy the slowest rank's minimum (and that rank), plus the plan
    alone."""
    cu = torch.tensor([0] + MIXES[mix](TOTAL)).cumsum(0)
    row = {"layout": layout, "mix": mix, "docs": int(cu.numel() - 1), "cp": cp,
           "ranks": list(ranks_of(cp)), "plan_ms": 0.0, "total_ms": {}, "slowest_rank": {}}
    base = CPConfig(layout=layout, backend=BACKEND)
    topology = topology_of(base, cp)
    row["plan_ms"] = max(min_ms(lambda: build_plan(cu, base, cp_size=cp, cp_rank=r,
                                                   layer_masks=LLAMA4, topology=topology),
                                repeats)
                         for r in ranks_of(cp))
    for name in STRATEGY_CHOICES:
        config = CPConfig(strategy=name, layout=layout, backend=BACKEND)
        if not applies(name, cp):
            row["total_ms"][name] = row["slowest_rank"][name] = None
            continue
        per_rank = {r: min_ms(lambda: plan_and_tables(cu, config, cp, r, topology), repeats)
                    for r in ranks_of(cp)}
        worst = max(per_rank, key=per_rank.get)
        row["total_ms"][name] = per_rank[worst]
        row["slowest_rank"][name] = worst
    return row


def run(layouts: tuple[str, ...], mixes: tuple[str, ...], cps: tuple[int, ...],
        repeats: int) -> list[dict]:
    rows = []
    for layout in layouts:
        print(f"\n{layout}: plan + tables, ms (thread CPU, min of {repeats}, slowest of "
              f"ranks first/middle/last)")
        print(f"{'mix':15} {'cp':>3} {'plan':>6} " + " ".join(f"{n:>9}" for n in
                                                            STRATEGY_CHOICES))
        for mix in mixes:
            for cp in cps:
                row = measure(layout, mix, cp, repeats)
                rows.append(row)
                print(f"{mix:15} {cp:>3} {row['plan_ms']:6.1f} " +
                      " ".join(_cell(row["total_ms"][n]) for n in STRATEGY_CHOICES), flush=True)
    return rows


def _cell(ms: float | None) -> str:
    return f"{'-':>9}" if ms is None else f"{ms:9.1f}"


def check(rows: list[dict]) -> dict:
    """Per cp: the slowest (strategy, batch) of the budget layout vs the budget."""
    out = {}
    for cp, budget in BUDGET_MS.items():
        cells = [(ms, r["mix"], name) for r in rows
                 if r["cp"] == cp and r["layout"] == BUDGET_LAYOUT
                 for name, ms in r["total_ms"].items() if ms is not None]
        if not cells:
            continue
        worst, mix, name = max(cells)
        out[f"plan_and_tables_ms_cp{cp}"] = {"worst": worst, "strategy": name, "mix": mix,
                                             "target": budget, "pass": worst <= budget}
    for key, res in out.items():
        print(f"{'PASS' if res['pass'] else 'FAIL'} {key}: {res['worst']:.1f} ms "
              f"({res['strategy']}, {res['mix']}; budget {res['target']})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"mixes {', '.join(QUICK_MIXES)} only, 3 repeats")
    p.add_argument("--layouts", default=f"{BUDGET_LAYOUT},dual_chunk")
    p.add_argument("--cp", default="8,64", help="comma-separated CP sizes")
    p.add_argument("--repeats", type=int, default=None, help="runs per cell (default 7)")
    p.add_argument("--backend", choices=("triton", "flash"), default="triton",
                   help="flash: FlashAttention's forms where exact (see the docstring)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node of the CP group's ranks 0..cp-1 (0: one node)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "host_tables.json"))
    args = p.parse_args()
    global BACKEND, GPUS_PER_NODE
    BACKEND = args.backend
    if args.gpus_per_node < 0:
        p.error(f"--gpus-per-node must be >= 0 (0: one node), got {args.gpus_per_node}")
    GPUS_PER_NODE = args.gpus_per_node
    if BACKEND == "flash":   # resolves on a CPU only with a registered kernel (none runs)
        from tests import flash_emulator
        flash_emulator.register()
    torch.set_num_threads(1)
    # As the integrations run: their PlanPrefetcher keeps freed host memory for the next
    # batch (VARLEN_CP_MALLOC_TUNING=0 times glibc's defaults instead).
    malloc_tuned = keep_freed_host_memory()
    mixes = QUICK_MIXES if args.quick else tuple(MIXES)
    repeats = args.repeats or (3 if args.quick else 7)
    layouts = tuple(args.layouts.split(","))
    cps = tuple(int(c) for c in args.cp.split(","))
    rows = run(layouts, mixes, cps, repeats)
    result = {"rows": rows, "budgets": check(rows), "repeats": repeats,
              "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "tokens": TOTAL,
              "masks": "Llama 4: chunked 8192 x3, causal x1",
              "shape": "bf16, 32 / 8 heads, d 128 (Triton tiles 64 x 64)", "backend": BACKEND,
              "timed": "build_plan + build_tables, thread CPU time",
              "gpus_per_node": GPUS_PER_NODE or None,
              "malloc_tuned": malloc_tuned}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()


def table_ms_for(plan, repeats: int = 3) -> dict[str, float]:
    """Per strategy (``auto`` included): ms of rebuilding ``plan`` (same batch, layout spec,
    rank and topology: the placement and relayed dispatch included) and preparing that
    strategy's tables for the plan's masks (causal when it has
    none), as the integrations' planner runs them (bench/plan.py's hook)."""
    from varlen_cp.plan import CPPlan

    masks = list(getattr(plan.layout_spec, "masks", None) or ((AttnMask(), 1),))
    out = {}
    for name in STRATEGY_CHOICES:
        if not applies(name, plan.cp_size):
            continue
        config = CPConfig(strategy=name, layout=plan.layout, backend="triton")

        def run() -> None:
            fresh = CPPlan.build(plan.cu_seqlens, cp_size=plan.cp_size, cp_rank=plan.cp_rank,
                                 layout=plan.layout_spec, topology=plan.topology)
            build_tables(fresh, config, masks, SHAPE, torch.device("cpu"))
        out[name] = min_ms(run, repeats)
    return out
