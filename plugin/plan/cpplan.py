"""CPPlan: which tokens each context-parallel rank holds, built on the host once per batch.

``CPPlan.build`` takes the GLOBAL packed batch's ``cu_seqlens`` (a CPU int tensor) and a
layout spec (``plan/layout_spec.py``, default ``Balanced()``: the spec checked its own
options; the build checks the batch and what involves cp) and is pure integer math: no
process group, no device, identical on every rank. Every layer of the
model shares one plan; derived tables (per-mask schedules, index maps on a device) are
memoized with :meth:`CPPlan.cached`, so Llama 4's chunked and global layers reuse it.

One array library: ``cu_seqlens`` is checked and converted ONCE, to an int64 numpy array;
the layouts, the balanced solver and the token tables compute in numpy only. Tensors are
made where the plan hands its tables out (its attributes and accessors: ``torch.from_numpy``
views, made once, no copy; index tables for a device, copied once and cached), in the
dtypes the strategies and kernels have always received. The host tables
(``varlen_cp.tables``) read the numpy arrays themselves (:attr:`CPPlan.arrays`), so the
local cu_seqlens and positions reach a kernel call in the plan's int32 with no conversion
on the way.

Invariant every strategy relies on: local segment i of any rank is document i (possibly
empty); its local tokens are contiguous, ordered by increasing position, padding last.

Limits: tables are materialized for all ranks (about 20 bytes per token of the global batch);
``shard``/``unshard`` copy index tensors to the data's device once and cache them; ``unshard``
is not differentiable.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import weakref
from functools import cached_property
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.host_copy import one_to_device
from ..masks import AttnMask
from ..checks import is_int
from .capacity import check_capacity, check_capacity_value, default_capacity, pad_tables
from .collective import check_group, gather_padded
from .layout_spec import TE, Balanced, LayoutSpec, layout_spec
from .layouts import Pieces, layout_pieces
from .nodes import Topology, check_topology, place_on_nodes
from .runs import Runs, pair_work
from .tokens import TokenTables, expand_pieces


MAX_DOC_TOKENS = 1 << 30          # real positions < 2**30 (kernels/validation.py)
MAX_TOTAL_TOKENS = (1 << 31) - 1  # int32 cu_seqlens and row offsets
MAX_CP_SIZE = 4096
"""The largest cp_size a plan is built for: its rank-pair tables (which ranks' keys each
rank's queries see, bytes between ranks) hold cp_size**2 entries, 128 MiB each in int64 at
4096, and the layouts cut a document into up to 2 * cp_size pieces; a cp_size of 10**6 on a
20-token batch took 42 s and 11.7 GB. No CP group of a real job comes near it."""


def _check_cu_seqlens(cu: Any) -> np.ndarray:
    """The global cu_seqlens, validated, as a new int64 numpy array: the one conversion of
    the plan (everything after it reads this array)."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.device.type != "cpu":
        raise ValueError(f"cu_seqlens must be a CPU (host) tensor, got device {cu.device}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with n_docs+1 >= 1 entries, got shape "
                         f"{tuple(cu.shape)}")
    c = cu.numpy().astype(np.int64)  # a copy: the plan never aliases the caller's tensor
    if int(c[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(c[0])}")
    steps = c[1:] - c[:-1]
    if bool((steps < 0).any()):
        i = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]="
                         f"{int(c[i])} > cu_seqlens[{i + 1}]={int(c[i + 1])}")
    # Checked before any table is allocated (~20 bytes per token): the kernels' positions
    # and the plan's local cu_seqlens are int32, and real positions stay below 2**30.
    if steps.size and int(steps.max()) > MAX_DOC_TOKENS:
        i = int(steps.argmax())
        raise ValueError(f"cu_seqlens: document {i} has {int(steps[i])} tokens, more than "
                         f"the {MAX_DOC_TOKENS} (2**30) the kernels' int32 positions allow")
    _check_total(int(c[-1]), "cu_seqlens")
    return c


def _check_total(total: int, what: str) -> None:
    if total > MAX_TOTAL_TOKENS:
        raise ValueError(f"{what}: the batch has {total} tokens, more than the "
                         f"{MAX_TOTAL_TOKENS} (2**31 - 1) of the plan's int32 tables")


