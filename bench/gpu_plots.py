"""Plots of the GPU suite's JSON: kernel TFLOP/s per case and backend, and the replayed
rank's per-call TFLOP/s against the call's size. Optional: without matplotlib (the lent GPU
machines may not have it) the suite writes its JSON only and says so."""

from __future__ import annotations

from pathlib import Path


def plot_all(result: dict, out: Path, slug: str) -> dict:
    """{"files": [...]} written into ``out``, or {"note": why none}."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - missing or broken: JSON only
        return {"files": [], "note": f"no plots: matplotlib unavailable ({e})"}
    files = []
    if result.get("kernels", {}).get("rows"):
        files.append(_kernels(plt, result, out / f"{slug}_kernels.png"))
    if any(r.get("calls") for r in result.get("replay", {}).get("results", [])):
        files.append(_replay(plt, result, out / f"{slug}_replay.png"))
    return {"files": [str(f.name) for f in files]}


def _kernels(plt, result: dict, path: Path) -> Path:
    rows = result["kernels"]["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    width = 0.8 / max(1, len(names))
    for ax, key, title in zip(axes, ("fwd_tflops", "bwd_tflops"), ("forward", "backward")):
        for i, name in enumerate(names):
            values = [next((r.get(key) or 0.0 for r in rows
                            if r["case"] == c and r["backend"] == name), 0.0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], values, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels(cases, rotation=25, ha="right", fontsize=8)
        ax.set_title(f"{title}, TFLOP/s of the mask area")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['device']}: {result['kernels']['shape']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _replay(plt, result: dict, path: Path) -> Path:
    # one colour per backend, one marker per strategy: FA and Triton side by side
    results = result["replay"]["results"]
    backends = list(dict.fromkeys(r.get("backend", "triton") for r in results))
    strategies = sorted({r["strategy"] for r in results})
    colour = {b: f"C{i}" for i, b in enumerate(backends)}
    marker = {s: "o^sDv"[i % 5] for i, s in enumerate(strategies)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in zip(axes, ("fwd_tflops", "bwd_tflops"), ("forward", "backward")):
        labelled = set()
        for r in results:
            pts = [(c["visible_pairs"], c[key]) for c in r.get("calls", []) if c.get(key)]
            if pts:
                backend = r.get("backend", "triton")
                group = (backend, r["strategy"])
                ax.scatter(*zip(*pts), s=10, c=colour[backend], marker=marker[r["strategy"]],
                           label=None if group in labelled else f"{backend} {r['strategy']}")
                labelled.add(group)
        ax.set_xscale("log")
        ax.set_xlabel("visible pairs per head in the call")
        ax.set_title(f"replayed rank, {title}: TFLOP/s per kernel call")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{result['device']}: {result['replay']['shape']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
