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

Real corpora are large (a 1e9-token corpus is ~1e6 documents; one document may be longer
than all the batches analysed together), so the files are read in one pass, line by line,
keeping only the documents that reach into the batches analysed (:func:`scan`: the rest are
counted, not kept), and :func:`pack` builds only the batches asked for, each from a binary
search of the document ends: time and memory grow with the file's size and the batches
analysed, never with the square of the batch count (``bench/cli_corpus.py``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from ..job_file import input_file, not_utf8
from ..mixes import MIXES


def _positive(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: a document length must be an int >= 1, got {value!r}")
    return value


@contextlib.contextmanager
def _text(p: Path, flag: str) -> Iterator[Iterator[tuple[int, str]]]:
    """(line number, line) of a UTF-8 text file, each line decoded on its own so that a
    byte that is not UTF-8 is named with its exact line (``job_file.not_utf8``)."""
    with p.open("rb") as f:
        def lines() -> Iterator[tuple[int, str]]:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise not_utf8(flag, p, n, e) from None
                yield n, line
        yield lines()


def iter_lengths_file(path: str | Path) -> Iterator[int]:
    """The integers of a text file (spaces, commas or newlines between them; ``#``
    comments), read line by line."""
    p = input_file(path, "--lengths")
    with _text(p, "--lengths") as lines:
        for n, line in lines:
            for token in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    value = int(token)
                except ValueError:
                    raise ValueError(f"--lengths: {p}:{n}: {token!r} is not an "
                                     f"integer") from None
                yield _positive(value, f"--lengths: {p}:{n}")


def iter_jsonl(path: str | Path, field: str) -> Iterator[int]:
    """The ``field`` of every record of a JSONL file (an int, or a list: its length), read
    record by record."""
    p = input_file(path, "--jsonl")
    with _text(p, "--jsonl") as lines:
        for n, line in lines:
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
            yield _positive(value, f"--jsonl: {p}:{n}: field {field!r}")


@dataclass(frozen=True)
class Corpus:
    """One pass over a corpus' lengths: ``head``, the documents up to the one that reaches
    the kept token count (all of them when the corpus is shorter), and the whole corpus'
    document count, token count and longest document."""

    head: list[int]
    n_docs: int
    tokens: int
    longest: int


def scan(values: Iterable[int], keep_tokens: int, what: str) -> Corpus:
    """Read ``values`` once, keeping the documents the first ``keep_tokens`` tokens touch;
    ``what`` names the source in the error for an empty one."""
    head: list[int] = []
    n = tokens = longest = 0
    for value in values:
        if tokens < keep_tokens:
            head.append(value)
        n += 1
        tokens += value
        longest = max(longest, value)
    if not n:
        raise ValueError(f"{what} holds no lengths")
    return Corpus(head, n, tokens, longest)


def mix_lengths(name: str, total: int) -> list[int]:
    """The synthetic mix ``name`` for ``total`` tokens."""
    if name not in MIXES:
        raise ValueError(f"--mix must be one of {sorted(MIXES)}, got {name!r}")
    return MIXES[name](total)


def count_batches(tokens: int, seq_len: int, rows: int = 1) -> int:
    """How many full batches of ``rows`` x ``seq_len`` tokens ``tokens`` packed tokens make
    (ValueError for a bad size or fewer than one)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"--seq-len must be an int >= 1, got {seq_len!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows per batch must be an int >= 1, got {rows!r}")
    n_batches = tokens // (seq_len * rows)
    if n_batches == 0:
        raise ValueError(f"the documents hold {tokens} tokens, fewer than one batch "
                         f"of {rows} x {seq_len} (--seq-len); give more documents or a "
                         f"shorter --seq-len")
    return n_batches


def pack(lengths: list[int], seq_len: int, rows: int = 1, limit: int | None = None
         ) -> list[torch.Tensor]:
    """The first ``limit`` (None: every) full batches of ``rows`` rows of ``seq_len``
    tokens, as their ``cu_seqlens`` (int64, CPU), documents cut at row ends (module
    docstring)."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    step = seq_len * rows
    n_batches = count_batches(int(ends[-1]) if ends.size else 0, seq_len, rows)
    if limit is not None:
        n_batches = min(n_batches, limit)
    row_ends = seq_len * np.arange(1, rows + 1, dtype=np.int64)
    out = []
    for b in range(n_batches):
        lo = b * step
        # every document end and every row end in (lo, lo + step] is a boundary
        inside = ends[np.searchsorted(ends, lo, "right"):np.searchsorted(ends, lo + step,
                                                                         "right")]
        cuts = np.union1d(inside - lo, row_ends)
        out.append(torch.from_numpy(np.concatenate([np.zeros(1, np.int64), cuts])))
    return out
