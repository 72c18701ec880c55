"""Dense reference attention, written directly from the mask table in docs/design.md.

Deliberately independent of the library: it loops over segments, builds the full score
matrix in the requested dtype, and evaluates the mask with explicit comparisons (it does not
use kernels.mask_math). Used by every kernel and CP test as the ground truth (in fp64) and
as "plain PyTorch in the same dtype" for the tolerance rule.
"""

from __future__ import annotations

import torch


def _segment_positions(n_q: int, n_k: int, q_pos, k_pos, device):
    """Explicit positions, or flash-attn's bottom-right alignment when absent."""
    qp = torch.arange(n_q, device=device) + (n_k - n_q) if q_pos is None else q_pos.long()
    kp = torch.arange(n_k, device=device) if k_pos is None else k_pos.long()
    return qp, kp


def reference_mask(qp, kp, *, causal, window_size=(-1, -1), chunk_size=None,
                   q_padding=True, k_padding=True):
    """Boolean [Lq, Lk]: which keys each query sees, straight from the mask table."""
    p = qp[:, None]
    k = kp[None, :]
    m = torch.ones(p.shape[0], k.shape[1], dtype=torch.bool, device=qp.device)
    if causal:
        m &= k <= p
    left, right = window_size
    if left >= 0:
        m &= k >= p - left
    if right >= 0:
        m &= k <= p + right
    if chunk_size:
        m &= torch.div(k, chunk_size, rounding_mode="floor") == torch.div(
            p, chunk_size, rounding_mode="floor")
    if q_padding:
        m &= p >= 0
    if k_padding:
        m &= k >= 0
    return m


def _reference_sink(softmax_type, sink, hq, dtype, device):
    """The sink logit per head as [Hq, 1, 1] in ``dtype``, or None for vanilla softmax."""
    if softmax_type == "vanilla":
        return None
    if softmax_type == "off-by-one":
        return torch.zeros(hq, 1, 1, dtype=dtype, device=device)
    return sink.to(dtype).view(hq, 1, 1)


def reference_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                   window_size=(-1, -1), chunk_size=None, q_positions=None, k_positions=None,
                   dtype=torch.float64, softmax_type="vanilla", sink=None,
                   return_row_max=False):
    """Dense varlen attention in ``dtype``. Returns (out [Tq, Hq, Dv], lse fp32 [Hq, Tq]).

    A sink ("off-by-one": logit 0, "learnable": ``sink`` [Hq]) is one more column of the
    score matrix, visible to every row, whose probability is dropped (no value): written
    that way, not via the logaddexp rescale the library uses. ``return_row_max`` adds the
    row max of the scaled visible scores [Hq, Tq] (-inf on empty rows; sink excluded).
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    hq, hkv = q.shape[1], k.shape[1]
    sink_col = _reference_sink(softmax_type, sink, hq, dtype, q.device)
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    if sink_col is not None:
        # Rows of empty segments have only the sink: lse = t (and a sink gradient).
        lse = sink_col.float().view(hq, 1).expand(hq, q.shape[0]).clone()
    row_max = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32,
                         device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        qp, kp = _segment_positions(
            q1 - q0, k1 - k0,
            None if q_positions is None else q_positions[q0:q1],
            None if k_positions is None else k_positions[k0:k1], q.device)
        mask = reference_mask(qp, kp, causal=causal, window_size=window_size,
                              chunk_size=chunk_size, q_padding=q_positions is not None,
                              k_padding=k_positions is not None)
        qs = q[q0:q1].to(dtype).transpose(0, 1)                       # [Hq, Lq, D]
        ks = k[k0:k1].to(dtype).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vs = v[k0:k1].to(dtype).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        if k1 > k0:  # amax refuses an empty key axis; such rows keep -inf
            row_max[:, q0:q1] = scores.detach().amax(dim=-1).float()
        if sink_col is not None:
            scores = torch.cat([scores, sink_col.expand(hq, q1 - q0, 1)], dim=-1)
        seg_lse = torch.logsumexp(scores, dim=-1)                      # -inf on empty rows
        probs = torch.exp(scores - seg_lse.nan_to_num(neginf=0.0)[..., None])
        if sink_col is not None:
            probs = probs[..., :-1]
        probs = probs.masked_fill(~mask, 0.0)
        out[q0:q1] = (probs @ vs).transpose(0, 1)
        lse[:, q0:q1] = seg_lse.float()
    return (out, lse, row_max) if return_row_max else (out, lse)


def tolerance(ref64: torch.Tensor, plain: torch.Tensor, factor: float, floor: float) -> float:
    """flash-attn's rule: allowed error = factor x (plain PyTorch's error) + floor."""
    return factor * (plain.double() - ref64.double()).abs().max().item() + floor


def assert_close_to_reference(name: str, got, ref64, plain, *, factor: float, floor: float):
    """Assert ``got`` is within ``factor`` x plain PyTorch's error of the fp64 reference."""
    err = (got.double() - ref64.double()).abs().max().item() if got.numel() else 0.0
    tol = tolerance(ref64, plain, factor, floor) if got.numel() else 0.0
    assert err <= tol, f"{name}: max error {err:.3e} > allowed {tol:.3e}"
    assert not torch.isnan(got).any(), f"{name}: NaN"
