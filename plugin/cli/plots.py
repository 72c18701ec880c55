"""The PNGs of ``varlen-cp-plan``: per-rank work by layer type, the rank x rank K/V traffic
matrix, and every strategy's estimate against the CP degree.

matplotlib is optional (the ``bench`` extra): :func:`have_matplotlib` says whether the plots
can be drawn; the report itself never needs it. Everything is drawn with the Agg backend
(no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..plan import CPPlan
from ..report import PlanReport
from ..tables.selected import fetch_counts

INSTALL_HINT = 'the PNGs need matplotlib: pip install "varlen-cp[bench]"'


def have_matplotlib() -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def traffic_matrix(plan: CPPlan, rep: PlanReport) -> torch.Tensor:
    """float64 [cp, cp]: bytes of K/V rank s's queries need from rank o per step, forward,
    summed over every layer (layer types weighted by their layer counts); diagonal 0. What
    ``dispatch`` moves; the floor of any strategy that moves K/V."""
    row = rep.shape.kv_row
    total = torch.zeros(plan.cp_size, plan.cp_size, dtype=torch.float64)
    for r in rep.layers:
        total += fetch_counts(plan, r.layer.mask).double() * (row * r.layer.n_layers)
    return total.fill_diagonal_(0)


def work_png(rep: PlanReport, path: Path, title: str) -> Path:
    """Grouped bars: per rank, each layer type's work and the tokens, relative to the mean
    over ranks (1.0 = perfectly balanced)."""
    plt = _pyplot()
    series = [(f"tokens (max/mean {rep.token_imbalance:.3f})", rep.tokens)]
    series += [(f"{r.label} x{r.layer.n_layers} (max/mean {r.work_imbalance:.3f})", r.work)
               for r in rep.layers]
    ranks = torch.arange(rep.cp, dtype=torch.float64)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * rep.cp * len(series) + 3), 3.6))
    for i, (name, values) in enumerate(series):
        v = torch.tensor(values, dtype=torch.float64)
        rel = v / v.mean() if float(v.mean()) > 0 else torch.ones_like(v)
        ax.bar((ranks + (i - (len(series) - 1) / 2) * width).tolist(), rel.tolist(), width,
               label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("CP rank")
    ax.set_ylabel("relative to the mean over ranks")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(ranks.tolist() if rep.cp <= 32 else ranks[::max(1, rep.cp // 16)].tolist())
    ax.legend(fontsize=8, loc="lower right")
    lo = min(0.9, min(float(min(v) / (sum(v) / len(v))) for _, v in series
                      if sum(v) > 0) - 0.02)
    ax.set_ylim(max(lo, 0.0), None)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def traffic_png(matrix: torch.Tensor, path: Path, title: str) -> Path:
    """Heat map of :func:`traffic_matrix` in MiB."""
    plt = _pyplot()
    cp = matrix.shape[0]
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    image = ax.imshow((matrix / (1 << 20)).numpy(), cmap="viridis")
    fig.colorbar(image, ax=ax, label="MiB per step (forward)")
    ax.set_xlabel("owner rank (K/V from)")
    ax.set_ylabel("query rank (K/V to)")
    if cp <= 16:
        ax.set_xticks(range(cp))
        ax.set_yticks(range(cp))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_png(sweep: dict[int, dict[str, tuple[float, float]]], chosen: dict[int, str],
              path: Path, title: str) -> Path:
    """Per strategy, the model's estimated attention time per step and the busiest rank's
    bytes per step against cp (log scales); ``chosen[cp]``: what auto picks there (per
    layer type, joined)."""
    plt = _pyplot()
    cps = sorted(sweep)
    names = list(dict.fromkeys(n for c in cps for n in sweep[c]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    for name in names:
        xs = [c for c in cps if name in sweep[c]]
        style = {"color": "black", "linestyle": "--", "marker": "x", "linewidth": 1.5,
                 "zorder": 3} if name == "auto" else {"marker": "o", "alpha": 0.85}
        left.plot(xs, [sweep[c][name][0] * 1e3 for c in xs], label=name, **style)
        right.plot(xs, [sweep[c][name][1] / (1 << 20) for c in xs], label=name, **style)
    for ax, unit in ((left, "attention time per step (ms, all layers, fwd+bwd)"),
                     (right, "bytes sent per step (MiB, busiest rank)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(cps)
        ax.set_xticklabels([str(c) for c in cps])
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("CP degree")
        ax.set_ylabel(unit, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    picks = ", ".join(f"{c}: {chosen[c]}" for c in cps if c in chosen)
    fig.suptitle(f"{title}\nauto picks {picks}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
