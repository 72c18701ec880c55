"""Balance and communication report of the CP layouts (pure host computation, no processes).

Usage: ``python bench/balance.py [--quick] [--threads N]``.

For document mixes packed to 128K tokens (log-normal lengths, TransformerEngine's bucket
pattern, one 128K document, thousands of short documents, a few long documents among short
ones), cp 2..64, masks causal, sliding window (4096, 0), chunked 8192 (causal) and Llama 4's
3:1 chunked:global mix, and every layout (contiguous, te, dual_chunk, balanced; balanced is
built for the scenario's masks and weights), it reports:

- work: max/mean over ranks of the layer-weighted visible pairs (``work_imb``), and for the
  3:1 mix also sum_layers max / sum_layers mean (``work_imb_layers``: each layer waits for
  its slowest rank);
- tokens: max/mean of local token counts (padding included), padding tokens (% of real);
- K/V bytes received per rank per layer (bf16 K+V, 8 KV heads x 128 dims = 4 KiB/token),
  max over ranks: ring / all-gather (every other rank's tokens); the lower bound (the other
  ranks' keys that this rank's queries see: union of every query token's interval, per
  document); ``dispatch`` (what a range fetch moves: the union of each local run's key range
  [lo(first), hi(last)]; equal to the bound since a run's intervals leave no gap, so a
  ratio above 1 would be a bug); ``tile`` (the union of each 64-row query tile's key range:
  what fetching whole kernel-tile ranges would move, tiles may straddle two runs);
- plan build time (``CPPlan.build``, thread CPU time, median of repeats).

Writes ``bench/results/balance.json`` and PNG plots next to it, prints a table and checks the
issue-7 targets for ``balanced`` at cp 8..64: work imbalance <= 1.03, token imbalance <= 1.02,
padding <= 0.5%, dispatch <= 1.1x the lower bound, build < 5 ms (128K tokens, 1K documents,
cp 64). Time: ~1-2 min on one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an installed package
    sys.path.insert(0, str(ROOT))

from varlen_cp import AttnMask, CPPlan  # noqa: E402
from varlen_cp.kernels import mask_math  # noqa: E402

TOTAL = 131072
CP_SIZES = (2, 4, 8, 16, 32, 64)
LAYOUTS = ("contiguous", "te", "dual_chunk", "balanced")
BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V, 8 KV heads, 128 dims, bf16
TILE = 64  # Triton block_m (kernels/triton_common.py)
CAUSAL = AttnMask()
CHUNKED = AttnMask(chunk_size=8192)
SCENARIOS = {
    "causal": ((CAUSAL, 1.0),),
    "swa4096": ((AttnMask(window_size=(4096, 0)), 1.0),),
    "chunked8192": ((CHUNKED, 1.0),),
    "llama4_3to1": ((CHUNKED, 3.0), (CAUSAL, 1.0)),
}
TARGETS = {"work_imb": 1.03, "token_imb": 1.02, "padding_pct": 0.5, "dispatch_over_lb": 1.1,
           "build_ms_1k_docs_cp64": 5.0}


# ---- document mixes -----------------------------------------------------------------------
def _fill(lengths: list[int]) -> list[int]:
    """Cut or extend the list so the lengths sum to exactly TOTAL."""
    out, used = [], 0
    for n in lengths:
        n = min(int(n), TOTAL - used)
        if n <= 0:
            break
        out.append(n)
        used += n
    if used < TOTAL:
        out.append(TOTAL - used)
    return out


def _lognormal(seed: int, n: int, mu: float, sigma: float) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g) * sigma + mu).long().clamp(min=1).tolist()


def lognormal_1k() -> list[int]:
    """1000 documents, log-normal, scaled to 128K (the build-time target's batch)."""
    g = torch.Generator().manual_seed(0)
    x = torch.exp(torch.randn(1000, generator=g) + 4.8)
    x = (x * (TOTAL - 1000) / x.sum()).long().add(1)
    x[0] += TOTAL - int(x.sum())
    return x.tolist()


MIXES = {
    "lognormal_1k": lognormal_1k,
    "lognormal_long": lambda: _fill(_lognormal(1, 400, 7.6, 1.0)),  # median 2K tokens
    "te_buckets": lambda: _fill([24576, 28672, 30720, 32768] * 2),
    "one_128k": lambda: [TOTAL],
    "short_4k": lambda: _fill(torch.randint(8, 57, (5000,),
                                            generator=torch.Generator().manual_seed(2)).tolist()),
    "few_long": lambda: _fill([32768, 7000] + _lognormal(3, 50, 5.0, 1.0) + [20000]
                              + _lognormal(4, 3000, 5.0, 1.0)),
}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


# ---- metrics ------------------------------------------------------------------------------
def _all_ranks(plan: CPPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, doc, position, index within the local segment) of every rank's tokens."""
    ranks, docs, pos, seg_idx = [], [], [], []
    for r in range(plan.cp_size):
        lcu = plan.local_cu_seqlens_of(r).long()
        seg = lcu[1:] - lcu[:-1]
        d = torch.repeat_interleave(torch.arange(plan.n_docs), seg)
        ranks.append(torch.full_like(d, r))
        docs.append(d)
        pos.append(plan.positions_of(r).long())
        seg_idx.append(torch.arange(d.numel()) - lcu[d])
    return torch.cat(ranks), torch.cat(docs), torch.cat(pos), torch.cat(seg_idx)


def _union_per_rank(group: torch.Tensor, rank: torch.Tensor, lo: torch.Tensor,
                    hi: torch.Tensor, cp: int) -> torch.Tensor:
    """Per rank: size of the union of intervals [lo, hi] within each group (rank, doc),
    intervals given in order with lo and hi non-decreasing inside a group."""
    prev_hi = torch.cat([torch.full((1,), -1, dtype=torch.int64), hi[:-1]])
    new_group = torch.ones_like(group, dtype=torch.bool)
    new_group[1:] = group[1:] != group[:-1]
    prev_hi = torch.where(new_group, -1, prev_hi)
    fresh = (hi - torch.maximum(lo, prev_hi + 1) + 1).clamp(min=0)
    return torch.zeros(cp, dtype=torch.int64).scatter_add_(0, rank, fresh)


def kv_tokens_needed(plan: CPPlan, mask: AttnMask, tables
                     ) -> tuple[list[int], list[int], list[int]]:
    """Per rank, in tokens of other ranks' K/V: (lower bound from every query token's
    interval, dispatch from each local run's interval, tile-range dispatch)."""
    rank, doc, pos, seg_idx = tables
    doc_len = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1])[doc]
    real = pos >= 0
    rank, doc, pos, seg_idx, doc_len = (t[real] for t in (rank, doc, pos, seg_idx, doc_len))
    own = torch.zeros(plan.cp_size, dtype=torch.int64).scatter_add_(
        0, rank, torch.ones_like(rank))
    lo, hi = mask_math.key_interval(pos, *mask.params)
    hi = torch.minimum(hi, doc_len - 1)
    group = rank * plan.n_docs + doc
    exact = _union_per_rank(group, rank, lo, hi, plan.cp_size) - own
    # Runs: consecutive positions of one segment; a run's keys are [lo(first), hi(last)].
    run_start = torch.ones_like(group, dtype=torch.bool)
    run_start[1:] = (group[1:] != group[:-1]) | (pos[1:] != pos[:-1] + 1)
    run_end = torch.ones_like(run_start)
    run_end[:-1] = run_start[1:]
    runs = _union_per_rank(group[run_start], rank[run_start], lo[run_start], hi[run_end],
                           plan.cp_size) - own
    # Tiles: 64 consecutive local rows of one segment; a tile's key range runs from its
    # first query's lo to its last query's hi (both monotone in position).
    tile = group * (TOTAL // TILE + 2) + seg_idx // TILE
    first = torch.ones_like(tile, dtype=torch.bool)
    first[1:] = tile[1:] != tile[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    t_lo, t_hi = lo[first], hi[last]
    tiles = _union_per_rank(group[first], rank[first], t_lo, t_hi, plan.cp_size) - own
    return exact.tolist(), runs.tolist(), tiles.tolist()


def _timed_build(cu: torch.Tensor, cp: int, layout: str, masks, repeats: int
                 ) -> tuple[CPPlan, float]:
    kw = {"masks": list(masks)} if layout == "balanced" else {}
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=layout, **kw)
        times.append(time.thread_time() - t0)
    return plan, statistics.median(times) * 1e3


def measure(mix: str, lengths: list[int], cp: int, scenario: str, layout: str,
            plan: CPPlan, build_ms: float, tables) -> dict:
    masks = SCENARIOS[scenario]
    wsum = sum(w for _, w in masks)
    per_mask = {m: [plan.work_of(r, m) for r in range(cp)] for m, _ in masks}
    work = [sum(w * per_mask[m][r] for m, w in masks) for r in range(cp)]
    mean_work = sum(work) / cp
    layers = sum(w * max(per_mask[m]) for m, w in masks) / mean_work
    counts = [plan.num_tokens_of(r) for r in range(cp)]
    ring = [(plan.padded_total_tokens - c) * BYTES_PER_TOKEN for c in counts]
    lb, disp, tile = [0.0] * cp, [0.0] * cp, [0.0] * cp
    for m, w in masks:  # bytes per layer: layer-weighted mean over the masks
        for acc, toks in zip((lb, disp, tile), kv_tokens_needed(plan, m, tables)):
            for r in range(cp):
                acc[r] += w / wsum * toks[r] * BYTES_PER_TOKEN
    mib = 1 / 2 ** 20
    return {
        "mix": mix, "n_docs": len(lengths), "cp": cp, "masks": scenario, "layout": layout,
        "work_imb": max(work) / mean_work, "work_imb_layers": layers,
        "token_imb": max(counts) * cp / sum(counts), "max_tokens": max(counts),
        "mean_tokens": sum(counts) / cp,
        "padding_tokens": plan.padded_total_tokens - plan.total_tokens,
        "padding_pct": 100 * (plan.padded_total_tokens - plan.total_tokens) / plan.total_tokens,
        "ring_mib_max": max(ring) * mib, "ring_mib_mean": sum(ring) / cp * mib,
        "lb_mib_max": max(lb) * mib, "lb_mib_mean": sum(lb) / cp * mib,
        "dispatch_mib_max": max(disp) * mib, "dispatch_mib_mean": sum(disp) / cp * mib,
        "tile_mib_max": max(tile) * mib, "tile_mib_mean": sum(tile) / cp * mib,
        "dispatch_over_lb": max(disp) / max(lb) if max(lb) else 1.0,
        "tile_over_lb": max(tile) / max(lb) if max(lb) else 1.0,
        "ring_over_lb": max(ring) / max(lb) if max(lb) else float("inf"),
        "build_ms": build_ms,
    }


def run(quick: bool) -> list[dict]:
    cps = (2, 8, 64) if quick else CP_SIZES
    mixes = {k: MIXES[k] for k in (("lognormal_1k", "te_buckets") if quick else MIXES)}
    repeats = 3 if quick else 5
    rows = []
    for mix, make in mixes.items():
        lengths = make()
        assert sum(lengths) == TOTAL, (mix, sum(lengths))
        cu = _cu(lengths)
        for cp in cps:
            for layout in LAYOUTS:
                fixed = None
                for scenario, masks in SCENARIOS.items():
                    if layout == "balanced" or fixed is None:
                        fixed = _timed_build(cu, cp, layout, masks, repeats)
                        tables = _all_ranks(fixed[0])
                    rows.append(measure(mix, lengths, cp, scenario, layout, *fixed, tables))
    return rows


# ---- report -------------------------------------------------------------------------------
def _worst(rows: list[dict], key: str, **match) -> float:
    vals = [r[key] for r in rows if all(r[k] == v for k, v in match.items())]
    return max(vals) if vals else float("nan")


def print_table(rows: list[dict]) -> None:
    cps = sorted({r["cp"] for r in rows})
    print(f"\nWorst over {len({r['mix'] for r in rows})} mixes (128K tokens); bytes are max "
          f"over ranks per layer; dispatch/LB is the worst mix, MiB columns and tile/LB, "
          f"ring/LB are of the mix with the largest lower bound (short mixes need ~0).")
    head = (f"{'masks':<12}{'layout':<11}{'cp':>3} {'work':>6} {'layers':>6} {'tokens':>6} "
            f"{'pad%':>5} {'ringMiB':>8} {'lbMiB':>7} {'dispMiB':>8} {'disp/LB':>7} "
            f"{'tile/LB':>7} {'ring/LB':>7} {'build ms':>8}")
    print(head)
    print("-" * len(head))
    for scenario in SCENARIOS:
        for layout in LAYOUTS:
            for cp in cps:
                m = {"masks": scenario, "layout": layout, "cp": cp}
                sel = [r for r in rows if all(r[k] == v for k, v in m.items())]
                # ratios: worst mix; absolute bytes: the mix with the largest lower bound
                big = max(sel, key=lambda r: r["lb_mib_max"])
                print(f"{scenario:<12}{layout:<11}{cp:>3} {_worst(sel, 'work_imb'):>6.3f} "
                      f"{_worst(sel, 'work_imb_layers'):>6.3f} "
                      f"{_worst(sel, 'token_imb'):>6.3f} {_worst(sel, 'padding_pct'):>5.2f} "
                      f"{big['ring_mib_max']:>8.1f} {big['lb_mib_max']:>7.1f} "
                      f"{big['dispatch_mib_max']:>8.1f} {_worst(sel, 'dispatch_over_lb'):>7.3f} "
                      f"{big['tile_over_lb']:>7.2f} "
                      f"{big['ring_over_lb']:>7.2f} {_worst(sel, 'build_ms'):>8.2f}")
        print()


def check_targets(rows: list[dict]) -> dict:
    sel = [r for r in rows if r["layout"] == "balanced" and 8 <= r["cp"] <= 64]
    got = {key: max(r[key] for r in sel) for key in
           ("work_imb", "token_imb", "padding_pct", "dispatch_over_lb")}
    build = [r["build_ms"] for r in sel if r["mix"] == "lognormal_1k" and r["cp"] == 64]
    got["build_ms_1k_docs_cp64"] = max(build) if build else float("nan")
    print("Targets for balanced at cp 8..64 (worst case over mixes and masks):")
    result = {}
    for key, limit in TARGETS.items():
        ok = got[key] <= limit
        result[key] = {"value": got[key], "target": limit, "met": ok}
        print(f"  {key:<24} {got[key]:8.3f}  target <= {limit:<5} {'met' if ok else 'NOT met'}")
    return result


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return []
    cps = sorted({r["cp"] for r in rows})
    written = []
    for key, label, name in (("work_imb", "work max/mean (worst mix)", "balance_work.png"),
                             ("token_imb", "tokens max/mean (worst mix)", "balance_tokens.png"),
                             ("ring_mib_max", "ring / all-gather MiB per rank per layer",
                              "balance_ring_bytes.png"),
                             ("tile_mib_max", "tile-range dispatch MiB per rank per layer",
                              "balance_tile_bytes.png"),
                             ("lb_mib_max", "lower bound MiB per rank per layer (worst mix)",
                              "balance_lower_bound.png")):
        fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(4 * len(SCENARIOS), 3.4),
                                 sharey=True)
        for ax, scenario in zip(axes, SCENARIOS):
            for layout in LAYOUTS:
                ys = [_worst(rows, key, masks=scenario, layout=layout, cp=cp) for cp in cps]
                ax.plot(cps, ys, marker="o", label=layout)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(scenario)
            ax.set_xlabel("cp")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel(label)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 mixes, cp 2/8/64 (CI smoke)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = run(args.quick)
    print_table(rows)
    targets = check_targets(rows)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(rows, out_dir)
    meta = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": args.threads, "quick": args.quick,
            "total_tokens": TOTAL, "bytes_per_token": BYTES_PER_TOKEN, "tile": TILE,
            "mixes": {k: len(MIXES[k]()) for k in MIXES}, "plots": plots,
            "seconds": time.perf_counter() - t0}
    name = "balance_quick.json" if args.quick else "balance.json"
    (out_dir / name).write_text(json.dumps({"meta": meta, "targets": targets, "rows": rows},
                                           indent=1))
    print(f"wrote bench/results/{name} and {len(plots)} plots in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
