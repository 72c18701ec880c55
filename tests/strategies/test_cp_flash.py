"""Every strategy routed to FlashAttention ("flash": torch's aten flash ops; "fa4":
flash-attn-4's interface), on CPU, against the fp64 reference.

torch's flash ops get a CPU implementation written from FlashAttention-2's sources
(``tests/flash_emulator.py``: bottom-right alignment, +inf LSE on rows without keys, rows
outside every segment never written: NaN) and FA4's interface a stand-in module
(``tests/fa4_standin.py``: -inf LSE, the LSE gradient); neither knows our kernels. One
pytest item per strategy x backend x layout x mask (``[p2p-flash-te-swa]``), one launch per
(strategy, backend) for the selected ones (``helpers.launches``): every layout x mask, both
GQA head splits, bf16, forward and backward (flash-attn's tolerance rule: 2x / 3x the error of plain PyTorch in
bf16 against fp64, plus a floor), and checks that the calls really ran on FlashAttention:
every call the rank made for causal, full and chunked masks (and the local calls of every
mask) had an FA form. Then the staged strategies with 2 stages at cp 4; a learnable sink
(its LSE gradient: "fa4" takes it, "flash" plans such layers on our kernels) and the max
logit (not an FA output: our kernels); the host-read guard on every case after the first;
and the single-device op, which runs its FlashAttention-shaped calls there.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.cp_grid import (DOCS, HEADS, LAYOUTS, MASKS, NAMES, check_padding, cp_run,
                                   dense, gather, global_inputs)
from tests.helpers.lanes import fast_first, slow
from tests.helpers.launches import GroupLaunches, assert_case_clean
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


def _check_close(what, got, ref64, plain):
    from tests.reference import assert_close_to_reference
    for name, g, r, p in zip(NAMES, got, ref64, plain):
        if g is None:
            continue
        factor, floor = (2, 2e-3) if name in ("out", "lse") else (3, 4e-3)
        assert_close_to_reference(f"{what} {name}", g, r, p, factor=factor, floor=floor)


CASES = [(layout, mname) for layout in LAYOUTS for mname in MASKS]


def grid_worker(rank, world, strategy, backend, stages, cases):
    """The given (layout, mask name) cases; per case its errors, the number of calls on
    FlashAttention and of FA calls handed part of the rows (spans)."""
    _install(backend)
    results = {}
    for n, (layout, mname) in enumerate(cases):
        i = CASES.index((layout, mname))
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        # torch's flash ops need one head dim; FA4 takes another for V (as MLA has)
        dv = 32 if backend == "flash" else 16
        inputs = global_inputs(DOCS, hq, hkv, 300 + i, d=32, dv=dv)
        ref64 = dense(inputs, DOCS, mask, torch.float64, torch.bfloat16)
        plain = dense(inputs, DOCS, mask, torch.bfloat16, torch.bfloat16)
        a2a = 2 if strategy == "a2a+p2p" and world == 4 else None
        options = AttnOptions(strategy=strategy, backend=backend, a2a_size=a2a,
                              overlap_stages=stages, validate=(n == 0))
        # "flash" runs without returning the LSE: a returned LSE may get a gradient, which
        # FA2 / FA3 cannot take, so such layers are planned on our kernels
        plan, *local = cp_run(rank, world, DOCS, layout, mask, options,
                              [t.to(torch.bfloat16) for t in inputs], torch.bfloat16,
                              no_host_reads=(n > 0), return_lse=backend == "fa4")
        what = f"[{strategy} {backend} cp={world} {layout} {mname} {hq}/{hkv}]"
        errors = []
        try:
            check_padding(plan, local[0], local[1], local[2:])
        except AssertionError as e:  # the gather below is collective: every rank goes on
            errors.append(f"{what} {e}")
        got = gather(plan, local)
        try:
            _check_close(what, got, ref64, plain)
        except AssertionError as e:
            errors.append(str(e))
        calls = plan_calls(plan)
        if mname in FA_MASKS:
            off = [c for c in calls if c.flash is None]
            if off:
                errors.append(f"[{strategy} {layout} {mname}] {len(off)} calls not on FA")
        if not all(c.flash.backend == backend for c in calls if c.flash is not None):
            errors.append(f"{what} a call on another FlashAttention backend")
        used = sum(c.flash is not None for c in calls)
        narrow = sum(f.q_span != (0, c.q_pos.numel()) for c in calls if c.flash is not None
                     for f in c.flash.calls)
        results[layout, mname] = (errors, used, narrow)
    return results


def plan_calls(plan):
    """The kernel calls of every table cached in ``plan``."""
    from varlen_cp.tables.holders import KernelCall
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


def _grid_params(groups, fast_group):
    """One item per case of each group, then its ``spans`` item (the checks over the whole
    grid: some call ran on FlashAttention, and whether FA calls got part of the rows);
    ``fast_group``'s first case and spans item stay in the fast lane."""
    for group in groups:
        for layout, mname in CASES + [(None, "spans")]:
            fast = group == fast_group and (mname == "spans" or (layout, mname) == CASES[0])
            name = "-".join(map(str, group + ((layout, mname) if layout else (mname,))))
            yield pytest.param(*group, layout, mname, marks=() if fast else (slow,), id=name)


