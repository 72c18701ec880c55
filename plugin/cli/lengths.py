"""Document lengths for ``varlen-cp-plan``, and their packing into training batches.

Sources: a text file of lengths (one or more integers per line, separated by spaces or
commas; ``#`` starts a comment), a JSONL file with a length field per record (an int, or a
list whose length is taken, e.g. token ids), or a named synthetic mix of
``varlen_cp.mixes`` generated for the tokens asked for.

Packing (what torchtitan's and Megatron's pretraining loaders do): documents are laid end
to end in their order and cut into rows of ``seq_len`` tokens; a document that crosses a
row end continues as a new document in the next row (every row starts a document, as
``trainer.packed_cu_seqlens`` counts them); ``rows`` rows make one batch, whose
``cu_seqlens`` the plan is built from. A last incomplete batch is dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..mixes import MIXES


def _positive(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: a document length must be an int >= 1, got {value!r}")
    return value


def read_lengths_file(path: str | Path) -> list[int]:
    """Integers of a text file (spaces, commas or newlines between them; ``#`` comments)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--lengths: no such file {str(p)!r}")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        for token in line.split("#", 1)[0].replace(",", " ").split():
            try:
                value = int(token)
            except ValueError:
                raise ValueError(f"--lengths: {p}:{n}: {token!r} is not an integer") from None
            out.append(_positive(value, f"--lengths: {p}:{n}"))
    if not out:
        raise ValueError(f"--lengths: {p} holds no lengths")
    return out


def read_jsonl(path: str | Path, field: str) -> list[int]:
    """The ``field`` of every record of a JSONL file: an int, or a list (its length)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--jsonl: no such file {str(p)!r}")
    out = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--jsonl: {p}:{n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                got = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"--jsonl: {p}:{n}: no field {field!r} (set "
                                 f"--length-field); the record has {got}")
            value = record[field]
            if isinstance(value, list):
                value = len(value)
            out.append(_positive(value, f"--jsonl: {p}:{n}: field {field!r}"))
    if not out:
        raise ValueError(f"--jsonl: {p} holds no records")
    return out


def mix_lengths(name: str, total: int) -> list[int]:
    """The synthetic mix ``name`` for ``total`` tokens."""
    if name not in MIXES:
        raise ValueError(f"--mix must be one of {sorted(MIXES)}, got {name!r}")
    return MIXES[name](total)


def pack(lengths: list[int], seq_len: int, rows: int = 1) -> list[torch.Tensor]:
    """Every full batch of ``rows`` rows of ``seq_len`` tokens, as its ``cu_seqlens`` (int64,
    CPU), documents cut at row ends (module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"--seq-len must be an int >= 1, got {seq_len!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows per batch must be an int >= 1, got {rows!r}")
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    step = seq_len * rows
    n_batches = int(ends[-1]) // step
    if n_batches == 0:
        raise ValueError(f"the documents hold {int(ends[-1])} tokens, fewer than one batch "
                         f"of {rows} x {seq_len} (--seq-len); give more documents or a "
                         f"shorter --seq-len")
    row_ends = torch.arange(1, n_batches * rows + 1, dtype=torch.int64) * seq_len
    # every document end and every row end inside the packed batches is a boundary
    cuts = torch.unique(torch.cat([ends[ends < n_batches * step], row_ends]))
    out = []
    for b in range(n_batches):
        lo, hi = b * step, (b + 1) * step
        inside = cuts[(cuts > lo) & (cuts <= hi)] - lo
        out.append(torch.cat([torch.zeros(1, dtype=torch.int64), inside]))
    return out
