"""Synthetic packed batches in megatron's THD form, for the training demo and the tests.

Each step packs documents from ``varlen_cp.integrations.synthetic_data`` (heavy-tailed
lengths, content learnable only within a document) into one row of ``seq_len`` tokens. Batches are a pure function of
(seed, step, dp_rank), so every CP rank of a data-parallel replica sees the same global
batch, and a CP=N run sees exactly the CP=1 run's batches.

Output: ``{"tokens", "labels", "loss_mask", "position_ids"}`` as [1, seq_len] tensors
(labels: the next token inside the document; a document's last token has loss_mask 0) and
the global ``cu_seqlens`` (int32, CPU). No downloads, no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..synthetic_data import make_rules, packed_documents


@dataclass(kw_only=True, frozen=True)
class SyntheticDataConfig:
    """seq_len: packed tokens per step; doc lengths ~ Pareto(alpha, min_doc_len) clipped to
    max_doc_len (0: seq_len); vocab: alphabet size (<= the model's vocab_size)."""

    seq_len: int = 512
    min_doc_len: int = 8
    max_doc_len: int = 0
    alpha: float = 1.1
    alphabet: int = 128
    num_rules: int = 4
    noise: float = 0.05
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("seq_len", "min_doc_len", "alphabet", "num_rules"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"data.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_doc_len, int) or self.max_doc_len < 0:
            raise ValueError(f"data.max_doc_len must be an int >= 0, got {self.max_doc_len!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"data.alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.noise, (int, float)) or not 0 <= self.noise <= 1:
            raise ValueError(f"data.noise must be in [0, 1], got {self.noise!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"data.seed must be an int, got {self.seed!r}")


def synthetic_batch(cfg: SyntheticDataConfig, step: int, dp_rank: int = 0
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The global packed batch of ``step`` for data-parallel rank ``dp_rank``."""
    rules = make_rules(cfg.seed, cfg.num_rules, cfg.alphabet)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 997 + dp_rank + 1)
    lengths, tokens, labels, positions = packed_documents(
        gen, rules, cfg.seq_len, min_len=cfg.min_doc_len,
        max_len=cfg.max_doc_len or cfg.seq_len, alpha=cfg.alpha, noise=cfg.noise)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    loss_mask = torch.ones(cfg.seq_len)
    loss_mask[cu[1:].long() - 1] = 0.0  # a document's last token has nothing to predict in it
    batch = {"tokens": tokens[None], "labels": labels[None], "loss_mask": loss_mask[None],
             "position_ids": positions[None]}
    return batch, cu