def _launch(world, stages, tmp, strategy, backend, siblings):
    """The selected cases in one launch; all of them when the spans item is selected."""
    wanted = [(p["layout"], p["mname"]) for p in siblings if p["mname"] != "spans"]
    cases = CASES if len(wanted) < len(siblings) else wanted
    return run_distributed(grid_worker, world, tmp, strategy, backend, stages, cases,
                           timeout_s=600)


def _check(results, layout, mname, spans_rule):
    if mname == "spans":
        assert [len(r) for r in results] == [len(CASES)] * len(results)
        assert all(sum(v[1] for v in r.values()) > 0 for r in results), \
            "no call ran on FlashAttention"
        spans_rule(sum(v[2] for r in results for v in r.values()))
        return
    assert_case_clean(results, (layout, mname), lambda entry: entry[0])


@pytest.fixture(scope="module")
def flash_launches():
    return GroupLaunches(("strategy", "backend"))


@pytest.mark.parametrize("strategy, backend, layout, mname", list(_grid_params(
    [(s, b) for b in ("flash", "fa4") for s in STRATEGIES], (STRATEGIES[0], "flash"))))
def test_strategies_on_flash_attention(strategy, backend, layout, mname, flash_launches,
                                       request, tmp_path_factory):
    """One item per strategy x backend x layout x mask (and the group's spans item); one
    launch of 2 ranks per strategy x backend for the selected cases."""
    results = flash_launches.result(request, lambda siblings: _launch(
        2, None, tmp_path_factory.mktemp("flash"), strategy, backend, siblings))

    def spans_rule(narrow):
        # FA calls handed part of the rows (spans: a window only some documents need, a
        # split call) ran and were exact wherever a rank holds pieces of documents (a2a's
        # whole documents make one call on every row)
        assert narrow > 0 if "a2a" not in strategy else narrow == 0, narrow
    _check(results, layout, mname, spans_rule)


@pytest.fixture(scope="module")
def staged_flash_launches():
    return GroupLaunches(("strategy", "backend"))


@pytest.mark.parametrize("strategy, backend, layout, mname", list(_grid_params(
    [(s, "flash") for s in ("all_gather", "dispatch")], None)))
def test_staged_on_flash_attention_cp4(strategy, backend, layout, mname,
                                       staged_flash_launches, request, tmp_path_factory):
    """The staged strategies with 2 stages at cp 4, one item per case, one launch each."""
    results = staged_flash_launches.result(request, lambda siblings: _launch(
        4, 2, tmp_path_factory.mktemp("flash4"), strategy, backend, siblings))

    def spans_rule(narrow):
        assert narrow > 0, "no FA call ran on part of the rows (spans)"
    _check(results, layout, mname, spans_rule)


# ------------------------------------------------------------------ softmax extras
EXTRAS_CASES = [("p2p", "dual_chunk", "causal"), ("dispatch", "balanced", "chunk_causal"),
                ("a2a", "te", "swa")]


def _extras_reference(inputs, sink, mask, dtype):
    """Dense reference with a learnable sink in ``dtype``: (out, lse, dq, dk, dv, dsink)
    of the loss sum(out * dout), and the row max of the scaled visible scores."""
    from tests.helpers.cp_grid import cu
    from tests.reference import reference_attn
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in inputs[:3])
    s = sink.clone().requires_grad_()
    c = cu(DOCS)
    out, lse, row_max = reference_attn(q, k, v, c, c, causal=mask.causal,
                                       window_size=mask.window_size,
                                       chunk_size=mask.chunk_size, dtype=dtype,
                                       softmax_type="learnable", sink=s, return_row_max=True)
    (out * inputs[3].to(dtype)).sum().backward()
    return (out.detach(), lse, q.grad, k.grad, v.grad, s.grad), row_max.amax(1)


