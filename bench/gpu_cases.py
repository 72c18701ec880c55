"""The GPU suite's cases (``bench/gpu.sh``): what the kernel benchmark and the CP-rank replay
run, at full size (one H100, 10 minutes) and at the dry run's tiny size (CPU, seconds), and
the mask-area FLOP count both report.

Kernel benchmark (issue 21): one 32K-token document causal; 1000 documents (log-normal
lengths, ``bench/mixes.py``) in 32K and in 128K tokens, causal; one 32K document with a
sliding window (4096, 0) and with chunks of 8192 (causal, Llama 4). bf16, d 128, 16 query
and 16 K/V heads (plain multi-head attention, as flash-attn's own benchmarks run it, so
every baseline takes the same inputs).

CP replay: 8K tokens per GPU (docs/design.md's simulation point) at cp 8 and 64, 32 query and 8
K/V heads, d 128, bf16; one long document and 1000 log-normal documents per 128K tokens;
causal, SWA (4096, 0) and chunked 8192; ``dispatch`` and ``all_gather`` on the ``balanced``
layout (the integrations' default), ``p2p`` on ``dual_chunk`` (the layout its ring stops
early on). Cases are listed most important first: a part that runs out of time drops the
last ones.

FLOPs of the mask area, per head, as flash-attn's benchmarks count them: forward 2 matmuls
of 2 * d (QK^T) and 2 * dv (PV) FLOPs per visible pair, so 4 * d * pairs when dv == d;
backward 2.5x the forward (5 matmuls). Pairs are counted exactly from the mask's interval
math (never Lq x Lk), so TFLOP/s compare across masks per useful FLOP.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mixes import lognormal_docs  # noqa: E402  (bench/mixes.py)
from varlen_cp.masks import AttnMask  # noqa: E402
from varlen_cp.shape import AttnShape  # noqa: E402

BWD_FLOPS_FACTOR = 2.5
TOKENS_PER_GPU = 8192


def masks(scale: float = 1.0) -> dict[str, AttnMask]:
    """The suite's masks; ``scale`` shrinks the window and chunk with the dry run's tokens."""
    return {
        "causal": AttnMask(causal=True),
        "swa4096": AttnMask(causal=True, window_size=(max(1, round(4096 * scale)), 0)),
        "chunk8192": AttnMask(causal=True, chunk_size=max(1, round(8192 * scale))),
    }


Shape = AttnShape   # the library's one head-shape type


def make_shape(n_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int,
               dtype: torch.dtype) -> AttnShape:
    """A benchmark's heads, head dims and dtype (no softmax extras)."""
    return AttnShape(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     head_dim_v=head_dim_v, dtype=dtype)


def describe(shape: AttnShape) -> dict:
    """The shape as the results' JSON records it."""
    return {"n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads,
            "head_dim": shape.head_dim, "head_dim_v": shape.value_dim,
            "dtype": str(shape.dtype).replace("torch.", "")}


@dataclass(frozen=True)
class KernelCase:
    """One single-GPU case: a packed batch of ``lengths`` under one mask."""

    name: str
    lengths: tuple[int, ...]
    mask_name: str
    mask: AttnMask

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class ReplayCase:
    """One CP-rank replay: a global batch planned for ``cp`` ranks, one strategy and mask."""

    name: str
    cp: int
    mix: str
    lengths: tuple[int, ...]
    mask_name: str
    mask: AttnMask
    strategy: str
    layout: str
    overlap_stages: int | None = None   # None: the cost model's choice, as in training


# ----------------------------------------------------------------------------- FLOPs
def visible_pairs(lengths, mask: AttnMask) -> int:
    """Exact visible (query, key) pairs of a packed batch, per head (one interval count per
    distinct document length)."""
    counts: dict[int, int] = {}
    for n in lengths:
        counts[int(n)] = counts.get(int(n), 0) + 1
    return sum(c * mask.document_work(n) for n, c in counts.items())


