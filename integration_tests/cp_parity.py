"""CP attention parity at the job's world size: every strategy x every mask x every layout.

One registered test per strategy. Each case builds the same global packed batch on every
rank (seeded), runs ``cp_varlen_attn`` forward + backward on this rank's shard (CP over the
whole world), gathers out / LSE / dq / dk / dv with ``plan.unshard`` and measures them
against the dense fp64 attention of ``tests/reference.py``. Tolerance, as flash-attn's tests: the CP
error may be at most 2x (out, LSE) or 3x (gradients) the error of the single-device op
(``varlen_cp.kernels.varlen_attn`` on the global batch, same dtype and backend), plus a
small floor. Padding rows (te layout) must be exactly 0 / -inf with zero gradients.
Layouts: every one in ``varlen_cp.plan.LAYOUTS``. dtypes: fp32 on CPU (torch backend);
bf16 and fp32 on CUDA (Triton). Limits: self-attention only, head counts chosen so every
strategy accepts them (Hq = 2*world, Hkv = world or 1).
"""

from __future__ import annotations

import itertools

import torch
from varlen_cp.plan import LAYOUTS as PLAN_LAYOUTS
from varlen_cp.strategies import STRATEGIES as PLAN_STRATEGIES

from .dist_env import JobContext
from .harness import register
from tests.reference import reference_attn

# Every strategy varlen_cp ships (a new one is covered without editing this file).
STRATEGIES: tuple[str, ...] = tuple(PLAN_STRATEGIES)
# Every layout the plan knows (a new one is covered without editing this file).
LAYOUTS: tuple[str, ...] = tuple(PLAN_LAYOUTS)
D, DV = 64, 32           # Dv != D (MLA-like) on purpose
FACTOR = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
# Absolute floors, scaled by max(1, max|truth|): the plain op's error can be ~0 in fp32.
FLOOR = {torch.float32: (2e-5, 1e-4), torch.float16: (1e-3, 2e-3),
         torch.bfloat16: (4e-3, 8e-3)}


def masks() -> dict:
    from varlen_cp import AttnMask
    return {
        "causal": AttnMask(causal=True),
        "full": AttnMask(causal=False),
        "swa": AttnMask(causal=True, window_size=(7, 0)),
        "swa_bidir": AttnMask(causal=False, window_size=(5, 3)),
        "chunk": AttnMask(causal=False, chunk_size=16),
        "chunk_causal": AttnMask(causal=True, chunk_size=12),      # Llama 4 RoPE layers
        "chunk_swa": AttnMask(causal=True, window_size=(9, 0), chunk_size=20),
    }


def documents(world: int) -> list[int]:
    """Odd lengths, length 1, shorter than cp, an empty one, and one long document that
    dual_chunk cuts into 2*world chunks (min_chunk_tokens=4)."""
    return [1, 2, 37, 9, 0, 130, 5, 23, 64 * world + 13]


def dtypes_for(device: torch.device) -> list[torch.dtype]:
    # The Triton interpreter (CPU) computes bf16 wrongly and is slow: CPU runs the torch
    # backend in fp32, where CP must agree to rounding.
    return [torch.bfloat16, torch.float32] if device.type == "cuda" else [torch.float32]


def a2a_sizes(world: int) -> list[int]:
    """a2a+p2p group sizes to rotate through: pure ring (1), a real hybrid (smallest prime
    factor of a composite world), pure Ulysses (world)."""
    spf = next((p for p in range(2, world) if world % p == 0), None)
    return sorted({1, world} | ({spf} if spf else set()))


def _global_inputs(n_tokens: int, hq: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_tokens, hq, D, generator=g), torch.randn(n_tokens, hkv, D, generator=g),
            torch.randn(n_tokens, hkv, DV, generator=g), torch.randn(n_tokens, hq, DV, generator=g))


def _truth(inputs, docs, mask, scale, device):
    q, k, v = (t.to(device, torch.float64, copy=True).requires_grad_() for t in inputs[:3])
    cu = torch.tensor([0, *itertools.accumulate(docs)])
    out, lse = reference_attn(q, k, v, cu, cu, softmax_scale=scale, causal=mask.causal,
                              window_size=mask.window_size, chunk_size=mask.chunk_size)
    out.backward(inputs[3].to(device, torch.float64))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _single_device(inputs, cu, docs, mask, scale, dtype, device):
    from varlen_cp.kernels import varlen_attn
    q, k, v = (t.to(device, dtype, copy=True).requires_grad_() for t in inputs[:3])
    out, lse = varlen_attn(q, k, v, cu, cu, max(docs), max(docs), scale, mask.causal,
                           mask.window_size, chunk_size=mask.chunk_size, return_lse=True)
    out.backward(inputs[3].to(device, dtype))
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _context_parallel(ctx: JobContext, inputs, cu, layout, mask, strategy, scale, dtype,
                      opts, validate):
    from varlen_cp import AttnOptions, CPPlan
    from varlen_cp.attention import cp_varlen_attn
    from varlen_cp.plan import DualChunk
    plan = CPPlan.build(cu, cp_size=ctx.world, cp_rank=ctx.rank,
                        layout=DualChunk(min_chunk_tokens=4) if layout == "dual_chunk"
                        else layout)
    q, k, v = (plan.shard(t).to(ctx.device, dtype, copy=True).requires_grad_() for t in inputs[:3])
    options = AttnOptions(strategy=strategy, validate=validate, **opts)
    out, lse = cp_varlen_attn(q, k, v, plan, mask, None, options, scale, return_lse=True)
    out.backward(plan.shard(inputs[3]).to(ctx.device, dtype))
    # Reported after the gathers below: raising here would leave the other ranks waiting
    # in them.
    padding = _padding_problems(plan, out, lse, (q.grad, k.grad, v.grad))
    world_group = None  # CP spans the whole job
    return padding, {"out": plan.unshard(out.detach().float(), world_group),
            "lse": plan.unshard(lse.t().contiguous(), world_group).t(),
            "dq": plan.unshard(q.grad.float(), world_group),
            "dk": plan.unshard(k.grad.float(), world_group),
            "dv": plan.unshard(v.grad.float(), world_group)}


