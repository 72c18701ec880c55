"""Static report of the Triton kernels as the compiler sees them: no GPU needed.

Compiles every kernel (fwd, dq, dkdv) in every tile mode the public op and the CP
strategies launch, for sm90 and sm80, with triton's bundled ptxas and cuobjdump, and reports
per kernel what decides its speed before any timing:

- registers, spill bytes (ptxas -v), shared memory (triton's metadata);
- tensor-core instructions: HGMMA (Hopper wgmma) vs HMMA (mma.sync, the Ampere path);
- SASS instructions per 64x64 tile in each main loop: the static instructions of the
  innermost loop that holds the matmuls, times num_warps / 4 (warp-instructions, as 4 warps
  run a 64x64 tile), times 64 * 64 / (block_m * block_n). Two loops per kernel where the
  mode knows full tiles: "full" (no mask; the steady state of a long document) and
  "boundary" (per-element mask: the diagonal, window and chunk edges);
- pipelining: the smallest N of the loop's ``DEPBAR.LE SB0, N`` (cp.async groups left in
  flight while the loop waits; 0 = it waits for every copy each iteration) and the number
  of buffers of the K/V (or Q/dO) tiles in shared memory (from the TTGIR allocations).

Modes: ``implicit`` (flash-attn positions, no schedule), ``cp`` (explicit positions and a
host schedule with full ranges: what every CP strategy runs), ``scan`` (explicit positions
on the device, no schedule), ``rows`` (the graph-safe mode's row kernels,
``kernels/triton_rows.py``). Masks: causal. ``--tutorial PATH`` also compiles the forward of
Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py of a triton
checkout; its ``_attn_fwd`` with block pointers) the same way, for comparison.

    python bench/kernel_report.py            # full table, sm90 + sm80: 144 compiles, ~2 min
                                             # on 2 idle cores (20+ on a busy shared host)
    python bench/kernel_report.py --quick    # the sm90 bf16 rows the CI targets check

Writes bench/results/kernel_report.json and prints a markdown table. TRITON_INTERPRET must
be off: the script clears it before triton is imported (run it as a script or ``-m``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "kernel_report.json"

# Static targets of issue 21 (sm90, triton 3.8, causal): 1.25x the tutorial forward's
# 351 / 298 instructions per 64x64 tile at d 128 / 64.
TARGET_PER_TILE = {128: 440, 64: 375}
KINDS = ("fwd", "dq", "dkdv")
MODES = ("implicit", "cp", "scan", "rows")
DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
DTYPES = ("bf16", "fp16")
ARCHS = (90, 80)


def _import_kernels():
    import torch

    from varlen_cp.kernels import triton_bwd, triton_fwd
    from varlen_cp.kernels.triton_common import triton_block_sizes
    return torch, triton_fwd, triton_bwd, triton_block_sizes


# ----------------------------------------------------------------------- compile one


def _signature(fn, constexprs: dict, dtype: str, scalars=()) -> tuple[dict, dict, dict]:
    """Triton signature of a kernel from its parameter names: upper-case names are
    pointers (inputs/outputs in ``dtype``, statistics fp32, tables int32), ``scale`` /
    ``qk_scale`` fp32, other scalars int32. Pointers and strides get the 16-divisibility
    the launcher specializes on."""
    data = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "Out"}
    stats = {"LSE", "LSE2", "DELTA", "RMAX", "DLSE", "STATS", "M"}
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr or p.name in constexprs:
            sig[p.name], consts[p.name] = "constexpr", constexprs[p.name]
            continue
        if p.name in data:
            sig[p.name] = "*" + dtype
        elif p.name in stats:
            sig[p.name] = "*fp32"
        elif p.name.isupper() and p.name not in scalars:
            sig[p.name] = "*i32"
        else:
            sig[p.name] = "fp32" if p.name in ("scale", "qk_scale", "sm_scale") else "i32"
        if sig[p.name].startswith("*") or p.name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _compile(fn, sig, consts, attrs, arch: int, options: dict):
    """(compiled kernel, ptxas log): compiled afresh so that ptxas prints its -v report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs),
                                target=GPUTarget("cuda", arch, 32), options=options)
    return kernel, log.getvalue()


