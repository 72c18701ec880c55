"""What the graph-safe mode's capacities cost (docs/graph-safe.md): padded rows and bytes
per rank against the dynamic strategies, on every document mix of ``varlen_cp.mixes``.

Usage: ``python bench/graph_capacity.py [--cp 8,16,32,64] [--out FILE]``.

Per mix at 8K tokens per rank (``8192 * cp`` tokens, as bench/plan.py's part 2) and cp, on
the ``balanced`` layout for Llama 4's masks (chunked 8192 x3 : causal x1): the derived
capacity (``default_capacity``: 1.02 x the mean, rounded up to 64), the largest rank's
tokens, the padded rows (cp x capacity / tokens - 1), and per strategy the K/V bytes the
busiest rank sends per layer forward, graph-safe / dynamic (the dynamic strategy's traffic
matrix, ``catalogue.traffic_of``; the graph-safe ones' fixed sizes: p2p and all_gather
(cp - 1) x capacity K|V rows, a2a (cp - 1) / cp of capacity rows of q|k|v out and
out (bf16) | lse (fp32) back, dispatch (cp - 1) x the send capacity, here the batch's own largest pair,
the least any send capacity could be, and that largest pair over the capacity, which is
static dispatch's bytes over static all_gather's). Shape: bf16, 32 query / 8 K/V heads, d 128. And
the idle programs of the row kernels (``kernels/triton_rows.py``: one program per block of
64 rows of the buffer and head; a block without a real row exits after its first loads):
per rank 1 - ceil(tokens / 64) / ceil(capacity / 64), the largest and the mean over ranks.
Host only: no process, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # the package from a checkout
    sys.path.insert(0, str(ROOT))

from varlen_cp import AttnMask, CPPlan  # noqa: E402
from varlen_cp.mixes import MIXES  # noqa: E402
from varlen_cp.plan import Balanced  # noqa: E402
from varlen_cp.shape import AttnShape  # noqa: E402
from varlen_cp.tables import catalogue  # noqa: E402
from varlen_cp.tables.selected import fetch_count_array  # noqa: E402
from varlen_cp.plan.capacity import default_capacity  # noqa: E402

MASKS = [(AttnMask(chunk_size=8192), 3), (AttnMask(), 1)]
SHAPE = AttnShape(n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
TOKENS_PER_RANK = 8192
ROW_BLOCK = 64      # the row kernels' block on GPUs (triton_common.triton_block_sizes)


def static_bytes(name: str, cp: int, cap: int, send: int) -> int:
    """Bytes one rank sends per layer forward in the graph-safe form of ``name``."""
    b, d = SHAPE.dtype_bytes, SHAPE.head_dim
    kv_row = 2 * SHAPE.n_kv_heads * d * b
    if name in ("p2p", "all_gather"):
        return (cp - 1) * cap * kv_row
    if name == "dispatch":
        return (cp - 1) * send * kv_row
    hk = max(SHAPE.n_kv_heads, cp)     # K/V heads repeated up to cp
    there = (SHAPE.n_heads * d + 2 * hk * d) * b // cp
    back = SHAPE.n_heads * (d * b + 4) // cp          # out in bf16 | lse in fp32
    return (cp - 1) * cap * (there + back)


def row(mix: str, cp: int) -> dict:
    lengths = MIXES[mix](TOKENS_PER_RANK * cp)
    cu = torch.tensor([0] + lengths).cumsum(0)
    plan = CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=Balanced(masks=MASKS))
    cap = default_capacity(plan.padded_total_tokens, cp)
    counts = np.diff(plan.arrays.rank_offsets)
    out = {"mix": mix, "cp": cp, "tokens": int(plan.padded_total_tokens), "capacity": cap,
           "max_rank_tokens": int(counts.max()),
           "padded_rows": cp * cap / plan.padded_total_tokens - 1, "bytes": {}}
    blocks = -(-counts // ROW_BLOCK) / -(-cap // ROW_BLOCK)
    out["idle_programs"] = {"max": float(1 - blocks.min()), "mean": float(1 - blocks.mean())}
    for mask, _ in MASKS:
        fetch = fetch_count_array(plan, mask).copy()
        np.fill_diagonal(fetch, 0)
        send = int(fetch.max())
        for name in ("p2p", "all_gather", "a2a", "dispatch"):
            if name == "a2a" and SHAPE.n_heads % cp:
                continue
            dyn = int(catalogue.traffic_of(name, plan, mask, SHAPE)["fwd"].sum(1).max())
            key = f"{name} {mask}"
            out["bytes"][key] = {"static": static_bytes(name, cp, cap, send),
                                 "dynamic": dyn}
        out.setdefault("send_over_capacity", {})[str(mask)] = send / cap
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", default="8,16,32,64")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "graph_capacity.json"))
    args = p.parse_args()
    rows = []
    print(f"{'mix':15} {'cp':>3} {'cap':>6} {'max':>6} {'pad':>6} {'idle':>5}  "
          f"static / dynamic bytes "
          f"(busiest rank, forward; causal layers); dispatch's largest pair / capacity "
          f"(chunked, causal)")
    for mix in MIXES:
        for cp in (int(c) for c in args.cp.split(",")):
            r = row(mix, cp)
            rows.append(r)
            ratios = " ".join(f"{k.split()[0]} {v['static'] / max(v['dynamic'], 1):5.2f}"
                              for k, v in r["bytes"].items() if "chunk_size=None" in k)
            pairs = "/".join(f"{x:.2f}" for x in r["send_over_capacity"].values())
            print(f"{mix:15} {cp:>3} {r['capacity']:>6} {r['max_rank_tokens']:>6} "
                  f"{r['padded_rows']:6.3f} {r['idle_programs']['max']:5.3f}  {ratios}  "
                  f"{pairs}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "shape": "bf16, 32 / 8 heads, d 128",
                   "masks": "Llama 4: chunked 8192 x3, causal x1", "layout": "balanced",
                   "tokens_per_rank": TOKENS_PER_RANK}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
