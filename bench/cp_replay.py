"""One-GPU replay of a CP rank: the exact kernel calls rank r of a cp 8 / 64 plan makes.

A CP layer's time is its slowest rank's. This replays that rank without the other ranks: the
plan is built and prepared with the code the integrations run (``varlen_cp.prefetch``:
``build_plan`` + ``build_tables``, which builds every host table of the strategy and its
device copy), the rank's kernel calls are read from the tables ``build_tables`` built (the
lookup fails if the replay would build a table of its own, so what runs is what a training
step would run), and each call goes through the strategies' own ``Attn.fwd`` / ``Attn.bwd``
on its ``KernelCall`` (positions, cu_seqlens, tile schedule), with random K/V of the size
the rank receives for it. Backward gets the merged (final) out/lse, as in the strategies,
and, with kernels that compute the backward's per-row terms once per layer
(``Attn.bwd_stats``), those terms once, handed to every call.

Per call: query and key counts, visible pairs (counted here from the call's positions,
independently of the plan's closed-form work), visited pairs (the schedule's tiles),
forward and backward milliseconds and TFLOP/s of the mask area; per rank: the sums, and
the back-to-back time of all the calls (launch gaps included). Transfers, merges and
accumulations are not replayed: this isolates the kernels' share of a CP layer.

The rank replayed is the one with the most visible pairs (``CPPlan.work_per_rank``): the
layer waits for it. ``max_calls`` (the dry run) runs only the first calls of each rank and
plans the rest.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from gpu_cases import ReplayCase, Shape, mask_area_flops, tflops
from gpu_timing import Budget, measure
from varlen_cp.config import AttnShape, CPConfig
from varlen_cp.kernels import block_sizes_for, merge_attn_partials
from varlen_cp.kernels.validation import check_backend
from varlen_cp.kernels.schedule import segment_ids
from varlen_cp.masks import AttnMask
from varlen_cp.plan import CPPlan
from varlen_cp.prefetch import build_plan, build_tables
from varlen_cp.tables.holders import KernelCall
from varlen_cp.tables.ring import p2p_tables
from varlen_cp.resolve import kernel_route
from varlen_cp.tables.catalogue import STAGED
from varlen_cp.tables.staged import resolve_stages
from varlen_cp.strategies.calls import Attn
from varlen_cp.strategies.selected_keys import tables as staged_device_tables

MIN_CASE_S = 4.0      # seconds a replay needs at least before it is started on a GPU
_KEY_BITS = 32


# ----------------------------------------------------------------------------- the calls
@contextmanager
def _prepared_only(plan: CPPlan) -> Iterator[list]:
    """Within the block, a table missing from ``plan`` is recorded in the yielded list (it
    is still built, so the caller can name it): the replay must find every table
    ``build_tables`` made, under the key the strategy looks it up with."""
    built: list = []
    original = plan.cached

    def cached(key: Any, fn: Callable[[], Any]) -> Any:
        def build() -> Any:
            built.append(key)
            return fn()
        return original(key, build)

    plan.cached = cached  # type: ignore[method-assign]
    try:
        yield built
    finally:
        del plan.cached


def route_of(backend: str, shape: Shape, device: torch.device):
    """The FlashAttention route the strategies take for ``backend`` (None: our kernels),
    resolved as ``build_tables`` and each call resolve it (no LSE gradient, no row max)."""
    return kernel_route(backend, device, shape)[2]


def rank_calls(plan: CPPlan, mask: AttnMask, strategy: str, block: tuple[int, int],
               shape: Shape, device: torch.device, overlap_stages: int | None = None,
               route=None
               ) -> tuple[list[tuple[str, KernelCall]], list[tuple[str, KernelCall]], int | None]:
    """(forward calls, backward calls, stages) of ``plan.cp_rank``, in the order the
    strategy makes them, from the device tables ``build_tables`` built (FA forms where
    exact with a ``route``, :func:`route_of`). RuntimeError when a table was not
    prepared."""
    rank = plan.cp_rank
    with _prepared_only(plan) as built:
        if strategy == "p2p":   # p2p.py's lookup: one ring position's tables
            ring = p2p_tables(plan, mask, block, rank, device, route)
            fwd = [(f"ring step {t}", c) for t, c in enumerate(ring.calls) if c is not None]
            bwd, stages = fwd, None
        elif strategy in STAGED:
            stages = resolve_stages(plan, mask, strategy, shape, overlap_stages)
            tab = staged_device_tables(plan, mask, block, strategy, stages, device, route)
            local = [("local keys", tab.local)] if tab.local is not None else []
            fetched = [(f"transfer {i + 1}" if stages > 1 else "all keys", s.call)
                       for i, s in enumerate(tab.stages) if s.call is not None]
            fwd, bwd = local + fetched, fetched + local   # backward: the local call last
        else:
            raise ValueError(f"strategy must be one of ('p2p', {', '.join(map(repr, STAGED))})"
                             f" for the replay, got {strategy!r}")
    if built:
        raise RuntimeError(f"build_tables did not build the tables the replay reads: "
                           f"{[k.kind if hasattr(k, 'kind') else k for k in built]} (the "
                           f"strategy's table keys changed? update bench/cp_replay.py)")
    return fwd, bwd, stages


def call_visible_pairs(call: KernelCall, mask: AttnMask) -> int:
    """Visible (query, key) pairs of one call, per head, from its positions: each query's
    key interval searched in the call's sorted (segment, position) keys."""
    q_pos, k_pos = call.q_pos.cpu().to(torch.int64), call.k_pos.cpu().to(torch.int64)
    q_doc = segment_ids(call.cu_q.cpu(), q_pos.numel())
    k_doc = segment_ids(call.cu_k.cpu(), k_pos.numel())
    real = k_pos >= 0               # padding keys trail their segment: dropping them keeps
    keys = (k_doc[real] << _KEY_BITS) + k_pos[real]      # the keys sorted
    lo, hi = mask.key_interval(q_pos)
    top = (1 << _KEY_BITS) - 1
    start = torch.searchsorted(keys, (q_doc << _KEY_BITS) + lo.clamp(0, top))
    end = torch.searchsorted(keys, (q_doc << _KEY_BITS) + hi.clamp(-1, top), right=True)
    return int((end - start).clamp(min=0).sum())


