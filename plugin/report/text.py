"""Plain-text forms of a plan report: the training logs' block and the CLI's tables.

Numbers: bytes in binary units (KiB, MiB, GiB), visible pairs per query head with k / M /
G, times in s / ms / us (the cost model's estimates: forward + backward, one layer, slowest
rank). The training block lists every rank up to ``PER_RANK_MAX`` ranks, else min / mean / max;
the CLI's rank table has a row per rank. Backend coverage (when computed): one line per
layer type, ``FA 100% of work, 12/12 calls (flash)``: the share of the reporting rank's
visible pairs in FlashAttention's form, its kernel calls with an FA form of all its calls,
and the backend they run on; the rest run on our kernels.
"""

from __future__ import annotations

import math

from .build import LayerReport, PlanReport

PER_RANK_MAX = 8


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_tokens(n: float) -> str:
    return f"{n:.0f}"


def fmt_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_share(share: float) -> str:
    """A share as a percentage, rounded down (99.96% is not shown as 100%)."""
    if share >= 1:
        return "100%"
    return f"{math.floor(share * 1000) / 10:.1f}%" if share > 0 else "0%"


def coverage_text(r: LayerReport) -> str:
    """``FA 100% of work, 12/12 calls (flash)``; empty without a coverage."""
    c = r.coverage
    if c is None:
        return ""
    text = (f"FA {fmt_share(c.pair_share)} of work, {c.flash_calls}/"
            f"{c.flash_calls + c.other_calls} calls ({r.flash_backend or 'no FA backend'})")
    if c.other_calls and r.flash_backend:
        text += ", the rest on our kernels"
    return text


def coverage_lines(rep: PlanReport) -> list[str]:
    """Per layer type its backend coverage on the reporting rank, then why there is no FA
    backend (when there is none)."""
    if rep.backends is None:
        return []
    out = []
    for r in rep.layers:
        c = r.coverage   # each call with an FA form makes one or more FA calls
        fa = f"; FA calls: {c.fa_calls}" if r.flash_backend else ""
        out.append(f"backends ({r.label}, {r.strategy}, rank {c.rank}): {coverage_text(r)}"
                   f"{fa}")
    b = rep.backends
    if b.route is None and b.reason:
        out.append(f"no FlashAttention backend: {b.reason}")
    return out


def strategy_cell(r: LayerReport) -> str:
    configured = r.layer.strategy
    return f"auto -> {r.strategy}" if configured == "auto" else r.strategy


def table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, the first row a header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
            for row in rows]


def headline(rep: PlanReport) -> str:
    s = rep.shape
    dv = f"/{s.value_dim}" if s.value_dim != s.head_dim else ""
    pad = (f" ({rep.padded_tokens - rep.total_tokens} padding)"
           if rep.padded_tokens != rep.total_tokens else "")
    return (f"cp {rep.cp}, layout {rep.layout}, {rep.total_tokens} tokens{pad} in "
            f"{rep.n_docs} documents, {s.n_heads} query / {s.n_kv_heads} K/V heads of "
            f"dim {s.head_dim}{dv}, {str(s.dtype).replace('torch.', '')}")


def layer_table(rep: PlanReport) -> list[str]:
    """Per layer type: layers, strategy, stages, work balance, and the busiest rank's K/V
    floor and bytes sent per layer (and of them to other nodes, when some leave one)."""
    nodes = any(max(r.cross_node_bytes) for r in rep.layers)
    rows = [["layer type", "layers", "strategy", "stages", "work max/mean",
             "K/V floor (max rank)", "sent per layer (max rank)"]
            + (["cross-node (max rank)"] if nodes else [])]
    for r in rep.layers:
        rows.append([r.label, str(r.layer.n_layers), strategy_cell(r),
                     "-" if r.stages is None else str(r.stages), f"{r.work_imbalance:.3f}",
                     fmt_bytes(max(r.kv_floor_bytes)), fmt_bytes(max(r.sent_bytes))]
                    + ([fmt_bytes(max(r.cross_node_bytes))] if nodes else []))
    return table(rows)


