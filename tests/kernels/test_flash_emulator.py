"""The FlashAttention emulators (tests/flash_emulator.py: torch's FA2 aten ops;
tests/fa4_standin.py: flash-attn-4's interface) against a dense fp64 reference written
here from the segment rule, plus the call conventions they rely on."""

import ast
import importlib
import importlib.metadata
import inspect
import pathlib
import sys

import pytest
import torch

from tests import fa4_standin as fa4
from tests import flash_emulator as fe

from tests.flash_cases import (  # noqa: F401  (registered: a fixture)
    D, DTYPES, DV, FA2_WINDOWS, FA4_WINDOWS, HEADS, INF, K_LENS, Q_LENS, SCALE, TOL, close,
    covered, fa2_bwd, fa2_fwd, inputs, layout, ref_attention, ref_mask, registered)


# --------------------------------------------------------------------- FA2 (aten ops)
@pytest.mark.parametrize("op, expected, n_pos", [
    ("_flash_attention_forward", fe.FORWARD_ARGS, fe.FORWARD_POSITIONAL),
    ("_flash_attention_backward", fe.BACKWARD_ARGS, fe.BACKWARD_POSITIONAL)])
def test_schema_matches_call_convention(op, expected, n_pos):
    args = getattr(torch.ops.aten, op).default._schema.arguments
    positional = [a.name for a in args if not a.kwarg_only]
    keyword = [a for a in args if a.kwarg_only]
    assert positional == list(expected[:n_pos])
    assert [a.name for a in keyword[:len(expected) - n_pos]] == list(expected[n_pos:])
    assert all(a.has_default_value() for a in keyword)  # the rest may be left out


def test_register_reaches_the_emulator(registered):
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU")
    with pytest.raises(RuntimeError, match="flash emulator: only varlen"):
        _call(cum_seq_q=None, cum_seq_k=None)  # the message is the emulator's own
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q, k, v, _ = inputs(torch.bfloat16, 4, 2, 4, 4)
    via_op = fa2_fwd(q, k, v, cu, cu, 4, 4, False, 2, None)
    direct = fe.flash_forward(q, k, v, cu, cu, 4, 4, 0.0, False, False, scale=SCALE,
                              window_size_left=2)
    assert all(torch.equal(a, b) for a, b in zip(via_op, direct))


@pytest.mark.parametrize("window", FA2_WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fa2_forward_and_backward_match_reference(registered, dtype, heads, window):
    dtype, (hq, hkv) = DTYPES[dtype], HEADS[heads]
    causal, wl, wr, (left, right) = FA2_WINDOWS[window]
    cu_q, cu_k, tq, tk = layout(Q_LENS, K_LENS)
    q, k, v, dout = inputs(dtype, hq, hkv, tq, tk)
    mq, mk = max(Q_LENS), max(K_LENS)
    out, lse, *_ = fa2_fwd(q, k, v, cu_q, cu_k, mq, mk, causal, wl, wr)

    mask = ref_mask(cu_q, cu_k, tq, tk, left, right)
    ref_out, ref_lse, (dq_r, dk_r, dv_r) = ref_attention(q, k, v, mask, SCALE, dout)
    cov, cov_k, seen = covered(cu_q, tq), covered(cu_k, tk), mask.any(1)
    blind = cov & ~seen
    assert (~cov).any() and blind.any() and (~cov_k).any()  # the checks below bite
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, tq)
    assert out[~cov].isnan().all() and lse[:, ~cov].isnan().all()
    assert (lse[:, blind] == INF).all() and (out[blind] == 0).all()  # FA2: +inf, not -inf
    torch.testing.assert_close(lse[:, seen].double(), ref_lse[:, seen], atol=1e-5, rtol=1e-5)
    close(out[cov], ref_out[cov], dtype)

    # backward from the reference's own out / lse (+inf on rows that see nothing)
    lse_in = ref_lse.float().masked_fill(~seen, INF)
    dq, dk, dv = fa2_bwd(dout, q, k, v, ref_out.to(dtype), lse_in, cu_q, cu_k, mq, mk,
                         causal, wl, wr)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    assert dq[~cov].isnan().all() and dk[~cov_k].isnan().all() and dv[~cov_k].isnan().all()
    unseen_k = cov_k & ~mask.any(0)
    assert unseen_k.any() and (dk[unseen_k] == 0).all() and (dv[unseen_k] == 0).all()
    assert (dq[blind] == 0).all()
    for ours, ref, rows in ((dq, dq_r, cov), (dk, dk_r, cov_k), (dv, dv_r, cov_k)):
        close(ours[rows], ref[rows], dtype)


