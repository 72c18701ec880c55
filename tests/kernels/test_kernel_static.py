"""Issue 21's static targets for sm90, from the compiler's own reports (no GPU needed).

The kernels are compiled for sm90 (and sm80) with triton's bundled ptxas and disassembled
with cuobjdump, exactly as ``bench/kernel_report.py`` does (its functions, in a subprocess
without the interpreter), once per test session; each test then reads the figures:

- the full-tile loops of the forward and dQ kernels, in the CP mode (explicit positions +
  host schedule) and the implicit mode, take <= 440 SASS instructions per 64x64 tile at
  d 128 and <= 375 at d 64 (1.25x the tutorial forward's 351 / 298);
- every main loop (full and boundary tiles, dK/dV's query loop included) keeps cp.async
  copies in flight: no ``DEPBAR.LE SB0, 0`` and no synchronous global load in it;
- no spills at head dim <= 128, and wgmma (no mma.sync) in every kernel at every head dim;
- shared memory within sm80's and sm90's limits, fp32 inputs included;
- the graph-safe mode's row kernels (``kernels/triton_rows.py``) at d 64 and 128: no
  spills, wgmma, shared memory within sm90's limit.

29 compiles, two at a time: ~30 s on 2 idle cores, up to ~4 min on a busy shared host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# slow: the module's fixture compiles every configuration (~35 s on 2 cores)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TARGET = {128: 440, 64: 375}
SM90 = ([(k, "bf16", d, d, 90, m) for d in (64, 128) for k in ("fwd", "dq", "dkdv")
         for m in ("implicit", "cp")]
        + [(k, "bf16", d, dv, 90, "cp") for d, dv in ((192, 128), (256, 256))
           for k in ("fwd", "dq", "dkdv")])
# The graph-safe mode's row kernels (one masked loop each): no spills, wgmma, shared memory.
ROWS = [(k, "bf16", d, d, 90, "rows") for d in (64, 128) for k in ("fwd", "dq", "dkdv")]
# Shared memory: sm80 and fp32 variants (fp32 at padded d 256 fits an A100 only with
# its 32x32 tiles), one of each kernel.
SMEM = [("fwd", "fp16", 192, 128, 80, "scan"), ("dkdv", "bf16", 256, 256, 80, "implicit"),
        ("dkdv", "fp32", 256, 256, 80, "implicit"), ("dq", "fp32", 192, 192, 80, "cp"),
        ("fwd", "bf16", 192, 128, 90, "implicit")]
SMEM_LIMIT_KB = {80: 163, 90: 227}  # per block: A100, H100

_SCRIPT = r"""
import json, sys
from multiprocessing import get_context
try:
    import triton.backends.nvidia  # noqa: F401
    from triton.backends.compiler import GPUTarget  # noqa: F401
except ImportError as exc:
    print(json.dumps({"skip": f"no triton nvidia backend: {exc}"}))
    sys.exit(0)
import bench.kernel_report as R
configs = [tuple(c) for c in json.loads(sys.argv[1])]
print(json.dumps({"rows": R.run(configs, 2)}))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    """{config tuple: report row} of every configuration the tests read."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA tests run the kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(SM90 + SMEM + ROWS)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    rows = {tuple(r["config"]): r for r in out["rows"]}
    errors = [f"{c}: {r['error']}" for c, r in rows.items() if "error" in r]
    assert not errors, "\n".join(errors)
    return rows


def _loop(row: dict, name: str) -> dict:
    found = [lp for lp in row["loops"] if lp["loop"] == name]
    assert len(found) == 1, (row["config"], row["loops"])
    return found[0]


def _targets(report: dict):
    """The sm90 16-bit rows the targets are about."""
    return [(c, report[c]) for c in SM90]


def test_full_tile_loops_within_the_instruction_budget(report):
    """Forward and dQ, CP and implicit modes: the loop a long document runs in."""
    over = []
    for (kind, dtype, d, dv, arch, mode), row in _targets(report):
        if kind in ("fwd", "dq") and d == dv and d in TARGET:
            per_tile = _loop(row, "full")["per_tile"]
            if per_tile > TARGET[d]:
                over.append(f"{kind} d{d} {mode}: {per_tile} > {TARGET[d]}")
    assert not over, over


def test_every_main_loop_keeps_copies_in_flight(report):
    stalled = []
    for config, row in _targets(report):
        assert {lp["loop"] for lp in row["loops"]} == {"full", "boundary"}, (config, row)
        for lp in row["loops"]:
            if lp["min_wait"] is None or lp["min_wait"] < 1 or lp["sync_loads"]:
                stalled.append((config, lp))
    assert not stalled, stalled


def test_no_spills_up_to_head_dim_128(report):
    """16-bit inputs (fp32 takes the IEEE dot without tensor cores: a test dtype, and it
    spilled before this rework too, 43-65 KB at d 128)."""
    spills = [(c, r["spill_stores"], r["spill_loads"]) for c, r in report.items()
              if c[1] != "fp32" and max(c[2], c[3]) <= 128
              and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, spills


def test_wgmma_in_every_sm90_kernel(report):
    """MLA's 192/128 dK/dV included (its 32-key tiles used to fall back to mma.sync)."""
    bad = [(c, r["hgmma"], r["hmma"]) for c, r in report.items()
           if c[4] == 90 and c[1] != "fp32" and (r["hmma"] or not r["hgmma"])]
    assert any(c[4] == 90 and c[2] == 192 for c in report), "MLA not compiled"
    assert not bad, bad


def test_shared_memory_fits_the_architecture(report):
    over = [(c, r["smem_kb"]) for c, r in report.items() if r["smem_kb"] > SMEM_LIMIT_KB[c[4]]]
    assert not over, over