def rank_rows(rep: PlanReport) -> list[tuple[str, list[float], object]]:
    """(name, per-rank values, formatter) of every per-rank figure."""
    rows: list[tuple[str, list[float], object]] = [("tokens", rep.tokens, fmt_tokens)]
    for r in rep.layers:
        rows += [(f"{r.label} work (pairs/head)", r.work, fmt_count),
                 (f"{r.label} K/V floor", r.kv_floor_bytes, fmt_bytes),
                 (f"{r.label} sent", r.sent_bytes, fmt_bytes)]
        if max(r.cross_node_bytes):
            rows.append((f"{r.label} cross-node", r.cross_node_bytes, fmt_bytes))
    return rows


def rank_columns(rep: PlanReport) -> list[str]:
    """Per-rank figures with the ranks as columns (up to PER_RANK_MAX ranks; beyond, the
    columns are min / mean / max over ranks)."""
    if rep.cp <= PER_RANK_MAX:
        rows = [["per rank"] + [f"r{i}" for i in range(rep.cp)]]
        rows += [[name] + [fmt(v) for v in values] for name, values, fmt in rank_rows(rep)]
    else:
        rows = [[f"per rank ({rep.cp} ranks)", "min", "mean", "max"]]
        rows += [[name, fmt(min(v)), fmt(sum(v) / len(v)), fmt(max(v))]
                 for name, v, fmt in rank_rows(rep)]
    return table(rows)


def rank_lines(rep: PlanReport) -> list[str]:
    """Per-rank figures with one row per rank (any cp: the CLI's table)."""
    figures = rank_rows(rep)
    rows = [["rank"] + [name for name, _, _ in figures]]
    rows += [[str(i)] + [fmt(values[i]) for _, values, fmt in figures]
             for i in range(rep.cp)]
    return table(rows)


def estimate_line(r: LayerReport) -> str:
    """``auto``'s table of one layer type on one line: time and bytes per strategy."""
    cells = []
    for name, e in (r.estimates or {}).items():
        mark = " <- auto" if name == r.auto_pick else ""
        cells.append(f"{name} {fmt_time(e.seconds)} {fmt_bytes(e.bytes_sent)}{mark}")
    return f"estimates ({r.label}, per layer, fwd+bwd, slowest rank): " + " | ".join(cells)


def block_lines(rep: PlanReport, *, step: int, plan_s: float | None = None,
                wait_s: float | None = None, lead_s: float | None = None) -> list[str]:
    """The training log's block (first step, and whenever a choice changes)."""
    out = [f"plan at step {step}: {headline(rep)}; tokens max/mean "
           f"{rep.token_imbalance:.3f}"]
    out += layer_table(rep)
    out += ["  " + line for line in coverage_lines(rep)]
    out += rank_columns(rep)
    out += ["  " + estimate_line(r) for r in rep.layers if r.estimates]
    if plan_s is not None:
        out.append("  " + planner_text(plan_s, wait_s, lead_s))
    return out


def planner_text(plan_s: float, wait_s: float | None, lead_s: float | None) -> str:
    text = f"planner {plan_s * 1e3:.1f} ms for this batch"
    if wait_s is None:
        return text + " (inline, prefetch off)"
    if wait_s > 0:
        return text + f"; the step waited {wait_s * 1e3:.1f} ms for it"
    return text + f"; ready {lead_s * 1e3:.0f} ms before the step asked"


def step_line(rep: PlanReport, *, step: int, plan_s: float | None, wait_s: float | None,
              lead_s: float | None) -> str:
    """One line per logged step: balance per layer type, bytes, planner and prefetch."""
    parts = [f"{r.label} work {r.work_imbalance:.3f} sent {fmt_bytes(max(r.sent_bytes))}"
             + ("" if r.coverage is None else f" FA {fmt_share(r.coverage.pair_share)}")
             for r in rep.layers]
    text = (f"step {step}: " + ", ".join(parts)
            + f"; tokens {rep.token_imbalance:.3f}")
    if plan_s is not None:
        text += "; " + planner_text(plan_s, wait_s, lead_s)
    return text
