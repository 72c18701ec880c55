"""The FlashAttention form of a call (``schedules.flash_form``) against the mask itself.

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
from varlen_cp.schedules.flash_form import FlashRoute, flash_forms, query_pieces
from varlen_cp.schedules.holders import Holder, HolderSet

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
    """The pairs FlashAttention computes for ``form``, by its own rule; also checks the
    calls' coverage and non-overlap."""
    out, pairs = set(), 0
    for n_call, call in enumerate(form.calls):
        cu_q, cu_k = call.cu_q.numpy(), call.cu_k.numpy()
        index = (np.arange(n_k) if call.k_index is None else call.k_index.numpy())
        assert cu_q[0] == 0 and cu_q[-1] == n_q, "every query row in a segment"
        assert cu_k[0] == 0 and cu_k[-1] == index.size, "every key row in a segment"
        assert (np.diff(cu_q) >= 0).all() and (np.diff(cu_k) >= 0).all()
        if call.k_index is None:
            assert index.size == n_k
        wl, wr = call.window
        for s in range(cu_q.size - 1):
            sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
            assert sq <= call.max_q and sk <= call.max_k
            for i in range(sq):
                for j in range(sk):
                    if (wl < 0 or j >= i + sk - sq - wl) and (wr < 0 or j <= i + sk - sq + wr):
                        pair = (cu_q[s] + i, int(index[cu_k[s] + j]))
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
    for route in (ROUTE, costly_kv):
        form = _form(q_cu, q_pos, keys, (0, 0, n), mask, route)
        assert form is not None
        assert _fa_pairs(form, q_pos.size, n) == _mask_pairs(q_cu, q_pos, k_cu, k_pos, mask)
    # cheap K/V rows: gathered into one call; costly ones: two calls, no gather
    gathered = _form(q_cu, q_pos, keys, (0, 0, n), mask)
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
