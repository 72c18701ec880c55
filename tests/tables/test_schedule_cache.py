"""Tables shared between masks that act the same on a plan (``tables.cache.table_mask``).

A chunk at least as long as the plan's longest document is no condition at all (every
position of a document lies in chunk 0), so the chunked mask's tables are the unchunked
mask's: one cache entry serves both. Checked here by building the chunked mask's tables
with the sharing switched off, on a fresh plan, and comparing them field by field with the
unchunked mask's (every strategy's tables and ``auto``'s pick; causal and full masks,
windows, padding layouts; chunk equal to and above the longest document), then that the
shared entry is the same object, and that a shorter chunk shares nothing. About 8 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.cp_grid import small_plan
from varlen_cp import AttnMask
from varlen_cp.config import AttnShape, CPConfig
from varlen_cp.prefetch import build_tables
from varlen_cp.tables import cache

DOCS = [37, 5, 120, 1, 64, 18]
SHAPE = AttnShape(n_heads=4, n_kv_heads=2, head_dim=16, dtype=torch.float32)
STRATEGIES = ("p2p", "all_gather", "a2a", "a2a+p2p", "dispatch", "auto")


def _same(a, b, path: str) -> None:
    """Equal tensors and arrays (dtype and shape too), objects field by field, sequences, values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), path
        for name, value in vars(a).items():
            _same(value, vars(b)[name], f"{path}.{name}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _tables(plan, mask: AttnMask) -> dict:
    """The plan's entries for ``mask``, by key with the mask left out."""
    return {k._replace(mask=None): v for k, v in plan._cache.items()
            if getattr(k, "mask", None) == mask}


def _prepared(strategy: str, layout: str, rank: int, mask: AttnMask):
    plan = small_plan(DOCS, 4, rank, layout)
    build_tables(plan, CPConfig(strategy=strategy, layout=layout, backend="torch"),
                 [(mask, 1)], SHAPE, "cpu")
    return plan


@pytest.mark.parametrize("layout", ["balanced", "te"])
@pytest.mark.parametrize("base", [AttnMask(), AttnMask(causal=False),
                                  AttnMask(window_size=(20, 0))])
def test_long_chunk_tables_equal_unchunked(monkeypatch, layout, base):
    longest = max(DOCS)
    for strategy in STRATEGIES:
        for rank in (3,):
            want = _tables(_prepared(strategy, layout, rank, base), base)
            for chunk in (longest, longest + 50)[:1 if strategy != "p2p" else 2]:
                chunked = AttnMask(base.causal, base.window_size, chunk)
                with monkeypatch.context() as m:   # sharing off: built from the chunk
                    m.setattr(cache, "table_mask", lambda plan, mask: mask)
                    got = _tables(_prepared(strategy, layout, rank, chunked), chunked)
                assert got.keys() == want.keys(), (strategy, chunk)
                assert any(k.kind in ("p2p", "ulysses_call", "auto", f"{strategy}_staged")
                           for k in got)
                for k in want:
                    _same(got[k], want[k], f"{strategy}/{layout}/r{rank}/c{chunk}/{k.kind}")


@pytest.mark.parametrize("base", [AttnMask(), AttnMask(causal=False),
                                  AttnMask(chunk_size=16), AttnMask(window_size=(-1, 5),
                                                                    causal=False)])
def test_wide_window_tables_equal_the_unwindowed(monkeypatch, base):
    """A window side reaching the longest document's length - 1 is no condition: the
    tables built for it (sharing off) equal those of the mask without that side."""
    reach = max(DOCS) - 1
    for strategy in ("p2p", "dispatch", "auto"):
        want = _tables(_prepared(strategy, "balanced", 2, base), base)
        left = reach + (strategy == "auto") * 7    # exactly the reach, and beyond it
        right = base.window_size[1] if base.causal or base.window_size[1] >= 0 else reach
        wide = AttnMask(base.causal, (left, right), base.chunk_size)
        assert cache.table_mask(small_plan(DOCS, 4, 2, "balanced"), wide) == base
        with monkeypatch.context() as m:   # sharing off: built from the window
            m.setattr(cache, "table_mask", lambda plan, mask: mask)
            got = _tables(_prepared(strategy, "balanced", 2, wide), wide)
        assert got.keys() == want.keys(), strategy
        for k in want:
            _same(got[k], want[k], f"{strategy}/{base}/{k.kind}")
    narrow = AttnMask(base.causal, (reach - 1, base.window_size[1]), base.chunk_size)
    assert cache.table_mask(small_plan(DOCS, 4, 2, "balanced"), narrow) == narrow


def test_long_chunk_shares_entries_short_chunk_does_not():
    longest = max(DOCS)
    plan = small_plan(DOCS, 4, 1, "balanced")
    config = CPConfig(strategy="p2p", backend="torch")
    long_chunk, short_chunk = AttnMask(chunk_size=longest), AttnMask(chunk_size=longest - 1)
    build_tables(plan, config, [(long_chunk, 1), (AttnMask(), 1), (short_chunk, 1)], SHAPE,
                 "cpu")
    shared, causal = _tables(plan, long_chunk), _tables(plan, AttnMask())
    assert shared and shared.keys() == causal.keys()
    assert all(shared[k] is causal[k] for k in causal)
    own = _tables(plan, short_chunk)
    assert own and all(own[k] is not causal[k] for k in own)
    assert cache.table_mask(plan, short_chunk) == short_chunk
    assert cache.table_mask(plan, long_chunk) == AttnMask()


def test_intervals_on_numpy_equal_those_on_torch():
    """``AttnMask.key_interval`` / ``query_interval`` (``kernels.mask_math``) on the host
    planner's numpy arrays give int64 numpy arrays equal to the torch results, padding
    positions included (the torch results are checked against dense masks in
    tests/package/test_masks.py)."""
    pos = torch.tensor([-3, -1, 0, 1, 5, 7, 8, 63, 64, 65, 200, 1000])
    for mask in (AttnMask(), AttnMask(causal=False), AttnMask(window_size=(5, 0)),
                 AttnMask(window_size=(3, 9), causal=False), AttnMask(chunk_size=64),
                 AttnMask(chunk_size=8, window_size=(2, 0)),
                 AttnMask(chunk_size=100, causal=False)):
        for fn in (mask.key_interval, mask.query_interval):
            got, want = fn(pos.numpy()), fn(pos)
            for g, w in zip(got, want):
                assert isinstance(g, np.ndarray) and g.dtype == np.int64, mask
                assert np.array_equal(g, w.numpy()), mask


@pytest.mark.parametrize("layout", ["balanced", "dual_chunk", "te"])
def test_spans_against_per_token_sets(layout):
    """``plan.spans`` on a plan's runs against sets of positions built token by token:
    each run's span is the union of its queries' key intervals (``AttnMask.key_interval``
    per position) clipped to the document; a holder's merged spans cover exactly the union
    of its runs' spans in each document; the pieces cut by the owners' runs are those
    positions, per owner."""
    from varlen_cp.plan import spans

    plan = small_plan(DOCS, 4, 0, layout)
    runs, part = plan.runs, plan.runs.by_document()
    doc_len = plan.doc_lengths.tolist()
    for mask in (AttnMask(), AttnMask(causal=False), AttnMask(window_size=(9, 0)),
                 AttnMask(chunk_size=16), AttnMask(chunk_size=20, window_size=(3, 2))):
        lo, hi = spans.key_spans(runs.start.numpy(), runs.stop.numpy(),
                                 plan.doc_lengths.numpy()[runs.doc.numpy()], mask)
        union: dict[tuple[int, int], set] = {}
        for k, (h, d, a, b) in enumerate(zip(*(t.tolist() for t in (
                runs.holder, runs.doc, runs.start, runs.stop)))):
            klo, khi = mask.key_interval(torch.arange(a, b))
            seen = set()
            for x, y in zip(klo.tolist(), khi.tolist()):
                seen |= set(range(max(x, 0), min(y, doc_len[d] - 1) + 1))
            assert (int(lo[k]), int(hi[k])) == (min(seen), max(seen)), (mask, k)
            assert seen == set(range(min(seen), max(seen) + 1))   # one span per run
            union.setdefault((h, d), set()).update(seen)
        holder, doc, mlo, mhi = spans.merge_spans(runs.holder.numpy(), runs.doc.numpy(),
                                                  lo, hi)
        merged: dict[tuple[int, int], set] = {}
        for h, d, a, b in zip(holder.tolist(), doc.tolist(), mlo.tolist(), mhi.tolist()):
            assert not merged.get((h, d), set()) & set(range(a, b + 1))   # disjoint
            assert (a - 1 not in merged.get((h, d), set()))               # not touching
            merged.setdefault((h, d), set()).update(range(a, b + 1))
        assert merged == union, mask
        span, run, first, length = spans.span_pieces(doc, mlo, mhi, part.doc.numpy(),
                                                     part.start.numpy(), part.stop.numpy())
        assert span.size
        owned = {}   # (span, owner run) -> positions of the span the run holds
        for k, (d, a, b) in enumerate(zip(doc.tolist(), mlo.tolist(), mhi.tolist())):
            for r, (rd, ra, rb) in enumerate(zip(*(t.tolist() for t in (
                    part.doc, part.start, part.stop)))):
                both = set(range(a, b + 1)) & set(range(ra, rb)) if rd == d else set()
                if both:
                    owned[(k, r)] = both
        got = {(int(s_), int(r)): set(range(int(f), int(f + n)))
               for s_, r, f, n in zip(span, run, first, length)}
        assert got == owned, mask


def test_key_dataclasses_hash_as_their_fields() -> None:
    """Masks, head shapes and cost models (every table key holds them) keep the hash made
    at construction: the hash of their fields, as the dataclass would compute it, equal
    for equal objects however they were made (``replace``, a pickle round trip); the
    unchunked twin of a chunked mask is one object per mask."""
    import dataclasses
    import pickle

    from varlen_cp.tables.cost_model import CostModel
    from varlen_cp.shape import AttnShape

    objects = [AttnMask(), AttnMask(causal=False, window_size=[128, 0]),
               AttnMask(chunk_size=8192),
               AttnShape(n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
               AttnShape(n_heads=4, n_kv_heads=4, head_dim=16, head_dim_v=8,
                         dtype=torch.float32), CostModel(), CostModel(flops_per_s=1e12)]
    for x in objects:
        fields = tuple(getattr(x, f.name) for f in dataclasses.fields(x))
        assert hash(x) == hash(fields)
        for y in (dataclasses.replace(x), pickle.loads(pickle.dumps(x))):
            assert y == x and hash(y) == hash(x)
    assert hash(AttnMask(chunk_size=5)) != hash(AttnMask(chunk_size=6))
    plan = small_plan(DOCS, 2, 0, "balanced")
    chunked = AttnMask(chunk_size=max(DOCS))
    assert cache.table_mask(plan, chunked) is cache.table_mask(plan, AttnMask(chunk_size=max(DOCS)))
    assert cache.table_mask(plan, chunked) == AttnMask()
