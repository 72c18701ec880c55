"""The demo's loss curve: CP=N vs CP=1 losses per step, from the launcher's loss files.

    python -m varlen_cp.cli.loss_curve CP2.jsonl CP1.jsonl --out loss_curve.png \\
        [--labels "CP=2" "CP=1"] [--title TEXT]

Each file has one JSON object per logged step with ``step`` and ``loss`` (what
``--metrics.loss_file`` writes). The top panel draws both curves, the bottom one the
difference of the first from the second (the runs should agree to fp32 rounding). Prints
the PNG's path; without matplotlib it prints a note (``pip install "varlen-cp[bench]"``) and
exits 0, so the demo still succeeds. Unreadable files: exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "varlen_cp.cli.loss_curve"


def read_losses(path: str) -> tuple[list[int], list[float]]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such loss file {path!r}")
    steps, losses = [], []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{n}: expected a JSON object with 'step' and 'loss', "
                             f"got {line[:80]!r}") from None
    if not steps:
        raise ValueError(f"{path} holds no steps")
    return steps, losses


def draw(runs: list[tuple[str, list[int], list[float]]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 4.6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    for (label, steps, losses), style in zip(runs, ({"linewidth": 2.2},
                                                    {"linestyle": "--", "linewidth": 1.2})):
        top.plot(steps, losses, label=label, **style)
    top.set_ylabel("loss")
    top.set_title(title, fontsize=10)
    top.legend()
    top.grid(True, alpha=0.3)
    (a, sa, la), (b, sb, lb) = runs[0], runs[1]
    common = sorted(set(sa) & set(sb))
    da, db = dict(zip(sa, la)), dict(zip(sb, lb))
    diff = [da[s] - db[s] for s in common]
    bottom.plot(common, diff, color="black", linewidth=1)
    bottom.axhline(0, color="grey", linewidth=0.6)
    worst = max((abs(d) for d in diff), default=0.0)
    bottom.set_ylabel(f"{a} - {b}", fontsize=8)
    bottom.set_xlabel(f"step (max |difference| {worst:.1e})")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs=2, help="loss files: the CP run, then the reference")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--labels", nargs=2, default=["CP=2", "CP=1"])
    p.add_argument("--title", default="varlen-cp demo: CP=2 vs CP=1 (same batches)")
    args = p.parse_args(argv)
    try:
        runs = [(label, *read_losses(f)) for label, f in zip(args.labels, args.files)]
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('loss curve: not drawn, matplotlib is missing (pip install "varlen-cp[bench]")')
        return 0
    print(f"loss curve: {draw(runs, Path(args.out), args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