def _spec(kind: str, dtype: str, d: int, dv: int, arch: int, mode: str):
    """(kernel fn, constexprs, launch options, loop tiles) exactly as the launchers build
    them for a causal call in ``mode``; loop tiles: {"full": (rows, cols), "boundary": ...}
    of one iteration of each loop."""
    torch, F, B, blocks = _import_kernels()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    bm, bn = blocks(d, dv, dt, arch)
    explicit = mode != "implicit"
    # What the CP plan's schedules carry: full ranges, no padding inside visited ranges.
    schedule = (SimpleNamespace(kv_full=True, q_full=True, padded=False) if mode == "cp"
                else None)
    mask = (True, -1, -1, 0)
    if mode == "rows":   # the graph-safe mode's row kernels: one masked loop each
        from varlen_cp.kernels import triton_rows as R
        consts, options = R.rows_specialization(kind, dt, d, dv, bm, bn, *mask, arch)
        if kind == "fwd":
            consts["STORE_MAX"] = False
        fn = {"fwd": R._rows_fwd_kernel, "dq": R._rows_dq_kernel,
              "dkdv": R._rows_dkdv_kernel}[kind]
        return fn, consts, options, {"boundary": (consts["BLOCK_M"], consts["BLOCK_N"])}
    if kind == "fwd":
        consts, options = F.fwd_specialization(dt, d, dv, bm, bn, *mask, explicit, explicit,
                                               schedule, False, arch)
        fn = F._fwd_kernel
    else:
        consts, options = B.bwd_specialization(kind, dt, d, dv, bm, bn, *mask, explicit,
                                                explicit, schedule, arch)
        fn = B._dq_kernel if kind == "dq" else B._dkdv_kernel
    tile = (consts["BLOCK_M"], consts["BLOCK_N"])
    loops = {"full": tile, "boundary": (consts.get("STEP_M", tile[0]), tile[1])}
    if mode == "scan":  # no full tiles without a schedule: every loop is a boundary loop
        del loops["full"]
    return fn, consts, options, loops


def _tools():
    import triton
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return base / "cuobjdump", base / "ptxas"


def measure(kernel, log: str, num_warps: int, loop_tiles: dict) -> dict:
    """Resource and loop figures of one compiled kernel."""
    cuobjdump, _ = _tools()
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out = {
        "regs": int(regs.group(1)) if regs else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "smem_kb": round(kernel.metadata.shared / 1024, 1),
        "buffers": _buffers(kernel.asm["ttgir"]),
    }
    out.update(analyze_sass(sass, num_warps, loop_tiles))
    return out


