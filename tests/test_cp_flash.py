"""Every strategy routed to FlashAttention ("flash": torch's aten flash ops; "fa4":
flash-attn-4's interface), on CPU, against the fp64 reference.

torch's flash ops get a CPU implementation written from FlashAttention-2's sources
(``tests/flash_emulator.py``: bottom-right alignment, +inf LSE on rows without keys, rows
outside every segment never written: NaN) and FA4's interface a stand-in module
(``tests/fa4_standin.py``: -inf LSE, the LSE gradient); neither knows our kernels. Each
launch runs one (strategy, backend) over every layout x mask, both GQA head splits, bf16,
forward and backward (flash-attn's tolerance rule: 2x / 3x the error of plain PyTorch in
bf16 against fp64, plus a floor), and checks that the calls really ran on FlashAttention:
every call the rank made for causal, full and chunked masks (and the local calls of every
mask) had an FA form. Then the staged strategies with 2 stages, the softmax extras (a
learnable sink needs the LSE gradient: "fa4" takes it, "flash" hands such layers to our
kernels), the max logit (not an FA output: our kernels), and the host-read guard.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
import contextlib

from tests.helpers import (DOCS, HEADS, LAYOUTS, MASKS, NAMES, dense, forbid_host_reads,
                           small_plan)
from varlen_cp import AttnOptions

STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch")
FA_MASKS = ("causal", "full", "chunk", "chunk_causal")   # every call must have an FA form


def _install(backend: str) -> None:
    """The CPU stand-ins for ``backend`` (in this worker process)."""
    from tests import fa4_standin, flash_emulator
    flash_emulator.register()
    if backend == "fa4":
        fa4_standin.install()
        from varlen_cp.kernels import flash
        flash.fa4_interface.cache_clear()


def global_inputs(hq, hkv, seed, dv):
    """q, k, v, dout of the global batch (fp32): head dim 32, V's ``dv`` (torch's flash ops
    need one head dim; FA4 takes another for V, as MLA has)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(DOCS)
    return (torch.randn(total, hq, 32, generator=g), torch.randn(total, hkv, 32, generator=g),
            torch.randn(total, hkv, dv, generator=g), torch.randn(total, hq, dv, generator=g))


def _check_close(what, got, ref64, plain):
    from tests.reference import assert_close_to_reference
    for name, g, r, p in zip(NAMES, got, ref64, plain):
        if g is None:
            continue
        factor, floor = (2, 2e-3) if name in ("out", "lse") else (3, 4e-3)
        assert_close_to_reference(f"{what} {name}", g, r, p, factor=factor, floor=floor)


def _run(rank, world, layout, mask, options, inputs, return_lse, no_host_reads):
    """CP forward + backward in bf16: (plan, global (out, lse or None, dq, dk, dv)).
    "flash" runs without returning the LSE: a returned LSE may get a gradient, which FA2
    / FA3 cannot take, so such layers are planned on our kernels."""
    from varlen_cp.attention import cp_varlen_attn
    q, k, v, dout = (t.to(torch.bfloat16) for t in inputs)
    plan = small_plan(DOCS, world, rank, layout, mask)
    ql, kl, vl = (plan.shard(t).requires_grad_() for t in (q, k, v))
    with forbid_host_reads() if no_host_reads else contextlib.nullcontext():
        res = cp_varlen_attn(ql, kl, vl, plan, mask, None, options, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out.backward(plan.shard(dout))
    pad = plan.token_indices < 0
    if bool(pad.any()):
        assert bool((out[pad] == 0).all()) and bool((ql.grad[pad] == 0).all())
    return plan, (plan.unshard(out.detach().float()),
                  None if lse is None else plan.unshard(lse.t().contiguous()).t(),
                  plan.unshard(ql.grad.float()), plan.unshard(kl.grad.float()),
                  plan.unshard(vl.grad.float()))


def grid_worker(rank, world, strategy, backend, stages):
    _install(backend)
    n = used = 0
    for i, (layout, mname) in enumerate((l, m) for l in LAYOUTS for m in MASKS):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(hq, hkv, 300 + i, 32 if backend == "flash" else 16)
        ref64 = dense(inputs, DOCS, mask, torch.float64, torch.bfloat16)
        plain = dense(inputs, DOCS, mask, torch.bfloat16, torch.bfloat16)
        a2a = 2 if strategy == "a2a+p2p" and world == 4 else None
        options = AttnOptions(strategy=strategy, backend=backend, a2a_size=a2a,
                              overlap_stages=stages, validate=(i == 0))
        plan, got = _run(rank, world, layout, mask, options, inputs, backend == "fa4",
                         no_host_reads=(i > 0))
        _check_close(f"[{strategy} {backend} cp={world} {layout} {mname} {hq}/{hkv}]",
                     got, ref64, plain)
        calls = plan_calls(plan)
        if mname in FA_MASKS:
            off = [c for c in calls if c.flash is None]
            assert not off, f"[{strategy} {layout} {mname}] {len(off)} calls not on FA"
        assert all(c.flash.backend == backend for c in calls if c.flash is not None)
        used += sum(c.flash is not None for c in calls)
        n += 1
    assert used > 0, "no call ran on FlashAttention"
    return n


def plan_calls(plan):
    """The kernel calls of every table cached in ``plan``."""
    from varlen_cp.schedules.holders import KernelCall
    found = []

    def walk(x, depth):
        if depth > 5:
            return
        if isinstance(x, KernelCall):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for e in x:
                walk(e, depth + 1)
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name), depth + 1)
    for value in list(plan._cache.values()):
        walk(value, 0)
    return found


@pytest.mark.parametrize("backend", ["flash", "fa4"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_on_flash_attention(strategy, backend, tmp_path):
    n = len(LAYOUTS) * len(MASKS)
    assert run_distributed(grid_worker, 2, tmp_path, strategy, backend, None,
                           timeout_s=600) == [n, n]


@pytest.mark.parametrize("strategy", ["all_gather", "dispatch"])
def test_staged_on_flash_attention_cp4(strategy, tmp_path):
    n = len(LAYOUTS) * len(MASKS)
    assert run_distributed(grid_worker, 4, tmp_path, strategy, "flash", 2,
                           timeout_s=600) == [n] * 4
