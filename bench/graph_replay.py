"""One-GPU replay of a graph-safe CP rank under a CUDA graph (docs/graph-safe.md).

What a graph-safe strategy runs on rank r per layer, without the other ranks (their
collectives left out): ``p2p``, its capacity rows' queries against every rank's block of
capacity rows (cp row-kernel calls, folded by their LSE), then the backward of each call
with the merged out and lse; ``a2a`` (Ulysses), one call of every rank's rows against every
rank's rows on this rank's 1/cp of the heads (both sides unsorted: sorted on the device by
the call), then its backward. The rows' documents and positions come from the mode's own
device buffer (``strategies.static.static_buffers``: every rank's rows, refreshed in place
per plan); q, K/V and dO are random.

Per case (mix, mask, cp), two batches A and B of the mix (other documents) are planned at
one capacity: the step is run eagerly on A, captured in a CUDA graph on A, the buffer
refreshed in place for B and the graph replayed; the replay must give the eager step on B
(max relative difference of out and dq at most ``DIFF_LIMIT``: the same kernels on the same
inputs, without atomics, so equal up to nothing), and the eager and replayed step
times (milliseconds, medians) are recorded. ``--dry-run`` (CPU, tiny shapes, the
interpreter): the same with the capture replaced by a second eager step, which checks the
pipeline, not the graph.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from gpu_cases import Shape, masks
from mixes import lognormal_docs
from gpu_timing import Budget, measure
from varlen_cp.kernels.merge import merge_attn_partials_
from varlen_cp.kernels.rows import RowsKernel
from varlen_cp.plan import Balanced, CPPlan
from varlen_cp.plan.capacity import default_capacity
from varlen_cp.strategies.static import static_buffers

DIFF_LIMIT = 1e-6   # the same launches on the same data, no atomics: bit-equal expected
TOKENS_PER_GPU = 8192


def graph_cases(dry_run: bool) -> list[dict]:
    """(name, cp, strategy, two batches' lengths, mask) of each replay: cp 8, one long
    document and the 1000-document log-normal mix; p2p causal and chunked, a2a causal."""
    per_gpu = 16 if dry_run else TOKENS_PER_GPU
    cp = 4 if dry_run else 8
    total = per_gpu * cp
    m = masks(per_gpu / TOKENS_PER_GPU)
    n_docs = cp if dry_run else 1000 * total // 131072
    mixes = {"one_doc": ((total,), (total // 3, total - total // 3)),
             "lognormal_1k": (tuple(lognormal_docs(n_docs, 0, total)),
                              tuple(lognormal_docs(n_docs, 1, total)))}
    cases = [("p2p", mix, mask) for mix in mixes for mask in ("causal", "chunk8192")]
    cases += [("a2a", mix, "causal") for mix in mixes]
    return [{"name": f"cp{cp}_{strategy}_{mix}_{mask}", "cp": cp, "strategy": strategy,
             "batches": mixes[mix], "mask": m[mask]} for strategy, mix, mask in cases]


def _plans(case: dict) -> tuple[CPPlan, CPPlan, int]:
    cp = case["cp"]
    cus = [torch.tensor([0, *lengths]).cumsum(0) for lengths in case["batches"]]
    layout = Balanced(masks=[(case["mask"], 1)])
    plain = [CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=layout) for cu in cus]
    cap = max(default_capacity(p.padded_total_tokens, cp) for p in plain)
    a, b = (CPPlan.build(cu, cp_size=cp, cp_rank=0, layout=layout, capacity=cap) for cu in cus)
    return a, b, cap


def rank_step(q, blocks, dout, rows, cp: int, kernel: RowsKernel, scale: float
              ) -> Callable[[], tuple]:
    """Rank 0's graph-safe p2p layer (forward and backward) as one callable."""
    def step() -> tuple:
        q_side = kernel.side(rows.rank_rows(0), in_order=True)   # shared by the cp calls
        calls, out, lse = [], None, None
        for s in range(cp):
            k, v = blocks[s]
            k_rows = q_side if s == 0 else rows.rank_rows(s)   # (as the strategy: its own)
            call = kernel.call(q, v, q_side, k_rows, q_sorted=True, k_sorted=True)
            o, l, _ = call.fwd(q, k, v, scale, False)
            out, lse = (o, l) if out is None else merge_attn_partials_(out, lse, o, l)
            calls.append(call)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for call, (k, v) in zip(calls, blocks):
            g = call.bwd(dout, q, k, v, out, lse, None, scale)
            dq += g[0]
        return out, dq
    return step


def ulysses_step(q, k, v, dout, rows, kernel: RowsKernel, scale: float
                 ) -> Callable[[], tuple]:
    """Rank 0's graph-safe a2a layer without its all-to-alls: q, k, v [cp * cap, h / cp,
    d] (every rank's rows on one head slice), one call forward and backward."""
    def step() -> tuple:
        whole = (rows.doc, rows.pos)
        call = kernel.call(q, v, whole, whole, q_sorted=False, k_sorted=False)
        out, lse, _ = call.fwd(q, k, v, scale, False)
        dq = call.bwd(dout, q, k, v, out, lse, None, scale)[0]
        return out, dq
    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def replay_case(case: dict, shape: Shape, device: torch.device, dry_run: bool,
                budget: Budget) -> dict:
    a, b, cap = _plans(case)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, shape.dtype)

    cp = case["cp"]
    kernel = RowsKernel(case["mask"].params, "triton")
    scale = shape.head_dim ** -0.5
    rows = static_buffers(b, cap, device)        # B's rows: the eager reference
    if case["strategy"] == "a2a":   # this rank's head slice of every rank's rows
        n, hq, hk = cp * cap, max(1, shape.n_heads // cp), max(1, shape.n_kv_heads // cp)
        q, dout = rand(n, hq, shape.head_dim), rand(n, hq, shape.value_dim)
        k, v = rand(n, hk, shape.head_dim), rand(n, hk, shape.value_dim)
        step = ulysses_step(q, k, v, dout, rows, kernel, scale)
    else:
        q = rand(cap, shape.n_heads, shape.head_dim)
        dout = rand(cap, shape.n_heads, shape.value_dim)
        blocks = [(rand(cap, shape.n_kv_heads, shape.head_dim),
                   rand(cap, shape.n_kv_heads, shape.value_dim)) for _ in range(cp)]
        step = rank_step(q, blocks, dout, rows, cp, kernel, scale)
    want = step()
    eager = measure(step, device, min_reps=0 if dry_run else 3, budget=budget)
    static_buffers(a, cap, device)               # A's rows, in place: the capture's batch
    replayed: Any
    if dry_run:
        step()
        static_buffers(b, cap, device)
        got, graph_ms = step(), None
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up off the capture (allocations)
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = step()
        static_buffers(b, cap, device)           # B's rows, in place
        graph.replay()
        got = replayed
        graph_ms = measure(graph.replay, device, budget=budget).ms
    return {"case": case["name"], "status": "ok", "capacity": cap,
            "tokens": [int(p.padded_total_tokens) for p in (a, b)],
            "eager_ms": eager.ms, "graph_ms": graph_ms,
            "max_rel_diff": {"out": _rel(got[0], want[0]), "dq": _rel(got[1], want[1])}}


def run_graph_replays(shape: Shape, device: torch.device, budget: Budget,
                      dry_run: bool) -> list[dict]:
    out = []
    for case in graph_cases(dry_run):
        if not budget.allows(0 if dry_run else 10.0):
            out.append({"case": case["name"], "status": "skipped", "reason": "time"})
            continue
        t0 = time.monotonic()
        try:
            r = replay_case(case, shape, device, dry_run, budget)
        except Exception as e:   # a failing case is a result: the next one still runs
            r = {"case": case["name"], "status": "error", "error": f"{type(e).__name__}: {e}"}
        r["seconds"] = time.monotonic() - t0
        print(f"  {r['case']}: {r['status']} eager {r.get('eager_ms')} ms, graph "
              f"{r.get('graph_ms')} ms, diff {r.get('max_rel_diff')}", flush=True)
        out.append(r)
    return out


def failures(results: list[dict]) -> list[str]:
    """A case that failed, or whose replay differs from the eager step on its batch."""
    bad = []
    for r in results:
        if r["status"] == "error":
            bad.append(f"graph replay {r['case']}: {r['error']}")
        elif r["status"] == "ok" and max(r["max_rel_diff"].values()) > DIFF_LIMIT:
            bad.append(f"graph replay {r['case']}: {r['max_rel_diff']}")
    return bad
