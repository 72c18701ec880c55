"""Softmax extras of the single-device op: max logit and attention sinks, both backends.

Checks out, lse (with the sink), the max logit and the gradients of q, k, v and the sink
against the dense fp64 reference (tests/reference.py, where a sink is an extra score
column), with docs/design.md's tolerance rule; a loss on the LSE checks the kernels' dlse path.
Triton runs under the interpreter on CPUs, so shapes stay tiny (one 32-row tile per side).
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import assert_close_to_reference, reference_attn
from tests.helpers.lanes import fast_first, slow
from varlen_cp.kernels import varlen_attn, varlen_attn_bwd, varlen_attn_fwd
from varlen_cp.kernels.sink import apply_softmax_sink, check_softmax_args, max_logit_of

BACKENDS = ["torch", "triton"]
NEG_INF = float("-inf")

# name: mask keyword arguments (explicit positions are added per case where noted)
MASKS = {
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=False, window_size=(3, 2)),
    "chunk": dict(causal=True, chunk_size=4),
    "causal_window": dict(causal=True, window_size=(2, -1)),
}


def _batch(lens_q=(5, 0, 9, 3), lens_k=(7, 2, 9, 0), hq=4, hkv=2, d=16, dv=16,
           dtype=torch.float32, seed=0):
    """A packed batch: a longer key segment, an empty query segment, keys-less queries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hkv, dv, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def _sink(softmax_type: str, hq: int, device="cpu") -> torch.Tensor | None:
    if softmax_type != "learnable":
        return None
    return torch.tensor([0.5, -1.0, 2.0, 0.0][:hq] + [0.3] * max(0, hq - 4), device=device)


def _lse_weights(tq: int, hq: int, device="cpu") -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, hq * tq, device=device).view(hq, tq)


def _loss(out, lse, dout, w):
    """Uses out and lse, so dlse reaches the kernels; -inf LSE rows are left out."""
    return (out.float() * dout).sum() + torch.where(torch.isfinite(lse), lse * w, 0.0).sum()


def _run_ours(leaves, sink, batch, mask, backend, softmax_type, dout, w):
    _, _, _, cu_q, cu_k, mq, mk = batch
    s = None if sink is None else sink.clone().requires_grad_()
    out, lse, ml = varlen_attn(*leaves, cu_q, cu_k, mq, mk, return_lse=True,
                               return_max_logit=True, backend=backend,
                               softmax_type=softmax_type, sink=s, **mask)
    wrt = leaves + ([] if s is None else [s])
    return out, lse, ml, torch.autograd.grad(_loss(out, lse, dout, w), wrt)


def _run_ref(batch, sink, mask, softmax_type, dout, w, dtype):
    q, k, v, cu_q, cu_k, _, _ = batch
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    s = None if sink is None else sink.to(dtype).requires_grad_()
    out, lse, row_max = reference_attn(*leaves, cu_q, cu_k, dtype=dtype,
                                       softmax_type=softmax_type, sink=s, return_row_max=True,
                                       **mask)
    wrt = leaves + ([] if s is None else [s])
    grads = torch.autograd.grad(_loss(out, lse, dout.to(dtype), w), wrt)
    ml = row_max.amax(dim=1) if row_max.shape[1] else row_max.new_full((q.shape[1],), NEG_INF)
    return out, lse, ml, grads


