"""Kernel benchmark: local varlen attention (no context parallelism).

Usage: ``python bench/kernels.py [--quick] [--threads N] [--reps N]``. On a shared machine
use ``--threads 1``: other jobs stall multi-threaded regions and inflate even CPU time.

CPU: the pure-PyTorch twin (``torch_fwd`` / ``torch_bwd``) against
``scaled_dot_product_attention`` looped over the documents (``is_causal`` for causal, an
explicit boolean mask for sliding-window and chunked masks, built outside the timed region),
fp32, forward and forward+backward, for a few document mixes; a block-size sweep of the twin;
and the tile efficiency of the host schedule (visible pairs / visited pairs) for sliding-window
and chunked masks on one long document. Times are the minimum over repetitions of both the
wall clock and the process CPU time: the CPU time is the figure to trust on a shared machine
(other jobs stretch the wall clock but not it).

CUDA: the GPU suite's kernel benchmark (``bench/gpu_kernels.py``; ``bash bench/gpu.sh`` runs
it with the CUDA tests and the CP-rank replay): forward and backward TFLOP/s of the mask area
of our Triton kernels against ``torch.nn.attention.varlen.varlen_attn`` and ``flex_attention``.

Writes ``bench/results/kernels_<device>.json`` next to this file and prints a table.
Targets printed against: twin within 2x of the SDPA loop on CPU; tile efficiency >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an installed package
    sys.path.insert(0, str(ROOT))

try:
    from varlen_cp.kernels import mask_math
    from varlen_cp.kernels import torch_attn
    from varlen_cp.kernels.schedule import build_block_schedule
except ImportError:  # not installed: the kernels folder is importable as a package itself
    from kernels import mask_math, torch_attn  # type: ignore[no-redef]
    from kernels.schedule import build_block_schedule  # type: ignore[no-redef]

# name -> (causal, window_left, window_right, chunk_size)
MASKS = {
    "causal": (True, -1, -1, 0),
    "swa512": (True, 512, 0, 0),
    "chunk512": (True, -1, -1, 512),
}
TARGET_RATIO = 2.0
TARGET_TILE_EFF = 0.95


# ----------------------------------------------------------------------------- inputs
def doc_mix(total: int, kind: str) -> list[int]:
    """Document lengths summing to ``total``: one doc, equal short docs, or a skewed mix."""
    if kind == "one_doc":
        return [total]
    if kind == "many_docs":
        return [128] * (total // 128)
    if kind == "mixed":  # power-law-ish lengths, a few long ones dominate (seeded)
        g = torch.Generator().manual_seed(0)
        lens: list[int] = []
        while sum(lens) < total:
            u = float(torch.rand((), generator=g))
            lens.append(int(32 * (total / 2 / 32) ** (u ** 2)))
        lens[-1] -= sum(lens) - total
        return [n for n in lens if n > 0]
    raise ValueError(f"doc_mix: unknown kind {kind!r}")


def cu_from(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def dense_mask(n: int, mask: tuple[bool, int, int, int]) -> torch.Tensor:
    """Boolean [n, n] mask of one document for SDPA (True = attend)."""
    p = torch.arange(n)
    return mask_math.visible(p, p, *mask)


def visible_pairs(lens: list[int], mask: tuple[bool, int, int, int]) -> int:
    """Exact visible (query, key) pairs of a mix (per head), host interval math."""
    total = 0
    for n in set(lens):
        p = torch.arange(n)
        total += lens.count(n) * mask_math.count_visible(p, p, *mask)
    return total


# ----------------------------------------------------------------------------- timing
def cpu_time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(min wall seconds, min process CPU seconds) over ``reps`` runs after one warm-up."""
    fn()
    wall, proc = math.inf, math.inf
    for _ in range(reps):
        w0, p0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        proc = min(proc, time.process_time() - p0)
    return wall, proc


def sdpa_loop(q, k, v, cu: list[int], masks: list[torch.Tensor | None]) -> torch.Tensor:
    """SDPA once per document; ``None`` in ``masks`` means plain causal (is_causal)."""
    outs = []
    for i, m in enumerate(masks):
        a, b = cu[i], cu[i + 1]
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        if m is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


