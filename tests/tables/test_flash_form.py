"""The FlashAttention form of a call (``tables.flash_form``) against the mask itself.

Every case builds a query holder and a key holder of random runs of positions per document,
asks for the FA form, then replays FlashAttention's own rule (row indices, bottom-right
alignment, one window per call, gathered key rows) and compares the visible (query row, key
row) pairs with the mask's, row by row; and checks the form's pair counts, that every call
covers every row, and that key rows of one call never overlap. Forms that exist must be
exact; the tests also require that the cases the strategies rely on get one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varlen_cp.masks import AttnMask
from varlen_cp.tables.flash_form import FlashRoute, flash_forms, query_pieces
from varlen_cp.tables.holders import Holder, HolderSet

ROUTE = FlashRoute("flash", q_row_bytes=1024, kv_row_bytes=256)
MASKS = [AttnMask(causal=True), AttnMask(causal=False), AttnMask(window_size=(5, 0)),
         AttnMask(causal=False, window_size=(4, 3)), AttnMask(chunk_size=8),
         AttnMask(chunk_size=8, window_size=(3, 0)), AttnMask(causal=False, chunk_size=6),
         AttnMask(causal=False, window_size=(-1, 2))]


def _holder(rng, doc_lens, keep_prob, pad):
    """cu, positions of a holder holding random runs of each document (position order),
    with ``pad`` padding rows at the end of some segments."""
    cu, pos = [0], []
    for n in doc_lens:
        keep = rng.random(n) < keep_prob
        p = list(np.flatnonzero(keep))
        if pad and rng.random() < 0.3:
            p += [-1] * int(rng.integers(1, 3))
        pos += p
        cu.append(len(pos))
    return np.array(cu, dtype=np.int64), np.array(pos, dtype=np.int64)


def _key_set(*holders):
    """A HolderSet of key holders given as (cu, positions) numpy pairs: the searches
    ``flash_forms`` makes run on it."""
    return HolderSet.of([Holder(torch.from_numpy(cu.astype(np.int32)),
                                torch.from_numpy(pos.astype(np.int32)),
                                int(np.diff(cu).max())) for cu, pos in holders])


def _form(q_cu, q_pos, keys, k_range, mask, route=None):
    """The FA form of the call (query holder) x (key holder ``k_range`` of ``keys``)."""
    return flash_forms(q_pos.size, query_pieces(q_cu, q_pos, mask.chunk_size or 0), keys,
                       [k_range], mask, route or ROUTE)[0]


def _mask_pairs(q_cu, q_pos, k_cu, k_pos, mask):
    """Set of (query row, key row) pairs the mask makes visible."""
    out = set()
    for s in range(q_cu.size - 1):
        qr = range(q_cu[s], q_cu[s + 1])
        kr = range(k_cu[s], k_cu[s + 1])
        for i in qr:
            p = q_pos[i]
            if p < 0:
                continue
            lo, hi = mask.key_interval(np.array([p]))
            for j in kr:
                if k_pos[j] >= 0 and lo[0] <= k_pos[j] <= hi[0]:
                    out.add((i, j))
    return out


def _fa_pairs(form, n_q, n_k):
    """The pairs FlashAttention computes for ``form``, by its own rule, on the rows each
    call is handed (its spans); also checks the calls' coverage and non-overlap."""
    out, pairs = set(), 0
    for n_call, call in enumerate(form.calls):
        cu_q, cu_k = call.cu_q.numpy(), call.cu_k.numpy()
        (q_a, q_b), (k_a, k_b) = call.q_span, call.k_span
        index = (np.arange(n_k) if call.k_index is None else call.k_index.numpy())
        assert 0 <= q_a <= q_b <= n_q and 0 <= k_a <= k_b <= index.size
        assert cu_q[0] == 0 and cu_q[-1] == q_b - q_a, "every spanned query row in a segment"
        assert cu_k[0] == 0 and cu_k[-1] == k_b - k_a, "every spanned key row in a segment"
        assert (np.diff(cu_q) >= 0).all() and (np.diff(cu_k) >= 0).all()
        if call.k_index is None:
            assert index.size == n_k
        else:
            assert (k_a, k_b) == (0, index.size)   # a gathered buffer is the call's own
        wl, wr = call.window
        for s in range(cu_q.size - 1):
            sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
            assert sq <= call.max_q and sk <= call.max_k
            for i in range(sq):
                for j in range(sk):
                    if (wl < 0 or j >= i + sk - sq - wl) and (wr < 0 or j <= i + sk - sq + wr):
                        pair = (q_a + cu_q[s] + i, int(index[k_a + cu_k[s] + j]))
                        assert pair not in out, "a pair computed twice"
                        out.add(pair)
                        pairs += 1
        assert pairs == sum(c.pairs for c in form.calls[:n_call + 1])
    return out


