"""Single-GPU kernel benchmark of the GPU suite: our Triton kernels against
``torch.nn.attention.varlen.varlen_attn`` and ``flex_attention`` with a document mask, in
the same run, on the cases of ``gpu_cases.kernel_cases`` (forward and backward, TFLOP/s of
the mask area).

Backends (each case runs every one that exists here and supports its mask; the others get a
row saying why not):
- ``varlen_cp``: ``varlen_cp.kernels.varlen_attn(backend="triton")`` with device
  cu_seqlens, as flash-attn callers pass them;
- ``varlen_cp_schedule``: the same op with a host-built ``BlockSchedule`` made once ahead
  (``build_block_schedule``, tiles from ``block_sizes_for``), as the CP strategies call it;
- ``varlen_cp_flash`` / ``varlen_cp_fa4``: the same op with ``backend="flash"`` (torch's
  flash ops: FA2, or FA3 / FA4 once activated) / ``"fa4"`` (flash-attn-4), where the call
  is FA-shaped (no chunked mask on one device) and the backend is there: what our routing
  costs on top of FlashAttention, side by side with our Triton kernels;
- ``torch_varlen_attn``: torch's flash-attention varlen op, when this torch has it (the
  module appeared in torch 2.9 with ``is_causal`` only; ``window_size`` came later): no
  chunked mask, sliding windows only with ``window_size``;
- ``flex_attention``: compiled (``torch.compile``) on CUDA with a block mask from a
  document + position ``mask_mod`` built outside the timed region; eager on a CPU.

Forward is timed under ``no_grad``; backward as ``torch.autograd.grad`` of a kept graph
(``retain_graph``), so every backend's backward is timed the same way, without its forward.
Outputs are compared with ``varlen_cp``'s (max abs difference), a cheap check that the
kernels compute the same thing on the GPU at these sizes, where no dense reference fits.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gpu_cases import KernelCase, Shape, mask_area_flops, tflops, visible_pairs
from gpu_timing import Budget, measure

# seconds a case needs at least (compile + a few reps) before it is started on a GPU
MIN_CASE_S = 8.0


@dataclass
class Backend:
    """One implementation on one case: ``make(q, k, v, dout)`` -> (fwd(), leaves, dout,
    to_thd) where ``fwd(*leaves)`` returns the output and ``to_thd`` maps it to [T, H, Dv];
    or ``unavailable`` says why it cannot run this case here."""

    name: str
    make: Callable[..., tuple] | None
    unavailable: str | None = None


# ----------------------------------------------------------------------------- backends
def _ours(case: KernelCase, shape: Shape, device: torch.device, schedule: bool) -> Backend:
    from varlen_cp.kernels import block_sizes_for, build_block_schedule, varlen_attn

    name = "varlen_cp_schedule" if schedule else "varlen_cp"
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    cu_host = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    cu = cu_host.to(device)
    longest = max(case.lengths)
    kw = dict(case.mask.kernel_kwargs(), backend="triton")
    if schedule:
        bm, bn = block_sizes_for("triton", device, shape.head_dim, shape.value_dim,
                                 dtype=shape.dtype)
        causal, wl, wr, chunk = case.mask.params
        kw["schedule"] = build_block_schedule(
            cu_host, cu_host, longest, longest, causal=causal, window_left=wl,
            window_right=wr, chunk_size=chunk, block_m=bm, block_n=bn).to(device)

    def make(q, k, v, dout):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return (lambda a, b, c: varlen_attn(a, b, c, cu, cu, longest, longest, **kw),
                leaves, dout, lambda o: o)
    return Backend(name, make)


def _ours_flash(case: KernelCase, shape: Shape, device: torch.device, backend: str
                ) -> Backend:
    from varlen_cp.kernels import varlen_attn
    from varlen_cp.kernels.flash import resolve_flash

    name = f"varlen_cp_{backend}"
    causal, wl, wr, chunk = case.mask.params
    if chunk:
        return Backend(name, None, "a chunked mask is not one FA call on one device "
                                   "(the CP tables cut it; this op runs it on Triton)")
    try:
        got, why = resolve_flash(backend, device, shape.dtype, shape.head_dim,
                                 shape.value_dim)
    except ValueError as e:   # the backend is not there at all (package, kernel)
        return Backend(name, None, str(e)[:300])
    if got != backend:
        return Backend(name, None, f"{backend} cannot run it: {why}")
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(
        device=device, dtype=torch.int32)
    longest = max(case.lengths)
    kw = dict(case.mask.kernel_kwargs(), backend=backend)

    def make(q, k, v, dout):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return (lambda a, b, c: varlen_attn(a, b, c, cu, cu, longest, longest, **kw),
                leaves, dout, lambda o: o)
    return Backend(name, make)


def _torch_varlen(case: KernelCase, shape: Shape, device: torch.device) -> Backend:
    name = "torch_varlen_attn"
    try:
        from torch.nn.attention.varlen import varlen_attn as tv
    except ImportError as e:
        return Backend(name, None, f"torch {torch.__version__} has no "
                                   f"torch.nn.attention.varlen ({e})")
    params = inspect.signature(tv).parameters
    causal, wl, wr, chunk = case.mask.params
    if chunk:
        return Backend(name, None, "no chunked (Llama 4) mask in torch's varlen_attn")
    kw: dict[str, Any] = {}
    if "window_size" in params:   # (left, right); causal is right = 0
        kw["window_size"] = (wl, 0 if causal else wr)
    elif wl >= 0 or wr >= 0:
        return Backend(name, None, f"torch {torch.__version__}'s varlen_attn has no "
                                   f"window_size")
    elif "is_causal" in params:
        kw["is_causal"] = causal
    if "scale" in params:
        kw["scale"] = shape.head_dim ** -0.5
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(
        device=device, dtype=torch.int32)
    longest = max(case.lengths)

    def make(q, k, v, dout):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return (lambda a, b, c: tv(a, b, c, cu, cu, longest, longest, **kw), leaves, dout,
                lambda o: o)
    return Backend(name, make)


def _flex(case: KernelCase, shape: Shape, device: torch.device) -> Backend:
    name = "flex_attention"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return Backend(name, None, f"no flex_attention in torch {torch.__version__} ({e})")
    causal, wl, wr, chunk = case.mask.params
    lengths = torch.tensor(case.lengths, device=device)
    doc = torch.repeat_interleave(torch.arange(len(case.lengths), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(case.tokens, device=device) - starts[doc]
    # One mask_mod for every mask, its parameters tensors (unbounded: 2**30), so the cases
    # of one size share one compiled kernel (inductor's cache) instead of compiling one
    # each; the mask runs on partial blocks only (full blocks skip it), so it costs little.
    unbounded = 1 << 30
    is_causal, left, right, width = (torch.tensor(x, device=device) for x in (
        causal, wl if wl >= 0 else unbounded, wr if wr >= 0 else unbounded,
        chunk or unbounded))

    def mask_mod(b, h, qi, ki):
        qp, kp = pos[qi], pos[ki]
        return ((doc[qi] == doc[ki]) & ((kp <= qp) | ~is_causal) & (kp >= qp - left)
                & (kp <= qp + right) & (kp // width == qp // width))

    on_gpu = device.type == "cuda"
    if on_gpu:   # each case's new mask_mod is a recompile: start from an empty dynamo cache,
        torch._dynamo.reset()   # or the 9th would fall back to eager flex (out of memory)
    mask_kw = {}
    if on_gpu and "_compile" in inspect.signature(create_block_mask).parameters:
        mask_kw["_compile"] = True   # a dense 128K x 128K mask evaluation would not fit
    block_mask = create_block_mask(mask_mod, None, None, case.tokens, case.tokens,
                                   device=device, **mask_kw)
    if on_gpu:
        fn = torch.compile(flex_attention, dynamic=False)
    else:   # the dry run's eager flex on purpose: a few tokens, no compile
        def fn(*args, **kw):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without")
                return flex_attention(*args, **kw)

    def to_bhtd(t):   # [T, H, D] -> contiguous [1, H, T, D], a fresh leaf
        return t.detach().transpose(0, 1).unsqueeze(0).contiguous()

    def make(q, k, v, dout):
        leaves = [to_bhtd(t).requires_grad_() for t in (q, k, v)]
        return (lambda a, b, c: fn(a, b, c, block_mask=block_mask), leaves, to_bhtd(dout),
                lambda o: o[0].transpose(0, 1))
    return Backend(name, make)


def backends(case: KernelCase, shape: Shape, device: torch.device) -> list[Backend]:
    """Every backend for ``case``; a backend whose setup raises becomes unavailable."""
    out = []
    for name, build in (("varlen_cp", lambda: _ours(case, shape, device, False)),
                        ("varlen_cp_schedule", lambda: _ours(case, shape, device, True)),
                        ("varlen_cp_flash", lambda: _ours_flash(case, shape, device, "flash")),
                        ("varlen_cp_fa4", lambda: _ours_flash(case, shape, device, "fa4")),
                        ("torch_varlen_attn", lambda: _torch_varlen(case, shape, device)),
                        ("flex_attention", lambda: _flex(case, shape, device))):
        try:
            out.append(build())
        except Exception as e:  # noqa: BLE001 - a backend failing to set up is a result
            out.append(Backend(name, None, f"setup failed: {type(e).__name__}: {e}"[:500]))
    return out


# ----------------------------------------------------------------------------- running
def _inputs(case: KernelCase, shape: Shape, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    t = case.tokens

    def rnd(h, d):
        return torch.randn(t, h, d, device=device, dtype=shape.dtype, generator=g)
    return (rnd(shape.n_heads, shape.head_dim), rnd(shape.n_kv_heads, shape.head_dim),
            rnd(shape.n_kv_heads, shape.value_dim), rnd(shape.n_heads, shape.value_dim))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def run_backend(backend: Backend, inputs, device: torch.device, budget: Budget,
                dry_run: bool, reference: torch.Tensor | None) -> tuple[dict, Any]:
    """Time one backend on one case: (row fields, its forward output in THD or None)."""
    reps = dict(min_reps=0) if dry_run else dict(budget=budget)
    fwd, leaves, dout, to_thd = backend.make(*inputs)
    row: dict[str, Any] = {}
    out_thd = None
    try:
        plain = [t.detach() for t in leaves]   # (flex on a CPU refuses inputs needing grad)
        with torch.no_grad():
            t = measure(lambda: fwd(*plain), device, **reps)
            out_thd = to_thd(t.last).float()
        row.update(fwd_ms=t.ms, fwd_reps=t.reps, fwd_first_ms=t.first_ms)
        if reference is not None:
            row["max_abs_diff_vs_varlen_cp"] = float((out_thd - reference).abs().max())
    except Exception as e:  # noqa: BLE001
        row["fwd_error"] = _error(e)
    try:
        out = fwd(*leaves)
        t = measure(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                    device, **reps)
        row.update(bwd_ms=t.ms, bwd_reps=t.reps, bwd_first_ms=t.first_ms)
        del out
    except Exception as e:  # noqa: BLE001
        row["bwd_error"] = _error(e)
    return row, out_thd


def run_case(case: KernelCase, shape: Shape, device: torch.device, budget: Budget,
             dry_run: bool, log: Callable[[str], None] = print) -> list[dict]:
    """Rows of every backend on one case (timings, TFLOP/s, status)."""
    pairs = visible_pairs(case.lengths, case.mask)
    flops_f, flops_b = mask_area_flops(pairs, shape)
    base = {"case": case.name, "tokens": case.tokens, "n_docs": len(case.lengths),
            "mask": case.mask_name, "visible_pairs": pairs, "fwd_flops": flops_f,
            "bwd_flops": flops_b}
    rows = []
    inputs = _inputs(case, shape, device)
    reference = None
    for backend in backends(case, shape, device):
        row = dict(base, backend=backend.name)
        if backend.make is None:
            row.update(status="unavailable", note=backend.unavailable)
        elif not budget.allows(0 if dry_run else MIN_CASE_S):
            row.update(status="skipped", note=f"{budget.name} budget spent")
        else:
            try:
                fields, out = run_backend(backend, inputs, device, budget, dry_run, reference)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory in setup
                fields, out = {"fwd_error": _error(e)}, None
            row.update(fields)
            if backend.name == "varlen_cp" and out is not None:
                reference = out
            row["status"] = ("ok" if "fwd_ms" in row and "bwd_ms" in row else
                             "fwd_only" if "fwd_ms" in row else "error")
            row["fwd_tflops"] = tflops(flops_f, row.get("fwd_ms"))
            row["bwd_tflops"] = tflops(flops_b, row.get("bwd_ms"))
        rows.append(row)
        log(_line(row))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(x: float | None, spec: str = "7.1f") -> str:
    return format(x, spec) if x is not None else "      -"


def _line(row: dict) -> str:
    extra = row.get("note") or row.get("fwd_error") or row.get("bwd_error") or ""
    return (f"  {row['case']:26s} {row['backend']:19s} {row['status']:11s} fwd "
            f"{_fmt(row.get('fwd_tflops'))} bwd {_fmt(row.get('bwd_tflops'))} TFLOP/s "
            f"{extra[:90]}")


def run_kernels(cases: list[KernelCase], shape: Shape, device: torch.device, budget: Budget,
                dry_run: bool, log: Callable[[str], None] = print) -> list[dict]:
    """Every case, in order, within ``budget``."""
    rows = []
    for case in cases:
        rows += run_case(case, shape, device, budget, dry_run, log)
    return rows


# ----------------------------------------------------------------------------- targets
OURS = ("varlen_cp", "varlen_cp_schedule")


def _best(rows: list[dict], case: str, key: str, backends=OURS) -> tuple[float | None, str]:
    got = [(r[key], r["backend"]) for r in rows
           if r["case"] == case and r["backend"] in backends and r.get(key)]
    return max(got) if got else (None, "")


def target_checks(rows: list[dict], cases: list[KernelCase]) -> list[dict]:
    """Issue 21's GPU targets on these rows (our figure: the better of our two variants)."""
    one, docs_small, docs_big, swa, chunk = (c.name for c in cases)
    checks = []

    def check(what, value, target, who=""):
        checks.append({"what": what, "value": value, "target": target, "ours": who,
                       "met": None if value is None else value >= target})

    for key, target in (("fwd_tflops", 344.0), ("bwd_tflops", 264.0)):
        value, who = _best(rows, one, key)
        check(f"{one} {key} (FlashAttention-2's figure)", value, target, who)
    for case in (one, docs_small, docs_big, swa):
        for key in ("fwd_tflops", "bwd_tflops"):
            ours, who = _best(rows, case, key)
            theirs, _ = _best(rows, case, key, ("torch_varlen_attn",))
            ratio = ours / theirs if ours and theirs else None
            check(f"{case} {key} vs torch_varlen_attn", ratio, 0.8, who)
    for case in (one, docs_small, docs_big, swa):   # our routing adds nothing to FA's time
        for key in ("fwd_tflops", "bwd_tflops"):
            ours, _ = _best(rows, case, key, ("varlen_cp_flash",))
            theirs, _ = _best(rows, case, key, ("torch_varlen_attn",))
            ratio = ours / theirs if ours and theirs else None
            check(f"{case} {key} varlen_cp_flash vs torch_varlen_attn", ratio, 0.95,
                  "varlen_cp_flash")
    for case, target in ((swa, 0.85), (chunk, 0.85), (docs_small, 0.7), (docs_big, 0.7)):
        for key in ("fwd_tflops", "bwd_tflops"):
            ours, who = _best(rows, case, key)
            causal, _ = _best(rows, one, key)
            ratio = ours / causal if ours and causal else None
            check(f"{case} {key} / {one}", ratio, target, who)
    return checks
