"""Pure-PyTorch twin of the varlen attention kernels (forward and FA2-style backward).

Runs anywhere torch runs (the CPU backend, and a readable reference for the Triton kernels).
The work is split like the kernels split it: per segment, query blocks of
``schedule.block_m`` rows, each visiting only the key range ``schedule.kv_range`` gives it,
so memory is O(block x visited keys), never O(total^2). Inside a tile the mask is evaluated
per element on the positions (``mask_math.visible``), so results are exact whatever the
schedule's ranges (they only bound the work).

Each Python-level step costs ~0.5-0.8 ms of torch-op overhead, so (segment, block) work
items of similar size are gathered into one padded batch ("group") and computed with a few
batched matmuls; thousands of short documents then cost a few dozen groups, not thousands of
loop turns. Keys are walked in chunks (online softmax) so score tiles stay cache sized.

Padding rows (explicit position < 0) are zeroed in the gathered operands before any
product, like the Triton kernels' masked loads: NaN / inf left in their q, k, v or dout
never reaches a real row, and their own gradients are 0.

Limits: scores and softmax are fp32 (fp64 for fp64 inputs), so the twin is memory bound and
much slower than the Triton kernels on a GPU. Without a schedule it builds one on the host,
sized by the longest segment (never by the caller's max_seqlen, which may be a loose bound);
if cu_seqlens / positions live on a GPU that means one device->host copy (a sync), which is
accepted in this twin only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import validation
from .mask_math import implicit_positions, visible
from .schedule import BlockSchedule, build_block_schedule
from .sink import lse_grad_rows

# Query rows per block when the caller passes no schedule. bench/kernels.py's sweep (fp32,
# 8 heads, d=128, 4K tokens, one CPU core): 128 is within noise of the best for one long
# document and the best for mixes of short ones, where smaller blocks waste less of the
# causal diagonal tile and larger ones run matmuls more efficiently.
DEFAULT_BLOCK_M = 128

# An item joins a group when the padding it adds (score elements, all heads) costs less than
# running it as a group of its own: a group's fixed cost (~50 torch ops) measured ~0.8 ms on
# one CPU core, as much as ~70K score elements at ~11.5 ns each (fwd, d=128).
_GROUP_OVERHEAD_ELEMS = 1 << 16
# Keys per score tile: the key range of a group is walked in chunks of this many keys
# (online softmax forward, plain loop backward) so tiles stay cache sized.
_KEY_CHUNK = 512
# Cap on one group's tile elements (items x heads x rows x min(keys, _KEY_CHUNK)): 2^18 fp32
# = 1 MiB per buffer ran 10-25% faster than 4 MiB on many short documents (cache); a single
# item larger than this still runs alone.
_GROUP_ELEMS = 1 << 18


@dataclass(frozen=True)
class _Group:
    """One padded batch of work items: rows/keys to gather and where results go."""

    n: int                # work items in the group
    mq: int               # padded query rows per item
    mk: int               # padded keys per item
    q_gather: Tensor      # [n * mq] row to read (padding reads the item's first row)
    q_scatter: Tensor     # [n * mq] row to write (padding writes the dummy row total_q)
    q_valid: Tensor       # [n, mq] bool
    k_gather: Tensor      # [n * mk]
    k_scatter: Tensor     # [n * mk] (padding -> dummy row total_k)
    k_valid: Tensor       # [n, mk] bool


def _host(t: Tensor | None) -> Tensor | None:
    """Host copy of metadata. On a GPU this syncs: accepted in the twin only (see docstring)."""
    return None if t is None else t.detach().to("cpu", torch.int64)


_LOG2E = 1.4426950408889634  # the stats hold the LSE in base 2, as the Triton kernels read it


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                  max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The op's own checks (kernels/validation.py), for callers that reach the twin directly;
    ``cu_q``/``cu_k`` are host copies, so the value checks never sync."""
    validation.check_qkv(q, k, v)
    validation.check_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q,
                                max_seqlen_k, q.device)


