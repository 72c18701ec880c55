"""The public op: argument validation, autograd through the custom op, torch.compile."""

import pytest
import torch

from tests.reference import assert_close_to_reference, reference_attn
from varlen_cp.kernels import varlen_attn, varlen_attn_bwd, varlen_attn_fwd


def _batch(lens_q=(5, 0, 9), lens_k=None, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32,
           seed=0):
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, dv or d, generator=g, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def _call(**over):
    q, k, v, cu_q, cu_k, mq, mk = _batch()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                max_seqlen_k=mk)
    args.update(over)
    return varlen_attn(**args)


q0, k0, v0, cu0, _, _, _ = _batch()


@pytest.mark.parametrize("over, match", [
    (dict(cu_seqlens_q=torch.tensor([0, 9, 5, 14], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 14], dtype=torch.int32)), "same length"),
    (dict(cu_seqlens_q=torch.tensor([1, 5, 5, 14], dtype=torch.int32)), r"cu_seqlens_q\[0\]"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 5, 13], dtype=torch.int32)), "does not match"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 5, 14.0])), "int32 or int64"),
    (dict(max_seqlen_q=4), "max_seqlen_q=4"),
    (dict(max_seqlen_k=-1), "max_seqlen_k"),
    (dict(k=k0[:, :1].expand(-1, 3, -1).contiguous(), v=v0[:, :1].expand(-1, 3, -1)), "multiple"),
    (dict(k=k0.double()), "dtype"),
    (dict(q=q0.long()), "q.dtype"),
    (dict(q=q0[..., :8]), "head dims differ"),
    (dict(v=v0[:3]), "k and v disagree"),
    (dict(q=q0[0]), "3-D"),
    (dict(q_positions=torch.arange(13, dtype=torch.int32)), "q_positions has 13"),
    (dict(k_positions=torch.arange(14.0)), "k_positions.dtype"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=3), "window_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_raises_value_error_naming_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_bad_backward_inputs_raise():
    q, k, v, cu_q, cu_k, mq, mk = _batch()
    out, lse = varlen_attn_fwd(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    with pytest.raises(ValueError, match="lse must be fp32"):
        varlen_attn_bwd(out, q, k, v, out, lse.t(), cu_q, cu_k, mq, mk, causal=True)
    with pytest.raises(ValueError, match="dout"):
        varlen_attn_bwd(out[:-1], q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=True)


BACKENDS = ["torch", "triton"]
CASES = [
    dict(causal=True),
    dict(causal=False, window_size=(3, 2)),
    dict(causal=True, chunk_size=4),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_op_matches_reference(backend, case):
    """Forward, LSE and all three gradients of the custom op vs the fp64 reference."""
    q, k, v, cu_q, cu_k, mq, mk = _batch(lens_q=(5, 0, 9), lens_k=(7, 3, 9))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attn(*leaves, cu_q, cu_k, mq, mk, return_lse=True, backend=backend,
                           **case)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r_out, r_lse = reference_attn(*ref_leaves, cu_q, cu_k, dtype=dtype, **case)
        refs[dtype] = (r_out, r_lse, torch.autograd.grad(r_out, ref_leaves, dout.to(dtype)))
    (o64, l64, g64), (o32, l32, g32) = refs[torch.float64], refs[torch.float32]
    assert_close_to_reference("out", out, o64, o32, factor=2, floor=1e-5)
    finite = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close_to_reference("lse", lse[finite], l64[finite], l32[finite], factor=2, floor=1e-5)
    for name, got, r64, r32 in zip("qkv", grads, g64, g32):
        assert_close_to_reference(f"d{name}", got, r64, r32, factor=3, floor=1e-5)


def test_padding_and_empty_rows_give_zero_and_no_nan():
    q, k, v, cu_q, cu_k, mq, mk = _batch(lens_q=(6,), lens_k=(6,))
    qpos = torch.tensor([0, 1, -1, 3, 4, 5], dtype=torch.int32)
    kpos = torch.tensor([-1, -1, -1, 3, 4, 5], dtype=torch.int32)  # rows 0, 1 see nothing
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attn(*leaves, cu_q, cu_k, mq, mk, causal=True, q_positions=qpos,
                           k_positions=kpos, return_lse=True)
    out.sum().backward()
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.isneginf(lse[:, :3]).all() and torch.isfinite(lse[:, 3:]).all()
    for t in leaves:
        assert not torch.isnan(t.grad).any()
    assert torch.equal(leaves[0].grad[:3], torch.zeros_like(leaves[0].grad[:3]))
    assert torch.equal(leaves[1].grad[:3], torch.zeros_like(leaves[1].grad[:3]))


def test_torch_compile_fullgraph_traces_the_op():
    """The op is a registered custom op with a fake impl: no graph break under compile."""
    q, k, v, cu_q, cu_k, mq, mk = _batch()

    def f(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, mq, mk, causal=True).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*leaves)
    loss.backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = f(*ref_leaves)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)
