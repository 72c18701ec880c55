"""Named synthetic document-length mixes, for any token count: at 128K tokens they are the
lists ``bench/plan.py`` reports on (docs/layouts.md); ``varlen-cp-plan --mix NAME`` plans
them, and the host benchmarks and layout tests draw from them.

Each mix is a function ``total -> list of document lengths`` summing to exactly ``total``,
deterministic (seeded generators). Mixes: ``lognormal_1k`` (1000 documents per 128K tokens,
log-normal), ``lognormal_long`` (log-normal around 2K tokens), ``te_buckets`` (24K-32K
documents, TransformerEngine's benchmark buckets), ``one_128k`` (one 128K document per
128K tokens), ``short_4k`` (8-56 token documents), ``few_long`` (a few long documents among
many short ones). Only torch is imported."""

from __future__ import annotations

import torch

TOTAL = 131072


def fill(lengths: list[int], total: int = TOTAL) -> list[int]:
    """Cut or extend the list so the lengths sum to exactly ``total``."""
    out, used = [], 0
    for n in lengths:
        n = min(int(n), total - used)
        if n <= 0:
            break
        out.append(n)
        used += n
    if used < total:
        out.append(total - used)
    return out


def lognormal(seed: int, n: int, mu: float, sigma: float) -> list[int]:
    """``n`` log-normal lengths (at least 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g) * sigma + mu).long().clamp(min=1).tolist()


def lognormal_docs(n: int, seed: int, total: int = TOTAL) -> list[int]:
    """``n`` log-normal documents (mu 4.8, sigma 1) scaled to sum to ``total``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) + 4.8)
    x = (x * (total - n) / x.sum()).long().add(1)
    x[0] += total - int(x.sum())
    return x.tolist()


def lognormal_1k(total: int) -> list[int]:
    """1000 documents per 128K tokens, log-normal, scaled to the total."""
    return lognormal_docs(max(1, 1000 * total // TOTAL), 0, total)


def _scale(total: int) -> int:
    return max(1, -(-total // TOTAL))


MIXES = {
    "lognormal_1k": lognormal_1k,
    "lognormal_long": lambda t: fill(lognormal(1, 400 * _scale(t), 7.6, 1.0), t),
    "te_buckets": lambda t: fill([24576, 28672, 30720, 32768] * 2 * _scale(t), t),
    "one_128k": lambda t: fill([TOTAL] * _scale(t), t),
    "short_4k": lambda t: fill(torch.randint(
        8, 57, (5000 * _scale(t),), generator=torch.Generator().manual_seed(2)).tolist(), t),
    "few_long": lambda t: fill(([32768, 7000] + lognormal(3, 50, 5.0, 1.0) + [20000]
                                + lognormal(4, 3000, 5.0, 1.0)) * _scale(t), t),
}