def _check_params(cp_size: Any, cp_rank: Any, spec: LayoutSpec) -> LayoutSpec:
    """Validate the ranks and the spec's rules that involve cp; returns the spec with
    ``te``'s ``pad_multiple`` resolved (its other fields were checked when it was built)."""
    if not is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if cp_size > MAX_CP_SIZE:
        raise ValueError(f"cp_size must be at most {MAX_CP_SIZE} (a plan's rank-pair tables "
                         f"grow with cp_size**2), got {cp_size}")
    if not is_int(cp_rank) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")
    if not isinstance(spec, TE):
        return spec
    if spec.pad_multiple is None:
        return TE(pad_multiple=2 * cp_size)
    if spec.pad_multiple % (2 * cp_size):
        raise ValueError(f"pad_multiple must be a positive multiple of 2*cp_size="
                         f"{2 * cp_size}, got {spec.pad_multiple!r}")
    return spec


def check_layout(spec: LayoutSpec, cp_size: int) -> LayoutSpec:
    """The layout spec's rules that involve cp (``te``'s ``pad_multiple``), and cp's bounds,
    without a batch: what a launcher checks before it builds a model."""
    return _check_params(cp_size, 0, spec)


# handle -> plan: how a compiled graph names a plan (``CPPlan.handle``) without holding it
_PLANS: "weakref.WeakValueDictionary[int, CPPlan]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def plan_of_handle(handle: torch.Tensor) -> "CPPlan":
    """The live plan whose ``handle`` this is (a CPU int64 tensor: reading it is host
    work)."""
    plan = _PLANS.get(int(handle[0]))
    if plan is None:
        raise ValueError(f"plan: handle {int(handle[0])} names no live CPPlan")
    return plan


def mark_token_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with its ``dim`` marked dynamic for torch.compile: a rank's local token count
    changes with every batch's documents, and a graph compiled for one count would
    otherwise be recompiled for the next (dynamo's automatic dynamic shapes only switch
    after one recompile). Only when dynamo is loaded (torch.compile imports it; loading it
    here would cost seconds to a user who never compiles); a hint, never an error."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and not torch.compiler.is_compiling():  # marks are for inputs
        dynamo.maybe_mark_dynamic(x, dim)
    return x


