"""What the FlashAttention tests share (tests/kernels/test_flash_emulator.py on the CPU emulator and
the FA4 stand-in, tests/kernels/test_flash_real.py on a GPU's real flash ops): segment layouts with
every corner case, the windows as each library takes them, a dense fp64 reference written
from the segment rule, inputs, and the aten calls as varlen_cp makes them."""

import pytest
import torch

from tests import flash_emulator as fe

INF = float("inf")
D, DV = 16, 32
SCALE = 0.3
# segments: sq == sk, sq == 0, sk == 0, sq < sk, sq > sk, one row; plus rows no segment covers
Q_LENS = [13, 0, 9, 6, 17, 1]
K_LENS = [13, 5, 0, 15, 11, 4]
HEADS = {"gqa4:2": (4, 2), "mha": (2, 2)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1.5e-3, rtol=1.5e-3)}
# name: (is_causal, window_size_left, window_size_right) as passed, (left, right) of the rule
FA2_WINDOWS = {
    "full": (False, None, None, (None, None)), "causal": (True, None, None, (None, 0)),
    "W,0": (False, 3, 0, (3, 0)), "W,R": (False, 4, 2, (4, 2)),
    "-1,R": (False, -1, 3, (None, 3)), "causal+W": (True, 5, None, (5, 0)),
}
FA4_WINDOWS = {
    "full": (False, None, None, (None, None)), "causal": (True, None, None, (None, 0)),
    "W,0": (False, 3, 0, (3, 0)), "W,R": (False, 4, 2, (4, 2)),
    "None,R": (False, None, 3, (None, 3)), "-1,-1": (False, -1, -1, (None, None)),
    "lone -1 is literal": (False, -1, None, (-1, None)),  # FA4: hides the diagonal
}


# -------------------------------------------------------------------------- reference
def layout(q_lens, k_lens, lead=(2, 1), tail=(3, 2)):
    """int32 cu_seqlens with ``lead`` rows before and ``tail`` rows after the segments."""
    cu_q = torch.tensor([lead[0]] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([lead[1]] + k_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu_q, cu_k, int(cu_q[-1]) + tail[0], int(cu_k[-1]) + tail[1]


def ref_mask(cu_q, cu_k, total_q, total_k, left, right):
    """[total_q, total_k]: row i of a segment (sq rows, sk keys) sees key j iff 0 <= j < sk,
    j >= i + sk - sq - left and j <= i + sk - sq + right (None: that side unbounded)."""
    m = torch.zeros(total_q, total_k, dtype=torch.bool)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:]):
        sq, sk = q1 - q0, k1 - k0
        for i in range(sq):
            for j in range(sk):
                if left is not None and j < i + sk - sq - left:
                    continue
                if right is not None and j > i + sk - sq + right:
                    continue
                m[q0 + i, k0 + j] = True
    return m


def ref_attention(q, k, v, mask, scale, dout=None, dlse=None):
    """Dense fp64 masked softmax per head: (out, lse with -inf on rows that see nothing,
    and with ``dout`` the autograd (dq, dk, dv) of <out, dout> + <lse, dlse>)."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", qd, kd.repeat_interleave(group, 1)) * scale
    seen = mask.any(1)
    # rows that see nothing get a finite dummy row so that autograd stays NaN-free
    s = torch.where(seen[:, None], s.masked_fill(~mask, -INF), 0.0)
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask, torch.exp(s - lse[..., None]), 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vd.repeat_interleave(group, 1))
    lse_out = torch.where(seen, lse, -INF)
    if dout is None:
        return out.detach(), lse_out.detach()
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(seen, lse, 0.0) * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse_out.detach(), (qd.grad, kd.grad, vd.grad)


def covered(cu, total):
    """Bool [total]: the row lies inside some segment."""
    c = torch.zeros(total, dtype=torch.bool)
    b = cu.tolist()
    for a, z in zip(b, b[1:]):
        c[a:z] = True
    return c


def inputs(dtype, hq, hkv, total_q, total_k, dv=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    return rnd(total_q, hq, D), rnd(total_k, hkv, D), rnd(total_k, hkv, dv), rnd(total_q, hq, dv)


def close(actual, expected, dtype):
    """bf16 / fp16 outputs vs the fp64 reference: the emulator's fp32 math is exact to a few
    ulps of fp32, so the rounding to ``dtype`` is all that is left, relative to the scale."""
    tol = TOL[dtype]
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, atol=tol["atol"] * scale,
                               rtol=tol["rtol"])


@pytest.fixture(scope="module")
def registered():
    was = fe.is_registered()
    fe.register()
    fe.register()  # idempotent
    yield
    if not was:
        fe.unregister()


def fa2_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, wl, wr):
    with torch.no_grad():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=SCALE,
            window_size_left=wl, window_size_right=wr)


def fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, wl, wr):
    rng, unused = torch.zeros(2, dtype=torch.int64), torch.empty(0)
    with torch.no_grad():
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=SCALE, window_size_left=wl, window_size_right=wr)
