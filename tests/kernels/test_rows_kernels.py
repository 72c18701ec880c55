"""The graph-safe mode's kernels (``varlen_cp.kernels.rows``): the Triton row kernels (run by
Triton's interpreter here) and the dense torch kernel against a float64 reference written
from the mask table (``tests.reference.reference_mask``), for rows as the static strategies
hand them over: a side's rows sorted by (document, position) with padding rows inside and
unused slots after them, or several ranks' rows in any order; GQA, the LSE's gradient, the
row max; NaN in every padding row (it must reach no real row). Then the graph-safety of a
call: two batches of other documents written in place into the same buffers issue the
identical ops (the launches included: custom ops with every host argument) on the identical
storages, and re-running the first recording on the second batch's buffers gives the
second batch's results.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.replay import DeviceWork
from tests.reference import reference_mask
from varlen_cp.kernels.rows import RowsKernel

MASKS = {
    "causal": (True, -1, -1, 0),
    "swa": (True, 5, 0, 0),
    "window": (False, 3, 2, 0),
    "chunk": (True, -1, -1, 8),
    "full": (False, -1, -1, 0),
}
BLOCKS = (16, 16)   # small tiles: the interpreter's cost is per tile


def side_rows(lens, stretches, cap, *, pad_every=0, shuffle=False, seed=0):
    """int32 (doc, pos) of ``cap`` rows: for each document i the positions of
    ``stretches[i]`` (a list of (start, stop)), in (document, position) order, a padding row
    (-1) after every ``pad_every`` rows (the ``te`` layout's), unused slots at the end;
    ``shuffle``: the rows in a random order (several ranks' rows)."""
    doc, pos = [], []
    for i, spans in enumerate(stretches):
        for a, b in spans:
            for p in range(a, min(b, lens[i])):
                doc.append(i)
                pos.append(p)
                if pad_every and len(doc) % pad_every == 0:
                    doc.append(-1)
                    pos.append(-1)
    assert len(doc) <= cap
    doc += [-1] * (cap - len(doc))
    pos += [-1] * (cap - len(pos))
    d, p = torch.tensor(doc, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)
    if shuffle:
        order = torch.randperm(cap, generator=torch.Generator().manual_seed(seed))
        d, p = d[order], p[order]
    return d, p


def reference(q, k, v, dout, dlse, q_rows, k_rows, mask, scale):
    """float64 (out, lse, dq, dk, dv) over the real rows (the others: 0, -inf, 0)."""
    causal, wl, wr, chunk = mask
    (qd, qp), (kd, kp) = q_rows, k_rows
    seen = reference_mask(qp.long(), kp.long(), causal=causal, window_size=(wl, wr),
                          chunk_size=chunk or None)
    seen &= (qd[:, None] == kd[None, :]) & (qd >= 0)[:, None] & (kd >= 0)[None, :]
    live_q, live_k = (qd >= 0), (kd >= 0)
    q64, k64, v64 = (torch.where(live[:, None, None], t.double(), 0.0).requires_grad_()
                     for t, live in ((q, live_q), (k, live_k), (v, live_k)))
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q64, k64.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v64.repeat_interleave(g, 1))
    dout64 = torch.where(live_q[:, None, None], dout.double(), 0.0)
    dlse64 = torch.where(live_q[None, :] & torch.isfinite(lse), dlse.double(), 0.0)
    torch.autograd.backward((out, torch.where(torch.isinf(lse), 0.0, lse)), (dout64, dlse64))
    return (out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad)


def _case(mask_name, k_shuffled, hq=4, hkv=2, dtype=torch.float32, seed=0):
    lens = [40, 9, 23, 1, 30]
    # q: one rank's rows (two stretches of document 0, pieces of the others), te padding
    q_rows = side_rows(lens, [[(0, 10), (30, 40)], [(0, 9)], [(5, 23)], [(0, 1)], []], 96,
                       pad_every=13)
    # k: another rank's rows (or several ranks' rows, shuffled)
    k_rows = side_rows(lens, [[(0, 40)], [(2, 9)], [(0, 23)], [], [(0, 30)]], 112,
                       shuffle=k_shuffled, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(96, hq, 16, generator=g).to(dtype)
    k = torch.randn(112, hkv, 16, generator=g).to(dtype)
    v = torch.randn(112, hkv, 16, generator=g).to(dtype)
    dout = torch.randn(96, hq, 16, generator=g).to(dtype)
    dlse = torch.randn(hq, 96, generator=g)
    for t, rows in ((q, q_rows), (k, k_rows), (v, k_rows), (dout, q_rows)):
        t[rows[0] < 0] = float("nan")     # padding rows hold anything
    dlse[:, q_rows[0] < 0] = float("nan")
    return q, k, v, dout, dlse, q_rows, k_rows, MASKS[mask_name]


def _run(backend, q, k, v, dout, dlse, q_rows, k_rows, mask, scale, k_sorted):
    call = RowsKernel(mask, backend, BLOCKS).call(q, v, q_rows, k_rows, q_sorted=True,
                                                 k_sorted=k_sorted)
    out, lse, row_max = call.fwd(q, k, v, scale, True)
    dlse_seen = torch.where(torch.isinf(lse), 0.0, dlse)
    grads = call.bwd(dout, q, k, v, out, lse, dlse_seen, scale)
    return (out, lse) + tuple(grads), row_max


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_negative_positions_are_padding_on_both_backends(backend):
    """A row of a real document but a negative position is padding on both backends (it
    sees nothing, nothing sees it, NaN in it reaches no real row): the reference gets the
    same rows with document -1."""
    q, k, v, dout, dlse, q_rows, k_rows, mask = _case("swa", True, seed=3)
    q_rows = (q_rows[0], q_rows[1].clone())
    k_rows = (k_rows[0], k_rows[1].clone())
    for rows, picks, tensors in ((q_rows, (3, 20, 41), (q, dout)), (k_rows, (0, 7, 55), (k, v))):
        real = torch.nonzero(rows[0] >= 0).flatten()
        for i in real[list(picks)]:
            rows[1][i] = -5
            for t in tensors:
                t[i] = float("nan")
    for i in torch.nonzero(q_rows[1] < 0).flatten():
        dlse[:, i] = float("nan")
    got, _ = _run(backend, q, k, v, dout, dlse, q_rows, k_rows, mask, 0.25, False)
    as_padding = [(torch.where(p >= 0, d, -1), p) for d, p in (q_rows, k_rows)]
    want = reference(q, k, v, dout, dlse, *as_padding, mask, 0.25)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), name
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name
        assert (a.double()[finite] - b[finite]).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("k_shuffled", [False, True], ids=["k_sorted", "k_shuffled"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_kernels_match_the_reference(backend, mask_name, k_shuffled):
    q, k, v, dout, dlse, q_rows, k_rows, mask = _case(mask_name, k_shuffled)
    scale = 0.25
    got, row_max = _run(backend, q, k, v, dout, dlse, q_rows, k_rows, mask, scale,
                        not k_shuffled)
    want = reference(q, k, v, dout, dlse, q_rows, k_rows, mask, scale)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), f"{name}: NaN from the padding rows"
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: -inf rows differ"
        err = (a.double()[finite] - b[finite]).abs().max().item()
        assert err < 2e-4, f"{name}: max error {err:.2e}"
    # the row max: the largest scaled visible score of each row (-inf where none)
    qd, qp = q_rows
    kd, kp = k_rows
    seen = reference_mask(qp.long(), kp.long(), causal=mask[0], window_size=mask[1:3],
                          chunk_size=mask[3] or None) & (qd[:, None] == kd[None, :]) \
        & (qd >= 0)[:, None]
    s = torch.einsum("qhd,khd->hqk", torch.nan_to_num(q.double()),
                     torch.nan_to_num(k.double()).repeat_interleave(2, 1)) * scale
    want_max = s.masked_fill(~seen, float("-inf")).amax(-1)
    finite = torch.isfinite(want_max)
    assert torch.equal(torch.isfinite(row_max), finite)
    assert (row_max.double()[finite] - want_max[finite]).abs().max() < 1e-4


@pytest.mark.parametrize("dout_dtype", [torch.float16, torch.float32])
def test_triton_rows_fp16_and_equal_heads(dout_dtype):
    """fp16 inputs; dO in fp16 or fp32 (what Ulysses' exchange and a missing dout hand the
    backward)."""
    q, k, v, dout, dlse, q_rows, k_rows, mask = _case("causal", True, hq=2, hkv=2,
                                                      dtype=torch.float16, seed=3)
    dout = dout.to(dout_dtype)
    got, _ = _run("triton", q, k, v, dout, dlse, q_rows, k_rows, mask, 0.25, False)
    want = reference(q, k, v, dout, dlse, q_rows, k_rows, mask, 0.25)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        finite = torch.isfinite(b)
        err = (a.double()[finite] - b[finite]).abs().max().item()
        assert err < 2e-2, f"{name}: max error {err:.2e}"


def test_rows_kernel_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        RowsKernel(MASKS["causal"], "flash")


class _Buffers:
    """One call's inputs and tables at fixed sizes, allocated once."""

    def __init__(self, cap_q: int, cap_k: int) -> None:
        self.q = torch.zeros(cap_q, 4, 16)
        self.k = torch.zeros(cap_k, 2, 16)
        self.v = torch.zeros(cap_k, 2, 16)
        self.dout = torch.zeros(cap_q, 4, 16)
        self.dlse = torch.zeros(4, cap_q)
        self.q_rows = torch.zeros(2, cap_q, dtype=torch.int32)
        self.k_rows = torch.zeros(2, cap_k, dtype=torch.int32)

    def load(self, case) -> None:
        q, k, v, dout, dlse, q_rows, k_rows, _ = case
        for static, new in ((self.q, q), (self.k, k), (self.v, v), (self.dout, dout),
                            (self.dlse, dlse)):
            static.copy_(torch.nan_to_num(new))
        self.q_rows.copy_(torch.stack(q_rows))
        self.k_rows.copy_(torch.stack(k_rows))

    def all(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v, self.dout, self.dlse, self.q_rows, self.k_rows]

    def step(self, backend, mask):
        call = RowsKernel(mask, backend, BLOCKS).call(
            self.q, self.v, tuple(self.q_rows), tuple(self.k_rows), q_sorted=True,
            k_sorted=False)
        out, lse, _ = call.fwd(self.q, self.k, self.v, 0.25, False)
        return (out, lse) + tuple(call.bwd(self.dout, self.q, self.k, self.v, out, lse,
                                           self.dlse, 0.25))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_call_issues_the_same_work_for_another_batch(backend):
    """Batch B (other documents, other stretches) in place of batch A: the identical ops
    and launch arguments on the identical storages; A's recording replayed on B's
    buffers gives B's results."""
    mask = MASKS["chunk"]
    case_a = _case("chunk", True, seed=1)
    lens = [12, 50, 3, 41]
    q_rows = side_rows(lens, [[(0, 12)], [(20, 50)], [(0, 3)], [(0, 20), (30, 41)]], 96)
    k_rows = side_rows(lens, [[(0, 12)], [(0, 50)], [], [(0, 41)]], 112, shuffle=True,
                       seed=7)
    case_b = (case_a[0] * 0.5, case_a[1] + 0.1, case_a[2] - 0.2, case_a[3], case_a[4],
              q_rows, k_rows, mask)
    bufs = _Buffers(96, 112)
    recordings, results = [], []
    for case in (case_a, case_b):
        bufs.load(case)
        with DeviceWork(bufs.all()) as rec:
            res = bufs.step(backend, mask)
        recordings.append(rec)
        results.append(res)
    first, second = recordings
    assert first.signature() == second.signature()
    assert not first.externs()
    if backend == "triton":   # the launches are in the recording, with their arguments
        names = {name for name, _ in first.signature()}
        assert {"varlen_cp.rows_fwd.default", "varlen_cp.rows_bwd.default"} <= names
    outs = first.replay()
    for got, want in zip((first.replayed(outs, t) for t in results[0]), results[1]):
        assert torch.equal(got, want)
    assert not torch.equal(results[0][0], results[1][0])   # the batches differ
