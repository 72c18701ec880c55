"""Attention over whole buffers by (document, position) per row: the static-shape kernel of
the graph-safe mode on CPUs.

A graph-safe call (``varlen_cp.strategies.static``) must issue the same device work for
every batch: no tile schedule, segment count or maximum length read from the batch. Here
every query row is scored against every key row of the call, and the pair counts when both
rows belong to the same document and the mask's interval (``mask_math.visible``) holds on
their positions; a row whose document is < 0 (padding, an unused capacity slot) sees
nothing and is seen by nothing. The shapes are the buffers' (capacity), so the ops, their
arguments and their sizes never change with the batch: the CPU stand-in of a capacity-grid
kernel. It computes Tq x Tk scores per head (quadratic in the capacity): meant for CPUs and
tests, where the shapes are small; a GPU runs the capacity-grid kernels instead.

Conventions are the kernels': fp32 math, LSE in natural log [Hq, Tq], a row that sees
nothing gives output 0, LSE -inf and zero gradients (never NaN); GQA by head groups (Hq =
g x Hkv, query head h reads key head h // g).
"""

from __future__ import annotations

import torch

from .mask_math import visible


def dense_visible(q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor,
                  k_pos: torch.Tensor, causal: bool, window_left: int, window_right: int,
                  chunk_size: int) -> torch.Tensor:
    """bool [Tq, Tk]: query row i sees key row j (same document >= 0, the mask on their
    positions)."""
    same = (q_doc.unsqueeze(1) == k_doc.unsqueeze(0)) & (q_doc >= 0).unsqueeze(1)
    return same & visible(q_pos, k_pos, causal, window_left, window_right, chunk_size)


def _live(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` with the rows that take part in no visible pair set to 0: padding rows
    may hold anything (NaN), and 0 x NaN in a product would reach the real rows."""
    return torch.where(rows.view(-1, *(1,) * (x.dim() - 1)), x.float(), 0.0)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, seen: torch.Tensor
            ) -> torch.Tensor:
    """fp32 [Hkv, g, Tq, Tk] scaled scores, -inf where not ``seen``."""
    q, k = _live(q, seen.any(1)), _live(k, seen.any(0))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(tq, hkv, hq // hkv, d)
    s = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale
    return s.masked_fill(~seen, float("-inf"))


def dense_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor,
              scale: float, need_max: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out fp32 [Tq, Hq, Dv], lse fp32 [Hq, Tq], row max fp32 [Hq, Tq] or None) of q over
    the rows of k, v with visibility ``seen`` [Tq, Tk] (:func:`dense_visible`)."""
    tq, hq, _ = q.shape
    s = _scores(q, k, scale, seen)                          # [Hkv, g, Tq, Tk]
    lse = torch.logsumexp(s, dim=-1)                        # -inf where nothing is seen
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("hgqk,khd->qhgd", p, _live(v, seen.any(0))).reshape(tq, hq, v.shape[2])
    row_max = s.amax(-1).reshape(hq, tq) if need_max else None
    return out, lse.reshape(hq, tq), row_max


def dense_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
              seen: torch.Tensor, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv) of :func:`dense_fwd` given the FINAL out and lse of the query rows
    (a partial call's keys get their share of the merged softmax: p = exp(s - lse))."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = _scores(q, k, scale, seen)
    q_live, k_live = seen.any(1), seen.any(0)
    q, k, v = _live(q, q_live), _live(k, k_live), _live(v, k_live)
    dout, out = _live(dout, q_live), _live(out, q_live)
    lse_g = lse.float().reshape(hkv, g, tq, 1)
    p = torch.exp(s - torch.where(torch.isinf(lse_g), 0.0, lse_g))   # 0 where unseen
    do = dout.float().reshape(tq, hkv, g, -1)
    dp = torch.einsum("qhgd,khd->hgqk", do, v.float())
    # delta = rowsum(dout * out) (- dlse: the LSE's own gradient enters with a minus)
    delta = (do * out.float().reshape(tq, hkv, g, -1)).sum(-1).permute(1, 2, 0)
    if dlse is not None:
        delta = delta - dlse.float().reshape(hkv, g, tq)
    delta = torch.where(q_live.view(1, 1, tq), delta, 0.0)   # (a padding row's dlse: NaN)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("hgqk,khd->qhgd", ds, k.float()).reshape(tq, hq, d)
    dk = torch.einsum("hgqk,qhgd->khd", ds, q.float().reshape(tq, hkv, g, d))
    dv = torch.einsum("hgqk,qhgd->khd", p, do)
    return dq, dk, dv