# ----------------------------------------------------------------------------- CPU
def cpu_compare(total: int, heads: tuple[int, int], dim: int, reps: int) -> list[dict]:
    """Twin vs SDPA loop, forward and forward+backward, every mix x mask."""
    hq, hkv = heads
    rows = []
    for mix in ("one_doc", "many_docs", "mixed"):
        lens = doc_mix(total, mix)
        cu_t, cu = cu_from(lens), cu_from(lens).tolist()
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(total, hq, dim, generator=gen)
        k = torch.randn(total, hkv, dim, generator=gen)
        v = torch.randn(total, hkv, dim, generator=gen)
        dout = torch.randn(total, hq, dim, generator=gen)
        scale = dim ** -0.5
        for mname, mask in MASKS.items():
            masks = [None if mname == "causal" else dense_mask(n, mask) for n in lens]
            args = (cu_t, cu_t, max(lens), max(lens), scale, *mask, None, None)

            def ours_fwd():
                return torch_attn.torch_fwd(q, k, v, *args)

            def ours_fwd_bwd():
                out, lse = torch_attn.torch_fwd(q, k, v, *args)
                return torch_attn.torch_bwd(dout, q, k, v, out, lse, *args)

            def ref_fwd():
                with torch.no_grad():
                    return sdpa_loop(q, k, v, cu, masks)

            def ref_fwd_bwd():
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                sdpa_loop(qg, kg, vg, cu, masks).backward(dout)

            for phase, ours, ref in (("fwd", ours_fwd, ref_fwd),
                                     ("fwd+bwd", ours_fwd_bwd, ref_fwd_bwd)):
                o_wall, o_cpu = cpu_time(ours, reps)
                r_wall, r_cpu = cpu_time(ref, reps)
                rows.append({
                    "mix": mix, "n_docs": len(lens), "tokens": total, "mask": mname,
                    "phase": phase, "torch_wall_ms": 1e3 * o_wall, "sdpa_wall_ms": 1e3 * r_wall,
                    "torch_cpu_ms": 1e3 * o_cpu, "sdpa_cpu_ms": 1e3 * r_cpu,
                    "ratio_cpu": o_cpu / r_cpu, "ratio_wall": o_wall / r_wall,
                })
                print(f"  {mix:9s} ({len(lens):3d} docs) {mname:8s} {phase:7s} "
                      f"torch {1e3 * o_cpu:8.1f} ms  sdpa {1e3 * r_cpu:8.1f} ms  "
                      f"ratio {o_cpu / r_cpu:5.2f} (wall {o_wall / r_wall:5.2f})  "
                      f"{'ok' if o_cpu / r_cpu <= TARGET_RATIO else 'ABOVE TARGET'}",
                      flush=True)
    return rows


def block_sweep(total: int, heads: tuple[int, int], dim: int, reps: int) -> list[dict]:
    """Twin forward+backward time per block size (schedule passed in), causal and SWA."""
    hq, hkv = heads
    rows = []
    for mix in ("one_doc", "mixed"):
        lens = doc_mix(total, mix)
        cu = cu_from(lens)
        gen = torch.Generator().manual_seed(2)
        q = torch.randn(total, hq, dim, generator=gen)
        k, v = (torch.randn(total, hkv, dim, generator=gen) for _ in range(2))
        dout = torch.randn(total, hq, dim, generator=gen)
        for mname in ("causal", "swa512"):
            mask = MASKS[mname]
            for block in (64, 128, 256, 512):
                sched = build_block_schedule(
                    cu, cu, max(lens), max(lens), causal=mask[0], window_left=mask[1],
                    window_right=mask[2], chunk_size=mask[3], block_m=block, block_n=block)
                args = (cu, cu, max(lens), max(lens), dim ** -0.5, *mask, None, None, sched)

                def run():
                    out, lse = torch_attn.torch_fwd(q, k, v, *args)
                    torch_attn.torch_bwd(dout, q, k, v, out, lse, *args)

                wall, cpu = cpu_time(run, reps)
                rows.append({"mix": mix, "mask": mname, "block_m": block,
                             "fwd_bwd_cpu_ms": 1e3 * cpu, "fwd_bwd_wall_ms": 1e3 * wall})
                print(f"  {mix:9s} {mname:8s} block {block:4d}: fwd+bwd {1e3 * cpu:8.1f} ms "
                      f"(wall {1e3 * wall:8.1f})", flush=True)
    return rows


