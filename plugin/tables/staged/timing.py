"""The time model of the staged strategies, and the default stage count it chooses.

Time (``staged_time``; per layer, forward + backward, every rank simulated, since a
collective ends for all when its last rank has posted it and its bytes have moved):
c_s is the compute of stage s on a rank (visible pairs x FLOPs per pair / flops_per_s; a
fetched stage's pairs are the rank's pairs with each owner's keys in proportion to that
owner's keys in it, plus ``stage_latency_s`` and the fold's memory traffic), t_s the
transfer of stage s (the most K/V rows a rank sends or receives in it, those of its own
node / bytes_per_s and those of other nodes / cross_node_bytes_per_s on their own links,
the longer; t_0 = 0: the local keys need none). Dispatch relayed through nodes moves a
transfer in three collectives, each on its own group (``strategies.relay_group``): its
first hop's cross-node rows on the CP group, its in-node rows on the node's direct group,
its second hop (after the cross-node rows have landed) on the node's relay group, the
last two one more ``stage_latency_s`` each; each waits only for its group's previous one
(and its post), and stage s computes once all three have landed.
The forward posts stage s+1 when stage s-1 has computed, so with equal ranks (one hop)

    forward  = t_0 + sum_{s=0..S-1} max(c_s, t_{s+1})       (t_S = 0)

the per-stage max(compute, transfer) plus the first transfer; the backward computes the
fetched stages first, posting each one's dK/dV return r_s while the next one computes, and
the local stage last, under the last return: b_1 + sum_{s=1..S-1} max(b_{s+1}, r_s) with
b_S the local stage (a return is folded before the stage after next computes, which the
simulation follows). S = 1 is the sequential t + c (forward) and c + r (backward).

``default_stages`` picks the S in ``CANDIDATE_STAGES`` (1..``MAX_STAGES``) with the least
time (the fewest among those within 1%) among those whose peak memory per rank
(``memory.staged_memory``, a host walk of the engine's allocations) is no more than
S = 1's: enough stages to hide the transfer, no more, since each adds a latency and an
unfused fold (T x Hq x Dv x (16 + dtype bytes) of memory traffic, 0.2 ms at 8K tokens, 32
heads, bf16 on an H100), and never more memory than the call without overlap.

Limits: latency and fold traffic are two constants of the cost model, not measured; a
relay's three groups are timed as running at once (no GPU has measured it yet), and its
two node groups' NVLink rows as not slowing each other; a
stage's compute is proportional within an owner's keys; kernels are assumed not to slow
down when a transfer runs beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...masks import AttnMask
from ...plan import CPPlan
from ..cost_model import CostModel, check_model
from ..cache import host_table, table_key
from ..selected import fetch_count_array, pair_count_array
from ..traffic import cross_node
from ...shape import AttnShape
from .memory import staged_memory
from .links import stage_links_of
from .routes import gather_stage_rows, transfers

MAX_STAGES = 8          # the default search range; a user may ask for more
# S values the default tries: the times of neighbouring S differ by little once S passes 4.
CANDIDATE_STAGES = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class StagedTime:
    """Estimated seconds of one layer with S stages (module docstring)."""

    stages: int                    # stages that run (empty transfers dropped)
    forward_s: float
    backward_s: float
    compute_s: float               # forward + backward compute, slowest rank, no overheads
    comm_s: float                  # forward + backward transfer time, summed
    bound_s: float                 # every transfer hidden at no cost: per phase
                                   # max(compute, transfer)

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


def _flops_per_pair(shape: AttnShape) -> tuple[float, float]:
    """(forward, backward) FLOPs per visible pair, all query heads (as ``auto``)."""
    d, dv = shape.head_dim, shape.value_dim
    return 2.0 * (d + dv) * shape.n_heads, (6.0 * d + 4.0 * dv) * shape.n_heads


_FS = 1e15   # the pipeline simulation counts integer femtoseconds (exact int64 vectors)


def _fs(seconds: float) -> int:
    return round(seconds * _FS)


@dataclass(frozen=True)
class _Rates:
    """What every stage count's simulation shares (numpy int64 [cp] or [cp, cp])."""

    vis: np.ndarray        # [d, o] visible pairs
    fetch: np.ndarray      # [d, o] keys fetched, at least 1
    local: np.ndarray      # visible pairs with the local keys
    elems_o: np.ndarray    # output elements per rank (all heads)
    elems_q: np.ndarray    # dQ elements per rank


def _rates(plan: CPPlan, mask: AttnMask, shape: AttnShape) -> _Rates:
    vis = pair_count_array(plan, mask)
    offsets = plan.arrays.rank_offsets
    tokens = offsets[1:] - offsets[:-1]
    return _Rates(vis, np.maximum(fetch_count_array(plan, mask), 1), np.diagonal(vis),
                  tokens * (shape.n_heads * shape.value_dim),
                  tokens * (shape.n_heads * shape.head_dim))