def test_window_edge_admits_w_plus_one_keys(registered):
    # q = 0: every visible score is 0, so the LSE is log(number of visible keys)
    n, w = 12, 3
    cu = torch.tensor([0, n], dtype=torch.int32)
    _, k, v, _ = inputs(torch.bfloat16, 2, 2, n, n)
    q = torch.zeros(n, 2, D, dtype=torch.bfloat16)
    want = torch.log(torch.tensor([min(i, w) + 1.0 for i in range(n)])).expand(2, n)
    _, lse, *_ = fa2_fwd(q, k, v, cu, cu, n, n, False, w, 0)
    torch.testing.assert_close(lse, want)
    _, lse4, *_ = fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      window_size_left=w, window_size_right=0, return_lse=True)
    torch.testing.assert_close(lse4, want)


def test_fa2_backward_reads_minus_inf_lse_as_zero(registered):
    # flash_bwd_kernel.h -> softmax.h scale_apply_exp2: max == -inf is replaced by 0
    cu_q, cu_k, tq, tk = layout([3, 4], [0, 5], (0, 0), (0, 0))
    q, k, v, dout = inputs(torch.float16, 2, 2, tq, tk)
    out, lse, *_ = fa2_fwd(q, k, v, cu_q, cu_k, 4, 5, False, None, None)
    assert (lse[:, :3] == INF).all()
    ref = fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 4, 5, False, None, None)
    minus = fa2_bwd(dout, q, k, v, out, lse.masked_fill(lse == INF, -INF), cu_q, cu_k, 4, 5,
                    False, None, None)
    for a, b in zip(ref, minus):  # rows that see nothing: P = 0 either way, no NaN
        assert torch.equal(a, b)
    zero = lse.clone()
    zero[:, 3] = 0.0
    as_zero = fa2_bwd(dout, q, k, v, out, zero, cu_q, cu_k, 4, 5, False, None, None)
    lse[:, 3] = -INF
    as_minus_inf = fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 4, 5, False, None, None)
    for a, b in zip(as_zero, as_minus_inf):
        assert torch.equal(a, b) and not a.isnan().any()


def test_fa2_overlapping_key_ranges_later_segment_wins(registered):
    # cum_seq_k = [0, 4, 2, 6]: segment 1 is empty, segments 0 and 2 share keys 2 and 3
    cu_q = torch.tensor([0, 4, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 2, 6], dtype=torch.int32)
    q, k, v, dout = inputs(torch.float16, 2, 2, 8, 6)
    out, lse, *_ = fa2_fwd(q, k, v, cu_q, cu_k, 4, 4, False, None, None)
    _, dk, _ = fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 4, 4, False, None, None)
    last = ref_mask(cu_q[2:], cu_k[2:], 8, 6, None, None)
    both = last | ref_mask(cu_q[:2], cu_k[:2], 8, 6, None, None)
    dk_last = ref_attention(q, k, v, last, SCALE, dout)[2][1]
    dk_sum = ref_attention(q, k, v, both, SCALE, dout)[2][1]
    close(dk[2:6], dk_last[2:6], torch.float16)
    assert not torch.allclose(dk[2:4].double(), dk_sum[2:4], atol=1e-2)


def test_fa2_max_q_one_gqa_needs_one_row_per_segment(registered):
    # flash_api.cpp seqlenq_ngroups_swapped: max_q == 1, Hq > Hkv, no window
    cu_k = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    q, k, v, _ = inputs(torch.bfloat16, 4, 2, 3, 10)
    cu_q = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    out, lse, *_ = fa2_fwd(q, k, v, cu_q, cu_k, 1, 5, True, None, None)
    ref_out, ref_lse = ref_attention(q, k, v, ref_mask(cu_q, cu_k, 3, 10, None, None), SCALE)
    close(out, ref_out, torch.bfloat16)
    q2 = torch.cat([q, q[:1]])
    with pytest.raises(RuntimeError, match="one query row per segment"):
        fa2_fwd(q2, k, v, torch.tensor([0, 1, 1, 2], dtype=torch.int32), cu_k, 1, 5,
                False, None, None)
    fa2_fwd(q2, k, v, torch.tensor([0, 1, 1, 2], dtype=torch.int32), cu_k, 1, 5,
            False, 2, None)  # a window: no swap, fine


