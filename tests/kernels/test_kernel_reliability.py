"""Kernel reliability: non-finite padding, overestimated max_seqlen, argument holes, the
validated-once entries for CP strategies, and the kernels' import structure (issues 15, 16).
"""

import ast
import math
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.lanes import fast_first, slow
from varlen_cp import kernels as K
from varlen_cp.kernels import api as kernel_api
from varlen_cp.kernels import (
    block_sizes_for, build_block_schedule, varlen_attn, varlen_attn_bwd, varlen_attn_fwd,
)

KERNELS_DIR = Path(K.__file__).resolve().parent


# ------------------------------------------------------------- non-finite padding rows
def _padded_batch(dtype, fill, seed=0):
    """Two documents with explicit positions; rows at position -1 are padding (in the middle
    of a document and at its end, as a CP shard or the te layout leaves them). Padding rows
    of q, k, v, dout and dlse hold ``fill`` (0 for the baseline)."""
    g = torch.Generator().manual_seed(seed)
    lens = (40, 30)
    pos = torch.cat([torch.arange(40), torch.arange(30)])
    pad = torch.zeros(70, dtype=torch.bool)
    pad[35:40] = True          # the end of document 0
    pad[50:53] = True          # inside document 1 (positions stay sorted around it)
    pos = torch.where(pad, -1, pos)
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    q = torch.randn(70, 4, 16, generator=g).to(dtype)
    k = torch.randn(70, 2, 16, generator=g).to(dtype)
    v = torch.randn(70, 2, 16, generator=g).to(dtype)
    dout = torch.randn(70, 4, 16, generator=g).to(dtype)
    dlse = torch.randn(4, 70, generator=g)
    for t in (q, k, v, dout):
        t[pad] = fill
    dlse[:, pad] = fill
    return q, k, v, dout, dlse, cu, max(lens), pos.to(torch.int32), pad


def _attn_with_grads(backend, q, k, v, dout, dlse, cu, max_len, pos):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True,
                           window_size=(20, -1), q_positions=pos, k_positions=pos,
                           return_lse=True, backend=backend)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    return out.detach(), lse.detach(), dq, dk, dv


def _assert_same_as_zero_padding(got, want, pad):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want):
        if name == "lse":
            a, b = a.t(), b.t()
        assert not torch.isnan(a).any(), f"{name} has NaN"
        if name != "lse":
            assert torch.isfinite(a).all(), f"{name} is not finite"
        assert torch.equal(a[~pad], b[~pad]), f"{name}: real rows differ from zero padding"
        if name in ("dq", "dk", "dv", "out"):
            assert (a[pad] == 0).all(), f"{name} of padding rows is not 0"


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", fast_first(["torch", "triton"]))
def test_nonfinite_padding_rows_do_not_reach_real_rows(backend, dtype, fill):
    *tensors, pad = _padded_batch(dtype, fill)
    *zeros, _ = _padded_batch(dtype, 0.0)
    got = _attn_with_grads(backend, *tensors)
    want = _attn_with_grads(backend, *zeros)
    _assert_same_as_zero_padding(got, want, pad)


@pytest.mark.parametrize("fill", fast_first([float("nan"), float("-inf")]))
def test_nonfinite_padding_triton_scan_mode(fill):
    """Explicit positions without a schedule: the kernels scan every tile (the CUDA path
    when positions live on the device), reached here through the unchecked entries."""
    q, k, v, dout, dlse, cu, max_len, pos, pad = _padded_batch(torch.float32, fill)
    zq, zk, zv, zdout, zdlse, *_ = _padded_batch(torch.float32, 0.0)

    def run(q, k, v, dout, dlse):
        args = (cu, cu, max_len, max_len, 0.25, True, 20, -1, 0, pos, pos, "triton", None)
        out, lse, _ = kernel_api.varlen_fwd_unchecked(q, k, v, *args, False)
        grads = kernel_api.varlen_bwd_unchecked(dout, q, k, v, out, lse, dlse, *args)
        return (out, lse, *grads)

    _assert_same_as_zero_padding(run(q, k, v, dout, dlse), run(zq, zk, zv, zdout, zdlse), pad)


# ------------------------------------------------------------ overestimated max_seqlen
def _small_call(n=14):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, n], dtype=torch.int32)
    return q, k, v, cu