def mask_area_flops(pairs: int, shape: Shape) -> tuple[float, float]:
    """(forward, backward) FLOPs of ``pairs`` visible pairs per head over all query heads."""
    fwd = 2.0 * (shape.head_dim + shape.value_dim) * pairs * shape.n_heads
    return fwd, BWD_FLOPS_FACTOR * fwd


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (None when not timed)."""
    if ms is None or ms <= 0:
        return None
    return flops / ms / 1e9


# ----------------------------------------------------------------------------- cases
def kernel_shape(dry_run: bool) -> Shape:
    # The dry run runs on Triton's CPU interpreter, which computes bf16 wrongly and fails
    # its atomics: fp16 there (docs/design.md); small heads and head dim keep it to seconds.
    if dry_run:
        return make_shape(1, 1, 32, 32, torch.float16)
    return make_shape(16, 16, 128, 128, torch.bfloat16)


def kernel_cases(dry_run: bool) -> list[KernelCase]:
    """The issue's five single-GPU cases (128-256 tokens, 4 documents in the dry run)."""
    one, many_small, many_big = (128, 128, 256) if dry_run else (32768, 32768, 131072)
    n_docs = 4 if dry_run else 1000
    m = masks(one / 32768)
    docs_small = tuple(lognormal_docs(n_docs, 0, many_small))
    docs_big = tuple(lognormal_docs(n_docs, 0, many_big))
    k = "32k" if not dry_run else f"{one}"
    return [
        KernelCase(f"one_doc_{k}_causal", (one,), "causal", m["causal"]),
        KernelCase(f"{n_docs}_docs_{k}_causal", docs_small, "causal", m["causal"]),
        KernelCase(f"{n_docs}_docs_{'128k' if not dry_run else many_big}_causal", docs_big,
                   "causal", m["causal"]),
        KernelCase(f"one_doc_{k}_swa4096", (one,), "swa4096", m["swa4096"]),
        KernelCase(f"one_doc_{k}_chunk8192", (one,), "chunk8192", m["chunk8192"]),
    ]


def replay_shape(dry_run: bool) -> Shape:
    if dry_run:
        return make_shape(2, 1, 32, 32, torch.float16)
    return make_shape(32, 8, 128, 128, torch.bfloat16)


# (strategy, layout), most important first: dispatch is the strategy built for local masks
# and short documents, p2p the classic ring; all_gather runs dispatch's kernel calls over
# other stage cuts.
REPLAY_STRATEGIES = (("dispatch", "balanced"), ("p2p", "dual_chunk"),
                     ("all_gather", "balanced"))


def replay_cases(dry_run: bool) -> list[ReplayCase]:
    """Every (strategy, cp, mix, mask) replay, most important first: strategy by strategy
    (``REPLAY_STRATEGIES``' order), cp 8 then 64 (the "1k" mix: 1000 documents per 128K
    tokens; the dry run's: cp documents)."""
    per_gpu = 16 if dry_run else TOKENS_PER_GPU
    scale = per_gpu / TOKENS_PER_GPU
    m = masks(scale)
    out = []
    for strategy, layout in REPLAY_STRATEGIES:
        for cp in (8, 64):
            total = per_gpu * cp
            n_docs = cp if dry_run else 1000 * total // 131072   # dry run: 16 tokens a doc
            mixes = {"one_doc": (total,),
                     "lognormal_1k": tuple(lognormal_docs(n_docs, 0, total))}
            for mix, lengths in mixes.items():
                for mask_name in ("causal", "chunk8192", "swa4096"):
                    out.append(ReplayCase(f"cp{cp}_{strategy}_{mix}_{mask_name}", cp, mix,
                                          lengths, mask_name, m[mask_name], strategy, layout))
            if strategy == "dispatch":   # forced stages: what cutting the keys costs the
                out.append(ReplayCase(     # kernels (and the S >= 2 tables in the dry run)
                    f"cp{cp}_dispatch_one_doc_causal_S4", cp, "one_doc", mixes["one_doc"],
                    "causal", m["causal"], "dispatch", "balanced", overlap_stages=4))
    return out