class CPPlan:
    """Token layout of one packed batch over ``cp_size`` ranks, seen from ``cp_rank``.

    Build with :meth:`build`. Tensors returned by the ``*_of`` accessors and the tensor
    attributes (``cu_seqlens``, ``doc_lengths``, ``cu_seqlens_padded``) are views of the
    plan's tables: treat them as read-only.
    """

    def __init__(self, cu_seqlens: np.ndarray, cp_size: int, cp_rank: int,
                 spec: LayoutSpec, padded_lengths: np.ndarray, tables: TokenTables,
                 topology: Topology | None = None, capacity: int | None = None) -> None:
        """From :meth:`build`'s checked values: ``cu_seqlens`` and ``padded_lengths`` int64
        numpy arrays, ``tables`` the layout's token tables (numpy)."""
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.layout_spec = spec  # the layout and its options (te: pad_multiple resolved)
        # Which CP ranks share a node (plan/nodes.py; None: not given, one node assumed).
        self.topology = topology
        # Rows every rank holds (the graph-safe mode: plan/capacity.py); None: its tokens.
        self.capacity = capacity
        self.layout = spec.name
        self.n_docs = cu_seqlens.size - 1
        self._cu = cu_seqlens
        self._doc_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        self.max_document_length = int(self._doc_lengths.max()) if self.n_docs else 0
        self.total_tokens = int(cu_seqlens[-1])
        self.padded_total_tokens = int(tables.token_index.size)
        cu_padded = np.zeros(self.n_docs + 1, dtype=np.int64)
        np.cumsum(padded_lengths, out=cu_padded[1:])
        # The public tensors (int64, as they always were): views of the numpy arrays.
        self.cu_seqlens = torch.from_numpy(cu_seqlens)
        self.doc_lengths = torch.from_numpy(self._doc_lengths)
        self.cu_seqlens_padded = torch.from_numpy(cu_padded)
        self._t = tables
        # The tables the accessors slice, as tensors once (views: no copy).
        self._token_index = torch.from_numpy(tables.token_index)
        self._padded_index = (self._token_index if tables.padded_index is tables.token_index
                              else torch.from_numpy(tables.padded_index))
        self._position = torch.from_numpy(tables.position)
        self._local_cu = torch.from_numpy(tables.local_cu)
        self._rank_offsets = torch.from_numpy(tables.rank_offsets)
        self._offsets = tables.rank_offsets.tolist()
        seg = tables.local_cu[:, 1:] - tables.local_cu[:, :-1]
        self._max_seg = (seg.max(1) if self.n_docs else np.zeros(cp_size, np.int64)).tolist()
        self._cache: dict[Any, Any] = {}
        # A graph input that names this plan (torch.compile: the plan is data, never a
        # guard or a constant; ``varlen_cp.graph_op`` looks it up with plan_of_handle).
        key = next(_HANDLES)
        _PLANS[key] = self
        self.handle = torch.tensor([key], dtype=torch.int64)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int,
              layout: LayoutSpec | str = "balanced",
              topology: Topology | None = None,
              capacity: int | str | None = None) -> "CPPlan":
        """Plan the layout of the global batch ``cu_seqlens`` (CPU int tensor [n_docs+1];
        checked, then converted once to int64 numpy for all of the planning).

        layout: a layout spec (``varlen_cp.plan.Balanced(masks=..., tile_tokens=...)``,
        ``DualChunk(min_chunk_tokens=...)``, ``TE(pad_multiple=...)``, ``Contiguous()``;
        see ``plan/layout_spec.py``), or a layout name for that layout with its default
        options. Default: ``balanced`` for causal attention, what the integrations use
        (pass the model's masks in ``Balanced(masks=...)`` to balance each of them).

        topology: which CP ranks share a node (``varlen_cp.plan.Topology``: the node of
        each CP rank and the two links' rates; the integrations derive it from the CP
        group's global ranks and the GPUs per node). ``balanced`` then places its ranks on
        the nodes so that the K/V a rank fetches comes from its own node where it can
        (``plan/nodes.py``; every rank's share, so the balance, unchanged); the plan records
        it for the cost model and refuses a group on other nodes. None: one node.

        capacity: every rank holds exactly this many rows, its tokens then padding rows
        (``plan/capacity.py``; the graph-safe mode, docs/graph-safe.md); "auto": 1.02 x the
        mean tokens per rank, rounded up to 64; a rank holding more is refused
        (ValueError). None: each rank holds its tokens.
        """
        cu = _check_cu_seqlens(cu_seqlens)
        spec = layout_spec(layout)
        spec = _check_params(cp_size, cp_rank, spec)
        topology = check_topology(topology, cp_size)
        lengths = cu[1:] - cu[:-1]
        pieces = layout_pieces(lengths, cp_size, spec)
        if isinstance(spec, TE):  # padding adds up to pad_multiple - 1 tokens per document
            _check_total(int(pieces.padded_lengths.sum()), "cu_seqlens (padded)")
        if isinstance(spec, Balanced) and topology is not None:
            rank = place_on_nodes(pieces.rank, pieces.doc, pieces.start, pieces.length,
                                  lengths, spec.masks, topology)
            pieces = Pieces(rank, pieces.doc, pieces.start, pieces.length,
                            pieces.padded_lengths)
        check_capacity_value(capacity)
        tables = expand_pieces(pieces, lengths, cp_size)
        if capacity is not None:
            total = int(tables.token_index.size)
            if capacity == "auto":
                capacity = default_capacity(total, cp_size)
            check_capacity(np.diff(tables.rank_offsets), capacity, total, spec.name)
            tables = pad_tables(tables, capacity)
        return cls(cu, cp_size, cp_rank, spec, pieces.padded_lengths, tables, topology,
                   capacity)

    def __repr__(self) -> str:
        cap = "" if self.capacity is None else f", capacity={self.capacity}"
        return (f"CPPlan(layout={self.layout!r}, cp_size={self.cp_size}, "
                f"cp_rank={self.cp_rank}, n_docs={self.n_docs}, "
                f"total_tokens={self.total_tokens}, "
                f"padded_total_tokens={self.padded_total_tokens}{cap})")

    # ---- per-rank tables -------------------------------------------------------------
    def _rows(self, rank: Any, what: str = "rank") -> slice:
        if not is_int(rank) or not 0 <= rank < self.cp_size:
            raise ValueError(f"{what} must be an int in [0, {self.cp_size}), got {rank!r}")
        return slice(self._offsets[rank], self._offsets[rank + 1])

    def token_indices_of(self, rank: int) -> torch.Tensor:
        """int64 [n_local]: global token index of each of ``rank``'s tokens; -1 = padding."""
        return self._token_index[self._rows(rank)]

    def padded_token_indices_of(self, rank: int) -> torch.Tensor:
        """int64 [n_local]: index in the packed sequence padded per ``cu_seqlens_padded``
        (for ``te``: exactly TransformerEngine's ``thd_get_partitioned_indices``)."""
        return self._padded_index[self._rows(rank)]

    def positions_of(self, rank: int) -> torch.Tensor:
        """int32 [n_local]: position of each token within its document; -1 = padding."""
        return self._position[self._rows(rank)]

    def local_cu_seqlens_of(self, rank: int) -> torch.Tensor:
        """int32 [n_docs+1]: local segment i = ``rank``'s tokens of document i."""
        self._rows(rank)
        return self._local_cu[rank]

    def num_tokens_of(self, rank: int) -> int:
        """Local token count of ``rank`` (padding included)."""
        rows = self._rows(rank)
        return rows.stop - rows.start

    def max_local_seqlen_of(self, rank: int) -> int:
        """Longest local segment of ``rank`` (padding included): the kernels' max_seqlen."""
        self._rows(rank)
        return int(self._max_seg[rank])

    @cached_property
    def runs(self) -> Runs:
        """Every rank's runs of consecutive real positions (holder = rank), sorted by
        (rank, doc, start); ``row`` is the run's first local row on its rank (int64
        tensors, views of the plan's run table). Read-only."""
        r = self._t.runs
        return Runs(*(torch.from_numpy(x) for x in (r.rank, r.doc, r.start, r.length, r.row)))

    @property
    def arrays(self) -> TokenTables:
        """The plan's token tables as numpy arrays (``plan/tokens.py``: ``rank_offsets``,
        ``position``, ``local_cu``, ``padded_index``, ``doc``, the ``runs`` RunTable): what
        the host tables (``varlen_cp.tables``) compute on, with no tensor in between.
        Read-only, as the tensors are (those are views of these)."""
        return self._t

    @property
    def doc_length_array(self) -> np.ndarray:
        """int64 [n_docs]: the documents' lengths (numpy; ``doc_lengths`` is its view)."""
        return self._doc_lengths

    def local_rows_of(self, rank: int) -> slice:
        """``rank``'s rows in the concatenation of every rank's local tokens (the order of
        the all-rank tables such as :meth:`all_positions`)."""
        return self._rows(rank)

    def all_positions(self) -> torch.Tensor:
        """int32 [padded_total]: every rank's local positions, concatenated in rank order."""
        return self._position

    def all_local_cu_seqlens(self) -> torch.Tensor:
        """int32 [cp, n_docs+1]: every rank's local cu_seqlens."""
        return self._local_cu

    def rank_offsets(self) -> torch.Tensor:
        """int64 [cp+1]: each rank's first row in the all-rank tables (``all_positions``)."""
        return self._rank_offsets

    def max_local_seqlens(self) -> tuple[int, ...]:
        """Every rank's longest local segment."""
        return tuple(int(x) for x in self._max_seg)

    def all_documents(self) -> torch.Tensor:
        """int64 [padded_total]: the document of every rank's local tokens, in rank order
        (built on first use)."""
        return self._documents

    @cached_property
    def _documents(self) -> torch.Tensor:
        return torch.from_numpy(self._t.doc)

    def all_padded_indices(self) -> torch.Tensor:
        """int64 [padded_total]: the padded global index of every rank's local tokens."""
        return self._padded_index

    @property
    def token_indices(self) -> torch.Tensor:
        return self.token_indices_of(self.cp_rank)

    @property
    def positions(self) -> torch.Tensor:
        return self.positions_of(self.cp_rank)

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        return self.local_cu_seqlens_of(self.cp_rank)

    @property
    def num_tokens(self) -> int:
        return self.num_tokens_of(self.cp_rank)

    @property
    def max_local_seqlen(self) -> int:
        return self.max_local_seqlen_of(self.cp_rank)

    # ---- padding (``te`` layout) ---------------------------------------------------------
    @property
    def num_real_tokens(self) -> int:
        """This rank's tokens that are not padding (``num_tokens`` less the ``te``
        layout's padding): what a per-token count (tokens seen, routed tokens) adds up."""
        index = self._t.token_index[self._rows(self.cp_rank)]
        return self.cached(("plan_real_count", self.cp_rank),
                           lambda: int(np.count_nonzero(index >= 0)))

    def real_rows(self, device: torch.device | str) -> torch.Tensor | None:
        """int64 [num_real_tokens]: the local rows of this rank's real tokens, on
        ``device`` (copied once, ``non_blocking``, and cached); None for layouts that never
        pad (every row is real), so callers skip the gather. A ``te`` plan always gives the
        rows, all of them when this batch happens to need no padding here: whether a batch
        pads must not change a compiled model's code path (a second graph), and the row
        count, which changes with every batch, is marked dynamic for the same reason."""
        if self.layout != "te" and self.capacity is None:
            return None
        index = self._t.token_index[self._rows(self.cp_rank)]
        rows = self._on("real_rows", torch.device(device),
                        lambda: torch.from_numpy(np.flatnonzero(index >= 0)))
        return mark_token_dim(rows, 0)

    # ---- sharding ----------------------------------------------------------------------
    def _on(self, name: str, device: torch.device, make: Callable[[], torch.Tensor]
            ) -> torch.Tensor:
        """Host index table ``make()`` copied once to ``device`` (from a pinned staging
        buffer, without a sync) and cached."""
        return self.cached(("plan_index", name, self.cp_rank, device),
                           lambda: one_to_device(make(), device))

    def _check_tokens(self, x: Any, dim: int, expected: int, what: str) -> int:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if not is_int(dim) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for {what} of "
                             f"shape {tuple(x.shape)}, got {dim!r}")
        dim = dim % x.dim()
        if x.shape[dim] != expected:
            raise ValueError(f"{what} has {x.shape[dim]} tokens along dim {dim}, expected "
                             f"{expected}")
        return dim

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's part of ``x``, whose ``dim`` is the global (unpadded) token dim;
        padding tokens are zeros. The token dim is marked dynamic for torch.compile
        (:func:`mark_token_dim`)."""
        dim = self._check_tokens(x, dim, self.total_tokens, "x")
        index = self._t.token_index[self._rows(self.cp_rank)]
        out = x.index_select(dim, self._on("shard", x.device,
                                           lambda: torch.from_numpy(np.maximum(index, 0))))
        if self.num_real_tokens < self.num_tokens:  # padding rows: zeros
            pad = self._on("shard_pad", x.device,
                           lambda: torch.from_numpy(np.flatnonzero(index < 0)))
            out.index_fill_(dim, pad, 0)
        return mark_token_dim(out, dim)

    def _global_gather_index(self, stride: int | None) -> torch.Tensor:
        """Row of every global token in the concatenation of all ranks' local rows, each
        rank's block ``stride`` rows long (``None``: exactly its local count)."""
        t = self._t
        rows = np.arange(t.token_index.size, dtype=np.int64)
        if stride is not None:
            counts = t.rank_offsets[1:] - t.rank_offsets[:-1]
            rank = np.repeat(np.arange(self.cp_size, dtype=np.int64), counts)
            rows = rows - t.rank_offsets[rank] + rank * stride
        real = t.token_index >= 0
        index = np.empty(self.total_tokens, dtype=np.int64)
        index[t.token_index[real]] = rows[real]
        return torch.from_numpy(index)

    def unshard_parts(self, parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The global tensor (unpadded, global order) from every rank's local part, given
        in rank order; no communication (tests, offline tools)."""
        if not isinstance(parts, (list, tuple)) or len(parts) != self.cp_size:
            got = f"{len(parts)} parts" if isinstance(parts, (list, tuple)) else \
                type(parts).__name__
            raise ValueError(f"parts must be a list of cp_size={self.cp_size} tensors, got "
                             f"{got}")
        dims = {self._check_tokens(p, dim, self.num_tokens_of(r), f"parts[{r}]")
                for r, p in enumerate(parts)}
        d = dims.pop()
        first = parts[0]
        for r, p in enumerate(parts):  # torch.cat would promote dtypes or fail obscurely
            rest = p.shape[:d] + p.shape[d + 1:]
            if (p.dtype, p.device, rest) != (first.dtype, first.device,
                                             first.shape[:d] + first.shape[d + 1:]):
                raise ValueError(f"parts[{r}] ({p.dtype}, {p.device}, shape "
                                 f"{tuple(p.shape)}) differs from parts[0] ({first.dtype}, "
                                 f"{first.device}, shape {tuple(first.shape)}) in more than "
                                 f"its token count along dim {d}")
        index = self._on("unshard_parts", parts[0].device,
                         lambda: self._global_gather_index(None))
        return torch.cat(list(parts), dim=d).index_select(d, index)

    def unshard(self, x_local: torch.Tensor, group: dist.ProcessGroup | None = None,
                dim: int = 0) -> torch.Tensor:
        """The global tensor (unpadded, global order) on every rank of ``group`` (the
        default group when None); collective: every rank of the group must call it."""
        dim = self._check_tokens(x_local, dim, self.num_tokens, "x_local")
        if self.cp_size == 1 and group is None:
            return self.unshard_parts([x_local], dim)
        check_group(group, self.cp_size, self.cp_rank)
        if self.cp_size == 1:
            return self.unshard_parts([x_local], dim)
        stride = max(self.num_tokens_of(r) for r in range(self.cp_size))
        x0 = x_local.movedim(dim, 0)
        gathered = gather_padded(x0, stride, self.cp_size, group)
        index = self._on(f"unshard_{stride}", x_local.device,
                         lambda: self._global_gather_index(stride))
        return gathered.index_select(0, index).movedim(0, dim)

    # ---- work and balance --------------------------------------------------------------
    def _work_per_rank(self, mask: AttnMask) -> list[int]:
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask must be a varlen_cp.AttnMask, got {type(mask).__name__}")

        def compute() -> list[int]:
            # Each run's queries against its whole document, in closed form.
            r = self._t.runs
            pairs = pair_work(r.start, r.start + r.length, np.zeros_like(r.start),
                              self._doc_lengths[r.doc], mask)
            work = np.zeros(self.cp_size, dtype=np.int64)
            np.add.at(work, r.rank, pairs)   # exact int64 sums
            return work.tolist()

        return self.cached(("plan_work", mask), compute)

    def work_per_rank(self, mask: AttnMask) -> list[int]:
        """Visible (query, key) pairs of every rank's queries against all keys."""
        return list(self._work_per_rank(mask))

    def work_imbalance(self, mask: AttnMask) -> float:
        """max / mean of the ranks' work under ``mask`` (1.0 when there is no work)."""
        work = self._work_per_rank(mask)
        total = sum(work)
        return max(work) * self.cp_size / total if total else 1.0

    def token_imbalance(self) -> float:
        """max / mean of the ranks' local token counts, padding included."""
        counts = [self.num_tokens_of(r) for r in range(self.cp_size)]
        total = sum(counts)
        return max(counts) * self.cp_size / total if total else 1.0

    # ---- memo and identity -------------------------------------------------------------
    def cached(self, key: Any, fn: Callable[[], Any]) -> Any:
        """``fn()`` computed once per plan under the hashable ``key``."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def fingerprint(self) -> int:
        """Stable 63-bit hash of (cu_seqlens, cp_size, layout spec, topology), the same on
        every rank (cp_rank excluded) and across processes, for the cross-rank check."""
        h = hashlib.blake2b(digest_size=8)
        # A spec's repr is its class and fields (masks: AttnMask reprs), no addresses; so is
        # a topology's (its nodes and rates).
        h.update(repr((self.cp_size, self.layout_spec)).encode())
        if self.capacity is not None:   # (None: the hash plans had before capacities)
            h.update(repr(("capacity", self.capacity)).encode())
        if self.topology is not None:
            h.update(repr(self.topology).encode())
        h.update(self._cu.astype("<i8", copy=False).tobytes())  # little-endian int64s
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