def test_fa2_max_k_zero_and_max_q_zero(registered):
    cu_q, cu_k, tq, tk = layout([3, 2], [0, 0])
    q, k, v, dout = inputs(torch.bfloat16, 2, 2, tq, tk)
    out, lse, *_ = fa2_fwd(q, k, v, cu_q, cu_k, 3, 0, False, None, None)
    assert (out == 0).all() and (lse == INF).all()  # every row, even uncovered ones
    cu_q, cu_k, tq, tk = layout([0, 0], [3, 2])
    q, k, v, dout = inputs(torch.bfloat16, 2, 2, tq, tk)
    dq, dk, dv = fa2_bwd(dout, q, k, v, dout, torch.zeros(2, tq), cu_q, cu_k, 0, 3,
                         False, None, None)
    assert dq.isnan().all() and (dk == 0).all() and (dv == 0).all()


def _call(**over):
    """A valid varlen forward call (4 rows, GQA 4:2) with ``over`` replacing arguments."""
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q, k, v, _ = inputs(torch.bfloat16, 4, 2, 4, 4)
    a = dict(query=q, key=k, value=v, cum_seq_q=cu, cum_seq_k=cu, max_q=4, max_k=4,
             dropout_p=0.0, is_causal=False, return_debug_mask=False)
    a.update(over)
    pos = [a.pop(n) for n in fe.FORWARD_ARGS[:fe.FORWARD_POSITIONAL]]
    with torch.no_grad():
        return torch.ops.aten._flash_attention_forward(*pos, **a)


def _qkv(dim, dtype=torch.bfloat16, hq=4):
    return dict(query=torch.zeros(4, hq, dim, dtype=dtype),
                key=torch.zeros(4, 2, dim, dtype=dtype), value=torch.zeros(4, 2, dim, dtype=dtype))