def _compare(batch, mask, backend, softmax_type, *, floor=1e-5):
    q, k, v = batch[:3]
    sink = _sink(softmax_type, q.shape[1], q.device)
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2],
                       generator=torch.Generator().manual_seed(3)).to(q.device)
    w = _lse_weights(q.shape[0], q.shape[1], q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, ml, grads = _run_ours(leaves, sink, batch, mask, backend, softmax_type, dout, w)
    o64, l64, m64, g64 = _run_ref(batch, sink, mask, softmax_type, dout, w, torch.float64)
    # "Plain PyTorch in the inputs' dtype" sets the tolerance (fp16 inputs: an fp16 reference).
    o32, l32, m32, g32 = _run_ref(batch, sink, mask, softmax_type, dout, w, q.dtype)
    assert_close_to_reference("out", out, o64, o32, factor=2, floor=floor)
    finite = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
    assert_close_to_reference("lse", lse[finite], l64[finite], l32[finite], factor=2, floor=floor)
    assert ml.dtype == torch.float32 and ml.shape == (q.shape[1],)
    assert torch.equal(torch.isfinite(ml), torch.isfinite(m64)), (ml, m64)
    ok = torch.isfinite(m64)
    assert_close_to_reference("max_logit", ml[ok], m64[ok], m32[ok], factor=2, floor=floor)
    names = ["dq", "dk", "dv", "dsink"]
    for name, got, r64, r32 in zip(names, grads, g64, g32):
        assert_close_to_reference(name, got, r64, r32, factor=3, floor=floor * 10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", fast_first(list(MASKS)))
def test_learnable_sink_every_mask(backend, mask):
    _compare(_batch(), MASKS[mask], backend, "learnable")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
def test_other_softmax_types(backend, softmax_type):
    _compare(_batch(), MASKS["causal"], backend, softmax_type)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_positions_with_padding(backend):
    """Padding rows see nothing: out 0, lse = the sink, zero grads; the max skips them."""
    batch = _batch(lens_q=(8, 6), lens_k=(8, 6), hq=2, hkv=1)
    qpos = torch.tensor([0, 1, -1, 3, 4, 5, 6, 7, -1, -1, -1, -1, -1, -1], dtype=torch.int32)
    kpos = torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5], dtype=torch.int32)
    mask = dict(causal=True, q_positions=qpos, k_positions=kpos)
    _compare(batch, mask, backend, "learnable")
    q, k, v, cu_q, cu_k, mq, mk = batch
    sink = torch.tensor([0.25, -0.5], requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, ml = varlen_attn(*leaves, cu_q, cu_k, mq, mk, return_lse=True,
                               return_max_logit=True, backend=backend, softmax_type="learnable",
                               sink=sink, **mask)
    (out.sum() + lse.sum()).backward()
    dead = torch.tensor([0, 2] + list(range(8, 14)))   # row 0 sees only a padded key
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.equal(lse[:, dead], sink.detach()[:, None].expand(-1, dead.numel()))
    assert torch.equal(leaves[0].grad[dead], torch.zeros_like(leaves[0].grad[dead]))
    for t in (*leaves, sink):
        assert torch.isfinite(t.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (interpreter bf16 is wrong)")
@pytest.mark.parametrize("mask", ["causal", "chunk", "window"])
def test_bf16_cuda(mask):
    q, k, v, *meta = _batch(lens_q=(70, 130), lens_k=(90, 130), hq=8, hkv=2, d=64, dv=64,
                            dtype=torch.bfloat16)
    _compare((q.cuda(), k.cuda(), v.cuda(), *meta), MASKS[mask], "triton", "learnable",
             floor=1e-2)


def test_fp16_triton_small():
    batch = _batch(lens_q=(9, 20), lens_k=(12, 20), dtype=torch.float16)
    _compare(batch, MASKS["causal"], "triton", "learnable", floor=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_on_lse_only(backend):
    """out unused by the loss: its gradient is None and the kernels run on dlse alone."""
    q, k, v, cu_q, cu_k, mq, mk = batch = _batch()
    w = _lse_weights(q.shape[0], q.shape[1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _, lse = varlen_attn(*leaves, cu_q, cu_k, mq, mk, causal=True, return_lse=True,
                         backend=backend)
    grads = torch.autograd.grad(torch.where(torch.isfinite(lse), lse * w, 0.0).sum(), leaves)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in batch[:3]]
        _, r_lse = reference_attn(*ref_leaves, cu_q, cu_k, dtype=dtype, causal=True)
        loss = torch.where(torch.isfinite(r_lse), r_lse * w, 0.0).sum()
        refs[dtype] = torch.autograd.grad(loss, ref_leaves, allow_unused=True)
    for name, got, r64, r32 in zip("qkv", grads, refs[torch.float64], refs[torch.float32]):
        r64 = torch.zeros_like(got, dtype=torch.float64) if r64 is None else r64
        r32 = torch.zeros_like(got) if r32 is None else r32
        assert_close_to_reference(f"d{name}", got, r64, r32, factor=3, floor=1e-5)
    assert torch.equal(grads[2], torch.zeros_like(grads[2]))  # lse does not depend on v


@pytest.mark.parametrize("backend", BACKENDS)
def test_fwd_bwd_halves_row_max_and_dlse(backend):
    """varlen_attn_fwd's row max and varlen_attn_bwd's dlse vs the reference's autograd."""
    q, k, v, cu_q, cu_k, mq, mk = batch = _batch()
    mask = MASKS["window"]
    out, lse, row_max = varlen_attn_fwd(q, k, v, cu_q, cu_k, mq, mk, backend=backend,
                                        return_max_logit=True, **mask)
    _, _, rm64 = reference_attn(q, k, v, cu_q, cu_k, return_row_max=True, **mask)
    assert row_max.shape == lse.shape and row_max.dtype == torch.float32
    assert torch.equal(torch.isfinite(row_max), torch.isfinite(rm64))
    ok = torch.isfinite(rm64)
    torch.testing.assert_close(row_max[ok], rm64[ok], atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    dlse = _lse_weights(q.shape[0], q.shape[1]).contiguous()
    dq, dk, dv = varlen_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, backend=backend,
                                 dlse=dlse, **mask)
    leaves = [t.detach().double().requires_grad_() for t in batch[:3]]
    r_out, r_lse = reference_attn(*leaves, cu_q, cu_k, **mask)
    loss = (r_out * dout.double()).sum() + torch.where(torch.isfinite(r_lse), r_lse * dlse,
                                                       0.0).sum()
    for name, got, ref in zip("qkv", (dq, dk, dv), torch.autograd.grad(loss, leaves)):
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4, msg=f"d{name}")


def test_nonfinite_dlse_on_empty_rows_gives_no_nan():
    """A NaN dlse where lse = -inf (e.g. logaddexp(-inf, -inf) upstream) must not leak."""
    q, k, v, cu_q, cu_k, mq, mk = _batch()
    out, lse = varlen_attn_fwd(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    dlse = torch.where(torch.isfinite(lse), 0.0, float("nan"))
    for backend in BACKENDS:
        for g in varlen_attn_bwd(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, mq, mk,
                                 causal=True, backend=backend, dlse=dlse):
            assert torch.isfinite(g).all()


def test_nothing_visible_gives_neg_inf_max_and_sink_lse():
    q, k, v, cu_q, cu_k, mq, mk = _batch(lens_q=(4,), lens_k=(4,))
    kpos = torch.full((4,), -1, dtype=torch.int32)
    sink = torch.zeros(4, requires_grad=True)
    out, lse, ml = varlen_attn(q, k, v, cu_q, cu_k, mq, mk, k_positions=kpos, return_lse=True,
                               return_max_logit=True, softmax_type="learnable", sink=sink)
    assert torch.isneginf(ml).all() and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.zeros_like(lse))
    lse.sum().backward()
    assert torch.equal(sink.grad, torch.full((4,), 4.0))  # d lse_s / d t = 1 on every row
    assert torch.isneginf(max_logit_of(torch.empty(3, 0))).all()


def test_apply_softmax_sink_matches_extra_column():
    """Direct check of the rescale identity against an explicit softmax with a sink column."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)    # [H, T, keys]
    vals = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0.3, -2.0, 1.5], dtype=torch.float64)
    out = (scores.softmax(-1) @ vals).transpose(0, 1)                   # [T, H, Dv]
    lse = scores.logsumexp(-1)
    out_s, lse_s = apply_softmax_sink(out, lse.float(), "learnable", t.float())
    full = torch.cat([scores, t[:, None, None].expand(3, 6, 1)], -1)
    want = (full.softmax(-1)[..., :-1] @ vals).transpose(0, 1)
    torch.testing.assert_close(out_s, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_s.double(), full.logsumexp(-1), atol=1e-6, rtol=1e-6)
    out_v, lse_v = apply_softmax_sink(out, lse.float(), "vanilla", None)
    assert out_v is out


@pytest.mark.parametrize("softmax_type, sink, match", [
    ("softmax1", None, "softmax_type"),
    ("learnable", None, "sink=None"),
    ("learnable", torch.zeros(3), r"sink must be fp32 of shape \[n_heads\] = \(4,\)"),
    ("learnable", torch.zeros(4, dtype=torch.float64), "sink must be fp32"),
    ("learnable", torch.zeros(1, 4), "sink must be fp32"),
    ("learnable", [0.0] * 4, "sink must be a torch.Tensor"),
    ("vanilla", torch.zeros(4), "sink is only used"),
    ("off-by-one", torch.zeros(4), "sink is only used"),
])
def test_bad_softmax_args_raise(softmax_type, sink, match):
    q, k, v, cu_q, cu_k, mq, mk = _batch()
    with pytest.raises(ValueError, match=match):
        varlen_attn(q, k, v, cu_q, cu_k, mq, mk, softmax_type=softmax_type, sink=sink)
    with pytest.raises(ValueError, match=match):
        check_softmax_args(softmax_type, sink, 4)


def test_bad_dlse_raises():
    q, k, v, cu_q, cu_k, mq, mk = _batch()
    out, lse = varlen_attn_fwd(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    for bad in (lse.t().contiguous(), lse.double(), lse[:, :-1]):
        with pytest.raises(ValueError, match="dlse"):
            varlen_attn_bwd(out, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=True, dlse=bad)


def test_torch_compile_fullgraph_with_sink_and_max_logit():
    q, k, v, cu_q, cu_k, mq, mk = _batch()

    def f(q, k, v, sink):
        out, lse, ml = varlen_attn(q, k, v, cu_q, cu_k, mq, mk, causal=True, return_lse=True,
                                   return_max_logit=True, softmax_type="learnable", sink=sink)
        return out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), ml

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, v, _sink("learnable", 4))]

    got_leaves, ref_leaves = leaves(), leaves()
    loss, ml = torch.compile(f, fullgraph=True, backend="aot_eager")(*got_leaves)
    loss.backward()
    ref_loss, ref_ml = f(*ref_leaves)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(ml, ref_ml)
    for a, b in zip(got_leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)
