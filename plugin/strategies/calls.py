"""What every strategy's runtime shares: the kernel calls, empty results, the max-logit and
LSE-gradient conventions, and flat message packing.

``Attn`` holds the constants of one ``cp_varlen_attn`` call (mask, scale, backend) and runs
one kernel call of a strategy on its host-built ``KernelCall`` tables: on FlashAttention
when the tables hold its form (``KernelCall.flash``: one or a few FA calls, merged by LSE;
gathered keys' gradients summed back in rounds of unique rows), else on our kernels. The
inputs were validated once by ``varlen_cp.attention`` and the tables are built by the
plan's schedules, so the per-step calls go through the kernels' unchecked entries: no
argument check, no host sync, no device copy per ring step or per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..kernels.api import varlen_bwd_stats, varlen_bwd_unchecked, varlen_fwd_unchecked
from ..kernels.merge import merge_attn_partials_
from ..kernels.sink import max_logit_of
from ..kernels.flash import backward_lse, flash_bwd, flash_fwd
from ..masks import AttnMask
from ..tables.flash_form import FlashForm
from ..tables.holders import KernelCall


class BwdStats:
    """The per-row terms a layer's backward calls share, made on first use (once per
    layer): our kernels' (delta, base-2 LSE) and the LSE FlashAttention is handed."""

    def __init__(self, attn: "Attn", dout: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: torch.Tensor | None) -> None:
        self._args = (attn, dout, out, lse, dlse)
        self._kernel: torch.Tensor | None = None
        self._flash: torch.Tensor | None = None

    @property
    def kernel(self) -> torch.Tensor:
        if self._kernel is None:
            attn, dout, out, lse, dlse = self._args
            self._kernel = varlen_bwd_stats(dout, out, lse, dlse, attn.backend)
        return self._kernel

    @property
    def flash_lse(self) -> torch.Tensor:
        if self._flash is None:
            self._flash = backward_lse(self._args[3])
        return self._flash


@dataclass(frozen=True)
class Attn:
    """The per-call constants every kernel invocation of a strategy shares.
    ``backend``: our kernels', resolved ("triton" or "torch"), for the calls without a
    FlashAttention form (the form names its own backend)."""

    mask: AttnMask
    scale: float
    backend: str

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: KernelCall,
            need_max: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, lse, row_max): row_max fp32 [Hq, Tq] when ``need_max``, else None (FA
        forms are only planned without it)."""
        if c.flash is not None:
            out, lse = flash_forward(c.flash, q, k, v, self.scale)
            return out, lse, None
        causal, wl, wr, chunk = self.mask.params
        return varlen_fwd_unchecked(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, self.scale,
                                    causal, wl, wr, chunk, c.q_pos, c.k_pos, self.backend,
                                    c.schedule, need_max)

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, c: KernelCall,
            dlse: torch.Tensor | None = None, stats: BwdStats | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This call's (dq, dk, dv) given the FINAL out/lse and their gradients.
        ``stats``: :meth:`bwd_stats` of the same dout, out, lse, dlse (None: made here)."""
        stats = stats if stats is not None else BwdStats(self, dout, out, lse, dlse)
        if c.flash is not None:
            return flash_backward(c.flash, dout, q, k, v, out, stats.flash_lse, self.scale,
                                  dlse)
        causal, wl, wr, chunk = self.mask.params
        return varlen_bwd_unchecked(dout, q, k, v, out, lse, dlse, c.cu_q, c.cu_k, c.max_q,
                                    c.max_k, self.scale, causal, wl, wr, chunk, c.q_pos,
                                    c.k_pos, self.backend, c.schedule, stats.kernel)

    def bwd_stats(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dlse: torch.Tensor | None = None) -> BwdStats:
        """The backward's per-row terms of the FINAL out/lse: the same for every step of a
        layer's backward, so made once (on first use) and passed to :meth:`bwd`."""
        return BwdStats(self, dout, out, lse, dlse)