def _fwd_bwd(backend, q, k, v, cu, max_len, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True, return_lse=True,
                           backend=backend, **kw)
    out.sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def test_huge_max_seqlen_costs_nothing_on_the_torch_backend():
    """flash-attn callers pass max_seqlen as a bound: 10**9 for 14 tokens took 6-13 s and
    ~2 GB of host tables before; the exact value takes milliseconds."""
    q, k, v, cu = _small_call()
    want = _fwd_bwd("torch", q, k, v, cu, 9)
    t0 = time.perf_counter()
    got = _fwd_bwd("torch", q, k, v, cu, 10**9)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"max_seqlen=10**9 took {elapsed:.2f} s"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class _GridSpy:
    """Stands in for a @triton.jit kernel: records each launch grid and refuses huge ones
    (the interpreter would run every one of their programs)."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        assert math.prod(grid) <= 10_000, f"launch grid {tuple(grid)} sized by a bound"
        return self.kernel[grid]


@pytest.mark.parametrize("explicit", [False, True])
def test_huge_max_seqlen_does_not_size_the_triton_grid(monkeypatch, explicit):
    from varlen_cp.kernels import triton_bwd, triton_fwd

    grids = []
    monkeypatch.setattr(triton_fwd, "_fwd_kernel", _GridSpy(triton_fwd._fwd_kernel, grids))
    for name in ("_dq_kernel", "_dkdv_kernel"):
        monkeypatch.setattr(triton_bwd, name, _GridSpy(getattr(triton_bwd, name), grids))
    q, k, v, cu = _small_call()
    pos = torch.cat([torch.arange(5), torch.arange(9)]) if explicit else None
    kw = dict(q_positions=pos, k_positions=pos)
    want = _fwd_bwd("triton", q, k, v, cu, 9, **kw)
    got = _fwd_bwd("triton", q, k, v, cu, 10**9, **kw)
    assert len(grids) == 6
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_huge_max_seqlen_many_documents_fwd_bwd_halves():
    """The non-autograd halves (what CP strategies call) take the same shortcut."""
    n = 1000
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(n, 1, 16, generator=g) for _ in range(4))
    cu = torch.arange(n + 1, dtype=torch.int32)
    want = varlen_attn_fwd(q, k, v, cu, cu, 1, 1, causal=True, backend="torch")
    t0 = time.perf_counter()
    got = varlen_attn_fwd(q, k, v, cu, cu, 10**6, 10**6, causal=True, backend="torch")
    grads = varlen_attn_bwd(dout, q, k, v, *got, cu, cu, 10**6, 10**6, causal=True,
                            backend="torch")
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"1000 documents with max_seqlen=10**6 took {elapsed:.2f} s"
    want_grads = varlen_attn_bwd(dout, q, k, v, *want, cu, cu, 1, 1, causal=True,
                                 backend="torch")
    for a, b in zip((*got, *grads), (*want, *want_grads)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------- small holes
@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_softmax_scale_must_be_finite_positive(scale):
    q, k, v, cu = _small_call()
    with pytest.raises(ValueError, match="softmax_scale"):
        varlen_attn(q, k, v, cu, cu, 9, 9, softmax_scale=scale)


@pytest.mark.parametrize("name", ["q_positions", "k_positions"])
@pytest.mark.parametrize("value", [2**31, 2**31 + 5, -2**31 - 1, -2**40, 2**30])
def test_positions_outside_kernel_range_are_rejected(name, value):
    q, k, v, cu = _small_call()
    pos = torch.cat([torch.arange(5), torch.arange(9)]).to(torch.int64)
    bad = pos.clone()
    bad[3] = value
    kw = {"q_positions": pos, "k_positions": pos, name: bad}
    with pytest.raises(ValueError, match=name):
        varlen_attn(q, k, v, cu, cu, 9, 9, causal=True, **kw)


def test_large_in_range_positions_still_accepted():
    q, k, v, cu = _small_call()
    pos = (torch.cat([torch.arange(5), torch.arange(9)]) + (2**30 - 100)).to(torch.int64)
    pos[0] = -2**31  # padding, however negative, is fine
    varlen_attn(q, k, v, cu, cu, 9, 9, causal=True, q_positions=pos, k_positions=pos)


# ------------------------------------------------------- validated-once private entries
def _unchecked_case(backend, explicit, seed=5):
    g = torch.Generator().manual_seed(seed)
    lens = (37, 0, 20)
    cu = torch.tensor([0, 37, 37, 57], dtype=torch.int32)
    q = torch.randn(57, 4, 16, generator=g)
    k = torch.randn(57, 2, 16, generator=g)
    v = torch.randn(57, 2, 8, generator=g)
    dout = torch.randn(57, 4, 8, generator=g)
    dlse = torch.randn(4, 57, generator=g)
    pos = None
    if explicit:
        pos = torch.cat([torch.arange(37), torch.arange(20)]).to(torch.int32)
        pos[10] = -1
    bm, bn = block_sizes_for(backend, "cpu", 16, 8)
    sched = build_block_schedule(cu, cu, max(lens), max(lens), causal=True, window_left=9,
                                 window_right=-1, chunk_size=16, q_positions=pos,
                                 k_positions=pos, block_m=bm, block_n=bn)
    return q, k, v, dout, dlse, cu, max(lens), pos, sched


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("backend", fast_first(["torch", "triton"]))
def test_unchecked_entries_match_public_ones_bit_for_bit(backend, explicit):
    q, k, v, dout, dlse, cu, mx, pos, sched = _unchecked_case(backend, explicit)
    pub = varlen_attn_fwd(q, k, v, cu, cu, mx, mx, 0.3, True, (9, -1), chunk_size=16,
                          q_positions=pos, k_positions=pos, backend=backend, schedule=sched,
                          return_max_logit=True)
    args = (cu, cu, mx, mx, 0.3, True, 9, -1, 16, pos, pos, backend, sched)
    got = kernel_api.varlen_fwd_unchecked(q, k, v, *args, True)
    for a, b in zip(got, pub):
        assert torch.equal(a, b)
    out, lse, row_max = kernel_api.varlen_fwd_unchecked(q, k, v, *args, False)
    assert row_max is None and torch.equal(out, pub[0]) and torch.equal(lse, pub[1])
    pub_grads = varlen_attn_bwd(dout, q, k, v, out, lse, cu, cu, mx, mx, 0.3, True, (9, -1),
                                chunk_size=16, q_positions=pos, k_positions=pos,
                                backend=backend, schedule=sched, dlse=dlse)
    got_grads = kernel_api.varlen_bwd_unchecked(dout, q, k, v, out, lse, dlse, *args)
    for a, b in zip(got_grads, pub_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unchecked_entries_run_no_validation(monkeypatch, backend):
    from varlen_cp.kernels import validation

    q, k, v, dout, dlse, cu, mx, pos, sched = _unchecked_case(backend, True)

    def refuse(*_a, **_k):
        raise AssertionError("validation ran in an unchecked entry")

    for name in dir(validation):
        if name.startswith("check_"):
            monkeypatch.setattr(validation, name, refuse)
    for s in (sched, None):
        args = (cu, cu, mx, mx, 0.3, True, 9, -1, 16, pos, pos, backend, s)
        out, lse, _ = kernel_api.varlen_fwd_unchecked(q, k, v, *args, False)
        kernel_api.varlen_bwd_unchecked(dout, q, k, v, out, lse, dlse, *args)
        kernel_api.varlen_bwd_unchecked(dout, q, k, v, out, lse, None, *args)


def test_resolve_backend():
    assert kernel_api.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert kernel_api.resolve_backend("torch", "cpu") == "torch"
    assert kernel_api.resolve_backend("triton", "cpu") == "triton"  # the interpreter is on in tests
    with pytest.raises(ValueError, match="backend"):
        kernel_api.resolve_backend("cuda", "cpu")


def test_block_sizes_for_takes_the_dtype():
    """fp32 at padded head dim 256 uses 32x32 tiles: 64x32 needs 192-200 KB of shared
    memory in dQ / dK-dV (ptxas, sm80), more than an A100 has. 16-bit MLA keeps 64-key
    blocks (a 32-key block made its dK/dV fall back to mma.sync on sm90)."""
    assert block_sizes_for("triton", "cpu", 128, 128) == (64, 64)
    assert block_sizes_for("triton", "cpu", 192, 128) == (64, 64)
    assert block_sizes_for("triton", "cpu", 192, 128, dtype=torch.bfloat16) == (64, 64)
    assert block_sizes_for("triton", "cpu", 256, 256, dtype=torch.float32) == (32, 32)
    assert block_sizes_for("triton", "cpu", 128, 128, dtype=torch.float32) == (64, 64)
    assert block_sizes_for("torch", "cpu", 256, 256, dtype=torch.float32) == \
        block_sizes_for("torch", "cpu", 256, 256)


# --------------------------------------------------------------------- import structure
_KERNEL_MODULES = {"triton_fwd", "triton_bwd", "torch_attn"}
_SHARED_MODULES = {"triton_common", "sink", "schedule", "mask_math", "merge", "validation"}


def _sibling_imports() -> dict[str, set[str]]:
    graph = {}
    for path in KERNELS_DIR.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[path.stem] = deps
    return graph


def test_kernel_modules_import_no_sibling_kernel_module():
    graph = _sibling_imports()
    for mod in _KERNEL_MODULES:
        assert graph[mod] <= _SHARED_MODULES, f"{mod} imports {graph[mod] - _SHARED_MODULES}"
    for mod in _SHARED_MODULES:
        assert not graph[mod] & (_KERNEL_MODULES | {"api"}), f"{mod} imports upwards"

    def depth(mod, seen=()):
        assert mod not in seen, f"import cycle through {mod}"
        return 1 + max((depth(d, seen + (mod,)) for d in graph.get(mod, ())), default=0)

    assert depth("api") <= 4, "api -> kernel -> shared -> shared is the deepest chain"
