"""Synthetic packed batches in megatron's THD form, for the training demo and the tests.

Each step packs documents with heavy-tailed (Pareto) lengths into one row of ``seq_len``
tokens. Content a small model can learn only by attending within its document: a document
follows one of ``num_rules`` fixed random permutations of the alphabet (next token =
rule[token]; with probability ``noise`` a random token). Batches are a pure function of
(seed, step, dp_rank), so every CP rank of a data-parallel replica sees the same global
batch, and a CP=N run sees exactly the CP=1 run's batches.

Output: ``{"tokens", "labels", "loss_mask", "position_ids"}`` as [1, seq_len] tensors
(labels: the next token inside the document; a document's last token has loss_mask 0) and
the global ``cu_seqlens`` (int32, CPU). No downloads, no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def document_lengths(gen: torch.Generator, total: int, min_len: int, max_len: int,
                     alpha: float) -> list[int]:
    """Pareto lengths clipped to [1, max_len] whose sum is exactly ``total``."""
    lengths: list[int] = []
    left = total
    while left > 0:
        u = float(torch.rand((), generator=gen)) * (1 - 1e-9) + 1e-9
        n = min(int(min_len / u ** (1.0 / alpha)), max_len, left)
        lengths.append(max(n, 1))
        left -= lengths[-1]
    return lengths


def synthetic_batch(cfg: SyntheticDataConfig, step: int, dp_rank: int = 0
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The global packed batch of ``step`` for data-parallel rank ``dp_rank``."""
    rules_gen = torch.Generator().manual_seed(cfg.seed)
    rules = torch.stack([torch.randperm(cfg.alphabet, generator=rules_gen)
                         for _ in range(cfg.num_rules)])
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 997 + dp_rank + 1)
    max_len = cfg.max_doc_len or cfg.seq_len
    lengths = document_lengths(gen, cfg.seq_len, cfg.min_doc_len, max_len, cfg.alpha)
    tokens, labels, mask, positions = [], [], [], []
    for n in lengths:
        rule = rules[int(torch.randint(cfg.num_rules, (), generator=gen))]
        seq = torch.empty(n + 1, dtype=torch.long)
        seq[0] = torch.randint(cfg.alphabet, (), generator=gen)
        noisy = torch.rand(n, generator=gen) < cfg.noise
        random_next = torch.randint(cfg.alphabet, (n,), generator=gen)
        for i in range(n):
            seq[i + 1] = random_next[i] if noisy[i] else rule[seq[i]]
        tokens.append(seq[:n])
        labels.append(seq[1:])
        m = torch.ones(n)
        m[-1] = 0.0  # the document's last token has nothing to predict inside it
        mask.append(m)
        positions.append(torch.arange(n))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    batch = {"tokens": torch.cat(tokens)[None], "labels": torch.cat(labels)[None],
             "loss_mask": torch.cat(mask)[None], "position_ids": torch.cat(positions)[None]}
    return batch, cu
