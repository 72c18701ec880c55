"""A CPU stand-in for the ``flash-attn-4`` package (FlashAttention 4, CuTe DSL), for tests.

``install()`` puts modules ``flash_attn``, ``flash_attn.cute`` and
``flash_attn.cute.interface`` into ``sys.modules`` (only when no real
``flash_attn.cute.interface`` is importable); the interface has ``_flash_attn_fwd`` and
``_flash_attn_bwd`` with the parameter names, order and defaults of flash-attn-4 4.0.0b36
(``flash_attn/cute/interface.py``), computing varlen attention on any device in fp32.
Every call is appended to ``CALLS`` as (function name, its non-tensor arguments).

Semantics, from 4.0.0b36's sources:

- ``interface.py`` ``_resolve_causal_local_window``: None is an unbounded side; both windows
  negative means no window; causal forces right = 0. A lone negative window is NOT
  unbounded (unlike FA2): the mask code uses it as it is (left = -1 hides the diagonal).
- ``mask.py``: bottom-right alignment as in FA2 (query row i of a segment with sq queries and
  sk keys sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right``, 0 <= j < sk).
- ``softmax.py`` (``finalize``): a row that sees no key gets out 0 and LSE **-inf** (FA2:
  +inf). ``_flash_attn_fwd``: no keys at all (total_k == 0) or no queries: out 0, LSE -inf
  everywhere; otherwise out / lse are ``torch.empty``: rows outside every segment are NaN.
- ``flash_bwd_preprocess.py``: D = rowsum(dO * O) - dLSE; an LSE of -inf is read as 0 in
  log2 space (so P = exp(scale * s) on the row's visible pairs, 0 where nothing is
  visible), +inf gives P = 0. dq / dk / dv are ``torch.empty_like`` (NaN outside every
  segment); key tiles no query sees get zeros (``flash_bwd_sm90.py``).

Only varlen calls (cu_seqlens_q and cu_seqlens_k) without paging, score / mask mods, softcap,
sinks, split-KV, FP8 or caller-allocated outputs are supported: anything else raises
NotImplementedError. The real function's tuning arguments are accepted and ignored.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from typing import Optional

import torch

from tests.flash_emulator import check_max_lengths, segment_backward, segment_forward, segments

__version__ = "4.0.0b36"
CALLS: list[tuple[str, dict]] = []
"""(function name, {argument: value} of every non-tensor argument) per call."""

_MODULES = ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")
_ADDED: list[str] = []
_INF = float("inf")


def _resolve_causal_local_window(causal, window_size_left, window_size_right, mask_mod=None):
    """As flash-attn-4's: (causal, local, window_size_left, window_size_right)."""
    if mask_mod is not None:
        return False, False, window_size_left, window_size_right
    if (window_size_left is not None and window_size_right is not None
            and window_size_left < 0 and window_size_right < 0):
        window_size_left = None
        window_size_right = None
    if causal:
        window_size_right = 0
    if window_size_left is not None or window_size_right is not None:
        if window_size_left is None and window_size_right == 0:
            causal, local = True, False
            window_size_right = None
        else:
            causal, local = False, True
    else:
        local = False
    return causal, local, window_size_left, window_size_right


def _mask_window(causal, left, right) -> tuple[Optional[int], Optional[int]]:
    """(left, right) for ``visible``: None unbounded, ints used as they are."""
    causal, local, left, right = _resolve_causal_local_window(causal, left, right)
    if causal:
        return None, 0
    if local:
        return left, right
    return None, None


def _record(name: str, args: dict) -> None:
    CALLS.append((name, {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}))


def _reject(args: dict, defaults: dict) -> None:
    """NotImplementedError for every unsupported argument set off its default."""
    bad = [k for k, d in defaults.items()
           if not (args[k] is d or (d is not None and not torch.is_tensor(args[k])
                                    and args[k] == d))]
    if bad:
        raise NotImplementedError(f"fa4 stand-in: {', '.join(bad)} not supported")


def _check(q, k, v, cu_q, cu_k, extra=()):
    """The real interface's asserts that apply to varlen fp16 / bf16 calls."""
    if cu_q is None or cu_k is None:
        raise NotImplementedError("fa4 stand-in: only varlen calls (cu_seqlens_q and _k)")
    assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
    assert all(t.dtype == v.dtype for t in (q, k, *extra)), "q, k, v must have the same dtype"
    assert q.dim() == k.dim() == v.dim() == 3, "varlen q / k / v are [total, heads, dim]"
    assert k.shape[:2] == v.shape[:2] and k.shape[-1] == q.shape[-1], "k / v shapes"
    assert q.shape[1] % k.shape[1] == 0, "num_head must be divisible by num_head_kv"
    for d in (q.shape[-1], v.shape[-1]):  # sm90's rule (the widest FA4 has)
        assert 8 <= d <= 256 and d % 8 == 0, f"head dim {d}: 8..256, divisible by 8"
    for t in (cu_q, cu_k):
        assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k must be int32"
    assert cu_q.dim() == 1 and cu_k.shape == cu_q.shape, "cu_seqlens must be (batch_size + 1,)"


def _int(x):
    return int(x) if torch.is_tensor(x) else x


_FWD_UNSUPPORTED = dict(
    qv=None, seqused_q=None, seqused_k=None, page_table=None, learnable_sink=None,
    num_splits=1, score_mod=None, mask_mod=None, block_sparse_tensors=None, out=None,
    lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
    v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
    seqlen_k_per_split=None, gather_bwd_recompute_p=False)


