"""varlen-cp-plan on large corpora: a lengths file of realistic documents (log-normal,
mean ~1500 tokens) of 1e7 .. 1e9 tokens, and one document of 1e12 tokens, each planned for
its first batch (``--batches 1``, the default cp sweep), timed in process.

Before issue 29 the CLI built every batch's ``cu_seqlens`` and scanned all cut points per
batch (time quadratic in the batch count: 1e7 tokens 0.25 s, 4e7 2.6 s, 1e9 ~25 min), and
a 1e12-token document asked ``torch.arange`` for 7.8 GB. Now the file is read once and only
the analysed batches are packed (``varlen_cp.cli.lengths``).

    python bench/cli_corpus.py [--max-tokens 1e9] [--json bench/results/cli_corpus.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from varlen_cp.cli import plan as cli

MEAN_DOC = 1500


def write_corpus(path: Path, tokens: int, seed: int = 0) -> int:
    """A lengths file of log-normal documents summing to ``tokens``; returns their count."""
    rng = np.random.default_rng(seed)
    n = max(1, tokens // MEAN_DOC)
    x = np.exp(rng.normal(0.0, 1.0, n))
    lengths = np.maximum(1, (x * (tokens - n) / x.sum()).astype(np.int64) + 1)
    lengths[0] += tokens - int(lengths.sum())
    np.savetxt(path, lengths, fmt="%d")
    return n


def plan_seconds(lengths_file: Path, seq_len: int) -> float:
    """Wall time of ``varlen-cp-plan`` on the file, first batch only, 8 ranks."""
    argv = ["--lengths", str(lengths_file), "--cp", "8", "--heads", "8", "--kv-heads", "2",
            "--head-dim", "128", "--seq-len", str(seq_len), "--batches", "1"]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"varlen-cp-plan {' '.join(argv)} exited {rc}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=float, default=1e9)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = 10 ** 7
        while tokens <= args.max_tokens:
            path = Path(tmp) / f"corpus_{tokens}.txt"
            n = write_corpus(path, tokens)
            for seq_len in (1024, 131072):
                s = plan_seconds(path, seq_len)
                rows.append({"tokens": tokens, "documents": n, "seq_len": seq_len,
                             "file_mb": path.stat().st_size / 2 ** 20, "seconds": s})
                print(f"{tokens:.0e} tokens ({n} documents, "
                      f"{path.stat().st_size / 2 ** 20:.0f} MB), --seq-len {seq_len}: "
                      f"{s:.2f} s", flush=True)
            tokens *= 10
        one = Path(tmp) / "one_document.txt"
        one.write_text(f"{10 ** 12}\n")
        for seq_len in (1024, 131072):
            s = plan_seconds(one, seq_len)
            rows.append({"tokens": 10 ** 12, "documents": 1, "seq_len": seq_len,
                         "seconds": s})
            print(f"one 1e12-token document, --seq-len {seq_len}: {s:.2f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
