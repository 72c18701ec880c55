"""Communication and compute per CP rank, per strategy and mask (host only, no processes).

For a few document mixes packed to ``--tokens`` tokens and cp = 2..8, builds the plan
(``dual_chunk`` layout by default) and asks every strategy's cost model, which reads the
same host tables the strategy runs on:
- bytes sent per rank per layer, forward and backward (``bytes_sent_per_rank``: K/V in
  bf16, GQA-aware, accumulators in fp32 where they travel; verified against the bytes the
  collectives really post by tests/test_cp_strategies.py);
- compute per rank: query-key pairs the kernels visit (tiles of the host schedules) and the
  visible pairs among them, per query head of the model (``compute_per_rank``);
- "needed": the K/V bytes of other ranks that this rank's queries can see at all, the floor
  for any strategy that moves K/V.
Masks: causal, sliding window (4096, 0) and chunked 8192 (Llama 4), both scaled by
tokens / 128K so that they keep their proportion to the mix.

Usage: python bench/cp.py [--quick] [--tokens N] [--layout dual_chunk] [--out PATH]
Prints a table and writes JSON (default bench/results/cp.json).
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
from varlen_cp.plan import CPPlan  # noqa: E402
from varlen_cp.schedules.hybrid import default_a2a_size, heads_fit  # noqa: E402
from varlen_cp.schedules.selected import fetched_tokens  # noqa: E402
from varlen_cp.strategies import STRATEGIES, get_strategy  # noqa: E402

# Llama-3-8B-like attention: 32 query heads, 8 K/V heads, head dim 128, bf16.
MODEL = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "head_dim_v": 128, "dtype_bytes": 2}
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
    row = MODEL["n_kv_heads"] * (MODEL["head_dim"] + MODEL["head_dim_v"]) * MODEL["dtype_bytes"]
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
        b = mod.bytes_sent_per_rank(plan, mask, **MODEL, **opts)
        c = mod.compute_per_rank(plan, mask, block=BLOCK, **MODEL, **opts)
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32K tokens, cp 2, 4, 8")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--layout", default="dual_chunk")
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
    for mix, docs in document_mixes(tokens).items():
        result["mixes"][mix] = {"n_docs": len(docs), "max_doc": max(docs)}
        for mname, mask in masks(tokens).items():
            rows = []
            for cp in cps:
                row = measure(docs, cp, mask, args.layout)
                rows.append((cp, row))
                result["rows"].append({"mix": mix, "mask": mname, "cp": cp, **row})
            print_table(mix, mname, rows)
    result["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
