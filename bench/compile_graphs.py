"""torch.compile of a whole model with the CP op: graph breaks, compiled graphs, compile time.

A 2-layer model (a chunked layer through ``ContextParallelVarlenAttention``, a global causal
layer through ``cp_varlen_attn``; projections, residuals, GQA 4/2 heads) is compiled as a
whole with ``torch.compile(backend=...)`` and trained on ``--batches`` batches of different
document mixes (same total tokens, other documents: the plan and its tables change every
batch), at CP=``--cp`` on gloo (CPU). Per strategy it reports dynamo's counters on rank 0:
graph breaks (``counters["graph_break"]``), compiled graphs
(``counters["stats"]["unique_graphs"]``), the graphs added after the first batch, the
seconds of every batch (the first ones are compile time), and whether the compiled loss and
gradients equal eager's on the same batches.

Usage: python bench/compile_graphs.py [--strategies p2p,dispatch] [--backend aot_eager]
[--batches 8] [--cp 2] [--a2a-size 2] [--out bench/results/compile.json]
Tests import :func:`run_rank` (tests/strategies/test_compile.py) with fewer batches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from varlen_cp import (AttnMask, AttnOptions, ContextParallelVarlenAttention,  # noqa: E402
                       CPPlan, cp_varlen_attn)
from varlen_cp import graph_op  # noqa: E402
from varlen_cp.plan import DualChunk  # noqa: E402

DIM, HQ, HKV, HEAD_DIM = 32, 4, 2, 8
MASKS = (AttnMask(causal=True, chunk_size=16), AttnMask(causal=True))
TOTAL = 192


def document_mixes(n: int, total: int = TOTAL, seed: int = 0) -> list[list[int]]:
    """``n`` packed batches of ``total`` tokens with different document lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        docs, used = [], 0
        while used < total:
            d = min(int(torch.randint(1, 90, (1,), generator=g)), total - used)
            docs.append(d)
            used += d
        out.append(docs)
    return out


class Layer(torch.nn.Module):
    """Pre-norm attention block; ``functional``: call ``cp_varlen_attn`` directly instead
    of the module (both public entries get compiled)."""

    def __init__(self, mask: AttnMask, strategy: str, group, functional: bool,
                 a2a_size: int | None = None, attn_backend: str = "auto") -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, (HQ + 2 * HKV) * HEAD_DIM)
        self.proj = torch.nn.Linear(HQ * HEAD_DIM, DIM)
        self.mask, self.group, self.functional = mask, group, functional
        self.options = AttnOptions(strategy=strategy, a2a_size=a2a_size, backend=attn_backend)
        self.attn = ContextParallelVarlenAttention(mask, self.options, group)

    def forward(self, x: torch.Tensor, plan: CPPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).split([HQ * HEAD_DIM, HKV * HEAD_DIM,
                                                HKV * HEAD_DIM], dim=-1)
        q, k, v = q.view(t, HQ, HEAD_DIM), k.view(t, HKV, HEAD_DIM), v.view(t, HKV, HEAD_DIM)
        if self.functional:
            o = cp_varlen_attn(q, k, v, plan, self.mask, self.group, self.options)
        else:
            o = self.attn(q, k, v, plan)
        return x + self.proj(o.reshape(t, HQ * HEAD_DIM))


class Model(torch.nn.Module):
    def __init__(self, strategy: str, group, a2a_size: int | None = None,
                 attn_backend: str = "auto") -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [Layer(m, strategy, group, i % 2 == 1, a2a_size, attn_backend)
             for i, m in enumerate(MASKS)])

    def forward(self, x: torch.Tensor, plan: CPPlan) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, plan)
        return x


def _batch(docs: list[int], world: int, rank: int, layout: str, seed: int,
           dtype: torch.dtype = torch.float32):
    cu = torch.tensor([0] + docs).cumsum(0)
    plan = CPPlan.build(cu, cp_size=world, cp_rank=rank,
                        layout=DualChunk(min_chunk_tokens=8) if layout == "dual_chunk"
                        else layout)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(docs), DIM, generator=g).to(dtype)
    target = torch.randn(sum(docs), DIM, generator=g).to(dtype)
    # plan.shard marks the token dim dynamic (it changes with every batch's documents)
    return plan, plan.shard(x).requires_grad_(), plan.shard(target)


