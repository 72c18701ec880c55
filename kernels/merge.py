"""Merge of partial attention results by their log-sum-exp (LSE).

Attention over a key set split in parts A and B equals the LSE-weighted sum of the parts:
lse = log(e^lse_A + e^lse_B), out = e^(lse_A - lse) out_A + e^(lse_B - lse) out_B.
Every CP strategy folds its per-step results with this. A part that saw no key (lse = -inf)
contributes nothing, and two empty parts stay empty (out 0, lse -inf), never NaN.
"""

from __future__ import annotations

import torch


def _weights(lse: torch.Tensor, lse_i: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new lse [H, T], weight of the accumulator, weight of the part) [T, H, 1], fp32."""
    new_lse = torch.logaddexp(lse, lse_i)
    # Where both parts are empty new_lse is -inf; subtract 0 instead so the weights are
    # exp(-inf) = 0 rather than exp(nan).
    base = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    return (new_lse, torch.exp(lse - base).t().unsqueeze(-1),
            torch.exp(lse_i - base).t().unsqueeze(-1))


def _check_shapes(out, lse, out_i, lse_i, name: str) -> None:
    if out.shape != out_i.shape or lse.shape != lse_i.shape:
        raise ValueError(f"{name}: shapes differ: out {tuple(out.shape)} vs "
                         f"out_i {tuple(out_i.shape)}, lse {tuple(lse.shape)} vs "
                         f"lse_i {tuple(lse_i.shape)}")


def merge_attn_partials(
    out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the partial result ``(out_i, lse_i)`` into the accumulator ``(out, lse)``.

    out, out_i: [T, H, Dv]; lse, lse_i: fp32 [H, T]. Returns new tensors (out in ``out``'s
    dtype: keep the accumulator in fp32 across many steps). The math runs in fp32.
    """
    _check_shapes(out, lse, out_i, lse_i, "merge_attn_partials")
    new_lse, w, w_i = _weights(lse, lse_i)
    merged = out.float() * w + out_i.float() * w_i
    return merged.to(out.dtype), new_lse


def merge_attn_partials_(
    out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_attn_partials` into the accumulator itself: ``out`` is updated in place
    when it is fp32 (else replaced by an fp32 copy, once), with [H, T] temporaries only,
    where the out-of-place merge allocates out-sized fp32 ones. Returns (out fp32, lse).
    For CP steps that fold many partials into one accumulator (ring steps, staged keys)."""
    _check_shapes(out, lse, out_i, lse_i, "merge_attn_partials_")
    new_lse, w, w_i = _weights(lse, lse_i)
    out = out.mul_(w) if out.dtype == torch.float32 else out * w   # (* w promotes to fp32)
    return out.addcmul_(out_i, w_i), new_lse