def _positions(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int,
               q_positions: Tensor | None, k_positions: Tensor | None,
               device: torch.device) -> tuple[Tensor, Tensor]:
    """Per-token positions (int64, on ``device``): explicit ones, or bottom-right implicit."""
    if q_positions is not None and k_positions is not None:
        return q_positions.to(torch.int64), k_positions.to(torch.int64)
    # Implicit positions come from host cu_seqlens and travel without a sync.
    imp_q, imp_k = implicit_positions(cu_q, cu_k, total_q, total_k)
    qp = imp_q.to(device, non_blocking=True) if q_positions is None else q_positions.long()
    kp = imp_k.to(device, non_blocking=True) if k_positions is None else k_positions.long()
    return qp, kp


def _longest(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _schedule(schedule: BlockSchedule | None, cu_q: Tensor, cu_k: Tensor, max_seqlen_q: int,
              max_seqlen_k: int, mask: tuple[bool, int, int, int],
              q_positions: Tensor | None, k_positions: Tensor | None) -> BlockSchedule:
    """The caller's schedule (validated) or one built on the host with the default block."""
    n_seg = cu_q.numel() - 1
    if schedule is None:
        # Tables sized by the real longest segments: max_seqlen may be a loose upper bound
        # (flash-attn callers pass one), and 10**9 would mean gigabytes of empty blocks.
        causal, wl, wr, chunk = mask
        return build_block_schedule(
            cu_q, cu_k, _longest(cu_q), _longest(cu_k), causal=causal, window_left=wl,
            window_right=wr, chunk_size=chunk, q_positions=_host(q_positions),
            k_positions=_host(k_positions), block_m=DEFAULT_BLOCK_M, block_n=DEFAULT_BLOCK_M)
    kv = schedule.kv_range
    longest = _longest(cu_q)
    if kv.dim() != 3 or kv.shape[0] != n_seg or kv.shape[1] * schedule.block_m < longest:
        raise ValueError(f"schedule.kv_range of shape {tuple(kv.shape)} with block_m="
                         f"{schedule.block_m} does not cover {n_seg} segments of up to "
                         f"{longest} query rows")
    return schedule


def _work_items(schedule: BlockSchedule, cu_q: Tensor, cu_k: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_start, n_rows, k_start, n_keys) of every (segment, query block) with work to do."""
    kv = _host(schedule.kv_range)
    bm = schedule.block_m
    row0 = torch.arange(kv.shape[1], dtype=torch.int64) * bm
    n_rows = ((cu_q[1:] - cu_q[:-1])[:, None] - row0).clamp(0, bm)
    n_keys = (kv[..., 1] - kv[..., 0]).clamp(min=0)
    live = (n_rows > 0) & (n_keys > 0)
    q_start = cu_q[:-1, None] + row0
    k_start = cu_k[:-1, None] + kv[..., 0]
    return q_start[live], n_rows[live], k_start[live], n_keys[live]


def _partition(n_rows: list[int], n_keys: list[int], heads: int) -> list[list[int]]:
    """Greedy grouping of items sorted by key count: merge while padding is cheaper than a
    separate group, and while the group's score tile stays under ``_GROUP_ELEMS``."""
    order = sorted(range(len(n_keys)), key=lambda i: (n_keys[i], n_rows[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    max_q = padded = 0
    for i in order:
        q, kk = n_rows[i], n_keys[i]
        new_q = max(max_q, q)
        new_padded = (len(cur) + 1) * new_q * kk  # sorted: kk is the widest key range so far
        waste = (new_padded - padded - q * kk) * heads
        tile = (len(cur) + 1) * new_q * min(kk, _KEY_CHUNK) * heads
        if cur and (waste > _GROUP_OVERHEAD_ELEMS or tile > _GROUP_ELEMS):
            groups.append(cur)
            cur, new_q, new_padded = [], q, q * kk
        cur.append(i)
        max_q, padded = new_q, new_padded
    if cur:
        groups.append(cur)
    return groups


def _padded_index(start: Tensor, count: Tensor, width: int, dummy: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Gather index (padding reads ``start``), scatter index (padding -> ``dummy``), valid."""
    idx = start[:, None] + torch.arange(width, dtype=torch.int64)
    valid = torch.arange(width, dtype=torch.int64) < count[:, None]
    gather = torch.where(valid, idx, start[:, None])
    scatter = torch.where(valid, idx, dummy)
    return gather.flatten(), scatter.flatten(), valid


_GROUP_MEMO_SIZE = 4


def _groups(schedule: BlockSchedule, cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int,
            heads: int, device: torch.device) -> list[_Group]:
    """Host-built gather/scatter tables of every group, copied to ``device`` (no sync).

    Memoized on the schedule object for its cu_seqlens (compared by value), head count and
    device: a CP plan's schedules serve every layer, forward and backward, and rebuilding
    the groups cost ~11 ms per call at 1K documents (one CPU core)."""
    memo = schedule.__dict__.setdefault("_twin_groups", [])
    key = (total_q, total_k, heads, str(device))
    for k, cq, ck, groups in memo:
        if k == key and torch.equal(cq, cu_q) and torch.equal(ck, cu_k):
            return groups
    q_start, n_rows, k_start, n_keys = _work_items(schedule, cu_q, cu_k)
    out = []
    for members in _partition(n_rows.tolist(), n_keys.tolist(), heads):
        sel = torch.tensor(members, dtype=torch.int64)
        mq, mk = int(n_rows[sel].max()), int(n_keys[sel].max())
        qg, qs, qv = _padded_index(q_start[sel], n_rows[sel], mq, total_q)
        kg, ks, kv = _padded_index(k_start[sel], n_keys[sel], mk, total_k)
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        out.append(_Group(len(members), mq, mk, to(qg), to(qs), to(qv), to(kg), to(ks),
                          to(kv)))
    # A schedule is built for one cu_seqlens, so the memo holds one entry per head count and
    # device; the cap only guards a caller that reuses a schedule across batches.
    if len(memo) == _GROUP_MEMO_SIZE:
        memo.pop(0)
    memo.append((key, cu_q.clone(), cu_k.clone(), out))
    return out


def _group_mask(qp: Tensor, kp: Tensor, g: _Group, mask: tuple[bool, int, int, int],
                q_explicit: bool) -> Tensor:
    """[n, mq, mk] bool: visible pairs of gathered positions ``qp`` [n, mq], ``kp`` [n, mk];
    padded rows and padded keys see / are seen by nothing."""
    # Key position -1 is never visible (key intervals start at 0), which hides padded keys.
    vis = visible(qp, torch.where(g.k_valid, kp, -1), *mask, negative_is_padding=q_explicit)
    return vis & g.q_valid[:, :, None]


def _zero_rows(x: Tensor, pad: Tensor | None) -> Tensor:
    """Zero the gathered rows ``x`` [n*rows, ...] (a fresh copy) where ``pad`` [n*rows].

    masked_fill, not a multiply: 0 * NaN would stay NaN. On the CPU a padding-free group
    skips the pass; on a GPU that test would sync, so the fill always runs there.
    """
    if pad is None or (pad.device.type == "cpu" and not bool(pad.any())):
        return x
    return x.masked_fill_(pad.view(-1, *([1] * (x.dim() - 1))), 0)


def _heads_major(x: Tensor, g: _Group, rows: int, hkv: int, acc: torch.dtype,
                 scale: float | None = None) -> Tensor:
    """Gathered [n*rows, H, d] -> [n, Hkv, rows*group, d] in ``acc`` (times ``scale``).

    GQA folds the query heads of a KV head into rows, so K/V are never expanded. The layout
    change, the cast and the scale happen in one pass.
    """
    d = x.shape[-1]
    grp = x.shape[1] // hkv
    src = x.view(g.n, rows, hkv, grp, d).permute(0, 2, 1, 3, 4)
    dst = torch.empty(src.shape, dtype=acc, device=x.device)
    if scale is None:
        dst.copy_(src)
    else:
        torch.mul(src, scale, out=dst)
    return dst.view(g.n, hkv, rows * grp, d)


def _put_rows(buf: Tensor, x: Tensor, g: _Group, rows: int, hkv: int) -> None:
    """Write heads-major [n, Hkv, rows*group, d] into token rows ``g.q_scatter`` of ``buf``."""
    d = x.shape[-1]
    grp = x.shape[2] // rows
    src = x.view(g.n, hkv, rows, grp, d).permute(0, 2, 1, 3, 4)   # no copy: index_put_
    buf.view(buf.shape[0], hkv, grp, d).index_put_((g.q_scatter.view(g.n, rows),),
                                                   src.to(buf.dtype))


def _tokens_major(x: Tensor, g: _Group, rows: int, hkv: int) -> Tensor:
    """Inverse of :func:`_heads_major`: [n, Hkv, rows*group, d] -> [n*rows, H, d]."""
    d = x.shape[-1]
    grp = x.shape[2] // rows
    x = x.view(g.n, hkv, rows, grp, d).permute(0, 2, 1, 3, 4)
    return x.reshape(g.n * rows, hkv * grp, d)


def _chunks(hidden: Tensor) -> list[tuple[int, int, bool]]:
    """Key chunks ``(start, end, needs_mask)`` of a group's [n, mq, mk] hidden-pair mask.

    On the CPU the fully visible chunks are found up front (most of a causal block's keys)
    and skip the masking pass, ~10% of a tile's time in profiles. On a GPU that test would sync,
    so every chunk is masked there.
    """
    mk = hidden.shape[-1]
    starts = range(0, mk, _KEY_CHUNK)
    if hidden.device.type != "cpu":
        return [(c0, min(c0 + _KEY_CHUNK, mk), True) for c0 in starts]
    return [(c0, min(c0 + _KEY_CHUNK, mk), bool(hidden[:, :, c0:c0 + _KEY_CHUNK].any()))
            for c0 in starts]


def _masked_scores(qh: Tensor, kh: Tensor, hidden: Tensor | None, mq: int) -> Tensor:
    """Scores [n, Hkv, mq*group, kc] of (pre-scaled) queries, -inf where ``hidden``."""
    s = torch.matmul(qh, kh.transpose(-1, -2))
    if hidden is not None:
        n, hkv, rows, kc = s.shape
        s.view(n, hkv, mq, rows // mq, kc).masked_fill_(hidden[:, None, :, None, :],
                                                        float("-inf"))
    return s


def _group_operands(g: _Group, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
                    mask: tuple[bool, int, int, int], explicit: tuple[bool, bool],
                    acc: torch.dtype, softmax_scale: float
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """What forward and backward both need of one group: the hidden (not visible) pairs,
    the heads-major q (pre-scaled), k and v in the accumulation dtype with padding rows
    zeroed, and which gathered query rows are padding (None without explicit positions)."""
    hkv = k.shape[1]
    qp = q_pos.index_select(0, g.q_gather).view(g.n, g.mq)
    kp = k_pos.index_select(0, g.k_gather).view(g.n, g.mk)
    hidden = ~_group_mask(qp, kp, g, mask, explicit[0])
    q_pad = (qp < 0).view(-1) if explicit[0] else None
    k_pad = (kp < 0).view(-1) if explicit[1] else None
    qh = _heads_major(_zero_rows(q.index_select(0, g.q_gather), q_pad), g, g.mq, hkv, acc,
                      softmax_scale)
    kh = _heads_major(_zero_rows(k.index_select(0, g.k_gather), k_pad), g, g.mk, hkv, acc)
    vh = _heads_major(_zero_rows(v.index_select(0, g.k_gather), k_pad), g, g.mk, hkv, acc)
    return hidden, qh, kh, vh, q_pad


def _fwd_group(qh: Tensor, kh: Tensor, vh: Tensor, hidden: Tensor, mq: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Online softmax over key chunks of one group -> (out, lse, row max), heads-major.

    All three in the acc dtype; the row max is of the scaled scores, -inf on empty rows.

    Chunking the keys keeps each score tile (``_KEY_CHUNK`` wide) in cache: every
    elementwise pass over a tile that spills to DRAM costs about as much as its matmul.
    """
    m = denom = acc = None
    for c0, c1, masked in _chunks(hidden):
        s = _masked_scores(qh, kh[:, :, c0:c1], hidden[:, :, c0:c1] if masked else None, mq)
        m_new = s.amax(dim=-1, keepdim=True)
        m_new = m_new if m is None else torch.maximum(m, m_new)
        # Rows with nothing visible yet keep max -inf; shifting by 0 there gives exp(-inf)=0.
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = s.sub_(m_safe).exp_()
        pv = torch.matmul(p, vh[:, :, c0:c1])
        if m is None:  # first chunk: nothing to rescale (saves three passes on short keys)
            denom, acc = p.sum(dim=-1, keepdim=True), pv
        else:
            alpha = (m - m_safe).exp_()
            denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(alpha).add_(pv)
        m = m_new  # the true running max (-inf until a key is seen), so denom >= 1 below
    # denom >= 1 on rows with a visible key (the max contributes exp(0)); 0 on empty rows,
    # whose acc is 0 too, so clamping gives out 0 and log(0) gives lse -inf, never NaN.
    lse = m.masked_fill(m == float("-inf"), 0.0) + denom.log()
    return acc.div_(denom.clamp(min=1.0)), lse, m


def _bwd_group(qh: Tensor, kh: Tensor, vh: Tensor, doh: Tensor, delta: Tensor,
               row_lse: Tensor, hidden: Tensor, mq: int) -> tuple[Tensor, Tensor, Tensor]:
    """FA2 backward of one group over key chunks -> (dS K, dS^T Q, P^T dO), heads-major.

    ``qh`` is pre-scaled, so dS^T Q is already dK; dQ still needs the softmax scale.
    """
    dq = None
    dk = torch.empty_like(kh)
    dv = torch.empty(*kh.shape[:3], vh.shape[-1], dtype=vh.dtype, device=vh.device)
    for c0, c1, masked in _chunks(hidden):
        kc, vc = kh[:, :, c0:c1], vh[:, :, c0:c1]
        p = _masked_scores(qh, kc, hidden[:, :, c0:c1] if masked else None, mq)
        p = p.sub_(row_lse).exp_()
        dv[:, :, c0:c1] = torch.matmul(p.transpose(-1, -2), doh)  # GQA rows sum here
        ds = torch.matmul(doh, vc.transpose(-1, -2)).sub_(delta).mul_(p)
        dk[:, :, c0:c1] = torch.matmul(ds.transpose(-1, -2), qh)
        dq_c = torch.matmul(ds, kc)
        dq = dq_c if dq is None else dq.add_(dq_c)
    return dq, dk, dv


@torch.no_grad()  # differentiated by torch_bwd, never by autograd
def torch_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
              window_left: int, window_right: int, chunk_size: int,
              q_positions: Tensor | None, k_positions: Tensor | None,
              schedule: BlockSchedule | None = None, *, return_max: bool = False,
              check: bool = True) -> tuple[Tensor, ...]:
    """Varlen attention forward. -> (out [Tq, Hq, Dv] in q.dtype, lse fp32 [Hq, Tq]).

    With ``return_max`` also the row max of the scaled visible scores, fp32 [Hq, Tq]
    (-inf on rows that see nothing), for the max logit of QK-clip. ``check=False`` skips
    the argument checks (the api layer has run them already).
    """
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if check:
        _check_inputs(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    mask = (bool(causal), int(window_left), int(window_right), int(chunk_size or 0))
    tq, hq, tk, hkv = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    acc = _acc_dtype(q.dtype)
    sched = _schedule(schedule, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, q_positions,
                      k_positions)
    # One dummy row at the end of each buffer absorbs the padded slots' writes.
    out = torch.zeros(tq + 1, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((tq + 1, hq, 1), float("-inf"), dtype=torch.float32, device=q.device)
    row_max = torch.full_like(lse, float("-inf")) if return_max else None
    q_pos, k_pos = _positions(cu_q, cu_k, tq, tk, q_positions, k_positions, q.device)
    explicit = (q_positions is not None, k_positions is not None)
    for g in _groups(sched, cu_q, cu_k, tq, tk, hq, q.device):
        hidden, qh, kh, vh, _ = _group_operands(g, q, k, v, q_pos, k_pos, mask, explicit, acc,
                                                softmax_scale)
        o, row_lse, m = _fwd_group(qh, kh, vh, hidden, g.mq)
        _put_rows(out, o, g, g.mq, hkv)
        _put_rows(lse, row_lse, g, g.mq, hkv)
        if row_max is not None:
            _put_rows(row_max, m, g, g.mq, hkv)
    lse_HT = lse[:tq, :, 0].t().contiguous()
    if row_max is None:
        return out[:tq], lse_HT
    return out[:tq], lse_HT, row_max[:tq, :, 0].t().contiguous()


@torch.no_grad()
def torch_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
              max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
              window_right: int, chunk_size: int, q_positions: Tensor | None,
              k_positions: Tensor | None, schedule: BlockSchedule | None = None, *,
              dlse: Tensor | None = None, stats: Tensor | None = None, check: bool = True
              ) -> tuple[Tensor, Tensor, Tensor]:
    """FA2 backward from the given (possibly merged) out/lse. -> (dq, dk, dv), input dtypes.

    ``out``/``lse`` are never recomputed: with the final merged ones of a ring step this
    yields that step's partial gradients. dK/dV are summed over each GQA group.
    ``dlse`` [Hq, Tq] (None = 0) is the gradient of the LSE output: since dlse/dS = P it
    enters as delta = rowsum(dO * O) - dlse. ``stats``: :func:`torch_bwd_stats` of these
    arguments, computed once by a caller that makes several calls with them.
    """
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    if check:
        _check_inputs(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    if check and (tuple(lse.shape) != (q.shape[1], q.shape[0]) or out.shape != dout.shape):
        raise ValueError(f"lse must be [Hq, Tq]={[q.shape[1], q.shape[0]]} and out like dout "
                         f"{tuple(dout.shape)}; got lse {tuple(lse.shape)}, "
                         f"out {tuple(out.shape)}")
    mask = (bool(causal), int(window_left), int(window_right), int(chunk_size or 0))
    tq, hq, tk, hkv = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    acc = _acc_dtype(q.dtype)
    sched = _schedule(schedule, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, q_positions,
                      k_positions)
    dq = torch.zeros(tq + 1, hq, q.shape[-1], dtype=acc, device=q.device)
    dk = torch.zeros(tk + 1, hkv, k.shape[-1], dtype=acc, device=k.device)
    dv = torch.zeros(tk + 1, hkv, v.shape[-1], dtype=acc, device=v.device)
    if stats is None:
        stats = torch_bwd_stats(dout, out, lse, dlse)
    delta_TH = stats[0].t().to(acc)
    # Rows that see no key anywhere: lse +inf makes P = exp(s - inf) = 0 (their delta is 0).
    # The natural-log lse, not the stats' base-2 copy: a round trip through log2(e) moved
    # P = 1 of a single visible key by an fp16 ulp of dV.
    lse_TH = lse.t().to(acc).masked_fill(lse.t() == float("-inf"), float("inf"))
    q_pos, k_pos = _positions(cu_q, cu_k, tq, tk, q_positions, k_positions, q.device)
    explicit = (q_positions is not None, k_positions is not None)
    for g in _groups(sched, cu_q, cu_k, tq, tk, hq, q.device):
        hidden, qh, kh, vh, q_pad = _group_operands(g, q, k, v, q_pos, k_pos, mask, explicit,
                                                    acc, softmax_scale)
        doh = _heads_major(_zero_rows(dout.index_select(0, g.q_gather), q_pad), g, g.mq, hkv,
                           acc)
        # Padding rows get delta 0 and lse 0 (their P is 0 through ``hidden`` anyway).
        rows = _zero_rows(torch.stack([delta_TH.index_select(0, g.q_gather),
                                       lse_TH.index_select(0, g.q_gather)], dim=-1), q_pad)
        delta, row_lse = _heads_major(rows, g, g.mq, hkv, acc).unbind(-1)
        dq_g, dk_g, dv_g = _bwd_group(qh, kh, vh, doh, delta[..., None], row_lse[..., None],
                                      hidden, g.mq)
        _put_rows(dq, dq_g.mul_(softmax_scale), g, g.mq, hkv)
        dk.index_add_(0, g.k_scatter, _tokens_major(dk_g, g, g.mk, hkv))
        dv.index_add_(0, g.k_scatter, _tokens_major(dv_g, g, g.mk, hkv))
    return dq[:tq].to(q.dtype), dk[:tk].to(k.dtype), dv[:tk].to(v.dtype)


@torch.no_grad()
def torch_bwd_stats(dout: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None = None
                    ) -> Tensor:
    """[2, Hq, Tq] in the accumulation dtype: delta = rowsum(dO * O) - dlse and lse * log2(e)
    (the Triton kernels' layout), 0 and +inf on rows whose lse is -inf: such a row sees no
    key, P = exp(s - inf) = 0 there, and 0 keeps a non-finite rowsum(dO * O) out of
    0 * (dP - delta)."""
    acc = _acc_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1).t()
    if dlse is not None:
        delta = delta - lse_grad_rows(dlse, lse).to(acc)
    dead = lse == float("-inf")
    return torch.stack([delta.masked_fill(dead, 0.0),
                        (lse.to(acc) * _LOG2E).masked_fill(dead, float("inf"))])