def _keys(call, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key buffer of one FA call: the call's K/V, or the rows it gathers."""
    if call.k_index is None:
        return k, v
    return k.index_select(0, call.k_index), v.index_select(0, call.k_index)


def flash_forward(form: FlashForm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse) of a kernel call in FlashAttention's form: each FA call on
    the rows it spans (``FlashCall.q_span`` / ``k_span``: row slices, views), its partial
    merged by LSE into those rows of the result (in fp32, then cast once)."""
    n_q = q.shape[0]
    out = lse = None
    for call in form.calls:
        k_c, v_c = _keys(call, k, v)
        (qa, qb), (ka, kb) = call.q_span, call.k_span
        o, l = flash_fwd(form.backend, q[qa:qb], k_c[ka:kb], v_c[ka:kb], call.cu_q,
                         call.cu_k, call.max_q, call.max_k, scale, call.window)
        if out is None and (qa, qb) == (0, n_q):
            out, lse = o, l
            continue
        if out is None:   # the rows no call spans yet: nothing seen
            out = q.new_zeros(n_q, q.shape[1], v.shape[2], dtype=torch.float32)
            lse = torch.full((q.shape[1], n_q), float("-inf"), device=q.device)
        elif out.dtype != torch.float32:
            out = out.float()
        # in place on the rows' views (fp32 out: mul_ / addcmul_); the LSE written back
        _, lse[:, qa:qb] = merge_attn_partials_(out[qa:qb], lse[:, qa:qb], o, l)
    if out is None:  # nothing visible
        out, lse, _ = empty_attn(q, v.shape[2], False)
    return out.to(q.dtype), lse


def flash_backward(form: FlashForm, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                   dlse: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a kernel call in FlashAttention's form, given the FINAL out and
    the LSE as FA's backward takes it (``BwdStats.flash_lse``), each FA call on its spans;
    gathered keys' gradients summed back in rounds of unique rows; several calls' summed
    in fp32 (the first spans every row, the others add into theirs)."""
    if not form.calls:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if len(form.calls) == 1:   # the common case: one call on every row (flash_form widens
        call = form.calls[0]   # a form's first call), FA's own dq
        k_c, v_c = _keys(call, k, v)
        dq, dk, dv = flash_bwd(form.backend, dout, q, k_c, v_c, out, lse, call.cu_q,
                               call.cu_k, call.max_q, call.max_k, scale, call.window, dlse)
        if call.k_index is not None:
            dk = call.k_rounds.add_(k.new_zeros(k.shape, dtype=torch.float32), dk.float())
            dv = call.k_rounds.add_(v.new_zeros(v.shape, dtype=torch.float32), dv.float())
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    dq = dk = dv = None
    for call in form.calls:
        k_c, v_c = _keys(call, k, v)
        (qa, qb), (ka, kb) = call.q_span, call.k_span
        rows = slice(qa, qb)
        dq_c, dk_c, dv_c = flash_bwd(
            form.backend, dout[rows], q[rows], k_c[ka:kb], v_c[ka:kb], out[rows],
            lse[:, rows].contiguous(), call.cu_q, call.cu_k, call.max_q, call.max_k, scale,
            call.window, None if dlse is None else dlse[:, rows].contiguous())
        if call.k_index is not None:   # the gathered buffer is the call's own (whole span)
            dk_c = call.k_rounds.add_(k.new_zeros(k.shape, dtype=torch.float32), dk_c.float())
            dv_c = call.k_rounds.add_(v.new_zeros(v.shape, dtype=torch.float32), dv_c.float())
            ka, kb = 0, k.shape[0]
        if dq is None:   # the first call spans every row (flash_form widens it)
            dq, dk, dv = dq_c.float(), dk_c.float(), dv_c.float()
        else:            # the others add into the rows they span, in fp32
            dq[rows] += dq_c
            dk[ka:kb] += dk_c
            dv[ka:kb] += dv_c
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def empty_attn(q: torch.Tensor, dv: int, need_max: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, row_max) of queries that see no key: 0, -inf, -inf."""
    hq, t = q.shape[1], q.shape[0]
    lse = torch.full((hq, t), float("-inf"), device=q.device)
    return (q.new_zeros(t, hq, dv), lse,
            torch.full((hq, t), float("-inf"), device=q.device) if need_max else None)


def head_max(row_max: torch.Tensor | None, n_heads: int, device: torch.device
             ) -> torch.Tensor:
    """fp32 [Hq]: the max over rows of ``row_max`` [Hq, T] (-inf where nothing is
    visible, or when ``row_max`` is None: a rank that computed nothing)."""
    if row_max is None:
        return torch.full((n_heads,), float("-inf"), device=device)
    return max_logit_of(row_max)


def no_max(device: torch.device) -> torch.Tensor:
    """Stand-in third output of the autograd functions when the max is not asked for
    (their outputs must be tensors); ``maybe_max`` turns it into None."""
    return torch.empty(0, device=device)


def maybe_max(max_part: torch.Tensor) -> torch.Tensor | None:
    """None for the :func:`no_max` stand-in, else ``max_part`` itself."""
    return max_part if max_part.numel() else None


def dlse_or_none(dlse: torch.Tensor | None) -> torch.Tensor | None:
    """The LSE gradient handed to backward, or None when the LSE fed nothing (no
    materialized zeros: the kernels then skip the term)."""
    if dlse is None or dlse.numel() == 0:
        return None
    return dlse.float().contiguous()


def global_rank(group: Any, group_rank: int) -> int:
    """Global rank of ``group_rank`` (P2P ops address global ranks)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def pack_flat(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One flat buffer holding ``tensors`` back to back (one message instead of several)."""
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])


def unpack_flat(buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous views of ``buf`` with ``shapes`` (the inverse of :func:`pack_flat`)."""
    out, at = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(buf[at:at + n].view(s))
        at += n
    return out