def tile_efficiency(doc_len: int) -> list[dict]:
    """Visible / visited pairs of the host schedule, query-major (fwd) and key-major (bwd)."""
    rows = []
    cu = torch.tensor([0, doc_len], dtype=torch.int32)
    p = torch.arange(doc_len)
    cases = {"swa512": (True, 512, 0, 0), "swa4096": (True, 4096, 0, 0),
             "chunk512": (True, -1, -1, 512), "chunk8192": (True, -1, -1, 8192),
             "swa4096_bidir": (False, 4096, 4096, 0)}
    for name, mask in cases.items():
        vis = mask_math.count_visible(p, p, *mask)
        for block in (64, 128):
            s = build_block_schedule(cu, cu, doc_len, doc_len, causal=mask[0],
                                     window_left=mask[1], window_right=mask[2],
                                     chunk_size=mask[3], block_m=block, block_n=block)
            kspan = (s.q_range[..., 1] - s.q_range[..., 0]).to(torch.int64).flatten()
            kcols = torch.full_like(kspan, block)
            kcols[-1] = doc_len - block * (kspan.numel() - 1)
            visited_bwd = int((kspan * kcols).sum())
            eff_f, eff_b = vis / s.visited_pairs, vis / visited_bwd
            rows.append({"doc_len": doc_len, "mask": name, "block": block,
                         "visible_pairs": vis, "visited_pairs_fwd": s.visited_pairs,
                         "visited_pairs_bwd": visited_bwd, "efficiency_fwd": eff_f,
                         "efficiency_bwd": eff_b})
            print(f"  {name:14s} block {block:4d}: fwd {eff_f:.4f}  bwd {eff_b:.4f}  "
                  f"{'ok' if min(eff_f, eff_b) >= TARGET_TILE_EFF else 'BELOW TARGET'}")
    print("  (a block's range is the exact union of its rows' key intervals, so a window or\n"
          "   chunk of W keys caps any B-row rectangular tiling near W / (W + B): 0.89 for\n"
          "   W=512, B=64; the target needs W >= ~20 B, e.g. the 4K/8K masks of training)")
    return rows


# ----------------------------------------------------------------------------- main
def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (0: auto)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    reps = a.reps or (2 if a.quick else 3)
    heads, dim = (8, 2), 128
    result: dict = {
        "device": device_name(), "torch": torch.__version__, "quick": a.quick,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "heads_q_kv": heads, "head_dim": dim,
        "twin_default_block_m": torch_attn.DEFAULT_BLOCK_M,
        "targets": {"torch_vs_sdpa_ratio_max": TARGET_RATIO,
                    "tile_efficiency_min": TARGET_TILE_EFF},
    }
    if torch.cuda.is_available():   # the GPU suite's kernel part (bench/gpu_kernels.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_cases
        from gpu_kernels import run_kernels
        from gpu_timing import Budget
        shape, cases = gpu_cases.kernel_shape(False), gpu_cases.kernel_cases(False)
        print(f"== CUDA {result['device']}: {gpu_cases.describe(shape)}, TFLOP/s of the mask area")
        result["cuda"] = run_kernels(cases, shape, torch.device("cuda"),
                                     Budget.of("kernels", 1e9), dry_run=False)
    else:
        total = 4096 if a.quick else 8192
        print(f"== CPU: torch twin vs SDPA loop, fp32, {total} tokens, heads {heads}, d={dim}, "
              f"{torch.get_num_threads()} threads (ratio = twin / SDPA on CPU time)")
        result["mixes"] = {m: doc_mix(total, m) for m in ("one_doc", "many_docs", "mixed")}
        result["cpu_vs_sdpa"] = cpu_compare(total, heads, dim, reps)
        print("== CPU: twin fwd+bwd per block size")
        result["block_sweep"] = block_sweep(total, heads, dim, reps)
    doc_len = 32768 if a.quick else 131072
    print(f"== tile efficiency (visible / visited pairs), one {doc_len}-token document")
    result["tile_efficiency"] = tile_efficiency(doc_len)
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_{re.sub(r'[^A-Za-z0-9_.-]+', '_', result['device'])}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