BAD_CALLS = {
    "fp32": _qkv(16, torch.float32), "head dim 12": _qkv(12), "head dim 264": _qkv(264),
    "heads 3:2": _qkv(16, hq=3), "v head dim": dict(value=torch.zeros(4, 2, 24).bfloat16()),
    "int64 cu": dict(cum_seq_q=torch.tensor([0, 4])), "dropout": dict(dropout_p=0.1),
    "dense": dict(cum_seq_q=None, cum_seq_k=None),
    "seqused_k": dict(seqused_k=torch.tensor([4], dtype=torch.int32)),
    "alibi": dict(alibi_slopes=torch.ones(4)),
    "block_table": dict(block_table=torch.zeros(1, 1, dtype=torch.int32)),
    "max_q too small": dict(max_q=3),
    "cu out of bounds": dict(cum_seq_k=torch.tensor([0, 5], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_fa2_rejects_what_fa_rejects(registered, case):
    _call()  # the unchanged call is fine
    with pytest.raises(RuntimeError):
        _call(**BAD_CALLS[case])


# --------------------------------------------------------------------- FA4 stand-in
@pytest.mark.parametrize("window", FA4_WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fa4_forward_and_backward_match_reference(dtype, heads, window):
    dtype, (hq, hkv) = DTYPES[dtype], HEADS[heads]
    causal, wl, wr, (left, right) = FA4_WINDOWS[window]
    cu_q, cu_k, tq, tk = layout(Q_LENS, K_LENS)
    q, k, v, dout = inputs(dtype, hq, hkv, tq, tk, dv=DV, seed=1)
    win = dict(causal=causal, window_size_left=wl, window_size_right=wr)
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(Q_LENS),
                max_seqlen_k=max(K_LENS))
    res = fa4._flash_attn_fwd(q, k, v, softmax_scale=SCALE, return_lse=True, **lens, **win)
    assert len(res) == 5 and res[2:] == (None, None, None)
    out, lse = res[:2]

    mask = ref_mask(cu_q, cu_k, tq, tk, left, right)
    dlse = torch.randn(hq, tq, generator=torch.Generator().manual_seed(2))
    ref_out, ref_lse, (dq_r, dk_r, dv_r) = ref_attention(q, k, v, mask, SCALE, dout, dlse)
    cov, cov_k, seen = covered(cu_q, tq), covered(cu_k, tk), mask.any(1)
    blind = cov & ~seen
    assert (~cov).any() and blind.any()
    assert out.dtype == dtype and out.shape == (tq, hq, DV) and lse.shape == (hq, tq)
    assert out[~cov].isnan().all() and lse[:, ~cov].isnan().all()
    assert (lse[:, blind] == -INF).all() and (out[blind] == 0).all()  # FA4: -inf
    torch.testing.assert_close(lse[:, seen].double(), ref_lse[:, seen], atol=1e-5, rtol=1e-5)
    close(out[cov], ref_out[cov], dtype)

    dq, dk, dv = fa4._flash_attn_bwd(q, k, v, ref_out.to(dtype), dout, ref_lse.float(), SCALE,
                                     causal, window_size_left=wl, window_size_right=wr,
                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS),
                                     dlse=dlse)
    assert dq[~cov].isnan().all() and dk[~cov_k].isnan().all() and dv[~cov_k].isnan().all()
    unseen_k = cov_k & ~mask.any(0)
    assert (dq[blind] == 0).all() and (dk[unseen_k] == 0).all() and (dv[unseen_k] == 0).all()
    for ours, ref, rows in ((dq, dq_r, cov), (dk, dk_r, cov_k), (dv, dv_r, cov_k)):
        close(ours[rows], ref[rows], dtype)
    assert fa4.CALLS[-1][0] == "_flash_attn_bwd"
    assert fa4.CALLS[-2] == ("_flash_attn_fwd", {**fa4.CALLS[-2][1], **win, "return_lse": True})
    assert not any(isinstance(x, torch.Tensor) for x in fa4.CALLS[-1][1].values())


def test_fa4_no_lse_unless_asked_and_empty_keys():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q, k, v, _ = inputs(torch.bfloat16, 2, 2, 3, 3)
    assert fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)[1] is None
    none = torch.zeros(2, dtype=torch.int32)
    out, lse, *_ = fa4._flash_attn_fwd(q, k[:0], v[:0], cu_seqlens_q=cu, cu_seqlens_k=none,
                                       return_lse=True)
    assert (out == 0).all() and (lse == -INF).all()


@pytest.mark.parametrize("bad", [
    dict(page_table=torch.zeros(1, 1, dtype=torch.int32)), dict(softcap=1.0),
    dict(num_splits=2), dict(score_mod=lambda *a: a[0]), dict(cu_seqlens_q=None),
    dict(learnable_sink=torch.zeros(2))])
def test_fa4_unsupported_arguments_raise(bad):
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q, k, v, _ = inputs(torch.bfloat16, 2, 2, 3, 3)
    fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)  # fine without ``bad``
    with pytest.raises(NotImplementedError):
        fa4._flash_attn_fwd(q, k, v, **{"cu_seqlens_q": cu, "cu_seqlens_k": cu, **bad})


def test_fa4_install_and_uninstall():
    names = ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")
    before = {n: sys.modules.get(n) for n in names}
    if not fa4.install():
        pytest.skip("a real flash_attn.cute.interface is importable")
    try:
        assert fa4.install()  # idempotent
        iface = importlib.import_module("flash_attn.cute.interface")
        assert iface._flash_attn_fwd is fa4._flash_attn_fwd
        assert iface._flash_attn_bwd is fa4._flash_attn_bwd
        assert importlib.import_module("flash_attn").__version__ == "4.0.0b36"
    finally:
        fa4.uninstall()
    assert {n: sys.modules.get(n) for n in names} == before


def test_fa4_signatures_match_the_real_interface():
    try:  # read, never imported: the real package needs CUDA libraries
        dist = importlib.metadata.distribution("flash-attn-4")
        path = pathlib.Path(dist.locate_file("flash_attn/cute/interface.py"))
    except importlib.metadata.PackageNotFoundError:
        path = pathlib.Path("/tmp/fa4/pkg/flash_attn/cute/interface.py")
    if not path.is_file():
        pytest.skip("neither an installed flash-attn-4 nor /tmp/fa4/pkg to read")
    funcs = {n.name: n for n in ast.parse(path.read_text()).body
             if isinstance(n, ast.FunctionDef)}
    for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
        a = funcs[name].args
        assert not (a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg)
        names = [x.arg for x in a.args]
        defaults = [inspect.Parameter.empty] * (len(names) - len(a.defaults)) + [
            ast.literal_eval(d) for d in a.defaults]
        ours = inspect.signature(getattr(fa4, name)).parameters.values()
        assert [(p.name, p.default, p.kind) for p in ours] == [
            (n, d, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n, d in zip(names, defaults)]