def _check_case(seed, mask, q_keep, k_keep, same_holder):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 40, size=int(rng.integers(1, 4)))
    q_cu, q_pos = _holder(rng, lens, q_keep, pad=True)
    if same_holder:
        k_cu, k_pos = q_cu, q_pos
    else:
        k_cu, k_pos = _holder(rng, lens, k_keep, pad=True)
    n_seg = lens.size
    # two key holders: a dummy one first, so offsets are exercised
    d_cu, d_pos = _holder(rng, lens, 0.5, pad=False)
    form = _form(q_cu, q_pos, _key_set((d_cu, d_pos), (k_cu, k_pos)),
                 (1, d_pos.size, k_pos.size), mask)
    if form is None:
        return None
    got = _fa_pairs(form, q_pos.size, k_pos.size)
    want = _mask_pairs(q_cu, q_pos, k_cu, k_pos, mask)
    assert got == want
    return form


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_forms_are_exact(mask):
    made = 0
    for seed in range(60):
        for q_keep, k_keep, same in ((1.0, 1.0, True), (0.6, 0.6, True), (0.7, 0.5, False),
                                     (1.0, 0.4, False)):
            made += _check_case(seed, mask, q_keep, k_keep, same) is not None
    assert made > 0


@pytest.mark.parametrize("mask", [m for m in MASKS], ids=str)
def test_own_keys_always_have_a_form_without_windows_cut_by_gaps(mask):
    """A rank's queries against its own keys (same holder): whole documents, or several
    runs per document, always get a form unless a sliding window reaches over a gap."""
    for seed in range(40):
        form = _check_case(seed, mask, 1.0, 1.0, True)
        assert form is not None and len(form.calls) <= 2
        if mask.window_size == (-1, -1):
            form = _check_case(seed, mask, 0.6, 0.6, True)
            assert form is not None


def test_dual_chunk_pieces_against_a_gathered_prefix_overlap_and_are_resolved():
    """Two pieces of one document (head and tail) against every key before them: their key
    rows overlap; the form gathers or splits, and stays exact."""
    n = 64
    q_pos = np.concatenate([np.arange(0, 8), np.arange(56, 64)])
    q_cu = np.array([0, q_pos.size])
    k_pos = np.arange(n)
    k_cu = np.array([0, n])
    mask = AttnMask(causal=True)
    keys = _key_set((k_cu, k_pos))
    costly_kv = FlashRoute("flash", q_row_bytes=10, kv_row_bytes=10 ** 6)
    for route in (ROUTE, costly_kv, FlashRoute("flash", 10 ** 6, 10)):
        form = _form(q_cu, q_pos, keys, (0, 0, n), mask, route)
        assert form is not None
        assert _fa_pairs(form, q_pos.size, n) == _mask_pairs(q_cu, q_pos, k_cu, k_pos, mask)
    # cheap K/V rows: gathered into one call; costly ones: two calls, no gather (the second
    # call's spans: its 8 queries and the 64 keys they see, so it takes far costlier query
    # rows to make the gather win)
    costly_q = FlashRoute("flash", q_row_bytes=10 ** 6, kv_row_bytes=10)
    gathered = _form(q_cu, q_pos, keys, (0, 0, n), mask, costly_q)
    assert len(gathered.calls) == 1 and gathered.calls[0].k_index is not None
    split = _form(q_cu, q_pos, keys, (0, 0, n), mask, costly_kv)
    assert len(split.calls) == 2 and all(c.k_index is None for c in split.calls)


def test_remote_keys_before_both_pieces_merge_into_one_non_causal_segment():
    """TransformerEngine's step: both of a rank's pieces see the same earlier keys whole:
    one segment, no window."""
    q_pos = np.concatenate([np.arange(16, 24), np.arange(24, 32) + 100])
    q_pos = np.sort(q_pos)
    q_cu = np.array([0, q_pos.size])
    k_pos = np.arange(0, 16)
    k_cu = np.array([0, k_pos.size])
    form = _form(q_cu, q_pos, _key_set((k_cu, k_pos)), (0, 0, k_pos.size),
                 AttnMask(causal=True))
    assert len(form.calls) == 1 and form.calls[0].window == (-1, -1)
    assert form.calls[0].cu_q.tolist() == [0, q_pos.size]


def test_query_pieces_cut_at_gaps_chunks_segments_and_padding():
    cu = np.array([0, 7, 10])
    pos = np.array([0, 1, 2, 5, 6, -1, -1, 3, 4, 5])
    seg, row0, rows, qs = query_pieces(cu, pos, 4)
    assert list(zip(seg, row0, rows, qs)) == [(0, 0, 3, 0), (0, 3, 2, 5), (1, 7, 1, 3),
                                              (1, 8, 2, 4)]
    assert torch.equal(torch.from_numpy(rows), torch.tensor([3, 2, 1, 2]))


