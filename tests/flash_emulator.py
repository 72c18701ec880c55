"""CPU emulation of torch's FlashAttention-2 ops, so routing to them is testable without a GPU.

Emulates ``aten::_flash_attention_forward`` / ``aten::_flash_attention_backward`` in varlen
mode (``cum_seq_q`` given), written from FlashAttention-2's sources as vendored by torch
(``aten/src/ATen/native/transformers/cuda/``), never from varlen_cp's kernels:

- ``attention.cu`` ``_flash_attention_forward`` / ``_backward``: None windows are -1, scale
  None is 1/sqrt(D), ``cum_seq_q`` given selects ``mha_varlen_fwd`` / ``mha_varlen_bwd``.
- ``flash_attn/flash_api.cpp`` ``mha_varlen_fwd`` / ``mha_varlen_bwd``: the input checks
  (RuntimeError); ``max_q == 1`` turns causal off (equivalent there) and, with GQA and no
  window, swaps query rows and heads, which needs exactly one query row per segment; a
  window >= ``max_k`` is -1; ``max_k == 0``: out 0, LSE +inf everywhere; bwd ``max_q == 0``:
  dk = dv = 0 everywhere; outputs and gradients are ``empty_like`` (rows outside every
  segment are never written: NaN here); GQA dk / dv are per-q-head, then summed.
- ``flash_attn/mask.h``: bottom-right alignment. Query row i of a segment (sq rows, sk keys)
  sees key j iff ``0 <= j < sk``, ``j >= i + sk - sq - left`` (left >= 0) and
  ``j <= i + sk - sq + right`` (right >= 0); causal is right = 0.
- ``flash_attn/softmax.h``: a row that sees no key gets out 0 and LSE **+inf**;
  ``scale_apply_exp2`` in the backward reads an LSE of -inf as 0 (P = exp(scale * s) on the
  row's visible pairs, 0 elsewhere), +inf gives P = 0.
- ``flash_attn/flash_bwd_kernel.h``: P = exp(scale * S - lse) on visible pairs,
  D = rowsum(dO * O) (fp32, from the out passed, which may be a merged one), dS = P (dP - D),
  dq = scale dS k, dk = scale dS^T q, dv = P^T dO; key blocks no query sees get dk = dv = 0.
  A segment whose end precedes its start is empty (the kernels' loops run zero times); only
  so can two segments' key ranges overlap (cum_seq_k = [0, 4, 2, 6]): both write dk / dv
  there, a race in FA, here the later segment wins (assignment, never a sum). Same for
  overlapping query ranges, in both passes.

Stricter than FA: ``max_q`` / ``max_k`` below a segment's length raise (FA's grid would leave
rows unwritten or mis-clamp windows); segment bounds outside the tensors raise (FA reads out
of bounds).

Registration (``register()``): a CPU kernel for each op through ``torch.library`` is all
that is needed. torch already has the ops' Autograd kernel (``FlashAttentionBackward0``,
which would call our backward) and Meta kernel; under ``torch.no_grad()`` the Autograd key
just redispatches to CPU, so nothing else is registered. The dispatcher hands keyword-only
arguments over only when they differ from their defaults (so every one needs a default
here), and ``SymInt?`` windows arrive as Python ``int`` (or are absent).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                "dropout_p", "is_causal", "return_debug_mask", "scale", "window_size_left",
                "window_size_right")
"""How varlen_cp calls ``aten::_flash_attention_forward``: the first 10 positionally,
the last 3 by keyword."""
FORWARD_POSITIONAL = 10
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                 "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "rng_state",
                 "unused", "scale", "window_size_left", "window_size_right")
"""How varlen_cp calls ``aten::_flash_attention_backward``: the first 14 positionally,
the last 3 by keyword."""
BACKWARD_POSITIONAL = 14

_LIB: Optional[torch.library.Library] = None
_NAN = float("nan")
_INF = float("inf")


# ----------------------------------------------------------------- shared segment math
def visible(sq: int, sk: int, left: Optional[int], right: Optional[int]) -> torch.Tensor:
    """Bool [sq, sk]: query row i sees key j (bottom-right aligned; None: unbounded side,
    an int is used as it is, as the kernels' mask code does)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    diag = i + sk - sq
    if left is not None:
        ok &= j >= diag - left
    if right is not None:
        ok &= j <= diag + right
    return ok


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, H, D] -> fp32 [H * group, rows, D] (kv head h serves q heads h*group...)."""
    return x.float().repeat_interleave(group, dim=1).transpose(0, 1)


def segment_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    left: Optional[int], right: Optional[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment in fp32: (out [sq, Hq, Dv], lse [Hq, sq], -inf where nothing is seen)."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = _heads_first(q, 1), _heads_first(k, group), _heads_first(v, group)
    mask = visible(q.shape[0], k.shape[0], left, right).to(qf.device)
    s = (qf @ kf.transpose(1, 2) * scale).masked_fill(~mask, -_INF)
    lse = torch.logsumexp(s, dim=-1)  # -inf on rows without a key (also when sk == 0)
    # where(), not exp(s - lse): -inf - -inf would be NaN on rows that see nothing
    p = torch.where(mask, torch.exp(s - lse.unsqueeze(-1)), 0.0)
    return (p @ vf).transpose(0, 1), lse


def segment_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, scale: float,
                     left: Optional[int], right: Optional[int],
                     dlse: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment's (dq [sq, Hq, D], dk [sk, Hkv, D], dv [sk, Hkv, Dv]) in fp32 from the
    out / lse given (lse [Hq, sq]: -inf is read as 0, as both FA2's scale_apply_exp2 and
    FA4's bwd preprocess do; +inf gives P = 0). ``dlse`` [Hq, sq] enters as D - dlse."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf, kf, vf = _heads_first(q, 1), _heads_first(k, group), _heads_first(v, group)
    dof, of = _heads_first(dout, 1), _heads_first(out, 1)
    mask = visible(q.shape[0], k.shape[0], left, right).to(qf.device)
    lse = lse.float().masked_fill(lse == -_INF, 0.0).unsqueeze(-1)
    p = torch.where(mask, torch.exp(qf @ kf.transpose(1, 2) * scale - lse), 0.0)
    delta = (dof * of).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    ds = p * (dof @ vf.transpose(1, 2) - delta.unsqueeze(-1))
    dq = (ds @ kf * scale).transpose(0, 1)
    dk = (ds.transpose(1, 2) @ qf * scale).unflatten(0, (hkv, group)).sum(1).transpose(0, 1)
    dv = (p.transpose(1, 2) @ dof).unflatten(0, (hkv, group)).sum(1).transpose(0, 1)
    return dq, dk, dv


def segments(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
             error=RuntimeError) -> list[tuple[int, int, int, int]]:
    """[(q0, q1, k0, k1)] of the varlen call. A bound outside the tensors raises ``error``
    (FA would read out of bounds); an end before its start is an empty range (FA's kernels
    compute nothing for it, as for length 0): that is the only way two segments' ranges
    overlap, e.g. cum_seq_k = [0, 4, 2, 6]."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if not all(0 <= b <= total_q for b in bq) or not all(0 <= b <= total_k for b in bk):
        raise error(f"flash emulator: cu_seqlens {bq} / {bk} outside total_q={total_q} / "
                    f"total_k={total_k} (FA would read out of bounds)")
    return [(q0, max(q0, q1), k0, max(k0, k1))
            for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:])]