def visited_pairs(call: KernelCall) -> int | None:
    """Pairs the kernels compute: the tiles' (ours) or the FA calls' visible pairs."""
    if call.flash is not None:
        return call.flash.pairs
    return getattr(call.schedule, "visited_pairs", None)


# ----------------------------------------------------------------------------- planning
def plan_rank(case: ReplayCase, shape: Shape, device: torch.device, backend: str,
              rank: int | None = None) -> tuple[CPPlan, dict]:
    """The prepared plan of ``case`` for ``rank`` (default: the rank with the most visible
    pairs), and the host seconds it took."""
    config = CPConfig(strategy=case.strategy, layout=case.layout, backend=backend,
                      overlap_stages=case.overlap_stages)
    layer_masks = [(case.mask, 1)]
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    if rank is None:
        probe = build_plan(cu, config, cp_size=case.cp, cp_rank=0, layer_masks=layer_masks)
        work = probe.work_per_rank(case.mask)
        rank = max(range(case.cp), key=lambda r: work[r])
    t0 = time.process_time()
    plan = build_plan(cu, config, cp_size=case.cp, cp_rank=rank, layer_masks=layer_masks)
    t1 = time.process_time()
    build_tables(plan, config, layer_masks,
                 AttnShape(n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
                           head_dim=shape.head_dim, head_dim_v=shape.value_dim,
                           dtype=shape.dtype), device)
    t2 = time.process_time()
    return plan, {"rank": rank, "plan_cpu_ms": 1e3 * (t1 - t0),
                  "prepare_cpu_ms": 1e3 * (t2 - t1)}