def _padding_problems(plan, out, lse, grads) -> list[str]:
    """Names of the tensors whose padding rows are not 0 / -inf / zero-gradient."""
    pad = (plan.token_indices < 0).to(out.device)
    if not bool(pad.any()):
        return []
    return [name for name, bad in (
        ("out", (out.detach()[pad] != 0).any()), ("lse", ~torch.isneginf(lse[:, pad]).all()),
        ("dq", (grads[0][pad] != 0).any()), ("dk", (grads[1][pad] != 0).any()),
        ("dv", (grads[2][pad] != 0).any())) if bool(bad)]


def _max_err(got: torch.Tensor, truth: torch.Tensor) -> float:
    got, truth = got.detach().double(), truth.detach().double()
    same_inf = torch.isinf(got) & torch.isinf(truth) & (got == truth)
    diff = torch.where(same_inf, torch.zeros_like(got), (got - truth).abs())
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def compare(got: dict, plain: dict, truth: dict, dtype: torch.dtype) -> tuple[list[str], float]:
    """Errors (one string per bad tensor) and the worst ratio err_cp / allowed."""
    errors, worst = [], 0.0
    for name, factor in FACTOR.items():
        floor = FLOOR[dtype][0 if name in ("out", "lse") else 1]
        t = truth[name]
        mag = float(t[torch.isfinite(t)].abs().max()) if t.numel() else 0.0
        allowed = factor * _max_err(plain[name], t) + floor * max(1.0, mag)
        err = _max_err(got[name], t)
        worst = max(worst, err / allowed)
        if not err <= allowed:
            errors.append(f"{name}: max err {err:.3g} > allowed {allowed:.3g} "
                          f"(single-device op err {_max_err(plain[name], t):.3g})")
    return errors, worst


def run_strategy(ctx: JobContext, strategy: str) -> str:
    """All masks x layouts x dtypes for one strategy; raises AssertionError listing every
    bad case, returns a one-line detail on success."""
    docs = documents(ctx.world)
    cu = torch.tensor([0] + docs).cumsum(0)
    sizes = a2a_sizes(ctx.world)
    errors, worst, n = [], 0.0, 0
    for dtype in dtypes_for(ctx.device):
        for i, (layout, (mname, mask)) in enumerate(
                (lay, m) for lay in LAYOUTS for m in masks().items()):
            hq, hkv = (2 * ctx.world, ctx.world) if i % 2 == 0 else (2 * ctx.world, 1)
            opts = {"a2a_size": sizes[i % len(sizes)]} if strategy == "a2a+p2p" else {}
            scale = D ** -0.5
            inputs = _global_inputs(sum(docs), hq, hkv, seed=1000 + i)
            truth = _truth(inputs, docs, mask, scale, ctx.device)
            plain = _single_device(inputs, cu, docs, mask, scale, dtype, ctx.device)
            padding, got = _context_parallel(ctx, inputs, cu, layout, mask, strategy, scale, dtype,
                                    opts, validate=(n == 0))
            bad, ratio = compare(got, plain, truth, dtype)
            worst = max(worst, ratio)
            tag = f"[{str(dtype).removeprefix('torch.')} {layout} {mname} {hq}/{hkv}{opts or ''}]"
            errors += [f"{tag} {b}" for b in bad]
            errors += [f"{tag} padding rows of {name} not 0 / -inf" for name in padding]
            n += 1
    if errors:
        raise AssertionError(f"{len(errors)} mismatches in {n} cases: " + "; ".join(errors))
    return f"{n} cases fwd+bwd, worst err/allowed {worst:.2f}"


def _make(strategy: str):
    def test(ctx: JobContext) -> str:
        return run_strategy(ctx, strategy)
    test.__doc__ = f"CP parity of strategy {strategy!r}: every mask x layout, fwd + grads."
    return test


for _s in STRATEGIES:
    register(f"cp_parity/{_s}", timeout_s=600.0)(_make(_s))
