"""The memory walk of the staged engine: what one layer's call holds at its peaks, per rank.

``strategies.selected_keys``' engine allocates exchange buffers, picked K/V, the output and
its fp32 accumulator, dQ, the fp32 dK|dV accumulator and the returns in flight in a fixed
program order; :func:`staged_memory` mirrors those allocations and frees one by one on the
host, every rank at once (int64 vectors; the engine's per-rank branches are masks), from
the transfer counts alone. ``timing.default_stages`` caps the stage count with it (never
more memory than the call without overlap). tests/tables/test_staged_memory.py tallies the
engine's real live bytes on CPU (a ``TorchDispatchMode``) against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...masks import AttnMask
from ...plan import CPPlan
from ..selected import fetch_count_array, pair_count_array
from ...shape import AttnShape
from .links import stage_links
from .routes import gather_stage_rows, transfers


@dataclass(frozen=True)
class StagedMemory:
    """Per rank, bytes the call holds at its ``forward`` peak beyond its inputs (q, k, v)
    and at its ``backward`` peak beyond q and dout (``kept`` included), and ``kept``: what
    the forward keeps for the backward beyond q, out and lse (the picked K/V, and the local
    k, v when a local call needs them)."""

    forward: list[int]
    backward: list[int]
    kept: list[int]

    @property
    def peak(self) -> list[int]:
        return [max(f, b) for f, b in zip(self.forward, self.backward)]


class _Live:
    """Bytes alive on every rank (numpy int64 [cp]: a walk is a few hundred operations on
    [cp] vectors, ~3x cheaper each than torch's), and their peak, as a walk allocates and
    frees; ``where`` limits a step to some ranks (the walk's branches, as masks)."""

    def __init__(self, base: np.ndarray) -> None:
        self.now = base.copy()
        self.peak = base.copy()

    def alloc(self, n: np.ndarray | int, where: np.ndarray | None = None) -> None:
        self.now = self.now + (n if where is None else np.where(where, n, 0))
        self.peak = np.maximum(self.peak, self.now)

    def free(self, n: np.ndarray | int, where: np.ndarray | None = None) -> None:
        self.now = self.now - (n if where is None else np.where(where, n, 0))


@dataclass(frozen=True)
class _Walk:
    """What the engine's allocations depend on, every rank at once (int64 [r] or [P, r])."""

    name: str
    cp: int
    t: np.ndarray           # local tokens
    fetched: np.ndarray     # [P, r] keys a rank takes in each transfer
    given: np.ndarray       # [P, r] keys others take from a rank in each transfer
    own: np.ndarray         # local keys the queries see
    keys: np.ndarray        # [P, r] keys of each transfer's call
    local: np.ndarray       # bool: a separate local call (S >= 2)
    one: bool                 # S = 1: one call over local and fetched keys
    slices: tuple             # all_gather's row slices per transfer
    b: int                    # dtype bytes
    kv: int                   # bytes of a K|V row, and in fp32
    kv4: int
    o: int                    # bytes of an output row, and in fp32
    o4: int
    g: int                    # bytes of a dQ row, and in fp32
    g4: int
    halves: tuple[int, int]   # bytes of a K row and of a V row (S = 1 picks them apart)

    @property
    def n_parts(self) -> int:
        return self.fetched.shape[0]

    @property
    def zero(self) -> np.ndarray:
        return np.zeros(self.cp, dtype=np.int64)

    def post(self, live: _Live, p: int) -> tuple[np.ndarray, np.ndarray]:
        """A transfer posted: its (send, receive) buffers (returned), built with their
        temporaries."""
        if self.name == "dispatch":   # two halves, cat into the send buffer; the receive
            live.alloc(self.given[p] * self.kv)
            live.alloc(self.given[p] * self.kv)
            live.free(self.given[p] * self.kv)
            live.alloc(self.fetched[p] * self.kv)
            return self.given[p] * self.kv, self.fetched[p] * self.kv
        lo, hi = self.slices[p]        # the zero-padded slice; the gathered slices
        live.alloc((1 + self.cp) * (hi - lo) * self.kv)
        return self.zero + (hi - lo) * self.kv, self.zero + self.cp * (hi - lo) * self.kv


def _forward_walk(w: _Walk) -> tuple[np.ndarray, np.ndarray]:
    """(peak beyond q, k, v; bytes kept for the backward) of the forward."""
    t, kv, o = w.t, w.kv, w.o
    live, have = _Live(w.zero), w.zero
    none = (w.zero, w.zero)
    xchg = w.post(live, 0) if w.n_parts else none
    acc = np.where(w.local, t * o, 0)
    live.alloc(t * o, w.local)                               # the local call's output
    for p in range(w.n_parts):
        nxt = w.post(live, p + 1) if p + 1 < w.n_parts else none
        live.free(xchg[0])      # the send buffer goes with the transfer, once it is in
        if w.one:   # every key: fetched ones picked, local ones copied, per K and V half
            for half in w.halves:
                live.alloc(w.keys[p] * half)
                live.alloc(w.fetched[p] * half)
                live.free(w.fetched[p] * half)
                live.alloc(w.own * half)
                live.free(w.own * half)
        else:
            live.alloc(w.keys[p] * kv)
        have = have + w.keys[p] * kv
        live.free(xchg[1])      # the receive buffer, once picked
        xchg = nxt
        k = w.keys[p] > 0
        live.alloc(t * o, k)                                 # the call's output
        first, later = k & (acc == 0), k & (acc != 0)
        to_fp32 = later & (acc == t * o) & (w.b != 4)        # the first fold: fp32
        live.alloc(t * w.o4, to_fp32)
        live.free(acc, to_fp32)
        acc = np.where(first, t * o, np.where(to_fp32, t * w.o4, acc))
        live.free(t * o, later)
    live.alloc(t * o, (acc != t * o) & (acc != 0))           # out in q.dtype
    return live.peak, have + np.where(w.local, t * kv, 0)  # k, v kept for the local call


def _backward_walk(w: _Walk, have: np.ndarray) -> np.ndarray:
    """Peak of the backward beyond q and dout (what the forward kept included)."""
    t, kv, kv4, g, g4 = w.t, w.kv, w.kv4, w.g, w.g4
    live = _Live(have)
    calls = w.local.astype(np.int64) + (w.keys > 0).sum(0)
    acc_kv, dq, prev = w.zero, w.zero, w.zero

    def call_out(where: np.ndarray) -> None:
        nonlocal dq
        fp32 = where & (dq == 0) & (calls > 1) & (w.b != 4)  # dq made fp32 at once
        live.alloc(t * g4, fp32)
        live.free(t * g, fp32)
        live.free(t * g, where & (dq != 0))
        dq = np.where(fp32, t * g4, np.where(where & (dq == 0), t * g, dq))

    def accumulator(where: np.ndarray | None = None) -> None:
        nonlocal acc_kv
        new = acc_kv == 0 if where is None else where & (acc_kv == 0)
        live.alloc(t * kv4, new)
        acc_kv = np.where(new, t * kv4, acc_kv)

    def fold(p: int) -> None:
        """Transfer p's returns land: in fp32 (a copy unless the input is fp32), added;
        then that transfer's buffers go."""
        accumulator()
        extra = w.given[p] * kv4 * (w.b != 4)
        live.alloc(extra)
        live.free(extra + prev)

    for p in range(w.n_parts):
        keys, k = w.keys[p], w.keys[p] > 0
        live.alloc(t * g + keys * kv, k)                    # dq, dk, dv of the call
        call_out(k)
        live.alloc(keys * kv, k)                            # packed dK|dV
        live.free(keys * kv, k)
        live.alloc(keys * kv, ~k)
        if w.one:                                           # local rows picked, in fp32
            accumulator()
            live.alloc(w.own * (kv + kv4 * (w.b != 4)))
            live.free(w.own * (kv + kv4 * (w.b != 4)))
        live.alloc((w.fetched[p] + w.given[p]) * kv)        # send (picked), receive
        live.free(keys * kv)
        if p:                                               # the previous returns land
            fold(p - 1)
        prev = (w.fetched[p] + w.given[p]) * kv
    live.alloc(t * g + t * kv, w.local)                     # the local call
    call_out(w.local)
    accumulator(w.local)
    live.free(t * kv, w.local)
    if w.n_parts:
        fold(w.n_parts - 1)
    back = (dq == t * g4) & (w.b != 4)                      # dq in q.dtype
    live.alloc(t * g, back)
    live.free(t * g4, back)
    live.alloc(t * kv)                                      # dk, dv
    return live.peak


def staged_memory(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, stages: int
                  ) -> StagedMemory:
    """Host count of the buffers ``selected_keys``' engine allocates, walked in its program
    order (its allocations and frees, mirrored one by one), every rank at once (int64
    vectors; the engine's per-rank branches are masks): exchange buffers (the transfer in
    flight and the next), picked K/V, the output and its fp32 accumulator, dQ (fp32 when
    the rank makes several calls), the fp32 dK|dV accumulator, one call's gradients, the
    returns in flight. Not counted: the kernels' own workspaces, [H, T] tensors (LSE, fold
    weights), index tables."""
    b = shape.dtype_bytes
    *hops, counts = stage_links(name, plan, mask, stages)
    one = stages == 1 and counts.shape[0] > 0      # one call over local and fetched keys
    own = np.diagonal(fetch_count_array(plan, mask))
    offsets = plan.arrays.rank_offsets
    o, g = shape.n_heads * shape.value_dim, shape.n_heads * shape.head_dim
    # relayed dispatch: its hops' buffers as one transfer's (received: both hops' rows;
    # sent: both hops'); approximate there: the walk mirrors the one-hop engine
    w = _Walk(name, plan.cp_size, offsets[1:] - offsets[:-1], sum(h.sum(2) for h in hops),
              sum(h.sum(1) for h in hops), own, counts.sum(2) + (own if one else 0),
              (np.diagonal(pair_count_array(plan, mask)) > 0) & (not one), one,
              gather_stage_rows(plan, transfers(stages)) if name == "all_gather" else (),
              b, shape.kv_row, shape.kv_row * 4 // b, o * b, o * 4, g * b, g * 4,
              (shape.n_kv_heads * shape.head_dim * b, shape.n_kv_heads * shape.value_dim * b))
    fwd, have = _forward_walk(w)
    return StagedMemory(fwd.tolist(), _backward_walk(w, have).tolist(), have.tolist())