def _step(model, x, target, plan):
    out = model(x, plan)
    loss = ((out - target) ** 2).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    return loss.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the scale of a loss sum or a gradient)."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def run_rank(rank: int, world: int, strategy: str, backend: str, n_batches: int,
             layout: str = "dual_chunk", check_eager: bool = True,
             a2a_size: int | None = None, attn_backend: str = "auto",
             dtype: torch.dtype = torch.float32) -> dict:
    """Compile the model with ``backend`` and run ``n_batches`` batches on this rank;
    returns the counters and timings, and the largest relative difference to eager (loss and
    every gradient, ``_rel``) and how many compiled calls' backward states are still held
    (``graph_op``; 0: nothing leaks). ``attn_backend`` / ``dtype``: the attention kernels'
    backend (``AttnOptions.backend``) and the model's dtype ("flash" needs bf16 / fp16)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    import torch.distributed as dist
    # an explicit CP group (its name is what the compiled op carries), not the default one
    model = Model(strategy, dist.new_group(list(range(world))), a2a_size,
                  attn_backend).to(dtype)
    compiled = torch.compile(model, backend=backend)
    graphs, breaks, seconds, diffs = [], [], [], []
    for i, docs in enumerate(document_mixes(n_batches)):
        plan, x, target = _batch(docs, world, rank, layout, seed=100 + i, dtype=dtype)
        start = time.perf_counter()
        loss, grads = _step(compiled, x, target, plan)
        seconds.append(round(time.perf_counter() - start, 3))
        graphs.append(int(counters["stats"]["unique_graphs"]))
        breaks.append(sum(counters["graph_break"].values()))
        if check_eager:
            ref_loss, ref_grads = _step(model, x, target, plan)
            diffs.append(max(_rel(a, b) for a, b in zip([loss] + grads, [ref_loss] + ref_grads)))
    reasons = sorted({str(k)[:160] for k in counters["graph_break"]})
    return {"strategy": strategy, "backend": backend, "graph_breaks": breaks[-1],
            "graphs": graphs[-1], "graphs_per_batch": graphs, "breaks_per_batch": breaks,
            "new_graphs_after_first": graphs[-1] - graphs[0], "seconds": seconds,
            "max_diff_vs_eager": max(diffs) if diffs else None,
            "recompiles": int(counters["recompiles"].get("total", 0))
            if "recompiles" in counters else None,
            "break_reasons": reasons[:20], "held_states": len(graph_op._STATE)}


def _worker(rank, world, store, args, out):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        res = [run_rank(rank, world, s, args.backend, args.batches, args.layout,
                        a2a_size=args.a2a_size if s == "a2a+p2p" else None)
               for s in args.strategies.split(",")]
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="p2p,all_gather,a2a,dispatch")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--layout", default="dual_chunk")
    p.add_argument("--a2a-size", type=int, default=None, help="a2a+p2p's Ulysses group size")
    p.add_argument("--out", default="")
    args = p.parse_args()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, args.cp, store, args, out))
                 for r in range(args.cp)]
        for proc in procs:
            proc.start()
        res = out.get(timeout=3600)
        for proc in procs:
            proc.join(timeout=60)
    for r in res:
        print(f"{r['strategy']:>10} {r['backend']}: {r['graph_breaks']} graph breaks, "
              f"{r['graphs']} graphs ({r['new_graphs_after_first']} after batch 1), "
              f"seconds per batch {r['seconds']}, max |compiled - eager| "
              f"{r['max_diff_vs_eager']:.2e} (relative)")
        for reason in r["break_reasons"][:6]:
            print(f"{'':>12}break: {reason}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cp": args.cp, "batches": args.batches, "layout": args.layout,
                       "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