def test_windows_over_key_gaps_are_cut_into_exact_pieces():
    """A rank's two pieces of one document closer than the window (the balanced layout's
    short stretches): the left edge of the second piece's queries runs through the first
    piece, then the gap, then its own keys. Cut where it enters and leaves each, every
    sub-piece is exact; the calls of windows that only some documents need are handed only
    their rows (spans)."""
    mask = AttnMask(causal=True, window_size=(40, 0))
    doc = np.concatenate([np.arange(0, 8), np.arange(20, 70)])    # gap [8, 20) < window
    other = np.arange(0, 30)                                       # a plain document after
    q_pos = np.concatenate([doc, other])
    q_cu = np.array([0, doc.size, q_pos.size])
    keys = _key_set((q_cu, q_pos))
    form = _form(q_cu, q_pos, keys, (0, 0, q_pos.size), mask)
    assert form is not None and len(form.calls) >= 2
    assert _fa_pairs(form, q_pos.size, q_pos.size) == _mask_pairs(q_cu, q_pos, q_cu, q_pos,
                                                                  mask)
    narrow = [c for c in form.calls if c.q_span != (0, q_pos.size)]
    assert narrow and all(c.q_span[1] <= doc.size for c in narrow)   # the first document's
    # without the cut the rule refuses the call (what it did before)
    from varlen_cp.tables import flash_form as ff
    whole = ff.flash_forms(q_pos.size, query_pieces(q_cu, q_pos, 0), keys,
                           [(0, 0, q_pos.size)], mask, ROUTE, refined=True)
    assert whole == [None]


def test_split_pieces_cuts_inside_pieces_only():
    from varlen_cp.tables.flash_form import _split_pieces

    pieces = (np.array([0, 0, 1]), np.array([0, 10, 20]), np.array([10, 5, 8]),
              np.array([0, 100, 0]))
    got = _split_pieces(pieces, np.array([0, 0, 0, 1, 1]), np.array([0, 4, 102, 8, 3]))
    seg, row0, rows, start = (x.tolist() for x in got)
    assert list(zip(seg, row0, rows, start)) == [
        (0, 0, 4, 0), (0, 4, 6, 4), (0, 10, 2, 100), (0, 12, 3, 102), (1, 20, 3, 0),
        (1, 23, 5, 3)]
    assert _split_pieces(pieces, np.array([0]), np.array([0])) is None   # at a start: none


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_calls_built_together_equal_calls_built_alone(mask):
    """flash_forms builds the one-window calls of many key holders with shared array
    operations (a ring's steps): each must be the call it makes for that holder alone."""
    from varlen_cp.tables.flash_form import flash_forms as forms_of

    def same(a, b):
        if a is None or b is None:
            return a is b
        return len(a.calls) == len(b.calls) and all(
            torch.equal(x.cu_q, y.cu_q) and torch.equal(x.cu_k, y.cu_k)
            and (x.max_q, x.max_k, x.window, x.pairs, x.q_span, x.k_span)
            == (y.max_q, y.max_k, y.window, y.pairs, y.q_span, y.k_span)
            and (x.k_index is None) == (y.k_index is None)
            for x, y in zip(a.calls, b.calls))

    # a call whose pieces' keys overlap (gathered or split, built alone) among simple ones
    q_pos = np.concatenate([np.arange(0, 8), np.arange(56, 64)])
    q_cu = np.array([0, q_pos.size])
    holders = [(np.array([0, 64]), np.arange(64)), (np.array([0, 4]), np.arange(60, 64)),
               (np.array([0, 0]), np.zeros(0, dtype=np.int64))]
    keys = _key_set(*holders)
    ranges = [(0, 0, 64), (1, 64, 4), (2, 68, 0)]
    pieces = query_pieces(q_cu, q_pos, mask.chunk_size or 0)
    mixed = forms_of(q_pos.size, pieces, keys, ranges, mask, ROUTE)
    for r, form in zip(ranges, mixed):
        assert same(form, forms_of(q_pos.size, pieces, keys, [r], mask, ROUTE)[0])
    checked = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        lens = rng.integers(1, 40, size=int(rng.integers(1, 4)))
        q_cu, q_pos = _holder(rng, lens, 0.8, pad=True)
        holders = [_holder(rng, lens, keep, pad=False) for keep in (1.0, 0.5, 0.9, 0.3)]
        keys = _key_set(*holders)
        off = np.concatenate([[0], np.cumsum([p.size for _, p in holders])])
        ranges = [(h, int(off[h]), int(off[h + 1] - off[h])) for h in range(len(holders))]
        pieces = query_pieces(q_cu, q_pos, mask.chunk_size or 0)
        together = forms_of(q_pos.size, pieces, keys, ranges, mask, ROUTE)
        for r, form in zip(ranges, together):
            assert same(form, forms_of(q_pos.size, pieces, keys, [r], mask, ROUTE)[0])
            checked += form is not None and len(form.calls) > 0
    assert checked > 0
