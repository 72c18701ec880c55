"""Synthetic packed documents shared by the torchtitan and Megatron demos (no framework imports).

Document lengths are heavy-tailed (Pareto, clipped) and fill a row exactly. Content is
learnable only by attending within the document: each document follows one of a few fixed
random permutations of the alphabet (next token = rule[token]; with probability ``noise`` a
random token), so the loss visibly falls and documents must not leak into each other.
Everything is a pure function of the generator's state: no downloads, no tokenizer.
"""

from __future__ import annotations

import torch


def document_lengths(gen: torch.Generator, total: int, *, min_len: int, max_len: int,
                     alpha: float) -> list[int]:
    """Pareto(alpha, scale=min_len) lengths clipped to max_len, filling exactly ``total``."""
    lengths: list[int] = []
    left = total
    while left > 0:
        u = float(torch.rand((), generator=gen)) * (1 - 1e-9) + 1e-9
        n = int(min_len / u ** (1.0 / alpha))
        n = max(1, min(n, max_len, left))
        lengths.append(n)
        left -= n
    return lengths


def make_rules(seed: int, num_rules: int, alphabet: int) -> torch.Tensor:
    """[num_rules, alphabet] random permutations (the 'grammar' of the synthetic language)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(alphabet, generator=gen) for _ in range(num_rules)])


def packed_documents(gen: torch.Generator, rules: torch.Tensor, seq_len: int, *,
                     min_len: int, max_len: int, alpha: float, noise: float
                     ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row: (lengths, tokens, next_tokens, positions), tensors [seq_len] int64.

    ``next_tokens[i]`` is the token that follows ``tokens[i]`` in its document's sequence;
    at a document's last token it is not visible in the row (callers mask it out of the loss).
    """
    num_rules, alphabet = rules.shape
    lengths = document_lengths(gen, seq_len, min_len=min_len, max_len=max_len, alpha=alpha)
    tokens, nexts, positions = [], [], []
    for n in lengths:
        rule = rules[int(torch.randint(num_rules, (), generator=gen))]
        doc = torch.empty(n + 1, dtype=torch.int64)
        doc[0] = torch.randint(alphabet, (), generator=gen)
        flips = torch.rand(n, generator=gen) < noise
        randoms = torch.randint(alphabet, (n,), generator=gen)
        for j in range(n):  # short docs; the loop is ~1 us per token
            doc[j + 1] = randoms[j] if flips[j] else rule[doc[j]]
        tokens.append(doc[:n])
        nexts.append(doc[1:])
        positions.append(torch.arange(n, dtype=torch.int64))
    return lengths, torch.cat(tokens), torch.cat(nexts), torch.cat(positions)
