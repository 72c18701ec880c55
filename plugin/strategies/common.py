"""Pieces every CP strategy shares: argument checks, token holders, kernel calls, groups.

A *holder* is a set of tokens that one kernel call sees as its queries or keys: a CP rank's
local tokens (p2p, all_gather), or the union of a Ulysses group's tokens (a2a, a2a+p2p).
Every holder keeps the plan's invariant: segment i is document i, positions increase inside
a segment, padding (position < 0) last. So any two holders pair up as one varlen call with
explicit positions, and the host can count exactly which pairs see anything.

Host tables are built once per (plan, mask, strategy, block sizes) with ``plan.cached`` and
copied to the device once (``non_blocking=True``); the forward and backward never read a
device tensor on the host. Limits: the fingerprint check (``validate=True``) reads one
all-reduced integer back to the host, a sync, which is why it is optional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..kernels import BlockSchedule, block_sizes_for, build_block_schedule
from ..kernels import max_logit_of, varlen_attn_bwd, varlen_attn_fwd
from ..masks import AttnMask

# Sort keys combine (segment, position) as segment * SORT_STRIDE + position; positions and the
# mask's unbounded ends (2^40) stay below it.
SORT_STRIDE = 1 << 42

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------- checks
def resolve_group(group: dist.ProcessGroup | None, cp_size: int) -> dist.ProcessGroup | None:
    """The process group to use: ``group``, else the default group; checks its size."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"group: torch.distributed is not initialized, but the plan has "
                         f"cp_size={cp_size} > 1")
    if group is None:
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    if size != cp_size:
        raise ValueError(f"group: size {size} differs from the plan's cp_size={cp_size}")
    return group


def check_rank(group: dist.ProcessGroup | None, cp_rank: int) -> None:
    """ValueError unless this process is ``cp_rank`` of ``group``."""
    rank = dist.get_rank(group)
    if rank != cp_rank:
        raise ValueError(f"plan: built for cp_rank={cp_rank}, but this process is rank "
                         f"{rank} of the group")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                 mask: Any) -> None:
    """Local q/k/v against the plan and each other (shapes, dtypes, devices only)."""
    if not isinstance(mask, AttnMask):
        raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [local_tokens, heads, head_dim], "
                             f"got {getattr(t, 'shape', type(t))}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype must be float16, bfloat16 or float32, got "
                             f"{t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    n_local = plan.num_tokens_of(plan.cp_rank)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != n_local:
            raise ValueError(f"{name} has {t.shape[0]} local tokens, but the plan gives "
                             f"rank {plan.cp_rank} {n_local} tokens")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dims differ: q has {q.shape[2]}, k has {k.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]} (GQA)")


def check_head_split(n_heads: int, n_kv_heads: int, parts: int, what: str) -> int:
    """K/V heads per part after an all-to-all over ``parts`` ranks (replicating K/V heads
    when there are fewer than ``parts``); ValueError when heads don't divide."""
    if n_heads % parts:
        raise ValueError(f"{what}: Hq={n_heads} must be divisible by {parts} (heads are "
                         f"split across the all-to-all ranks)")
    if n_kv_heads % parts == 0:
        return n_kv_heads // parts
    if parts % n_kv_heads == 0:
        return 1  # each K/V head replicated parts // n_kv_heads times
    raise ValueError(f"{what}: Hkv={n_kv_heads} and the all-to-all size {parts} must divide "
                     f"one another (K/V heads are split, or replicated when fewer)")


