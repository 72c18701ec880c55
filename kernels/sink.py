"""Softmax extras applied outside the kernels: attention sinks and the max logit.

A sink is one extra logit ``t_h`` per head that joins every row's softmax denominator but
has no value vector (gpt-oss's learnable sinks; "off-by-one" softmax is the fixed t = 0).
Given the (merged) attention result of a row, ``out`` and ``lse``, the sink only rescales:
``lse_s = logaddexp(lse, t)`` and ``out_s = out * exp(lse - lse_s)``. So the kernels never
see sinks: this is a differentiable composition of torch ops on (out, lse), applied ONCE
after all partial results of a context-parallel computation are merged. Its gradient flows
into ``lse``, which is why the attention ops' LSE output is differentiable.

The max logit (QK-clip / MuonClip) is the per-head max of the scaled, masked scores; the
kernels produce it per row (``row_max`` [Hq, Tq]) and ``max_logit_of`` reduces it.
``lse_grad_rows`` is the LSE-gradient term both backward kernels subtract from delta.
Limits: sinks are fp32 [Hq] tensors on the attention's device; nothing here syncs the host.
"""

from __future__ import annotations

from typing import Optional

import torch

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_args(softmax_type: str, sink: Optional[torch.Tensor], n_heads: int,
                       device: Optional[torch.device] = None) -> None:
    """ValueError naming the argument when ``softmax_type`` / ``sink`` do not fit together.

    ``sink`` must be given exactly for "learnable", as an fp32 [n_heads] tensor (on
    ``device`` when one is passed). Metadata only: safe in the hot path and under compile.
    """
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
    if softmax_type != "learnable":
        if sink is not None:
            raise ValueError(f"sink is only used with softmax_type='learnable', but "
                             f"softmax_type={softmax_type!r} got a sink of shape "
                             f"{tuple(getattr(sink, 'shape', ()))}")
        return
    if sink is None:
        raise ValueError("softmax_type='learnable' needs sink (an fp32 [n_heads] tensor), "
                         "got sink=None")
    if not isinstance(sink, torch.Tensor):
        raise ValueError(f"sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dtype != torch.float32 or tuple(sink.shape) != (n_heads,):
        raise ValueError(f"sink must be fp32 of shape [n_heads] = ({n_heads},), got "
                         f"{sink.dtype} {tuple(sink.shape)}")
    if device is not None and sink.device != torch.device(device):
        raise ValueError(f"sink is on {sink.device}, expected the attention's device {device}")


def _sink_logits(softmax_type: str, sink: Optional[torch.Tensor], lse: torch.Tensor
                 ) -> torch.Tensor:
    """The sink logit of every head as [Hq, 1] (broadcasts over the rows of lse)."""
    if softmax_type == "off-by-one":
        return lse.new_zeros(lse.shape[0], 1)
    return sink.to(lse.dtype).unsqueeze(1)


def apply_softmax_sink(out: torch.Tensor, lse: torch.Tensor, softmax_type: str,
                       sink: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a sink to the softmax of finished rows: -> (out_s, lse_s), differentiable.

    out [Tq, Hq, Dv] (any float dtype), lse fp32 [Hq, Tq] (natural log, -inf on rows that
    see nothing). "vanilla" returns the inputs unchanged. Rows that see nothing get out 0
    and lse_s = t, with zero (never NaN) gradients into out / lse.
    """
    check_softmax_args(softmax_type, sink, lse.shape[0], lse.device)
    if softmax_type == "vanilla":
        return out, lse
    t = _sink_logits(softmax_type, sink, lse)
    lse_s = torch.logaddexp(lse, t)
    # exp(lse - lse_s) written as a sigmoid: exact for large |lse - t|, and 0 with a zero
    # gradient when lse = -inf (no inf - inf anywhere).
    keep = torch.sigmoid(lse - t)                                   # [Hq, Tq]
    out_s = (out.float() * keep.t().unsqueeze(-1)).to(out.dtype)
    return out_s, lse_s


def lse_grad_rows(dlse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """fp32 dlse with rows that see nothing zeroed: their P is 0, and a non-finite dlse there
    (e.g. from logaddexp(-inf, -inf) upstream, or NaN padding) must not turn
    0 * (dP - delta) into NaN. The backward kernels use delta = rowsum(dO * O) - this."""
    return torch.where(lse == float("-inf"), 0.0, dlse.float())


def max_logit_of(row_max: torch.Tensor) -> torch.Tensor:
    """Per-head max logit fp32 [Hq] from row maxima [Hq, Tq]; -inf where no pair is visible.

    Not differentiable (QK-clip reads it as a statistic).
    """
    row_max = row_max.detach()
    if row_max.shape[1] == 0:  # amax refuses an empty reduction; no rows: nothing visible
        return torch.full((row_max.shape[0],), float("-inf"), dtype=torch.float32,
                          device=row_max.device)
    return row_max.amax(dim=1).float()
