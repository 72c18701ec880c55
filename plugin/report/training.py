"""What the integrations log while training: the plan's block and per-step metrics.

``TrainingReport`` is fed each step's plan and its ``PlanTiming`` (from the
``PlanPrefetcher``) with :meth:`TrainingReport.on_batch`. On the logging rank it writes one
block to the ``varlen_cp`` logger (``logging.getLogger("varlen_cp")``, one record per line)
at the first step and whenever a choice changes (layout, the strategy a layer type runs,
its stage count: ``auto`` and the stage search decide per batch); the block holds the
layout, strategy per layer type (with ``auto``'s estimate table), stage counts, per-rank
tokens, work and K/V bytes, balance and planner time. :meth:`TrainingReport.log_step`, at
the framework's logging steps, logs one line and returns flat scalars for the framework's
metrics (torchtitan's MetricsProcessor, hence TensorBoard / W&B):

- ``varlen_cp/work_imbalance/<layer type>``, ``varlen_cp/token_imbalance``: max / mean over
  the CP ranks, this step's batch;
- ``varlen_cp/sent_bytes/<layer type>``, ``varlen_cp/kv_floor_bytes/<layer type>``: the
  busiest rank's bytes per layer (sent by the running strategy, fwd + bwd; the K/V its
  queries need from other ranks);
- ``varlen_cp/cross_node_bytes/<layer type>``: the busiest rank's part of them that leaves
  its node (the plan's topology: ``[varlen_cp] gpus_per_node``), when the CP group spans
  nodes;
- ``varlen_cp/stages/<layer type>`` for staged strategies;
- ``varlen_cp/fa_work_share/<layer type>``, ``varlen_cp/fa_call_share/<layer type>``: the
  share of this rank's visible pairs and of its kernel calls in FlashAttention's form (the
  rest on our kernels), when the report knows the step's backend (``backend`` given);
- ``varlen_cp/plan_ms`` (planner time of this batch), ``varlen_cp/plan_lead_ms`` (how long
  the plan was ready before the step asked), ``varlen_cp/plan_wait_ms`` (mean wait per step
  since the last logged step; 0 when the prefetcher kept ahead) and
  ``varlen_cp/plans_late`` (steps since the last log whose plan was not ready).

Cost: the choice check is cache lookups (the prefetcher prepared the same keys); a log
step's figures are the plan's closed forms (``build.plan_report`` without estimates) and
the backend coverage, read from the tables the step's prepare cached (the route and tiles
are resolved once, as ``build_layer_tables`` resolves them: the same cache keys);
``bench/report_cost.py`` measures the first two, docs/plan-report.md the coverage's share.
``enabled=False`` (``[varlen_cp] report = false``) makes every method a no-op.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..config import STAGED_STRATEGIES, AttnShape
from ..plan import CPPlan
from ..prefetch import PlanTiming
from ..tables.staged import resolve_stages
from .build import LOCAL, LayerType, PlanReport, plan_report, resolve_strategy
from .coverage import Backends, check_backend
from .text import block_lines, step_line

LOGGER = logging.getLogger("varlen_cp")


def layer_keys(layers: Sequence[LayerType]) -> list[str]:
    """A metric key per layer type: its mask label, with "@strategy" when two layer types
    share a mask (per-layer strategy lists)."""
    labels = [t.label for t in layers]
    return [f"{lab}@{t.strategy}" if labels.count(lab) > 1 else lab
            for lab, t in zip(labels, layers)]


class TrainingReport:
    """The plan's logs and metrics during training (module docstring).

    layers: the model's attention layer types (mask, layer count, configured strategy).
    shape: their ``AttnShape`` (heads on this rank). overlap_stages: as configured.
    enabled: False silences everything. log_block: whether this rank writes the block and
    step lines (rank 0); metrics are computed wherever ``log_step`` is called.
    backend, device: the configured kernels' backend (``CPConfig.backend``) and the
    training device: the report then gives each layer type's backend coverage on this
    rank, with the route and tiles the step resolves (``Backends.step``, resolved at the
    first batch: after ``build_tables``, which resolves the same, so any error is the
    step's own); None: no coverage.
    """

    def __init__(self, layers: Sequence[LayerType], shape: AttnShape, *,
                 overlap_stages: int | None = None, enabled: bool = True,
                 log_block: bool = True, logger: logging.Logger = LOGGER,
                 backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        self.layers = list(layers)
        self.keys = layer_keys(self.layers)
        self.shape = shape
        self.overlap_stages = overlap_stages
        self.enabled = enabled and bool(self.layers)
        self.log_block = log_block
        self.logger = logger
        self.plan: CPPlan | None = None
        self.timing: PlanTiming | None = None
        self.last_choices: tuple | None = None
        self.blocks = 0
        self._waits: list[float] = []
        self._late = 0
        if backend is not None:
            check_backend(backend, "backend")
        self.backend = backend
        self.device = torch.device("cpu" if device is None else device)
        self._backends: Backends | None = None

    def backends(self) -> Backends | None:
        """The step's route and tiles (None without a ``backend``); resolved once."""
        if self.backend is not None and self._backends is None:
            self._backends = Backends.step(self.backend, self.device, self.shape)
        return self._backends

    def choices(self, plan: CPPlan) -> tuple:
        """(layout, cp, per layer type: strategy that runs, stage count); cache lookups on
        a prepared plan. Equal to ``PlanReport.choices`` of the same plan."""
        out = []
        for t in self.layers:
            if plan.cp_size == 1:
                out.append((t.label, LOCAL, None))
                continue
            name = resolve_strategy(plan, t, self.shape)
            stages = resolve_stages(plan, t.mask, name, self.shape, self.overlap_stages) \
                if name in STAGED_STRATEGIES else None
            out.append((t.label, name, stages))
        return (plan.layout, plan.cp_size, tuple(out))

    def on_batch(self, plan: CPPlan, timing: PlanTiming | None, step: int) -> None:
        """Remember the step's plan; log the block when the choices differ from the last
        block's (always at the first batch)."""
        if not self.enabled:
            return
        self.plan, self.timing = plan, timing
        if timing is not None and timing.wait_s is not None:
            self._waits.append(timing.wait_s)
            self._late += timing.wait_s > 0
        if not self.log_block:
            return
        choices = self.choices(plan)
        if choices == self.last_choices:
            return
        rep = plan_report(plan, self.layers, self.shape, overlap_stages=self.overlap_stages,
                          with_estimates="auto", backends=self.backends())
        if self.last_choices is not None:
            self.logger.info("the plan's choices changed at step %d", step)
        self.last_choices = choices
        self.blocks += 1
        t = timing
        for line in block_lines(rep, step=step, plan_s=t and t.plan_s,
                                wait_s=t and t.wait_s, lead_s=t and t.lead_s):
            self.logger.info("%s", line)

    def report(self) -> PlanReport | None:
        """The last batch's report, without estimates (None before the first batch)."""
        if self.plan is None:
            return None
        return plan_report(self.plan, self.layers, self.shape,
                           overlap_stages=self.overlap_stages, backends=self.backends())

    def log_step(self, step: int) -> dict[str, float]:
        """The metrics of the last batch (module docstring); logs one line on the logging
        rank. Resets the per-interval counters."""
        if not self.enabled or self.plan is None:
            return {}
        rep = self.report()
        out: dict[str, float] = {"varlen_cp/token_imbalance": rep.token_imbalance}
        for key, r in zip(self.keys, rep.layers):
            out[f"varlen_cp/work_imbalance/{key}"] = r.work_imbalance
            out[f"varlen_cp/sent_bytes/{key}"] = float(max(r.sent_bytes))
            out[f"varlen_cp/kv_floor_bytes/{key}"] = float(max(r.kv_floor_bytes))
            if self.plan.topology is not None and self.plan.topology.n_nodes > 1:
                out[f"varlen_cp/cross_node_bytes/{key}"] = float(max(r.cross_node_bytes))
            if r.stages is not None:
                out[f"varlen_cp/stages/{key}"] = float(r.stages)
            if r.coverage is not None:
                out[f"varlen_cp/fa_work_share/{key}"] = r.coverage.pair_share
                out[f"varlen_cp/fa_call_share/{key}"] = r.coverage.call_share
        t = self.timing
        if t is not None:
            out["varlen_cp/plan_ms"] = t.plan_s * 1e3
            if t.wait_s is not None:
                out["varlen_cp/plan_lead_ms"] = t.lead_s * 1e3
                out["varlen_cp/plan_wait_ms"] = \
                    sum(self._waits) / max(len(self._waits), 1) * 1e3
                out["varlen_cp/plans_late"] = float(self._late)
        self._waits, self._late = [], 0
        if self.log_block:
            self.logger.info("%s", step_line(
                rep, step=step, plan_s=t and t.plan_s, wait_s=t and t.wait_s,
                lead_s=t and t.lead_s))
        return out


def stdout_handler(logger: logging.Logger = LOGGER, fmt: str = "[%(name)s] %(message)s"
                   ) -> None:
    """Give ``logger`` a stdout handler at INFO when nothing would print its records (no
    handler on it or on the root logger): for launchers that print rather than log
    (megatron's demo). Idempotent; leaves configured logging alone."""
    import sys

    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