# ----------------------------------------------------------------------------- running
KVSource = Callable[[KernelCall], tuple[torch.Tensor, torch.Tensor]]


def random_kv(shape: Shape, device: torch.device, seed: int = 0) -> KVSource:
    """K/V of the size a call receives, random (what they hold does not change the time)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def make(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        n = call.k_pos.numel()
        return (torch.randn(n, shape.n_kv_heads, shape.head_dim, generator=g, device=device,
                            dtype=shape.dtype),
                torch.randn(n, shape.n_kv_heads, shape.value_dim, generator=g,
                            device=device, dtype=shape.dtype))
    return make


def merge_partials(q: torch.Tensor, partials: list[tuple[torch.Tensor, torch.Tensor]],
                   dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse): the calls' partial (out, lse) folded by their LSE, as the
    strategies do; zeros / -inf when the rank made no call."""
    out = lse = None
    for o, l in partials:
        out, lse = (o.float(), l) if out is None else merge_attn_partials(out, lse, o, l)
    if out is None:
        return q.new_zeros(q.shape[0], q.shape[1], dv), torch.full(
            (q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    return out.to(q.dtype), lse


def replay_rank(plan: CPPlan, case: ReplayCase, shape: Shape, device: torch.device,
                backend: str, budget: Budget | None = None, dry_run: bool = False,
                max_calls: int | None = None, q: torch.Tensor | None = None,
                kv_source: KVSource | None = None, dout: torch.Tensor | None = None) -> dict:
    """Replay ``plan.cp_rank``'s calls (see the module docstring): a JSON-able dict.
    ``q``, ``dout`` (default random) and ``kv_source`` (default :func:`random_kv`) let a
    test feed the real global tensors; the dict's ``"tensors"`` entry holds (out, lse, dq)
    of the calls that ran. The dry run calls each kernel once (its timing is that call)."""
    block = block_sizes_for(backend, device, shape.head_dim, shape.value_dim,
                            dtype=shape.dtype)
    fwd_calls, bwd_calls, stages = rank_calls(plan, case.mask, case.strategy, tuple(block),
                                              shape, device, case.overlap_stages,
                                              route_of(backend, shape, device))
    run = fwd_calls if max_calls is None else fwd_calls[:max_calls]
    run_labels = {label for label, _ in run}
    run_bwd = [c for c in bwd_calls if c[0] in run_labels]
    attn = Attn(case.mask, shape.head_dim ** -0.5, check_backend(backend, device))
    g = torch.Generator(device=device).manual_seed(1)
    if q is None:
        q = torch.randn(plan.num_tokens, shape.n_heads, shape.head_dim, generator=g,
                        device=device, dtype=shape.dtype)
    kv_source = kv_source or random_kv(shape, device)
    kv = {label: kv_source(call) for label, call in run}
    reps = dict(min_reps=0) if dry_run else dict(budget=budget, target_s=0.1)
    rows, partials = [], []
    for label, call in fwd_calls:
        pairs = call_visible_pairs(call, case.mask)
        row = {"call": label, "n_q": int(call.q_pos.numel()), "n_k": int(call.k_pos.numel()),
               "visible_pairs": pairs, "visited_pairs": visited_pairs(call),
               "flash_calls": len(call.flash.calls) if call.flash is not None else 0}
        if label in run_labels:
            k, v = kv[label]
            t = measure(lambda: attn.fwd(q, k, v, call), device, **reps)
            partials.append(t.last[:2])
            row.update(fwd_ms=t.ms, fwd_tflops=tflops(mask_area_flops(pairs, shape)[0], t.ms))
        rows.append(row)
    out, lse = merge_partials(q, partials, shape.value_dim)
    del partials
    if dout is None:
        dout = torch.randn(out.shape, generator=g, device=device, dtype=shape.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    stats_ms, bwd = _backward_of(attn, dout, q, out, lse, device, reps)
    for row, (label, call) in zip(rows, fwd_calls):
        if label in run_labels:
            k, v = kv[label]
            t = measure(lambda: bwd(call, k, v), device, **reps)
            dq += t.last[0].float()
            row.update(bwd_ms=t.ms, bwd_tflops=tflops(
                mask_area_flops(row["visible_pairs"], shape)[1], t.ms))
    result = _summary(plan, case, shape, stages, rows, len(run))
    result["bwd_stats_ms"] = stats_ms
    if run and not dry_run:   # back to back, in the strategy's order (launch gaps included)
        t_f = measure(lambda: [attn.fwd(q, *kv[lb], c) for lb, c in run], device, **reps)

        def backward_all() -> list:   # the layer's once-per-layer terms, then every call
            _, each = _backward_of(attn, dout, q, out, lse, device, None)
            return [each(c, *kv[lb]) for lb, c in run_bwd]
        t_b = measure(backward_all, device, **reps)
        ran = sum(r["visible_pairs"] for r in rows if "fwd_ms" in r)
        flops_f, flops_b = mask_area_flops(ran, shape)
        result.update(fwd_seq_ms=t_f.ms, bwd_seq_ms=t_b.ms,
                      fwd_tflops=tflops(flops_f, t_f.ms), bwd_tflops=tflops(flops_b, t_b.ms))
    result["tensors"] = (out, lse, dq.to(q.dtype))
    return result


def _backward_of(attn: Attn, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, device: torch.device, reps: dict | None
                 ) -> tuple[float | None, Callable[..., tuple]]:
    """(ms of the layer's once-per-layer backward terms or None, bwd(call, k, v)). Kernels
    that compute the backward's per-row terms (delta) once per layer expose
    ``Attn.bwd_stats``, and the strategies then pass them to every call, as done here;
    without it each call makes its own. ``reps=None``: not timed."""
    stats_of = getattr(attn, "bwd_stats", None)
    if stats_of is None:
        return None, lambda call, k, v: attn.bwd(dout, q, k, v, out, lse, call, None)
    if reps is None:
        stats, ms = stats_of(dout, out, lse, None), None
    else:
        t = measure(lambda: stats_of(dout, out, lse, None), device, **reps)
        stats, ms = t.last, t.ms
    return ms, lambda call, k, v: attn.bwd(dout, q, k, v, out, lse, call, None, stats)


def _summary(plan: CPPlan, case: ReplayCase, shape: Shape, stages: int | None,
             rows: list[dict], n_run: int) -> dict:
    visible = sum(r["visible_pairs"] for r in rows)
    visited = [r["visited_pairs"] for r in rows]
    timed = [r for r in rows if "fwd_ms" in r]
    flops_f, flops_b = mask_area_flops(sum(r["visible_pairs"] for r in timed), shape)
    fwd_sum = sum(r["fwd_ms"] for r in timed) if timed else None
    bwd_sum = sum(r["bwd_ms"] for r in timed) if timed else None
    return {
        "case": case.name, "cp": case.cp, "strategy": case.strategy, "layout": case.layout,
        "mix": case.mix, "mask": case.mask_name, "n_docs": len(case.lengths),
        "tokens": sum(case.lengths), "rank": plan.cp_rank, "rank_tokens": plan.num_tokens,
        "stages": stages, "n_calls": len(rows), "n_calls_run": n_run,
        # the share of the rank's work that runs on FlashAttention (the rest: our kernels)
        "flash_work_share": (sum(r["visible_pairs"] for r in rows if r["flash_calls"])
                             / visible) if visible else None,
        "flash_calls": sum(r["flash_calls"] for r in rows),
        "plan_visible_pairs": plan.work_per_rank(case.mask)[plan.cp_rank],
        "visible_pairs": visible,
        "visited_pairs": None if None in visited else sum(visited),
        "fwd_ms_sum": fwd_sum, "bwd_ms_sum": bwd_sum,
        # the calls' own times summed; replaced by the back-to-back time on a GPU
        "fwd_tflops": tflops(flops_f, fwd_sum), "bwd_tflops": tflops(flops_b, bwd_sum),
        "calls": rows,
    }


def run_replays(cases: list[ReplayCase], shape: Shape, device: torch.device,
                backends: tuple[str, ...], budget: Budget, dry_run: bool,
                max_calls: Callable[[ReplayCase], int | None] = lambda case: None,
                log: Callable[[str], None] = print) -> list[dict]:
    """Every case, in order, within ``budget``, on each of ``backends`` in turn (one
    JSON-able dict each, ``"backend"`` naming it). ``max_calls(case)``: how many of the
    rank's calls to run (None: all; the others are planned only). The same seeds give every
    backend the same q, K/V and dout, so each later backend's out, LSE and dq are compared
    with the first's (``max_rel_diff_vs``): FA's and our kernels' answers on the GPU."""
    results = []
    for case in cases:
        base = {"case": case.name, "cp": case.cp, "strategy": case.strategy,
                "mask": case.mask_name, "mix": case.mix}
        first = None
        for backend in backends:
            row = dict(base, backend=backend)
            if not budget.allows(0 if dry_run else MIN_CASE_S):
                results.append(dict(row, status="skipped", note=f"{budget.name} budget spent"))
                log(f"  {case.name:40s} {backend:6s} skipped ({budget.name} budget spent)")
                continue
            try:
                plan, host = plan_rank(case, shape, device, backend)
                res = replay_rank(plan, case, shape, device, backend, budget, dry_run,
                                  max_calls(case))
                tensors = res.pop("tensors")
                if first is None:
                    first = (backend, tensors)
                else:
                    res["max_rel_diff_vs"] = {"backend": first[0], **_diffs(first[1], tensors)}
                res.update(host, backend=backend, status="ok")
            except Exception as e:  # noqa: BLE001 - one case failing is a result
                res = dict(row, status="error", error=f"{type(e).__name__}: {e}"[:500])
            results.append(res)
            log(_line(res))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


DIFF_LIMIT = 0.05
"""Largest relative difference (of the tensor's largest magnitude) between two backends'
out or dq in bf16 before the replay calls it a failure; rounding gives ~1e-2."""


def _diffs(a: tuple, b: tuple) -> dict:
    """Max |a - b| / max(1, max |a|) of out, dq, and max |a - b| of the LSE on rows where
    both are finite (rows that see nothing are -inf in both)."""
    out = {}
    for name, x, y in (("out", a[0], b[0]), ("dq", a[2], b[2])):
        x, y = x.float(), y.float()
        out[name] = float((x - y).abs().max() / x.abs().max().clamp(min=1.0)) \
            if x.numel() else 0.0
    la, lb = a[1].float(), b[1].float()
    fin = torch.isfinite(la) & torch.isfinite(lb)
    out["lse_abs"] = float((la[fin] - lb[fin]).abs().max()) if fin.any() else 0.0
    out["lse_inf_agree"] = bool(torch.equal(torch.isfinite(la), torch.isfinite(lb)))
    return out


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"  {r['case']:40s} {r.get('backend', ''):6s} {r['status']}: " \
               f"{r.get('error', '')[:100]}"
    f, b = r.get("fwd_tflops"), r.get("bwd_tflops")
    share = r.get("flash_work_share")
    diff = r.get("max_rel_diff_vs")
    extra = (f" FA {share:.0%}" if share else "") + (
        f" diff out {diff['out']:.1e} dq {diff['dq']:.1e}" if diff else "")
    return (f"  {r['case']:40s} {r['backend']:6s} rank {r['rank']:2d} S={r['stages'] or '-'} "
            f"{r['n_calls_run']}/{r['n_calls']} calls  fwd "
            f"{'-' if f is None else f'{f:6.1f}'} bwd {'-' if b is None else f'{b:6.1f}'} "
            f"TFLOP/s  (plan {r['plan_cpu_ms']:.0f} + prepare {r['prepare_cpu_ms']:.0f} ms)"
            f"{extra}")