def _simulate(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, model: CostModel,
              stage_list: tuple[int, ...], r: _Rates) -> dict[int, StagedTime]:
    """``staged_time`` of every S in ``stage_list`` on shared inputs, in one pass: the
    per-stage counts of all S concatenated (one set of numpy operations instead of one per
    S), and the pipelines of all S run side by side on [S, cp] int64 arrays, each S's
    steps beyond its own transfers masked out (integer math: the same values as one S at
    a time). An ``auto`` batch at cp 8 runs 4 of these where it ran 14 simulations: 1.8 ->
    1.6 ms with the stage counts they build, which now cost most of it."""
    cp = plan.cp_size
    f_fwd, f_bwd = _flops_per_pair(shape)
    rate, row = model.flops_per_s, shape.kv_row
    links = stage_links_of(name, plan, mask, stage_list)             # per S: hops, keys
    sizes = [lk[-1].shape[0] for lk in links]
    first = np.cumsum([0] + sizes)
    counts = np.concatenate([lk[-1] for lk in links])                 # [sum P, d, o]
    pairs_all = ((counts * r.vis) // r.fetch).sum(2)                # [sum P, d], proportional
    nodes = model.nodes(cp, plan.topology)
    cross_mask = cross_node(nodes) if nodes.any() else None

    def hop_seconds(rows: np.ndarray) -> np.ndarray:
        # per transfer: its slowest rank's rows sent or received (the larger), on each link
        if cross_mask is None:
            inside, cross_rows = rows, 0
        else:   # several nodes: the rows between nodes apart
            cross = rows * cross_mask
            inside = rows - cross
            cross_rows = np.maximum(cross.sum(2), cross.sum(1)) * row
        return model.link_seconds(np.maximum(inside.sum(2), inside.sum(1)) * row,
                                  cross_rows).max(1)

    # dK/dV returns (and dispatch's sends: the same rows) per transfer, on three chains
    # of collectives (the CP group, a relay's direct and relay groups): a relay's first
    # hop's cross-node rows, its in-node rows, its second hop (each node-group collective
    # one more latency); else the one hop on the CP group.
    n_hops = len(links[0]) - 1
    rows_of = [np.concatenate([lk[h] for lk in links]) for h in range(n_hops)]
    n_all = rows_of[0].shape[0]
    if n_hops == 2:
        lat = model.stage_latency_s
        chains = [hop_seconds(rows_of[0] * cross_mask),
                  hop_seconds(rows_of[0] * ~cross_mask) + lat, hop_seconds(rows_of[1]) + lat]
    else:
        chains = [hop_seconds(rows_of[0]), np.zeros(n_all), np.zeros(n_all)]
    chains = [c.tolist() for c in chains]
    peers_in = np.bincount(nodes, minlength=int(nodes.max()) + 1)[nodes] - 1
    peers_cross = cp - 1 - peers_in
    out: dict[int, StagedTime] = {}
    piped = []   # (S, its index, sends, backs, compute, comm, bound) of the S that overlap
    for i, stages in enumerate(stage_list):
        a, n_parts = int(first[i]), sizes[i]
        back = tuple(c[a:a + n_parts] for c in chains)
        if name == "dispatch":
            send = back
        else:   # every rank sends (cp - 1) copies of its slice, to its node and others
            send = ([float(model.link_seconds(peers_in * (hi - lo) * row,
                                              peers_cross * (hi - lo) * row).max())
                     for lo, hi in gather_stage_rows(plan, transfers(stages))],
                    [0.0] * n_parts, [0.0] * n_parts)
        work = int((r.local + pairs_all[a:a + n_parts].sum(0)).max())
        compute = work * (f_fwd + f_bwd) / rate
        comm = sum(map(sum, send)) + sum(map(sum, back))
        # each phase's transfers at no cost beyond their links: the three chains side by
        # side
        bound = max(work * f_fwd / rate, *map(sum, send)) \
            + max(work * f_bwd / rate, *map(sum, back))
        if stages == 1 or n_parts == 0:   # one exchange, one call: nothing overlaps
            # (a relay's in-node rows beside its cross-node rows and second hop; back:
            # the second hop reversed, then the other two beside each other)
            fwd = sum(max(x + h, d) for x, d, h in zip(*send)) + work * f_fwd / rate
            bwd = work * f_bwd / rate + sum(h + max(x, d) for x, d, h in zip(*back))
            out[stages] = StagedTime(1, fwd, bwd, compute, comm, bound)
        else:
            piped.append((stages, i, send, back, compute, comm, bound))
    if piped:
        spans = [(int(first[i]), sizes[i], send, back) for _, i, send, back, *_ in piped]
        fwd, bwd = _pipelines(spans, pairs_all, r, shape, model)
        for j, (stages, i, _, _, compute, comm, bound) in enumerate(piped):
            out[stages] = StagedTime(sizes[i] + 1, fwd[j] / _FS, bwd[j] / _FS, compute, comm,
                                     bound)
    return out


def _pipelines(spans: list[tuple[int, int, tuple, tuple]], pairs_all: np.ndarray, r: _Rates,
               shape: AttnShape, model: CostModel) -> tuple[list[int], list[int]]:
    """Forward and backward end times (int femtoseconds, slowest rank) of the staged
    pipelines of several stage counts side by side: ``spans`` gives each one's first row and
    stage count in ``pairs_all`` [sum P, cp] and its transfer and return seconds per
    transfer on each of three chains (``_simulate``: a relay's cross-node rows, in-node
    rows, second hop; 0 on the last two but for a relay)."""
    f_fwd, f_bwd = _flops_per_pair(shape)
    rate, mem, b = model.flops_per_s, model.memory_bytes_per_s, shape.dtype_bytes
    up = (b + 4) if b != 4 else 0          # a conversion to fp32 and back, per element
    live_all = pairs_all > 0
    lat = _fs(model.stage_latency_s)
    # forward: each fetched stage + fold (acc *= w, acc += o * w_i: 16 + b bytes per element)
    c_all = np.where(live_all, pairs_all * _fs(f_fwd / rate) + r.elems_o * _fs((16 + b) / mem)
                     + lat, 0)
    # backward: dq += dq_s: 8 + b bytes per element (dq to fp32 and back counted with the
    # local call)
    bb_all = np.where(live_all, pairs_all * _fs(f_bwd / rate)
                      + r.elems_q * _fs((8 + b) / mem) + lat, 0)
    n_s, cp = len(spans), pairs_all.shape[1]
    most = max(k for _, k, _, _ in spans)
    n = np.array([k for _, k, _, _ in spans], dtype=np.int64)
    c = np.zeros((n_s, most, cp), dtype=np.int64)
    bb = np.zeros((n_s, most, cp), dtype=np.int64)
    send_fs = np.zeros((3, n_s, most), dtype=np.int64)   # [chain, S, transfer]
    back_fs = np.zeros((3, n_s, most), dtype=np.int64)
    folds = np.zeros((n_s, cp), dtype=bool)        # 2+ partials on this rank
    for j, (a, k, send, back) in enumerate(spans):
        c[j, :k], bb[j, :k] = c_all[a:a + k], bb_all[a:a + k]
        for h in range(3):
            send_fs[h, j, :k] = [_fs(x) for x in send[h]]
            back_fs[h, j, :k] = [_fs(x) for x in back[h]]
        folds[j] = live_all[a:a + k].any(0)
    # the local calls (+ out / dq to fp32 and back when partials fold)
    c0 = r.local * _fs(f_fwd / rate) + np.where(folds, r.elems_o * _fs(2 * up / mem), 0)
    b0 = r.local * _fs(f_bwd / rate) + np.where(folds, r.elems_q * _fs(2 * up / mem), 0)
    return _forward_ends(c0, c, send_fs, n), _backward_ends(b0, bb, back_fs, n)


def _forward_ends(c0: np.ndarray, c: np.ndarray, send_fs: np.ndarray, n: np.ndarray
                  ) -> list[int]:
    """Forward: the local call, then per transfer p, each collective ending for all ranks
    at once: its CP-group hop after the previous one and its post (when the previous
    stage's call ended on every rank); a relay's in-node rows after the previous ones and
    the post (the node's direct group), its second hop after the previous one and its
    cross-node rows (the relay group); stage p computes after all. [S, P, cp] costs, [3,
    S, P] chain seconds (``_pipelines``), [S] stage counts ``n``: each S's end."""
    ends = c0                              # end of the last computed stage, per rank
    last = np.zeros((3, n.size), dtype=np.int64)   # the previous ends: CP, direct, relay
    posted = np.zeros(n.size, dtype=np.int64)  # this one's post
    for p in range(c.shape[1]):
        on = p < n
        far = np.maximum(last[0], posted) + send_fs[0, :, p]
        near = np.maximum(last[1], posted) + send_fs[1, :, p]
        two = np.maximum(last[2], far) + send_fs[2, :, p]
        posted = np.where(on, ends.max(1), posted)
        last = np.where(on, np.stack([far, near, two]), last)
        landed = np.maximum(last[1], last[2])
        ends = np.where(on[:, None], np.maximum(ends, landed[:, None]) + c[:, p], ends)
    return ends.max(1).tolist()


def _backward_ends(b0: np.ndarray, bb: np.ndarray, back_fs: np.ndarray, n: np.ndarray
                   ) -> list[int]:
    """Backward: the fetched stages, posting each return (a relay's: its second hop
    reversed on the relay group, then its first hop's cross-node rows on the CP group and
    its in-node rows on the direct group, each after its group's previous one); the
    returns of stage p folded before stage p + 2 computes; the local call last
    (``returned[:, p]``: return p - 1 landed). Each S's end."""
    n_s, most, cp = bb.shape
    ends = np.zeros((n_s, cp), dtype=np.int64)
    returned = np.zeros((n_s, most + 1), dtype=np.int64)
    last = np.zeros((3, n_s), dtype=np.int64)   # the previous ends: CP, direct, relay
    for p in range(most):
        on = p < n
        gate = returned[:, p - 1] if p >= 1 else 0
        ends = np.where(on[:, None], np.maximum(ends, np.reshape(gate, (-1, 1))) + bb[:, p],
                        ends)
        two = np.maximum(last[2], ends.max(1)) + back_fs[2, :, p]
        far = np.maximum(last[0], two) + back_fs[0, :, p]
        near = np.maximum(last[1], two) + back_fs[1, :, p]
        last = np.stack([far, near, two])
        returned[:, p + 1] = np.maximum(returned[:, p], np.maximum(far, near))
    pick = np.arange(n_s)
    start = np.maximum(ends, np.where(n >= 2, returned[pick, n - 1], 0)[:, None])
    return np.maximum((start + b0).max(1), returned[pick, n]).tolist()


def _simulated(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, model: CostModel,
               stage_list: tuple[int, ...]) -> dict[int, StagedTime]:
    """:func:`_simulate` with the plan's cached rates."""
    rates = host_table(plan, table_key("staged_rates", mask, None, shape),
                       lambda: _rates(plan, mask, shape))
    return _simulate(name, plan, mask, shape, model, stage_list, rates)


def staged_time(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, model: CostModel,
                stages: int) -> StagedTime:
    """Estimate of ``name`` with ``stages`` stages (module docstring). Integer tables; the
    per-rank pipeline in int64 femtoseconds, every rank at once (no floating tensor is
    read: the hot path may call this). Cached in the plan per (mask, strategy, shape,
    model, stages): ``auto`` asks again for the stage count the default picked."""
    return host_table(plan, table_key("staged_time", mask, None, name, shape, model, stages),
                      lambda: _simulated(name, plan, mask, shape, model, (stages,))[stages])


def staged_times(name: str, plan: CPPlan, mask: AttnMask, shape: AttnShape, model: CostModel
                 ) -> dict[int, StagedTime]:
    """:func:`staged_time` of every stage count in ``CANDIDATE_STAGES``, simulated together
    (one pass; each also cached as ``staged_time``'s entry)."""
    both = host_table(plan, table_key("staged_times", mask, None, name, shape, model),
                      lambda: _simulated(name, plan, mask, shape, model, CANDIDATE_STAGES))
    return {s: host_table(plan, table_key("staged_time", mask, None, name, shape, model, s),
                          lambda s=s: both[s]) for s in CANDIDATE_STAGES}


def default_stages(plan: CPPlan, mask: AttnMask, name: str, shape: AttnShape,
                   model: CostModel | None = None) -> int:
    """The S in CANDIDATE_STAGES with the least ``staged_time`` (the fewest among those
    within 1% of it) among those whose peak memory (``staged_memory``, max over ranks) is
    no more than S = 1's, the call without overlap; cached in the plan per (mask,
    strategy, shape, model)."""
    model = check_model(model, plan.topology)

    def choose() -> int:
        times = {s: t.seconds for s, t in staged_times(name, plan, mask, shape, model).items()}
        limit = max(staged_memory(name, plan, mask, shape, 1).peak)

        seen: dict[int, bool] = {1: True}

        def fits(s: int) -> bool:   # memory walks only for the candidates that matter
            if s not in seen:
                seen[s] = max(staged_memory(name, plan, mask, shape, s).peak) <= limit
            return seen[s]
        best = next(times[s] for s in sorted(times, key=times.get) if fits(s))
        return next(s for s in sorted(times) if times[s] <= best * 1.01 and fits(s))
    return host_table(plan, table_key("overlap_stages", mask, None, name, shape, model),
                      choose)


def resolve_stages(plan: CPPlan, mask: AttnMask, name: str, shape: AttnShape,
                   stages: int | None) -> int:
    """``stages`` when given, else the cost model's default."""
    return default_stages(plan, mask, name, shape) if stages is None else stages