def check_fingerprint(plan: Any, group: dist.ProcessGroup | None,
                      device: torch.device) -> None:
    """All ranks built the same plan: MAX and MIN of the fingerprint agree (one
    all-reduce of [fp, -fp] with MAX). Reads the result on the host: a sync."""
    fp = plan.fingerprint()
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = (int(x) for x in t.cpu())
    if hi != -neg_lo:
        raise ValueError(f"plan: ranks built different plans (fingerprints range "
                         f"{-neg_lo}..{hi}); every rank must build the plan from the same "
                         f"global cu_seqlens, cp_size and layout")


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` (P2P ops address global ranks)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ------------------------------------------------------------------------------ holders
@dataclass(frozen=True)
class Holder:
    """Tokens one kernel call sees as queries or keys (host tensors).

    cu: int32 [n_docs+1]; pos: int32 [n]; max_len: longest segment.
    """

    cu: torch.Tensor
    pos: torch.Tensor
    max_len: int

    @property
    def n_tokens(self) -> int:
        return int(self.pos.numel())


def rank_holder(plan: Any, rank: int) -> Holder:
    """Holder of ``rank``'s local tokens."""
    return Holder(plan.local_cu_seqlens_of(rank), plan.positions_of(rank),
                  plan.max_local_seqlen_of(rank))


def segment_ids(cu: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: segment of each row of a varlen batch with boundaries ``cu``."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=n)


def merged_order(plan: Any, members: list[int]) -> tuple[torch.Tensor, Holder]:
    """Order and holder of the union of ``members``' local tokens.

    ``order`` [N] indexes the concatenation of the members' local tokens (member order) and
    lists them segment by segment, by position, padding last: the layout the Ulysses
    all-to-all hands to local attention.
    """
    doc = torch.cat([segment_ids(plan.local_cu_seqlens_of(r), plan.num_tokens_of(r))
                     for r in members])
    pos = torch.cat([plan.positions_of(r).to(torch.int64) for r in members])
    key = doc * SORT_STRIDE + torch.where(pos >= 0, pos, torch.full_like(pos, SORT_STRIDE - 1))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(doc, minlength=plan.n_docs)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    max_len = int(counts.max()) if counts.numel() else 0
    return order, Holder(cu.to(torch.int32), pos[order].to(torch.int32), max_len)


def visible_pairs(q: Holder, k: Holder, mask: AttnMask) -> int:
    """Exact number of visible (query, key) pairs between two holders (host)."""
    kpos = k.pos.to(torch.int64)
    kdoc = segment_ids(k.cu, kpos.numel())
    live = kpos >= 0
    keys = torch.sort(kdoc[live] * SORT_STRIDE + kpos[live]).values
    lo, hi = mask.key_interval(q.pos)  # padding queries: empty (lo > hi)
    base = segment_ids(q.cu, q.pos.numel()) * SORT_STRIDE
    n = (torch.searchsorted(keys, base + hi, right=True)
         - torch.searchsorted(keys, base + lo))
    return int(n.clamp(min=0).sum())


# --------------------------------------------------------------------------- kernel calls
@dataclass(frozen=True)
class KernelCall:
    """Everything but the tensors of one varlen kernel call (host or device copies)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    schedule: BlockSchedule

    @property
    def visited_pairs(self) -> int:
        return self.schedule.visited_pairs

    def to(self, device: torch.device) -> "KernelCall":
        """Copy the tables to ``device`` once, without a sync."""
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        return KernelCall(mv(self.cu_q), mv(self.cu_k), self.max_q, self.max_k,
                          mv(self.q_pos), mv(self.k_pos), self.schedule.to(device))


def kernel_call(q: Holder, k: Holder, mask: AttnMask, block: tuple[int, int]) -> KernelCall:
    """Host tables (and tile schedule) of the call ``q`` holder x ``k`` holder."""
    causal, wl, wr, chunk = mask.params
    sched = build_block_schedule(q.cu, k.cu, q.max_len, k.max_len, causal=causal,
                                 window_left=wl, window_right=wr, chunk_size=chunk,
                                 q_positions=q.pos, k_positions=k.pos, block_m=block[0],
                                 block_n=block[1])
    return KernelCall(q.cu, k.cu, q.max_len, k.max_len, q.pos, k.pos, sched)


@dataclass(frozen=True)
class Attn:
    """The per-call constants every kernel invocation of a strategy shares."""

    mask: AttnMask
    scale: float
    backend: str

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: KernelCall,
            need_max: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, lse, row_max): row_max fp32 [Hq, Tq] when ``need_max``, else None."""
        res = varlen_attn_fwd(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, self.scale,
                              self.mask.causal, self.mask.window_size,
                              chunk_size=self.mask.chunk_size, q_positions=c.q_pos,
                              k_positions=c.k_pos, backend=self.backend, schedule=c.schedule,
                              return_max_logit=need_max)
        return res if need_max else (*res, None)

    def bwd(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, c: KernelCall,
            dlse: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This call's (dq, dk, dv) given the FINAL out/lse and their gradients."""
        return varlen_attn_bwd(dout, q, k, v, out, lse, c.cu_q, c.cu_k, c.max_q, c.max_k,
                               self.scale, self.mask.causal, self.mask.window_size,
                               chunk_size=self.mask.chunk_size, q_positions=c.q_pos,
                               k_positions=c.k_pos, backend=self.backend, schedule=c.schedule,
                               dlse=dlse)


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
    return dlse.contiguous()


def block_for(backend: str, device: torch.device, head_dim: int, head_dim_v: int
              ) -> tuple[int, int]:
    """Tile sizes the host schedules must be built with for ``backend`` on ``device``."""
    return tuple(block_sizes_for(backend, device, head_dim, head_dim_v))


def cached_on(plan: Any, key: tuple, device: torch.device, build: Callable[[], Any]) -> Any:
    """Host tables ``build()`` cached in the plan under ``key``, and their copy on
    ``device`` (made once, non_blocking) under ``key + (device,)``."""
    host = plan.cached(key, build)
    return plan.cached(key + ("device", str(device)), lambda: _to_device(host, device))


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if hasattr(x, "to") and not isinstance(x, (int, float, str)):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to_device(e, device) for e in x)
    if isinstance(x, list):
        return [_to_device(e, device) for e in x]
    return x


# ------------------------------------------------------------------------------ packing
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