def _buffers(ttgir: str) -> int:
    """Most buffers of one tile in shared memory: the leading dim of a 3-D allocation."""
    dims = [int(m.group(1)) for m in
            re.finditer(r"local_alloc[^\n]*!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]
    return max(dims, default=1)


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)")


def analyze_sass(sass: str, num_warps: int, loop_tiles: dict) -> dict:
    """Tensor-core instructions and the innermost loops that hold them.

    A loop is a backward branch and its target; innermost: no other loop inside it. Of two
    such loops the one with fewer FSEL (per-element selects: the mask) is the full-tile
    loop, the other the boundary loop; a single one is the full-tile loop if it has no
    FSEL and ``loop_tiles`` has a "full" entry, else a boundary loop (scan mode).
    Per-tile figures are warp-instructions per 64x64 tile (see the module docstring), each
    loop with its own tile (``loop_tiles``).
    """
    instrs = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
              if (m := _INSTR.match(line))]
    loops = []
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))
    innermost = [lp for lp in loops
                 if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    found = []
    for lo, hi in sorted(set(innermost)):
        body = [t for a, t in instrs if lo <= a <= hi]
        ops = [re.sub(r"^@!?U?P\w+ ", "", t).split()[0] for t in body]
        hgmma = sum(op.startswith("HGMMA") for op in ops)
        hmma = sum(op.startswith("HMMA") for op in ops)
        if hgmma + hmma == 0:
            continue
        waits = [int(m.group(1), 16) for t in body
                 if (m := re.search(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", t))]
        found.append({
            "instructions": len(body), "hgmma": hgmma, "hmma": hmma,
            "fsel": sum(op.startswith("FSEL") for op in ops),
            "cp_async": sum(op.startswith("LDGSTS") for op in ops),
            "sync_loads": sum(op.startswith("LDG.") or op == "LDG" for op in ops),
            "spill_ops": sum(op.startswith(("LDL", "STL")) for op in ops),
            "min_wait": min(waits) if waits else None,
        })
    found.sort(key=lambda lp: lp["fsel"])
    if "full" in loop_tiles and (len(found) == 2 or len(found) == 1 and not found[0]["fsel"]):
        names = ["full", "boundary"][:len(found)]  # one loop without selects: full tiles
    else:
        names = []
    names += ["boundary"] * (len(found) - len(names))
    for name, lp in zip(names, found):
        rows, cols = loop_tiles[name]
        lp["loop"] = name
        lp["tile"] = [rows, cols]
        lp["per_tile"] = round(lp["instructions"] * num_warps / 4 * 64 * 64 / (rows * cols))
    return {
        "hgmma": sum(" HGMMA" in f" {t}" for _, t in instrs),
        "hmma": sum(re.search(r"\bHMMA\b", t) is not None for _, t in instrs),
        "total_instructions": len(instrs),
        "loops": found,
    }


def compile_config(cfg: tuple) -> dict:
    """Compile and measure one (kind, dtype, d, dv, arch, mode) configuration."""
    kind, dtype, d, dv, arch, mode = cfg
    fn, consts, options, loop_tiles = _spec(kind, dtype, d, dv, arch, mode)
    sig, constexprs, attrs = _signature(fn, consts, dtype)
    try:
        kernel, log = _compile(fn, sig, constexprs, attrs, arch, options)
    except Exception as exc:  # a compile failure is a finding, not a crash of the report
        return {"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    row = {"config": list(cfg), "block": [consts["BLOCK_M"], consts["BLOCK_N"]], **options}
    row.update(measure(kernel, log, options.get("num_warps", 4), loop_tiles))
    return row


# ------------------------------------------------------------------------ the tutorial


def tutorial_config(path: str, head_dim: int, arch: int = 90) -> dict:
    """Triton tutorial 06's block-pointer forward, causal, 64x64, 4 warps, 3 stages, fp16
    (its loop casts P to fp16): its ``_attn_fwd_inner`` and ``_attn_fwd`` are read from
    ``path`` (not imported: the module asks for a GPU at import) and compiled like ours."""
    import triton
    import triton.language as tl
    tree = ast.parse(Path(path).read_text())
    wanted = {"_attn_fwd_inner", "_attn_fwd"}
    source = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            node.decorator_list = [d for d in node.decorator_list
                                   if "autotune" not in ast.unparse(d)]
            source.append(ast.unparse(node))
    scope = {"triton": triton, "tl": tl, "__name__": "tutorial_fwd"}
    code = "\n\n".join(source)
    # @triton.jit reads the source from a file: give it one.
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tutorial_fwd_{os.getpid()}.py"
    tmp.write_text("import triton\nimport triton.language as tl\n\n" + textwrap.dedent(code))
    exec(compile(tmp.read_text(), str(tmp), "exec"), scope)
    fn = scope["_attn_fwd"]
    consts = {"HEAD_DIM": head_dim, "BLOCK_M": 64, "BLOCK_N": 64, "CAUSAL": True,
              "N_CTX": 32768}
    sig, constexprs, attrs = _signature(fn, consts, "fp16", scalars=("Z", "H"))
    options = {"num_warps": 4, "num_stages": 3}
    kernel, log = _compile(fn, sig, constexprs, attrs, arch, options)
    row = {"config": ["tutorial_fwd", "fp16", head_dim, head_dim, arch, "-"],
           "block": [64, 64], **options}
    # Its off-band loop (STAGE 1) runs unmasked: the counterpart of our full-tile loop.
    row.update(measure(kernel, log, 4, {"full": (64, 64), "boundary": (64, 64)}))
    return row


# ----------------------------------------------------------------------------- checks


def loop_named(row: dict, name: str) -> dict | None:
    """The row's "full" or "boundary" loop (None if the kernel has none)."""
    return next((lp for lp in row.get("loops") or [] if lp["loop"] == name), None)


def check_targets(rows: list[dict]) -> list[str]:
    """Issue 21's static targets for sm90, as failures (empty: all met)."""
    bad = []
    for r in rows:
        if "error" in r:
            bad.append(f"{r['config']}: {r['error']}")
            continue
        kind, dtype, d, dv, arch, mode = r["config"]
        if arch != 90 or kind.startswith("tutorial"):
            continue
        name = f"{kind} {dtype} d{d}/{dv} {mode}"
        if r["hmma"] or not r["hgmma"]:
            bad.append(f"{name}: {r['hmma']} mma.sync, {r['hgmma']} wgmma (wgmma only)")
        if max(d, dv) <= 128 and (r["spill_stores"] or r["spill_loads"]):
            bad.append(f"{name}: spills {r['spill_stores']} / {r['spill_loads']} bytes")
        if mode in ("scan", "rows"):
            continue  # device positions / row tables: kept working, not a target (masked
            # loops with bounds read on the device)
        for lp in r["loops"]:
            if lp["min_wait"] is None or lp["min_wait"] < 1 or lp["sync_loads"]:
                bad.append(f"{name}: the {lp['loop']} loop does not keep copies in flight "
                           f"(smallest DEPBAR {lp['min_wait']}, {lp['sync_loads']} "
                           f"synchronous loads)")
        if kind in ("fwd", "dq") and d == dv and d in TARGET_PER_TILE:
            lp = loop_named(r, "full")
            if lp is None or lp["per_tile"] > TARGET_PER_TILE[d]:
                bad.append(f"{name}: {lp and lp['per_tile']} instructions per 64x64 tile "
                           f"in the full-tile loop (target <= {TARGET_PER_TILE[d]})")
    return bad


# ------------------------------------------------------------------------------ output


def table(rows: list[dict]) -> str:
    """Markdown table, one line per kernel configuration."""
    head = ("| kernel | dtype | d | arch | mode | tile, warps, stages | regs | spill B | "
            "smem KB | MMA | buffers, wait | instr / 64x64 tile: full, boundary |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        kind, dtype, d, dv, arch, mode = r["config"]
        dims = f"{d}" if d == dv else f"{d}/{dv}"
        if "error" in r:
            lines.append(f"| {kind} | {dtype} | {dims} | sm{arch} | {mode} | | error: "
                         f"{r['error'][:60]} |||||||")
            continue
        mma = (f"wgmma {r['hgmma']}" if r["hgmma"] and not r["hmma"]
               else f"mma.sync {r['hmma']}" if r["hmma"] and not r["hgmma"]
               else f"wgmma {r['hgmma']} + mma.sync {r['hmma']}")
        loops = [loop_named(r, "full"), loop_named(r, "boundary")]
        waits = ",".join("-" if lp is None or lp["min_wait"] is None else str(lp["min_wait"])
                         for lp in loops)
        per_tile = ", ".join("-" if lp is None else str(lp["per_tile"]) for lp in loops)
        spill = (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        lines.append(
            f"| {kind} | {dtype} | {dims} | sm{arch} | {mode} | {r['block'][0]}x"
            f"{r['block'][1]}, {r['num_warps']}w, {r.get('num_stages', 3)}s | {r['regs']} | "
            f"{spill} | {r['smem_kb']} | {mma} | {r['buffers']}, {waits} | {per_tile} |")
    return head + "\n".join(lines)


def configs(quick: bool, archs, dtypes, kinds, modes, dims) -> list[tuple]:
    if quick:  # what the CI targets read: sm90 bf16, every kernel, mode and head dim
        archs, dtypes = (90,), ("bf16",)
    return [(k, dt, d, dv, a, m) for a in archs for dt in dtypes for (d, dv) in dims
            for k in kinds for m in modes]


def run(cfgs: list[tuple], jobs: int) -> list[dict]:
    if jobs <= 1:
        return [compile_config(c) for c in cfgs]
    with get_context("spawn").Pool(jobs) as pool:
        return pool.map(compile_config, cfgs, chunksize=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sm90 bf16 only")
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES))
    ap.add_argument("--kind", nargs="+", default=list(KINDS))
    ap.add_argument("--mode", nargs="+", default=list(MODES))
    ap.add_argument("--dims", nargs="+", default=[f"{d}/{dv}" for d, dv in DIMS],
                    help="head dims as d/dv")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--tutorial", help="path of triton's python/tutorials/06-fused-attention.py")
    ap.add_argument("--json", default=str(RESULTS), help="output path ('' = do not write)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the sm90 targets hold")
    args = ap.parse_args()
    dims = [tuple(int(x) for x in s.split("/")) for s in args.dims]
    cfgs = configs(args.quick, args.arch, args.dtype, args.kind, args.mode, dims)
    rows = run(cfgs, args.jobs)
    if args.tutorial:
        rows += [tutorial_config(args.tutorial, d) for d in (128, 64)]
    import triton
    report = {"triton": triton.__version__, "rows": rows, "failures": check_targets(rows)}
    print(table(rows))
    for line in report["failures"]:
        print("target missed:", line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if args.check and report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
