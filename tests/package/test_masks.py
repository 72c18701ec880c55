"""AttnMask: validation and interval math, checked against the dense reference mask."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.reference import reference_mask
from varlen_cp import AttnMask

MASKS = [
    AttnMask(causal=True),
    AttnMask(causal=False),
    AttnMask(causal=True, window_size=(3, 0)),
    AttnMask(causal=False, window_size=(3, 2)),
    AttnMask(causal=False, window_size=(-1, 5)),
    AttnMask(causal=False, window_size=(0, 0)),
    AttnMask(causal=True, chunk_size=4),
    AttnMask(causal=False, chunk_size=7),
    AttnMask(causal=True, chunk_size=1),
    AttnMask(causal=True, window_size=(5, 0), chunk_size=6),
]


def _ref(mask, qp, kp):
    return reference_mask(qp, kp, causal=mask.causal, window_size=mask.window_size,
                          chunk_size=mask.chunk_size)


@pytest.mark.parametrize("bad, field", [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(0,)), "window_size"),
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-3), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
    (dict(causal="yes"), "causal"),
])
def test_invalid_mask_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        AttnMask(**bad)


def test_mask_is_hashable_and_normalized():
    a = AttnMask(window_size=[3, 0])
    assert a == AttnMask(window_size=(3, 0)) and hash(a) == hash(AttnMask(window_size=(3, 0)))
    assert a.params == (True, 3, 0, 0)
    assert AttnMask(chunk_size=8).kernel_kwargs() == {
        "causal": True, "window_size": (-1, -1), "chunk_size": 8}


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_intervals_match_reference(mask):
    """Keys visible to p are exactly the keys in [lo(p), hi(p)]; queries that see k are
    exactly the (non-padding) queries in [qlo(k), qhi(k)]."""
    qp = torch.arange(-2, 30)
    kp = torch.arange(-2, 30)
    ref = _ref(mask, qp, kp)
    lo, hi = mask.key_interval(qp)
    in_interval = (kp[None, :] >= lo[:, None]) & (kp[None, :] <= hi[:, None])
    assert torch.equal(in_interval, ref)
    qlo, qhi = mask.query_interval(kp)
    seen_by = (qp[:, None] >= qlo[None, :]) & (qp[:, None] <= qhi[None, :]) & (qp[:, None] >= 0)
    assert torch.equal(seen_by, ref)


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_interval_ends_never_decrease(mask):
    p = torch.arange(0, 200)
    lo, hi = mask.key_interval(p)
    assert bool((lo[1:] >= lo[:-1]).all()) and bool((hi[1:] >= hi[:-1]).all())


@given(
    mask_i=st.integers(0, len(MASKS) - 1),
    q_start=st.integers(0, 40), q_len=st.integers(0, 30),
    k_parts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=3),
)
def test_count_visible_matches_dense_count(mask_i, q_start, q_len, k_parts):
    mask = MASKS[mask_i]
    qp = torch.arange(q_start, q_start + q_len)
    keys = sorted({k for a, n in k_parts for k in range(a, a + n)})
    kp = torch.tensor(keys, dtype=torch.long)
    assert mask.count_visible(qp, kp) == int(_ref(mask, qp, kp).sum())


def test_document_work_closed_forms():
    assert AttnMask(causal=True).document_work(10) == 55
    assert AttnMask(causal=False).document_work(10) == 100
    assert AttnMask(causal=True, chunk_size=4).document_work(10) == 10 + 10 + 3
    assert AttnMask(causal=True, window_size=(2, 0)).document_work(5) == 1 + 2 + 3 + 3 + 3
