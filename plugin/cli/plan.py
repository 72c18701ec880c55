"""``varlen-cp-plan``: the plan report for YOUR documents and cluster size, before booking GPUs.

    varlen-cp-plan --config configs/llama4_debug_cp2.toml --lengths lengths.txt --out plots/
    varlen-cp-plan --cp 8 --heads 32 --kv-heads 8 --mask chunk=8192:3 --mask causal:1 \\
        --jsonl docs.jsonl --length-field n_tokens --seq-len 131072 --strategy auto
    varlen-cp-plan --cp 16 --heads 40 --kv-heads 8 --mix lognormal_long --seq-len 131072

The job (CP degree, layout, strategy, layer masks, heads, head dim, dtype) comes from a
torchtitan or megatron TOML job file and/or flags (``varlen_cp.cli.jobs``: mask syntax
there); the documents from a file of lengths, a JSONL field or a named synthetic mix,
packed into batches of ``--seq-len`` tokens (``varlen_cp.cli.lengths``). For the first
``--batches`` batches it builds the plan every rank would build (host only: no GPU, no
process group, no torchtitan needed) and prints, from ``varlen_cp.report``:

- per layer type: layers, the strategy that runs (``auto`` resolved), stage count, work
  max/mean over ranks, the busiest rank's K/V floor and bytes sent per layer; and rank 0's
  backend coverage: the share of its visible pairs and of its kernel calls in
  FlashAttention's form, and the FA backend they run on (``--backend``, below);
- per rank (batch 0): tokens, work per layer type, K/V floor, bytes sent;
- per strategy and layer type: the cost model's time per layer (forward + backward,
  slowest rank), compute, communication, bytes and memory kept for the backward, what
  ``auto`` picks, and the whole model's time per step per strategy;
- over all analysed batches: balance (mean and worst) and ``auto``'s picks.

With ``--out DIR`` it writes ``plan_work.png`` (per-rank work by layer type),
``plan_traffic.png`` (rank x rank K/V traffic) and ``plan_strategies.png`` (each strategy's
estimate against cp, ``--sweep``), which need matplotlib (``pip install
"varlen-cp[bench]"``; without it the report is printed and the PNGs are skipped with that
note); ``--json FILE`` writes every figure, unrounded. Bad input: one line naming the flag
or file and value, exit status 2.

``--backend`` (default: the job file's ``[varlen_cp] backend``, else "auto") has an offline
meaning, as there is no GPU here (``varlen_cp.report.Backends.planned``): "flash" / "fa4"
build the FA forms a GPU run with that backend would build (on an sm90 GPU), where the
library takes this model's calls at all (dtype, head dims, sinks, QK-clip); "auto" counts
as FA-capable, so its coverage is what FlashAttention CAN take (FA4's rules): on a GPU
where auto picks our Triton kernels (torch's flash ops running FA2 on sm90+, no
flash-attn-4) none of it runs there; "triton" / "torch": our kernels only (0%).

Limits: the rates are a model (``--flops``, ``--bandwidth``; defaults: one H100 node); one
head shape for all layers; the plan is rank 0's view (every rank builds the same plan);
the coverage is rank 0's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import BACKENDS, LAYOUTS, STRATEGY_CHOICES
from ..job_file import check_output
from ..resolve import check_heads
from ..mixes import MIXES
from ..options import AttnOptions
from ..plan.cpplan import MAX_CP_SIZE, check_layout
from ..plan.nodes import Topology, launch_gpus_per_node
from ..prefetch import build_plan
from ..report import Backends, PlanReport, plan_report
from ..report.text import (coverage_lines, fmt_bytes, fmt_share, fmt_time, headline,
                           layer_table, rank_lines, table)
from ..tables.auto import CostModel
from . import jobs, lengths, plots

PROG = "varlen-cp-plan"
DEFAULT_SWEEP = (2, 4, 8, 16, 32, 64)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="Mask syntax: MASK[:LAYERS], MASK = causal | full | "
                                "chunk=N | window=L | window=L,R joined by '+' (e.g. "
                                "chunk=8192:3, window=4096:5, full+window=128,128).")
    job = p.add_argument_group("job (flags override --config)")
    job.add_argument("--config", help="torchtitan or megatron TOML job file")
    job.add_argument("--cp", type=int, help="context-parallel degree")
    job.add_argument("--layout", choices=LAYOUTS)
    job.add_argument("--strategy", choices=STRATEGY_CHOICES)
    job.add_argument("--backend", metavar="{" + ",".join(BACKENDS) + "}",
                     help="kernels' backend, for the FlashAttention coverage (default: the "
                     "job file's, else auto). Offline: flash / fa4 build the FA forms as a "
                     "GPU run would where the library takes the model's calls; auto counts "
                     "as FA-capable (what FA CAN take); triton / torch: none on FA")
    job.add_argument("--mask", action="append", metavar="MASK[:LAYERS]",
                     help="a layer type's mask and layer count (repeat per layer type)")
    job.add_argument("--heads", type=int, help="query heads (per tensor-parallel rank)")
    job.add_argument("--kv-heads", type=int, help="K/V heads (default: --heads)")
    job.add_argument("--head-dim", type=int, help="q/k head dim (default 128)")
    job.add_argument("--head-dim-v", type=int, help="v head dim (default: --head-dim)")
    job.add_argument("--dtype", help=f"one of {sorted(jobs.DTYPES)} (default bfloat16)")
    for flag in ("a2a-size", "overlap-stages", "tile-tokens", "min-chunk-tokens",
                 "pad-multiple"):
        job.add_argument(f"--{flag}", type=int, help="as in [varlen_cp]")
    docs = p.add_argument_group("documents (one source)")
    docs.add_argument("--lengths", help="text file of document lengths")
    docs.add_argument("--jsonl", help="JSONL file with a length field per document")
    docs.add_argument("--length-field", default="length",
                      help="the JSONL field (int, or a list: its length; default 'length')")
    docs.add_argument("--mix", help=f"synthetic mix: {', '.join(sorted(MIXES))}")
    docs.add_argument("--seq-len", type=int, help="tokens per packed row (default: the job "
                      "file's, else 131072)")
    docs.add_argument("--tokens", type=int, help="--mix only: tokens to generate (default: "
                      "4 batches)")
    out = p.add_argument_group("output")
    out.add_argument("--batches", type=int, default=8,
                     help="analyse the first N batches (default 8)")
    out.add_argument("--out", help="directory for the PNGs")
    out.add_argument("--json", help="write every figure to this JSON file")
    out.add_argument("--sweep", default=None,
                     help="cp values of the strategies-vs-cp plot, e.g. 2,4,8 (default: "
                     "powers of two to 64 and the job's cp)")
    out.add_argument("--flops", type=float, default=CostModel.flops_per_s,
                     help="attention FLOP/s per GPU of the cost model (default 3e14)")
    out.add_argument("--bandwidth", type=float, default=None,
                     help="bytes/s one rank sends to ranks of its own node (default: the job "
                     "file's [varlen_cp] node_bandwidth, else 1.5e11: NVLink)")
    out.add_argument("--cross-node-bandwidth", type=float, default=None,
                     help="bytes/s one rank sends to other nodes (default: the job file's "
                     "[varlen_cp] cross_node_bandwidth, else 4.5e10: a 400 Gb/s NIC per "
                     "GPU); both links run at once")
    out.add_argument("--gpus-per-node", type=int, default=None,
                     help="GPUs per node (default: the job file's [varlen_cp] gpus_per_node, "
                     "else $LOCAL_WORLD_SIZE, else 8); a node holds gpus-per-node / TP "
                     "consecutive CP ranks, and balanced places its ranks on them as a run "
                     "does")
    return p


def cost_model(args: Any, job: jobs.Job) -> CostModel:
    """The rates of the flags, else of the job's ``[varlen_cp]`` keys (``node_bandwidth``,
    ``cross_node_bandwidth``: what a run's cost model takes), and the nodes of the job's CP
    ranks: ``--gpus-per-node`` (else the job's ``gpus_per_node``, else the launch's
    ``LOCAL_WORLD_SIZE``, else 8) over the job's TP degree."""
    cfg = job.config
    gpus = next((g for g in (args.gpus_per_node, cfg.gpus_per_node) if g is not None),
                None)
    gpus = launch_gpus_per_node() if gpus is None else gpus
    jobs._int(gpus, "--gpus-per-node")
    inside = cfg.node_bandwidth if args.bandwidth is None else args.bandwidth
    cross = (cfg.cross_node_bandwidth if args.cross_node_bandwidth is None
             else args.cross_node_bandwidth)
    try:
        return CostModel(flops_per_s=args.flops, bytes_per_s=inside,
                         cross_node_bytes_per_s=cross, ranks_per_node=max(gpus // job.tp, 1))
    except ValueError as e:   # name the flag, not the field
        field = str(e).split(" ", 1)[0].split(".")[-1]
        flag = {"flops_per_s": "--flops", "bytes_per_s": "--bandwidth",
                "cross_node_bytes_per_s": "--cross-node-bandwidth"}.get(field, "--gpus-per-node")
        raise ValueError(f"{flag}: {e}") from None


# ---- inputs -------------------------------------------------------------------------------
def read_documents(args: Any, job: jobs.Job, keep_tokens: int) -> tuple[lengths.Corpus, str]:
    """One pass over the documents (``lengths.scan``), keeping those the first
    ``keep_tokens`` tokens (the batches analysed) touch."""
    given = [f for f in ("lengths", "jsonl", "mix") if getattr(args, f)]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --lengths, --jsonl, --mix (got "
                         f"{', '.join('--' + g for g in given) or 'none'})")
    if args.lengths:
        return (lengths.scan(lengths.iter_lengths_file(args.lengths), keep_tokens,
                             f"--lengths: {args.lengths}"), f"from {args.lengths}")
    if args.jsonl:
        return (lengths.scan(lengths.iter_jsonl(args.jsonl, args.length_field), keep_tokens,
                             f"--jsonl: {args.jsonl}"),
                f"from {args.jsonl} (field {args.length_field!r})")
    total = args.tokens if args.tokens is not None else 4 * (job.seq_len or 131072) * job.rows
    jobs._int(total, "--tokens")
    return (lengths.scan(lengths.mix_lengths(args.mix, total), keep_tokens, "--mix"),
            f"of mix {args.mix!r}")


def check_job(job: jobs.Job) -> None:
    """The strategies' and the layout's own rules for these heads and cp, at every cp, as
    the launchers check them (``resolve.check_launch``; not the backend: the job runs
    elsewhere)."""
    for t in job.layers:
        try:
            check_heads(AttnOptions(strategy=t.strategy, a2a_size=t.a2a_size),
                        job.shape.n_heads, job.shape.n_kv_heads, job.cp)
        except ValueError as e:
            raise ValueError(f"strategy {t.strategy!r} at cp {job.cp}: {e}") from None
    try:
        check_layout(job.config.layout_spec(), job.cp)
    except ValueError as e:
        raise ValueError(f"--layout {job.config.layout}: {e}") from None


def sweep_values(text: str | None, job: jobs.Job, tokens: int) -> list[int]:
    if text is None:
        values = {c for c in DEFAULT_SWEEP if c <= max(tokens // 64, 2)} | {job.cp}
    else:
        try:
            values = {int(v) for v in text.split(",") if v.strip()}
        except ValueError:
            raise ValueError(f"--sweep must be comma-separated ints, got {text!r}") from None
        if not values or min(values) < 2:
            raise ValueError(f"--sweep values must be ints >= 2, got {text!r}")
        if max(values) > MAX_CP_SIZE:
            raise ValueError(f"--sweep values must be at most {MAX_CP_SIZE} (a plan's "
                             f"rank-pair tables grow with cp**2), got {max(values)}")
    return sorted(c for c in values if c >= 2)


# ---- analysis -----------------------------------------------------------------------------
def analyse(job: jobs.Job, cu: Any, cp: int, model: CostModel,
            backends: Backends | None = None) -> tuple[Any, PlanReport]:
    """Rank 0's plan and report; ``backends``: with the backend coverage (None: without,
    as the cp sweep needs only estimates)."""
    layer_masks = [(t.mask, t.n_layers) for t in job.layers]
    # The run's topology: consecutive CP ranks fill a node (model.ranks_per_node of them),
    # with the flags' rates; balanced places its ranks on those nodes as a run would.
    topology = Topology(tuple(model.nodes(cp).tolist()), model.bytes_per_s,
                        model.cross_node_bytes_per_s) if cp > 1 else None
    plan = build_plan(cu, job.config, cp_size=cp, cp_rank=0, layer_masks=layer_masks,
                      topology=topology)
    return plan, plan_report(plan, job.layers, job.shape,
                             overlap_stages=job.config.overlap_stages,
                             with_estimates=True, model=model, backends=backends)


def auto_picks(rep: PlanReport) -> str:
    return ", ".join(f"{r.label} -> {r.auto_pick}" for r in rep.layers if r.auto_pick)


def per_step(rep: PlanReport) -> dict[str, tuple[float, float]]:
    """Per strategy (and "auto": each layer type's pick): the model's attention time per
    step and the sum over layers of the busiest rank's bytes."""
    names = list(rep.layers[0].estimates or {})
    out = {}
    for name in names + ["auto"]:
        pick = {r.label: (r.auto_pick if name == "auto" else name) for r in rep.layers}
        if any(pick[r.label] not in (r.estimates or {}) for r in rep.layers):
            continue
        out[name] = (sum(r.layer.n_layers * r.estimates[pick[r.label]].seconds
                         for r in rep.layers),
                     sum(r.layer.n_layers * r.estimates[pick[r.label]].bytes_sent
                         for r in rep.layers))
    return out


def sweep(job: jobs.Job, cu: Any, cps: list[int], model: CostModel
          ) -> tuple[dict[int, dict[str, tuple[float, float]]], dict[int, str]]:
    results, chosen = {}, {}
    for cp in cps:
        _, rep = analyse(job, cu, cp, model)
        results[cp] = per_step(rep)
        chosen[cp] = "/".join(dict.fromkeys(r.auto_pick for r in rep.layers))
    return results, chosen


# ---- text ---------------------------------------------------------------------------------
def strategy_lines(rep: PlanReport) -> list[str]:
    rows = [["layer type", "strategy", "time", "compute", "comm", "sent (max rank)",
             "kept for bwd", ""]]
    for r in rep.layers:
        for i, (name, e) in enumerate((r.estimates or {}).items()):
            mark = " ".join(m for m, on in (("<- auto", name == r.auto_pick),
                                            ("(runs)", name == r.strategy)) if on)
            rows.append([r.label if i == 0 else "", name, fmt_time(e.seconds),
                         fmt_time(e.compute_s), fmt_time(e.comm_s), fmt_bytes(e.bytes_sent),
                         fmt_bytes(e.saved_bytes), mark])
    return table(rows)


def summary_lines(reps: list[PlanReport]) -> list[str]:
    out = []
    for i, first in enumerate(reps[0].layers):
        values = [rep.layers[i].work_imbalance for rep in reps]
        picks = Counter(rep.layers[i].auto_pick for rep in reps)
        out.append(f"  {first.label}: work max/mean mean {sum(values) / len(values):.3f}, "
                   f"worst {max(values):.3f}; auto picks "
                   + ", ".join(f"{n} in {c}" for n, c in picks.most_common()))
        shares = [rep.layers[i].coverage.pair_share for rep in reps
                  if rep.layers[i].coverage is not None]
        if shares:
            out[-1] += (f"; FA share of rank 0's work mean "
                        f"{fmt_share(sum(shares) / len(shares))}, worst {fmt_share(min(shares))}")
    tokens = [rep.token_imbalance for rep in reps]
    out.append(f"  tokens max/mean: mean {sum(tokens) / len(tokens):.3f}, worst "
               f"{max(tokens):.3f}")
    return out


def report_text(job: jobs.Job, docs: str, reps: list[PlanReport], n_batches: int,
                model: CostModel) -> list[str]:
    rep = reps[0]
    cfg = job.config
    lines = [f"{PROG}: {job.source}",
             f"documents {docs}; {n_batches} batches of {job.rows} x {job.seq_len} tokens; "
             f"analysing {len(reps)}",
             f"cost model: {model.flops_per_s:.3g} FLOP/s attention, "
             f"{model.bytes_per_s:.3g} B/s per rank in a node, "
             f"{model.cross_node_bytes_per_s:.3g} B/s across nodes, {model.ranks_per_node} "
             f"CP ranks per node (--flops, --bandwidth, --cross-node-bandwidth, "
             f"--gpus-per-node)",
             "", f"batch 0: {headline(rep)}; tokens max/mean {rep.token_imbalance:.3f}"]
    if cfg.overlap_stages is not None:
        lines[-1] += f"; overlap_stages {cfg.overlap_stages}"
    lines += ["layer types:"] + layer_table(rep)
    if rep.backends is not None:
        b = rep.backends
        lines.append(f"kernels: --backend {b.backend} (offline: {b.note}); FA-form calls "
                     f"on {b.flash or 'none'}")
        lines += ["  " + line for line in coverage_lines(rep)]
    lines += ["per rank:"] + rank_lines(rep)
    if job.cp > 1:
        lines += ["strategies per layer type (one layer, fwd+bwd, slowest rank):"]
        lines += strategy_lines(rep)
        steps = per_step(rep)
        lines.append("model per step (all layers): " + " | ".join(
            f"{n} {fmt_time(s)} {fmt_bytes(b)}" for n, (s, b) in steps.items()))
        lines.append(f"auto picks: {auto_picks(rep)}")
    lines += [f"over {len(reps)} batches:"] + summary_lines(reps)
    return lines


def coverage_json(r: Any) -> dict[str, Any] | None:
    """A layer type's backend coverage on rank 0 (None: not computed)."""
    c = r.coverage
    if c is None:
        return None
    return {"rank": c.rank, "flash_backend": r.flash_backend, "flash_pairs": c.flash_pairs,
            "total_pairs": c.total_pairs, "pair_share": c.pair_share,
            "flash_calls": c.flash_calls, "other_calls": c.other_calls,
            "call_share": c.call_share, "fa_calls": c.fa_calls}


def report_json(job: jobs.Job, docs: str, reps: list[PlanReport], n_batches: int,
                sweep_data: dict, chosen: dict) -> dict[str, Any]:
    def layer(r: Any) -> dict[str, Any]:
        return {"label": r.label, "n_layers": r.layer.n_layers, "configured": r.layer.strategy,
                "strategy": r.strategy, "stages": r.stages, "work": r.work,
                "work_imbalance": r.work_imbalance, "kv_floor_bytes": r.kv_floor_bytes,
                "sent_bytes": r.sent_bytes, "cross_node_bytes": r.cross_node_bytes,
                "auto_pick": r.auto_pick,
                "estimates": {n: vars(e) for n, e in (r.estimates or {}).items()},
                "coverage": coverage_json(r)}

    b = reps[0].backends

    return {"source": job.source, "documents": docs, "cp": job.cp,
            "layout": job.config.layout, "seq_len": job.seq_len, "rows": job.rows,
            "n_batches": n_batches,
            "backend": None if b is None else {"backend": b.backend, "flash": b.flash,
                                               "reason": b.reason, "note": b.note},
            "batches": [{"n_docs": rep.n_docs, "tokens": rep.tokens,
                         "token_imbalance": rep.token_imbalance,
                         "layers": [layer(r) for r in rep.layers]} for rep in reps],
            "sweep": {str(c): v for c, v in sweep_data.items()},
            "sweep_auto": {str(c): v for c, v in chosen.items()}}


# ---- main ---------------------------------------------------------------------------------
def check_outputs(args: Any) -> None:
    """``--json`` names a file that can be written and ``--out`` a folder that can be,
    checked before the analysis (nothing is created yet), so a typo costs no planning."""
    for flag, value, is_dir in (("--json", args.json, False), ("--out", args.out, True)):
        if value:
            check_output(flag, value, folder=is_dir)


def run(args: Any) -> int:
    job = jobs.with_flags(jobs.read_job(args.config) if args.config else None, args)
    model = cost_model(args, job)
    if job.unchecked:   # read without torchtitan: say what could not be checked
        print(f"{PROG}: warning: torchtitan is not installed, so these keys of its sections "
              f"in {args.config} were not checked: {', '.join(job.unchecked)}",
              file=sys.stderr)
    if job.seq_len is None:
        job = dataclasses.replace(job, seq_len=131072)
    check_job(job)
    backends = Backends.planned(job.config.backend, job.shape)
    jobs._int(args.batches, "--batches")
    check_outputs(args)
    cps = sweep_values(args.sweep, job, job.seq_len * job.rows)
    corpus, where = read_documents(args, job, args.batches * job.seq_len * job.rows)
    n_batches = lengths.count_batches(corpus.tokens, job.seq_len, job.rows)
    batches = lengths.pack(corpus.head, job.seq_len, job.rows, limit=args.batches)
    start = time.perf_counter()
    analysed = [analyse(job, cu, job.cp, model, backends) for cu in batches]
    plan0, reps = analysed[0][0], [rep for _, rep in analysed]
    desc = (f"{corpus.n_docs} lengths {where} ({corpus.tokens} tokens, mean "
            f"{corpus.tokens / corpus.n_docs:.0f}, max {corpus.longest})")
    lines = report_text(job, desc, reps, n_batches, model)
    sweep_data, chosen = sweep(job, batches[0], cps, model) if cps else ({}, {})
    if sweep_data:
        lines.append("strategies vs cp (batch 0, model per step): " + "; ".join(
            f"cp {c}: auto {fmt_time(v['auto'][0])} ({chosen[c]})"
            for c, v in sweep_data.items() if "auto" in v))
    lines.append(f"(planned in {time.perf_counter() - start:.2f} s)")
    if args.out:
        lines += write_pngs(Path(args.out), job, plan0, reps[0], sweep_data, chosen)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            report_json(job, desc, reps, n_batches, sweep_data, chosen), indent=1))
        lines.append(f"json: {args.json}")
    print("\n".join(lines))
    return 0


def write_pngs(out: Path, job: jobs.Job, plan: Any, rep: PlanReport, sweep_data: dict,
               chosen: dict) -> list[str]:
    if not plots.have_matplotlib():
        return [f"png: none written; {plots.INSTALL_HINT}"]
    out.mkdir(parents=True, exist_ok=True)
    name = Path(job.source.split(" ", 1)[0]).stem if job.source != "command line" else "job"
    what = f"{name}, cp {job.cp}, {job.config.layout}, batch 0"
    paths = [plots.work_png(rep, out / "plan_work.png", f"per-rank work ({what})"),
             plots.traffic_png(plots.traffic_matrix(plan, rep), out / "plan_traffic.png",
                               f"K/V each rank needs from the others\n({what}, "
                               f"all layers, forward)")]
    if sweep_data:
        paths.append(plots.sweep_png(sweep_data, chosen, out / "plan_strategies.png",
                                     f"strategy estimates vs cp ({name}, batch 0: "
                                     f"{rep.total_tokens} tokens, {rep.n_docs} documents)"))
    return [f"png: {p}" for p in paths]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse: usage errors exit 2
    try:
        return run(args)
    except (ValueError, OSError) as e:   # a user's mistake (or the disk's): one line
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