def check_max_lengths(spans, max_q: Optional[int], max_k: Optional[int], error=RuntimeError):
    """Raise when a max length is below a segment's: FA's grid would miss rows."""
    for q0, q1, k0, k1 in spans:
        if (max_q is not None and q1 - q0 > max_q) or (max_k is not None and k1 - k0 > max_k):
            raise error(f"flash emulator: segment of {q1 - q0} queries / {k1 - k0} keys "
                        f"exceeds max_q={max_q} / max_k={max_k}; FA would leave rows unwritten")


# ------------------------------------------------------------------------ aten kernels
def _check_inputs(q, k, v, cu_q, cu_k, dropout_p, extra=()):
    """mha_varlen_fwd / _bwd's TORCH_CHECKs that matter on CPU (RuntimeError, like FA)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for t in (k, v, *extra):
        if t.dtype != q.dtype:
            raise RuntimeError("FlashAttention: all inputs must have the dtype of query")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise RuntimeError("flash emulator: varlen q / k / v are [total, heads, head_dim]")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape != k.shape:
        raise RuntimeError("FlashAttention: k and v must be [total_k, heads_k, head_dim of q]")
    if d % 8 or d > 256:
        raise RuntimeError("FlashAttention: head_size must be a multiple of 8 and at most 256")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    if cu_q.dim() != 1 or cu_k.shape != cu_q.shape or cu_q.numel() < 2:
        raise RuntimeError("cu_seqlens_q / cu_seqlens_k must be 1-D of batch_size + 1 > 1")
    if dropout_p != 0.0:
        raise RuntimeError("flash emulator: dropout is not emulated")


def _fa2_windows(is_causal: bool, left: Optional[int], right: Optional[int], max_k: int):
    """FA2's (left, right) as ``visible`` takes them: -1 / None unbounded, causal forces
    right = 0, a window >= max_k is dropped (flash_api.cpp)."""
    wl = -1 if left is None else int(left)
    wr = -1 if right is None else int(right)
    if is_causal:
        wr = 0
    wl = -1 if wl >= max_k else wl
    wr = -1 if wr >= max_k else wr
    return (None if wl < 0 else wl), (None if wr < 0 else wr)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                  window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):
    """CPU kernel of ``aten::_flash_attention_forward`` (varlen only). ``num_splits`` only
    tunes FA's split-KV heuristic: accepted and ignored."""
    if cum_seq_q is None or cum_seq_k is None:
        raise RuntimeError("flash emulator: only varlen mode (cum_seq_q / cum_seq_k) is emulated")
    if seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise RuntimeError("flash emulator: seqused_k / alibi_slopes / block_table not emulated")
    if return_debug_mask:
        raise RuntimeError("return_softmax is only supported when p_dropout > 0.0")
    _check_inputs(query, key, value, cum_seq_q, cum_seq_k, dropout_p)
    total_q, hq, d = query.shape
    n = cum_seq_q.numel() - 1
    wl = -1 if window_size_left is None else int(window_size_left)
    wr = -1 if window_size_right is None else int(window_size_right)
    if max_q == 1:  # "causal=true is the same as causal=false in this case"
        is_causal = False
    if is_causal:
        wr = 0
    # seqlenq_ngroups_swapped: q.reshape({batch_size, Hkv, ngroups, D}) then row b is segment
    # b's only query, cum_seq_q unread; any other row count is a reshape error in FA
    if max_q == 1 and hq > key.shape[1] and wl < 0 and wr < 0:
        if total_q != n:
            raise RuntimeError(f"shape '[{n}, {key.shape[1]}, {hq // key.shape[1]}, {d}]' is "
                               f"invalid for input of size {query.numel()} (FA2's max_q == 1 "
                               "GQA path needs exactly one query row per segment)")
        cum_seq_q = torch.arange(n + 1, dtype=torch.int32)
    left, right = _fa2_windows(is_causal, wl, wr, max_k)
    spans = segments(cum_seq_q, cum_seq_k, total_q, key.shape[0])
    check_max_lengths(spans, max_q, max_k)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    out = torch.full_like(query, _NAN)  # empty_like in FA: rows no segment covers stay unwritten
    lse = torch.full((hq, total_q), _NAN, dtype=torch.float32)
    if max_k == 0:  # flash_api.cpp: no launch, out.zero_(), lse.fill_(+inf)
        out.zero_()
        lse.fill_(_INF)
    else:
        for q0, q1, k0, k1 in spans:
            o, l = segment_forward(query[q0:q1], key[k0:k1], value[k0:k1], scale, left, right)
            out[q0:q1] = o.to(query.dtype)
            lse[:, q0:q1] = l.masked_fill(l == -_INF, _INF)  # softmax.h: +inf, not -inf
    rng_state = torch.zeros(2, dtype=torch.int64)
    return out, lse, rng_state, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=query.dtype)


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                   window_size_left=None, window_size_right=None):
    """CPU kernel of ``aten::_flash_attention_backward`` (varlen): uses ``out`` and
    ``logsumexp`` exactly as given (a ring's merged ones), never recomputes them."""
    _check_inputs(query, key, value, cum_seq_q, cum_seq_k, dropout_p, extra=(out, grad_out))
    total_q, hq, _ = query.shape
    if out.shape != query.shape or grad_out.shape != query.shape:
        raise RuntimeError("flash emulator: out / grad_out must have the shape of query")
    if logsumexp.dtype != torch.float32 or logsumexp.shape != (hq, total_q):
        raise RuntimeError(f"flash emulator: logsumexp must be fp32 [{hq}, {total_q}]")
    left, right = _fa2_windows(is_causal, window_size_left, window_size_right, max_k)
    spans = segments(cum_seq_q, cum_seq_k, total_q, key.shape[0])
    check_max_lengths(spans, max_q, max_k)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)

    dq, dk, dv = (torch.full_like(t, _NAN) for t in (query, key, value))
    if max_q == 0:  # flash_api.cpp: no launch, dk / dv zeroed (dq stays unwritten)
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    for q0, q1, k0, k1 in spans:
        g = segment_backward(grad_out[q0:q1], query[q0:q1], key[k0:k1], value[k0:k1],
                             out[q0:q1], logsumexp[:, q0:q1], scale, left, right)
        # assignment: an overlapping later segment overwrites (FA: racing plain stores)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (x.to(query.dtype) for x in g)
    return dq, dk, dv


# ------------------------------------------------------------------------ registration
def register() -> None:
    """Register the two CPU kernels (idempotent; the Library stays alive in ``_LIB``)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", flash_forward, "CPU")
    lib.impl("_flash_attention_backward", flash_backward, "CPU")
    _LIB = lib


def unregister() -> None:
    """Drop the CPU kernels again (the ops have none in torch)."""
    global _LIB
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None


def is_registered() -> bool:
    """Whether this module's CPU kernels are registered now."""
    return _LIB is not None
