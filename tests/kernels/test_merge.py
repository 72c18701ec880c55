"""LSE merge: attention over a split key set equals the merge of the parts."""

import pytest
import torch

from tests.reference import reference_attn
from varlen_cp.kernels import merge_attn_partials
from varlen_cp.kernels.merge import merge_attn_partials_


@pytest.mark.parametrize("split", [0, 5, 11, 17])
def test_merge_of_key_halves_equals_whole(split):
    g = torch.Generator().manual_seed(split)
    q = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(17, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(17, 2, 6, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 9])
    qpos = torch.arange(8, 17)
    kpos = torch.arange(17)
    out, lse = reference_attn(q, k, v, cu_q, torch.tensor([0, 17]), causal=True,
                              q_positions=qpos, k_positions=kpos)
    a = reference_attn(q, k[:split], v[:split], cu_q, torch.tensor([0, split]), causal=True,
                       q_positions=qpos, k_positions=kpos[:split])
    b = reference_attn(q, k[split:], v[split:], cu_q, torch.tensor([0, 17 - split]),
                       causal=True, q_positions=qpos, k_positions=kpos[split:])
    m_out, m_lse = merge_attn_partials(a[0], a[1], b[0], b[1])
    # lse is fp32 by contract, so the merge weights carry fp32 rounding (~2e-7)
    torch.testing.assert_close(m_out, out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(m_lse, lse, atol=2e-6, rtol=2e-6)


def test_merge_with_empty_sides_never_nans():
    out = torch.randn(3, 1, 4)
    lse = torch.tensor([[0.5, float("-inf"), float("-inf")]])
    empty = torch.zeros(3, 1, 4)
    none = torch.full((1, 3), float("-inf"))
    m_out, m_lse = merge_attn_partials(out, lse, empty, none)
    torch.testing.assert_close(m_out[0], out[0])
    assert torch.equal(m_out[1:], torch.zeros(2, 1, 4))
    assert torch.isneginf(m_lse[0, 1:]).all() and m_lse[0, 0] == 0.5
    m2, l2 = merge_attn_partials(empty, none, out, lse)
    torch.testing.assert_close(m2, m_out)
    assert not torch.isnan(m2).any()


def test_merge_keeps_accumulator_dtype_and_checks_shapes():
    acc = torch.zeros(2, 1, 4)
    part = torch.ones(2, 1, 4, dtype=torch.float16)
    o, _ = merge_attn_partials(acc, torch.full((1, 2), float("-inf")), part, torch.zeros(1, 2))
    assert o.dtype == torch.float32 and torch.equal(o, torch.ones(2, 1, 4))
    with pytest.raises(ValueError, match="shapes differ"):
        merge_attn_partials(acc, torch.zeros(1, 2), part[:1], torch.zeros(1, 1))


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float16])
def test_in_place_merge_equals_the_merge(acc_dtype):
    """merge_attn_partials_ folds into the fp32 accumulator itself (a low-precision first
    accumulator is promoted once), with the result of merge_attn_partials, empty sides too."""
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5, 2, 4, generator=g).to(acc_dtype)
    part = torch.randn(5, 2, 4, generator=g, dtype=torch.float16)
    lse, lse_i = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    lse[0, 1] = lse_i[0, 1] = float("-inf")   # both empty: stays 0 / -inf
    lse[1, 2] = float("-inf")                 # accumulator empty there
    want, want_lse = merge_attn_partials(out.float(), lse, part, lse_i)
    acc = out.clone()
    got, got_lse = merge_attn_partials_(acc, lse, part, lse_i)
    assert got.dtype == torch.float32
    assert (got.data_ptr() == acc.data_ptr()) == (acc_dtype == torch.float32)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_lse, want_lse) and not torch.isnan(got).any()
    with pytest.raises(ValueError, match="shapes differ"):
        merge_attn_partials_(got, lse, part[:1], lse_i)
