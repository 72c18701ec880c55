"""Synthetic packed-document data for the demo and the tests (no downloads, no tokenizer).

Each batch row is a packed sequence of documents whose lengths follow a heavy-tailed
(Pareto) distribution, so a row mixes many short documents with an occasional long one,
as real pretraining data does. Content a small model can learn, and that needs attention
within the document: every document follows one of ``num_rules`` fixed random permutations
of the alphabet (next token = perm_rule[token], with probability ``noise`` a random token).
The first transition of a document reveals its rule, so the loss falls from ln(alphabet)
towards the noise floor only if the model attends to earlier tokens of the same document.

Output per step, as torchtitan's text dataloaders: ``({"input": [B, L], "positions":
[B, L]}, labels [B, L])``; positions restart at 0 at every document start; the label of a
document's last token is ``IGNORE_INDEX`` (no prediction across documents). Batches are a
pure function of (seed, dp_rank, batch index), so CP ranks of one data-parallel group see
the same data and a CP=N run sees exactly the batches of the CP=1 run.
Real data: set ``[dataloader] dataset`` to a torchtitan HF dataset name instead (see
config.py); its tokenizer comes from ``[job] hf_assets_path``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer

from ..synthetic_data import make_rules, packed_documents


class SyntheticTokenizer(BaseTokenizer):
    """Identity 'tokenizer' over integer ids; only its vocabulary size matters."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> list[int]:
        return [int(t) % self.vocab_size for t in text]

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return " ".join(str(int(i)) for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size


def make_row(gen: torch.Generator, rules: torch.Tensor, seq_len: int, *, min_len: int,
             max_len: int, alpha: float, noise: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row: (tokens, positions, labels), each [seq_len] int64."""
    lengths, tokens, labels, positions = packed_documents(
        gen, rules, seq_len, min_len=min_len, max_len=max_len, alpha=alpha, noise=noise)
    ends = torch.tensor(lengths).cumsum(0) - 1
    labels[ends] = IGNORE_INDEX  # the next document is not predictable from this one
    return tokens, positions, labels


class SyntheticPackedDataLoader(BaseDataLoader):
    """Endless (or ``num_batches``-long) stream of synthetic packed batches."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "synthetic"
        seed: int = 1234
        min_doc_len: int = 16
        """Pareto scale: the shortest typical document."""
        max_doc_len: int = 0
        """Longest document (0: the sequence length)."""
        doc_len_alpha: float = 1.2
        """Pareto shape: smaller = heavier tail (mean length = min * alpha / (alpha - 1))."""
        alphabet: int = 256
        """Tokens used (<= the model's vocab_size)."""
        num_rules: int = 4
        noise: float = 0.05
        num_batches: int = 0
        """0: endless."""

        def __post_init__(self) -> None:
            for name in ("min_doc_len", "alphabet", "num_rules"):
                if getattr(self, name) < 1:
                    raise ValueError(f"dataloader.{name} must be >= 1, got {getattr(self, name)}")
            if self.max_doc_len < 0 or self.num_batches < 0:
                raise ValueError("dataloader.max_doc_len and num_batches must be >= 0")
            if self.doc_len_alpha <= 0:
                raise ValueError(f"dataloader.doc_len_alpha must be > 0, got {self.doc_len_alpha}")
            if not 0.0 <= self.noise <= 1.0:
                raise ValueError(f"dataloader.noise must be in [0, 1], got {self.noise}")

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0,
                 tokenizer: BaseTokenizer | None = None, seq_len: int = 2048,
                 local_batch_size: int = 1, **kwargs: Any) -> None:
        vocab = tokenizer.get_vocab_size() if tokenizer is not None else config.alphabet
        if config.alphabet > vocab:
            raise ValueError(f"dataloader.alphabet ({config.alphabet}) must be <= the "
                             f"vocabulary size ({vocab})")
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.rules = make_rules(config.seed, config.num_rules, config.alphabet)
        self.next_batch = 0

    def batch(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Batch ``index`` of this data-parallel rank (deterministic)."""
        c = self.config
        gen = torch.Generator().manual_seed(
            (c.seed * 1_000_003 + self.dp_rank * 7919 + index) % (2**63 - 1))
        rows = [make_row(gen, self.rules, self.seq_len, min_len=c.min_doc_len,
                         max_len=c.max_doc_len or self.seq_len, alpha=c.doc_len_alpha,
                         noise=c.noise) for _ in range(self.batch_size)]
        tokens, positions, labels = (torch.stack(t) for t in zip(*rows))
        return {"input": tokens, "positions": positions}, labels

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while not self.config.num_batches or self.next_batch < self.config.num_batches:
            out = self.batch(self.next_batch)
            self.next_batch += 1
            yield out

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.next_batch, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"dp_rank_{self.dp_rank}"
        if key in state_dict:
            self.next_batch = int(state_dict[key])