def _flash_attn_fwd(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None,
    softmax_scale=None, causal=False, softcap=None, window_size_left=None,
    window_size_right=None, learnable_sink=None, tile_mn=None, mma_pv_is_rs=None,
    intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, _arch=None,
    score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
    lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
    v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
    seqlen_k_per_split=None, disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
):
    """(out [total_q, Hq, Dv] in q's dtype, lse fp32 [Hq, total_q] or None, None, None,
    None); lse -inf on rows that see nothing, NaN on rows outside every segment."""
    args = dict(locals())
    _record("_flash_attn_fwd", args)
    _reject(args, _FWD_UNSUPPORTED)
    if softcap not in (None, 0.0):
        raise NotImplementedError("fa4 stand-in: softcap not supported")
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    total_q, hq, d = q.shape
    total_k = k.shape[0]
    spans = segments(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    check_max_lengths(spans, _int(max_seqlen_q), _int(max_seqlen_k))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    left, right = _mask_window(causal, window_size_left, window_size_right)
    want_lse = return_lse or any(t.requires_grad for t in (q, k, v))

    res = torch.full((total_q, hq, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    res_lse = torch.full((hq, total_q), float("nan"), dtype=torch.float32, device=q.device)
    if total_k == 0 or total_q == 0:  # interface.py: out.zero_(), lse.fill_(-inf)
        res.zero_()
        res_lse.fill_(-_INF)
    else:
        with torch.no_grad():
            for q0, q1, k0, k1 in spans:
                o, l = segment_forward(q[q0:q1], k[k0:k1], v[k0:k1], scale, left, right)
                res[q0:q1] = o.to(q.dtype)
                res_lse[:, q0:q1] = l  # -inf where nothing is seen, FA4's convention
    return res, (res_lse if want_lse else None), None, None, None


_BWD_UNSUPPORTED = dict(
    seqused_q=None, seqused_k=None, dq=None, dk=None, dv=None, score_mod=None,
    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
    block_sparse_tensors=None, learnable_sink=None)


def _flash_attn_bwd(
    q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
    window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
    num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
    dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
    V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
    score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
    block_sparse_tensors=None, dlse=None, learnable_sink=None,
):
    """(dq, dk, dv) in the inputs' dtypes from the out / lse / dlse given (a ring's merged
    ones); NaN on rows outside every segment."""
    args = dict(locals())
    _record("_flash_attn_bwd", args)
    _reject(args, _BWD_UNSUPPORTED)
    if softcap not in (None, 0.0):
        raise NotImplementedError("fa4 stand-in: softcap not supported")
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, extra=(out, dout))
    total_q, hq, d = q.shape
    assert out.shape == dout.shape == (total_q, hq, v.shape[-1]), "out / dout shapes"
    assert lse.dtype == torch.float32 and lse.shape == (hq, total_q), \
        "lse must have shape (num_head, total_q)"
    assert dlse is None or dlse.shape == (hq, total_q), "dlse must have the shape of lse"
    if q.numel() == 0 or k.numel() == 0:  # interface.py: zeros_like, no kernel
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    spans = segments(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0])
    check_max_lengths(spans, _int(max_seqlen_q), _int(max_seqlen_k))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    left, right = _mask_window(causal, window_size_left, window_size_right)

    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # empty_like in FA4
    with torch.no_grad():
        for q0, q1, k0, k1 in spans:
            g = segment_backward(dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1],
                                 lse[:, q0:q1], scale, left, right,
                                 None if dlse is None else dlse[:, q0:q1])
            for dst, rows, src in zip(grads, ((q0, q1), (k0, k1), (k0, k1)), g):
                dst[rows[0]:rows[1]] = src.to(dst.dtype)  # a later overlapping segment wins
    return tuple(grads)


# ------------------------------------------------------------------------ installation
def _real_interface_importable() -> bool:
    """Whether ``flash_attn.cute.interface`` imports without the stand-in (a real one, or
    whatever another test put there)."""
    try:
        importlib.import_module("flash_attn.cute.interface")
        return True
    except Exception:  # not installed, or its CUDA libraries missing
        return False


def install() -> bool:
    """Put the stand-in modules into ``sys.modules`` unless ``flash_attn.cute.interface``
    already imports; idempotent. True when the stand-in is what it now imports as. A module
    already in ``sys.modules`` (say a real FA2 ``flash_attn``) is left alone."""
    if _ADDED:
        return True
    if _real_interface_importable():
        return False
    mods = {name: types.ModuleType(name, __doc__) for name in _MODULES}
    for name in _MODULES[:2]:  # packages, so that submodule imports resolve
        mods[name].__path__ = []
        mods[name].__version__ = __version__
    mods["flash_attn"].cute = mods["flash_attn.cute"]
    mods["flash_attn.cute"].interface = iface = mods["flash_attn.cute.interface"]
    iface._flash_attn_fwd = _flash_attn_fwd
    iface._flash_attn_bwd = _flash_attn_bwd
    iface._resolve_causal_local_window = _resolve_causal_local_window
    for name, mod in mods.items():
        if name not in sys.modules:
            sys.modules[name] = mod
            _ADDED.append(name)
    return True


def uninstall() -> None:
    """Remove exactly the modules ``install`` added."""
    while _ADDED:
        sys.modules.pop(_ADDED.pop(), None)
