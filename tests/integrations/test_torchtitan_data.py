"""Synthetic packed data: structure, determinism, heavy tail, and learnable content; and the
trainer's host-side packing of a [B, L] batch into one sequence of documents."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402

from varlen_cp.integrations.synthetic_data import document_lengths  # noqa: E402
from varlen_cp.integrations.torchtitan.data import (SyntheticPackedDataLoader,  # noqa: E402
                                                    SyntheticTokenizer)
from varlen_cp.integrations.torchtitan.trainer import packed_cu_seqlens  # noqa: E402


def loader(dp_rank=0, **kw):
    cfg = SyntheticPackedDataLoader.Config(**kw)
    tok = SyntheticTokenizer.Config(vocab_size=512).build()
    return cfg.build(dp_world_size=2, dp_rank=dp_rank, tokenizer=tok, seq_len=512,
                     local_batch_size=2)


def test_batch_structure():
    (inp, labels) = loader().batch(0)
    tokens, pos = inp["input"], inp["positions"]
    assert tokens.shape == pos.shape == labels.shape == (2, 512)
    assert (pos[:, 0] == 0).all()
    for row in range(2):
        starts = (pos[row] == 0).nonzero().flatten().tolist() + [512]
        for a, b in zip(starts[:-1], starts[1:]):
            assert pos[row, a:b].tolist() == list(range(b - a))  # positions count up per doc
            assert labels[row, b - 1] == IGNORE_INDEX  # no prediction across documents
            assert (labels[row, a:b - 1] == tokens[row, a + 1:b]).all()  # next-token labels
    assert tokens.max() < 256  # the default alphabet


def test_deterministic_per_dp_rank_and_index():
    a, b = loader().batch(3), loader().batch(3)
    assert torch.equal(a[0]["input"], b[0]["input"])
    other_rank = loader(dp_rank=1).batch(3)
    assert not torch.equal(a[0]["input"], other_rank[0]["input"])
    assert not torch.equal(a[0]["input"], loader().batch(4)[0]["input"])


def test_iteration_and_state_dict_resume():
    dl = loader(num_batches=3)
    got = list(dl)
    assert len(got) == 3 and torch.equal(got[2][0]["input"], loader().batch(2)[0]["input"])
    resumed = loader(num_batches=3)
    resumed.load_state_dict({"dp_rank_0": 2})
    assert torch.equal(next(iter(resumed))[0]["input"], got[2][0]["input"])


def test_document_lengths_heavy_tailed():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor(document_lengths(gen, 200_000, min_len=16, max_len=8192, alpha=1.1),
                           dtype=torch.float)
    assert lengths.sum() == 200_000 and lengths.min() >= 1 and lengths.max() <= 8192
    # Heavy tail: the mean is far above the median and the longest docs are >> typical.
    assert lengths.mean() > 2 * lengths.median()
    assert lengths.max() > 50 * lengths.median()


def test_content_follows_a_rule_per_document():
    dl = loader(noise=0.0, num_rules=2)
    inp, labels = dl.batch(0)
    rules = dl.rules
    tokens, pos = inp["input"][0], inp["positions"][0]
    valid = labels[0] != IGNORE_INDEX
    # Every transition follows one of the two permutations, and one rule per document.
    nxt = torch.stack([r[tokens] for r in rules])  # [rules, L]
    ok = (nxt == labels[0]).any(0)
    assert ok[valid].all()
    doc_id = (pos == 0).cumsum(0)
    for d in doc_id.unique():
        sel = valid & (doc_id == d)
        if sel.sum() >= 3:
            per_rule = (nxt[:, sel] == labels[0][sel]).all(1)
            assert per_rule.any()


def test_packed_cu_seqlens_marks_row_starts():
    pos = torch.tensor([[3, 4, 0, 1, 2], [0, 1, 2, 0, 1]])  # row 0 starts mid-document
    assert packed_cu_seqlens(pos, (2, 5)).tolist() == [0, 2, 5, 8, 10]
    assert packed_cu_seqlens(None, (2, 5)).tolist() == [0, 5, 10]


def test_alphabet_must_fit_vocab():
    cfg = SyntheticPackedDataLoader.Config(alphabet=1024)
    with pytest.raises(ValueError, match="alphabet"):
        cfg.build(tokenizer=SyntheticTokenizer.Config(vocab_size=512).build(), seq_len=64)
