"""torch's real flash ops on a GPU against the CPU emulator the other tests route through
(tests/flash_emulator.py): the emulator is only worth its tests if FlashAttention on CUDA
does what it does. Same inputs on both, compared on every row FA writes (rows outside every
segment are ``empty_like`` garbage on CUDA, NaN in the emulator): bottom-right alignment
for sq != sk, the window edge (W + 1 keys), rows that see nothing (out 0, LSE +inf), the
backward reading an LSE of -inf as 0, empty key sets, GQA. Then one CP rank's FA-form calls
(the replay, bench/cp_replay.py) on the real ops against the same calls on our Triton
kernels. CUDA only (the ``cuda`` marker: ``bash bench/gpu.sh`` runs them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.flash_cases import (  # noqa: F401  (registered: a fixture)
    FA2_WINDOWS, HEADS, INF, K_LENS, Q_LENS, SCALE, covered, fa2_fwd, inputs, layout, ref_mask,
    registered)

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
D = 64   # FA2 on CUDA: q, k and v of one head dim, a multiple of 8
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cuda(*ts):
    return [t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in ts]


def fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, wl, wr):
    """The aten backward as kernels/flash.py calls it (its unused RNG state on q's device)."""
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    with torch.no_grad():
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng,
            torch.empty(0, device=q.device), scale=SCALE, window_size_left=wl,
            window_size_right=wr)


def _close(real: torch.Tensor, emu: torch.Tensor, dtype: torch.dtype) -> None:
    real, emu = real.cpu().double(), emu.double()
    scale = max(1.0, emu.abs().max().item())
    torch.testing.assert_close(real, emu, atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize("window", FA2_WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_fa2_matches_emulator(registered, dtype, heads, window):
    dtype, (hq, hkv) = DTYPES[dtype], HEADS[heads]
    causal, wl, wr, (left, right) = FA2_WINDOWS[window]
    cu_q, cu_k, tq, tk = layout(Q_LENS, K_LENS)
    q, k, v, dout = inputs(dtype, hq, hkv, tq, tk, dv=D)
    q, k = (torch.nn.functional.pad(t, (0, D - t.shape[-1])) for t in (q, k))
    mq, mk = max(Q_LENS), max(K_LENS)
    args = (cu_q, cu_k, mq, mk, causal, wl, wr)
    out_e, lse_e, *_ = fa2_fwd(q, k, v, *args)
    out_r, lse_r, *_ = fa2_fwd(*_cuda(q, k, v, *args))
    cov, cov_k = covered(cu_q, tq), covered(cu_k, tk)
    seen = ref_mask(cu_q, cu_k, tq, tk, left, right).any(1)
    blind = cov & ~seen
    assert blind.any()
    lse_r, out_r = lse_r.cpu(), out_r.cpu()
    assert (lse_r[:, blind] == INF).all() and (out_r[blind] == 0).all()
    torch.testing.assert_close(lse_r[:, seen], lse_e[:, seen], atol=2e-3, rtol=1e-3)
    _close(out_r[cov], out_e[cov], dtype)
    # backward from the emulator's out / LSE (+inf on blind rows), on both
    dq_e, dk_e, dv_e = fa2_bwd(dout, q, k, v, out_e, lse_e, *args)
    dq_r, dk_r, dv_r = fa2_bwd(*_cuda(dout, q, k, v, out_e, lse_e, *args))
    for real, emu, rows in ((dq_r, dq_e, cov), (dk_r, dk_e, cov_k), (dv_r, dv_e, cov_k)):
        _close(real.cpu()[rows], emu[rows], dtype)


def test_real_fa2_window_edge_and_minus_inf_lse(registered):
    n, w = 40, 7
    cu = torch.tensor([0, n], dtype=torch.int32, device=CUDA)
    _, k, v, _ = (t.to(CUDA) for t in inputs(torch.bfloat16, 2, 2, n, n, dv=D))
    k = torch.nn.functional.pad(k, (0, D - k.shape[-1]))
    q = torch.zeros(n, 2, D, dtype=torch.bfloat16, device=CUDA)
    _, lse, *_ = fa2_fwd(q, k, v, cu, cu, n, n, False, w, 0)
    want = torch.log(torch.tensor([min(i, w) + 1.0 for i in range(n)])).expand(2, n)
    torch.testing.assert_close(lse.cpu(), want)   # (W, 0) admits W + 1 keys
    # the backward reads an LSE of -inf as 0 (softmax.h), as the emulator does
    cu_q, cu_k, tq, tk = layout([3, 4], [0, 5], (0, 0), (0, 0))
    q, k, v, dout = inputs(torch.float16, 2, 2, tq, tk, dv=D)
    q, k = (torch.nn.functional.pad(t, (0, D - t.shape[-1])) for t in (q, k))
    out, lse, *_ = fa2_fwd(*_cuda(q, k, v, cu_q, cu_k, 4, 5, False, None, None))
    zero, minus = lse.clone(), lse.clone()
    zero[:, 3], minus[:, 3] = 0.0, -INF
    as_zero = fa2_bwd(*_cuda(dout, q, k, v), out, zero, *_cuda(cu_q, cu_k), 4, 5, False,
                      None, None)
    as_minus = fa2_bwd(*_cuda(dout, q, k, v), out, minus, *_cuda(cu_q, cu_k), 4, 5, False,
                       None, None)
    emu = fa2_bwd(dout, q, k, v, out.cpu(), minus.cpu(), cu_q, cu_k, 4, 5, False, None, None)
    for a, b, e in zip(as_zero, as_minus, emu):
        assert torch.equal(a, b) and not a.isnan().any()
        _close(b, e, torch.float16)


def test_real_fa2_empty_keys(registered):
    cu_q, cu_k, tq, tk = layout([3, 2], [0, 0])
    q, k, v, _ = inputs(torch.bfloat16, 2, 2, tq, tk, dv=D)
    q, k = (torch.nn.functional.pad(t, (0, D - t.shape[-1])) for t in (q, k))
    out, lse, *_ = fa2_fwd(*_cuda(q, k, v, cu_q, cu_k, 3, 0, False, None, None))
    assert (out == 0).all() and (lse == INF).all()


def test_real_flash_replay_matches_triton():
    """One CP rank's calls (cp 8, 1000 documents per 128K tokens scaled down, causal, SWA
    and chunked) through the real flash ops and through our Triton kernels, same inputs:
    the same out, LSE and dq."""
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [p for p in (str(root / "bench"),) if p not in sys.path]
    import cp_replay
    import gpu_cases
    from gpu_timing import Budget

    shape = gpu_cases.make_shape(4, 2, 64, 64, torch.bfloat16)
    m = gpu_cases.masks(1 / 64)
    lengths = tuple(gpu_cases.lognormal_docs(64, 0, 8 * 1024))
    cases = [gpu_cases.ReplayCase(f"cp8_{s}_{n}", 8, "lognormal", lengths, n, m[n], s, lay)
             for s, lay in gpu_cases.REPLAY_STRATEGIES for n in ("causal", "swa4096",
                                                                  "chunk8192")]
    res = cp_replay.run_replays(cases, shape, CUDA, ("triton", "flash"),
                                Budget.of("replay", 300), dry_run=True, log=lambda s: None)
    assert all(r["status"] == "ok" for r in res), [r for r in res if r["status"] != "ok"]
    for r in res[1::2]:
        assert r["backend"] == "flash" and r["flash_work_share"] > 0, r["case"]
        diff = r["max_rel_diff_vs"]
        assert diff["lse_inf_agree"] and max(diff["out"], diff["dq"]) < 2e-2, (r["case"], diff)
