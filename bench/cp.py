"""Communication and compute per CP rank, per strategy and mask (host only, no processes).

For a few document mixes packed to ``--tokens`` tokens and cp = 2..8, builds the plan
(``dual_chunk`` layout by default) and asks every strategy's cost model, which reads the
same host tables the strategy runs on:
- bytes sent per rank per layer, forward and backward (``bytes_sent_per_rank``: K/V in
  bf16, GQA-aware, accumulators in fp32 where they travel; verified against the bytes the
  collectives really post by tests/strategies/test_cp_strategies.py);
- compute per rank: query-key pairs the kernels visit (tiles of the host schedules) and the
  visible pairs among them, per query head of the model (``compute_per_rank``);
- "needed": the K/V bytes of other ranks that this rank's queries can see at all, the floor
  for any strategy that moves K/V.
Masks: causal, sliding window (4096, 0) and chunked 8192 (Llama 4), both scaled by
tokens / 128K so that they keep their proportion to the mix.

Overlap section (``overlap`` in the JSON; ``--overlap-only`` runs just it): 8K tokens per
GPU, cp 8..64, layout ``balanced``, masks causal / SWA (4096, 0) / chunked 8192 at their
real sizes, H100 model (400 TFLOP/s attention, 150 GB/s per rank inside a node at cp <= 8,
45 GB/s across nodes above). Per strategy, the modelled time of one layer (forward +
backward, slowest rank): ``dispatch`` and ``all_gather`` before (sequential: the whole
exchange, then the whole compute) and after (staged, ``varlen_cp.tables.staged``,
the cost model's stage count), ``p2p`` / ``a2a`` from ``strategy="auto"``'s estimate; the
efficiency = mean compute over ranks / that time (and the bound: every transfer hidden
under its phase's compute at no cost); and the peak memory per rank, a host count of the
buffers each strategy's code holds at its peak (forward: beyond q, k, v; backward: beyond
q and dout, what the forward kept included), walked through its allocations in program
order (``staged.staged_memory`` for the staged strategies; :func:`old_selected_memory` for
the one-shot code they replaced; approximate main-buffer counts for p2p and a2a).

Usage: python bench/cp.py [--quick] [--tokens N] [--layout dual_chunk] [--overlap-only]
[--out PATH]. Prints tables and writes JSON (default bench/results/cp.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from varlen_cp.masks import AttnMask  # noqa: E402
from varlen_cp.plan import Balanced, CPPlan  # noqa: E402
from varlen_cp.tables.hybrid import default_a2a_size, heads_fit  # noqa: E402
from varlen_cp.tables.selected import fetched_tokens  # noqa: E402
from varlen_cp.strategies import STRATEGIES, get_strategy  # noqa: E402
from varlen_cp.tables import auto, staged  # noqa: E402
from varlen_cp.tables.catalogue import STAGED  # noqa: E402
from varlen_cp.shape import AttnShape  # noqa: E402
from varlen_cp.tables.hybrid import group_members  # noqa: E402
from varlen_cp.tables.selected import fetch_counts  # noqa: E402

# Llama-3-8B-like attention: 32 query heads, 8 K/V heads, head dim 128, bf16.
MODEL = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "head_dim_v": 128, "dtype_bytes": 2}
SHAPE = AttnShape(n_heads=32, n_kv_heads=8, head_dim=128, head_dim_v=128)  # MODEL, bf16
# Tile sizes of the Triton kernels for d=128 (kernels.triton_common.triton_block_sizes).
BLOCK = (64, 64)
MIB = float(1 << 20)


def document_mixes(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Packed batches of exactly ``tokens`` tokens (the last document is cut to fit)."""
    rng = random.Random(seed)

    def pack(draw) -> list[int]:
        docs, total = [], 0
        while total < tokens:
            n = min(max(1, int(draw())), tokens - total)
            docs.append(n)
            total += n
        return docs

    return {
        "one_doc": [tokens],
        # Long tail: lognormal lengths (median ~2K), a few documents of tens of K tokens.
        "long_tail": pack(lambda: min(rng.lognormvariate(7.6, 1.3), tokens // 2)),
        "short_docs": pack(lambda: rng.randint(256, 4096)),
    }


def masks(tokens: int) -> dict[str, AttnMask]:
    scale = tokens / 131072
    return {
        "causal": AttnMask(causal=True),
        "swa": AttnMask(causal=True, window_size=(max(1, round(4096 * scale)), 0)),
        "chunked": AttnMask(causal=True, chunk_size=max(1, round(8192 * scale))),
    }


def _fits(strategy: str, cp: int) -> bool:
    return strategy != "a2a" or heads_fit(MODEL["n_heads"], MODEL["n_kv_heads"], cp)


def needed_bytes(plan: CPPlan, mask: AttnMask) -> list[int]:
    """K/V bytes from other ranks that each rank's queries see (the floor)."""
    row = SHAPE.kv_row
    return [n * row for n in fetched_tokens(plan, mask)]


def measure(docs: list[int], cp: int, mask: AttnMask, layout: str) -> dict:
    cu = torch.tensor([0] + docs).cumsum(0)
    plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=layout)
    row = {"needed_fwd": needed_bytes(plan, mask),
           "tokens": [plan.num_tokens_of(r) for r in range(cp)], "strategies": {}}
    for name in STRATEGIES:
        if not _fits(name, cp):
            continue
        mod = get_strategy(name)
        opts = {"a2a_size": hybrid_size(cp)} if name == "a2a+p2p" else {}
        b = mod.bytes_sent_per_rank(plan, mask, SHAPE, **opts)
        c = mod.compute_per_rank(plan, mask, SHAPE, block=BLOCK, **opts)
        row["strategies"][name] = {"bytes_fwd": b["fwd"], "bytes_bwd": b["bwd"],
                                   "visited": c["visited"], "visible": c["visible"], **opts}
    return row


def hybrid_size(cp: int) -> int:
    """a2a_size of the a2a+p2p column: the largest that the heads allow below cp, so that
    the column shows a real hybrid (the strategy's own default would pick plain a2a)."""
    return max([1] + [a for a in range(2, cp) if cp % a == 0 and default_a2a_size(
        MODEL["n_heads"], MODEL["n_kv_heads"], a) == a])


def _imbalance(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean else 1.0


def print_table(mix: str, mname: str, rows: list[tuple[int, dict]]) -> None:
    names = list(STRATEGIES)
    print(f"\n{mix} / {mname}: MiB sent per rank per layer (fwd+bwd, max over ranks) "
          f"and compute imbalance (max/mean visited pairs); a2a+p2p as a x ring")
    print(f"{'cp':>3} {'needed fwd':>10} " + " ".join(f"{n:>18}" for n in names))
    for cp, row in rows:
        cells = []
        for n in names:
            e = row["strategies"].get(n)
            if e is None:
                cells.append(f"{'n/a':>18}")
                continue
            total = max(f + b for f, b in zip(e["bytes_fwd"], e["bytes_bwd"])) / MIB
            shape = f"{e['a2a_size']}x{cp // e['a2a_size']} " if "a2a_size" in e else ""
            cells.append(f"{shape + f'{total:.1f}':>11} x{_imbalance(e['visited']):<5.2f}")
        print(f"{cp:>3} {max(row['needed_fwd']) / MIB:>10.1f} " + " ".join(cells))


# ---- overlap: modelled time and peak memory ------------------------------------------------
TOKENS_PER_GPU = 8192
OVERLAP_CPS = (8, 16, 32, 64)


def h100(cp: int) -> auto.CostModel:
    """400 TFLOP/s attention; 150 GB/s per rank in one node (cp <= 8), 45 GB/s across."""
    return auto.CostModel(flops_per_s=4e14, bytes_per_s=1.5e11 if cp <= 8 else 4.5e10)


def old_selected_memory(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape
                        ) -> dict[str, list[int]]:
    """Per rank, the peak bytes of the one-shot dispatch / all_gather code that staging
    replaced (commit 9644a3b), walked in its program order like ``staged.staged_memory``:
    forward: packed K|V, send, receive, the concatenation and the index_select it feeds,
    the picked K/V (kept), the output; backward: the kept K/V, dq, dK|dV, their packed
    copy, the exchange buffers and the fp32 accumulator with its inputs."""
    cp, b = plan.cp_size, shape.dtype_bytes
    counts = fetch_counts(plan, mask)
    kv, kv4 = shape.kv_row, shape.kv_row * 4 // b
    out = shape.n_heads * shape.value_dim * b
    dq = shape.n_heads * shape.head_dim * b
    stride = max(plan.num_tokens_of(r) for r in range(cp))
    fwd, bwd, kept = [], [], []
    for r in range(cp):
        t = plan.num_tokens_of(r)
        own = int(counts[r, r])
        n = int(counts[r].sum()) - own            # fetched
        m = int(counts[:, r].sum()) - own         # others take from r
        sel = n + own
        if name == "dispatch":
            base = t + m + n
            f = [base + t + n + sel, base + 2 * sel, base + sel]
            f = [x * kv for x in f]
            f[-1] += t * out
            g = [2 * sel * kv, (sel + m + n) * kv, (sel + m + own) * kv + t * kv4 + own * kv4,
                 (sel + m) * kv + t * kv4 + m * kv4, (sel + m) * kv + t * kv4 + t * kv]
        else:
            base = (1 + cp) * stride
            f = [(base + 2 * sel) * kv, (base + sel) * kv + t * out]
            back = own + m                        # dK/dV rows arriving, own included
            g = [2 * sel * kv, (2 * sel + back) * kv + t * kv4 + back * kv4,
                 (2 * sel + back) * kv + t * kv4 + t * kv]
        fwd.append(max(f))
        bwd.append(sel * kv + t * dq + max(g))
        kept.append(sel * kv)
    return {"forward": fwd, "backward": bwd, "kept": kept}


def ring_memory(plan: CPPlan, shape: AttnShape) -> int:
    """p2p, approximate: K/V in hand and in flight, the fp32 out accumulator, one step's
    output and merge_attn_partials' three fp32 temporaries; backward: K/V in hand and in
    flight, fp32 dQ and dK|dV accumulators, one step's gradients, two partials out and two
    in. Max over ranks and phases."""
    b = shape.dtype_bytes
    t = max(plan.num_tokens_of(r) for r in range(plan.cp_size))
    kv, out, out4 = shape.kv_row, shape.n_heads * shape.value_dim * b, \
        shape.n_heads * shape.value_dim * 4
    dq, dq4 = shape.n_heads * shape.head_dim * b, shape.n_heads * shape.head_dim * 4
    fwd = t * (2 * kv + 4 * out4 + out)
    bwd = t * (2 * kv + dq4 + kv * 4 // b + dq + kv + 4 * kv)
    return max(fwd, bwd)


def ulysses_memory(plan: CPPlan, shape: AttnShape, size: int) -> int:
    """a2a, approximate: the group's tokens for this rank's heads (packed, then split; out,
    then picked), this rank's output; backward: the kept q/k/v/out slices, dout in and
    picked, the gradients, packed and picked, and the tokens they go back to. Max over
    groups and phases."""
    b = shape.dtype_bytes
    hk = max(1, shape.n_kv_heads // size)
    w = (shape.n_heads // size * shape.head_dim + hk * (shape.head_dim + shape.value_dim)) * b
    wo = shape.n_heads // size * shape.value_dim * b
    t = max(plan.num_tokens_of(r) for r in range(plan.cp_size))
    n = max(sum(plan.num_tokens_of(m) for m in group_members(g, size))
            for g in range(0, plan.cp_size, size))
    full = (shape.n_heads * shape.head_dim + shape.n_kv_heads
            * (shape.head_dim + shape.value_dim)) * b
    fwd = n * (2 * w + 2 * wo) + t * shape.n_heads * shape.value_dim * b
    bwd = n * (w + wo) + n * (2 * wo + 3 * w) + t * full
    return max(fwd, bwd)


def overlap_row(docs: list[int], cp: int, mname: str, mask: AttnMask, shape: AttnShape) -> dict:
    cu = torch.tensor([0] + docs).cumsum(0)
    plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=Balanced(masks=mask))
    model = h100(cp)
    pairs = plan.work_per_rank(mask)
    flops = (2 * (shape.head_dim + shape.value_dim) + 6 * shape.head_dim
             + 4 * shape.value_dim) * shape.n_heads
    ideal = sum(pairs) / cp * flops / model.flops_per_s
    row = {"cp": cp, "mask": mname, "n_docs": len(docs), "ideal_ms": ideal * 1e3,
           "strategies": {}}
    for name in STAGED:
        stages = staged.default_stages(plan, mask, name, shape, model)
        t = staged.staged_time(name, plan, mask, shape, model, stages)
        seq = staged.staged_time(name, plan, mask, shape, model, 1)   # today's: no overlap
        old, new = old_selected_memory(name, plan, mask, shape), \
            staged.staged_memory(name, plan, mask, shape, stages)
        row["strategies"][name] = {
            "stages": stages, "effective_stages": t.stages,
            "bound_eff": ideal / t.bound_s,     # every transfer hidden at no cost
            "before_ms": seq.seconds * 1e3, "after_ms": t.seconds * 1e3,
            "before_eff": ideal / seq.seconds, "after_eff": ideal / t.seconds,
            "before_peak_mib": max(max(f, b) for f, b in zip(old["forward"], old["backward"]))
            / MIB,
            "after_peak_mib": max(new.peak) / MIB,
            "before_fwd_mib": max(old["forward"]) / MIB, "after_fwd_mib": max(new.forward) / MIB,
            "before_kept_mib": max(old["kept"]) / MIB, "after_kept_mib": max(new.kept) / MIB}
    for name in ("p2p", "a2a"):
        opts = auto.candidate_options(name, shape, cp)
        if opts is None:
            continue
        e = auto.estimate(plan, mask, name, shape, model)
        peak = ring_memory(plan, shape) if name == "p2p" else ulysses_memory(plan, shape, cp)
        row["strategies"][name] = {"after_ms": e.seconds * 1e3, "after_eff": ideal / e.seconds,
                                   "after_peak_mib": peak / MIB}
    return row


def run_overlap(cps: tuple[int, ...]) -> list[dict]:
    shape = SHAPE
    rows = []
    for cp in cps:
        tokens = TOKENS_PER_GPU * cp
        for mix, docs in document_mixes(tokens).items():
            for mname, mask in masks(131072).items():   # the masks' real sizes
                row = overlap_row(docs, cp, mname, mask, shape)
                row["mix"] = mix
                rows.append(row)
    return rows


def print_overlap(rows: list[dict]) -> None:
    print(f"\nOverlap: {TOKENS_PER_GPU} tokens per GPU, balanced layout, H100 model; "
          f"modelled ms per layer (fwd+bwd, slowest rank) before -> after staging "
          f"(efficiency = mean compute / time), S = stages; peak MiB per rank")
    print("(bound: the efficiency if every transfer hid under compute at no cost)")
    print(f"{'mix':>10} {'mask':>7} {'cp':>3} {'ideal':>6} | {'dispatch':>27} "
          f"{'S':>2} {'bound':>5} {'peak MiB':>11} | {'all_gather':>27} {'S':>2} "
          f"{'bound':>5} {'peak MiB':>11} | {'p2p':>12} {'MiB':>5} | {'a2a':>12} {'MiB':>5}")
    for r in rows:
        cells = []
        for name in STAGED:
            e = r["strategies"][name]
            cells.append(f"{e['before_ms']:6.2f} ({e['before_eff']:.2f}) -> "
                         f"{e['after_ms']:6.2f} ({e['after_eff']:.2f}) {e['stages']:>2} "
                         f"{e['bound_eff']:5.2f} "
                         f"{e['before_peak_mib']:5.0f}->{e['after_peak_mib']:<5.0f}")
        for name in ("p2p", "a2a"):
            e = r["strategies"].get(name)
            cells.append("n/a".rjust(18) if e is None else
                         f"{e['after_ms']:6.2f} ({e['after_eff']:.2f}) {e['after_peak_mib']:5.0f}")
        print(f"{r['mix']:>10} {r['mask']:>7} {r['cp']:>3} {r['ideal_ms']:6.2f} | "
              + " | ".join(cells))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32K tokens, cp 2, 4, 8")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--layout", default="dual_chunk")
    p.add_argument("--overlap-only", action="store_true",
                   help="only the overlap section (modelled time and peak memory)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "cp.json"))
    args = p.parse_args(argv)
    # Planning is many small host ops: on shared cores OpenMP hand-offs cost more than the
    # ops themselves (measured ~15 ms vs ~10 us per op on 2 busy cores).
    torch.set_num_threads(1)
    tokens = args.tokens or (32768 if args.quick else 131072)
    cps = [2, 4, 8] if args.quick else [2, 3, 4, 6, 8]
    t0 = time.time()
    result = {"model": MODEL, "block": BLOCK, "tokens": tokens, "layout": args.layout,
              "masks": {}, "mixes": {}, "rows": []}
    for mname, mask in masks(tokens).items():
        result["masks"][mname] = {"causal": mask.causal, "window_size": list(mask.window_size),
                                  "chunk_size": mask.chunk_size}
    for mix, docs in ({} if args.overlap_only else document_mixes(tokens)).items():
        result["mixes"][mix] = {"n_docs": len(docs), "max_doc": max(docs)}
        for mname, mask in masks(tokens).items():
            rows = []
            for cp in cps:
                row = measure(docs, cp, mask, args.layout)
                rows.append((cp, row))
                result["rows"].append({"mix": mix, "mask": mname, "cp": cp, **row})
            print_table(mix, mname, rows)
    result["overlap"] = run_overlap((8, 16) if args.quick else OVERLAP_CPS)
    print_overlap(result["overlap"])
    result["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