def extras_worker(rank, world, backend):
    """A learnable sink (its LSE gradient: "fa4" takes it, "flash" plans the layer on our
    kernels) and the max logit (no FA output: our kernels for both), bf16 vs fp64."""
    from tests.helpers.cp_grid import small_plan
    from tests.reference import assert_close_to_reference
    from varlen_cp.attention import cp_varlen_attn
    _install(backend)
    for i, (strategy, layout, mname) in enumerate(EXTRAS_CASES):
        mask = MASKS[mname]
        hq, hkv = HEADS[world][i % 2]
        inputs = global_inputs(DOCS, hq, hkv, 400 + i, d=32, dv=32)
        sink = torch.randn(hq, generator=torch.Generator().manual_seed(i))
        ref64, max64 = _extras_reference(inputs, sink, mask, torch.float64)
        plain, _ = _extras_reference(inputs, sink, mask, torch.bfloat16)
        plan = small_plan(DOCS, world, rank, layout, mask)
        q, k, v = (plan.shard(t.to(torch.bfloat16)).requires_grad_() for t in inputs[:3])
        s = sink.clone().requires_grad_()
        options = AttnOptions(strategy=strategy, backend=backend)
        out = cp_varlen_attn(q, k, v, plan, mask, None, options, softmax_type="learnable",
                             sink=s)
        out.backward(plan.shard(inputs[3].to(torch.bfloat16)))
        dsink = s.grad.clone()
        torch.distributed.all_reduce(dsink)
        got = (plan.unshard(out.detach().float()), None, plan.unshard(q.grad.float()),
               plan.unshard(k.grad.float()), plan.unshard(v.grad.float()), dsink)
        what = f"[sink {strategy} {backend} {layout} {mname}]"
        for name, g, r, p in zip((*NAMES, "dsink"), got, ref64, plain):
            if g is not None:
                assert_close_to_reference(f"{what} {name}", g, r, p, factor=3, floor=6e-3)
        on_fa = [c.flash is not None for c in plan_calls(plan)]
        assert all(on_fa) if backend == "fa4" else not any(on_fa), (what, on_fa)
        # the max logit: not an output of FlashAttention, so our kernels run the layer
        plan = small_plan(DOCS, world, rank, layout, mask)
        out, max_logit = cp_varlen_attn(plan.shard(inputs[0].to(torch.bfloat16)),
                                        plan.shard(inputs[1].to(torch.bfloat16)),
                                        plan.shard(inputs[2].to(torch.bfloat16)), plan, mask,
                                        None, options, return_max_logit=True)
        assert torch.allclose(max_logit.double(), max64.double(), atol=0.05, rtol=0.02), what
        assert not any(c.flash is not None for c in plan_calls(plan)), what
    return len(EXTRAS_CASES)


@pytest.mark.parametrize("backend", fast_first(["flash", "fa4"]))
def test_sinks_and_max_logit_on_flash_backends(backend, tmp_path):
    n = len(EXTRAS_CASES)
    assert run_distributed(extras_worker, 2, tmp_path, backend, timeout_s=400) == [n, n]


# ------------------------------------------------------------------ single device
@pytest.fixture
def stand_ins():
    """``_install`` in this (the pytest) process, undone afterwards: other tests see torch's
    flash ops without a CPU kernel and no flash_attn module, as before."""
    from tests import fa4_standin, flash_emulator
    from varlen_cp.kernels import flash
    registered = flash_emulator.is_registered()
    yield _install
    fa4_standin.uninstall()
    flash.fa4_interface.cache_clear()
    if not registered:
        flash_emulator.unregister()


@pytest.mark.parametrize("backend", ["flash", "fa4"])
@pytest.mark.parametrize("mname", fast_first(["causal", "full", "swa", "swa2"]))
def test_single_device_op_runs_flash_attention(backend, mname, monkeypatch, one_thread,
                                               stand_ins):
    """``varlen_attn(backend=...)`` without positions or chunks is FlashAttention's own
    call: it runs there, forward and backward (a loss on the LSE too: "fa4" takes its
    gradient, "flash" hands that backward to our kernels), against fp64."""
    from tests.helpers.cp_grid import cu
    from tests.reference import assert_close_to_reference, reference_attn
    from varlen_cp.kernels import flash, varlen_attn
    stand_ins(backend)
    calls = []
    real = flash.flash_fwd
    monkeypatch.setattr(flash, "flash_fwd",
                        lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    mask = MASKS[mname]
    inputs = global_inputs(DOCS, 4, 2, 7, d=32, dv=32)
    c = cu(DOCS)
    w = torch.randn(4, sum(DOCS), generator=torch.Generator().manual_seed(1))

    def run(fn, in_dtype, **kw):
        q, k, v = (t.to(in_dtype).clone().requires_grad_() for t in inputs[:3])
        out, lse = fn(q, k, v, c, c, causal=mask.causal, window_size=mask.window_size, **kw)
        finite = torch.isfinite(lse)
        loss = (out * inputs[3].to(in_dtype)).sum() + (torch.where(finite, lse, 0) * w).sum()
        loss.backward()
        return out.detach(), lse.detach(), q.grad, k.grad, v.grad

    got = run(lambda q, k, v, cq, ck, **kw: varlen_attn(q, k, v, cq, ck, max(DOCS), max(DOCS),
                                                        **kw),
              torch.bfloat16, return_lse=True, backend=backend)
    ref64 = run(reference_attn, torch.float64, dtype=torch.float64)
    plain = run(reference_attn, torch.bfloat16, dtype=torch.bfloat16)
    for name, g, r, p in zip(NAMES, got, ref64, plain):
        assert_close_to_reference(f"[{backend} {mname}] {name}", g, r, p, factor=3, floor=4e-3)
    assert calls == [backend]
