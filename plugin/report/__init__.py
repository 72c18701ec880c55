"""Plan reports: what varlen-cp does with a batch, for training logs, metrics and the CLI.

- ``build``: ``plan_report(plan, layers, shape)`` -> ``PlanReport``: per rank tokens, work
  per layer type, K/V floor and bytes sent; per layer type the strategy that runs (``auto``
  resolved), stage counts, balance and, on request, every strategy's estimate. Host closed
  forms only (``varlen_cp.tables.cost`` / ``auto``).
- ``coverage``: ``Backends`` (the step's FlashAttention route and tiles, or the CLI's
  offline one): with ``plan_report(..., backends=...)`` each layer type's share of work and
  calls on FlashAttention vs our kernels on the reporting rank.
- ``text``: the same as text (the training block, the per-step line, tables).
- ``training``: ``TrainingReport``, the integrations' hook: a block on the ``varlen_cp``
  logger at the first step and when a choice changes, and per-step metrics.

``varlen-cp-plan`` (``varlen_cp.cli.plan``) prints these reports for a job file and a
document-length list, before any GPU is booked.
"""

from .build import LayerReport, LayerType, PlanReport, layer_types, mask_label, plan_report
from .coverage import Backends
from .training import LOGGER, TrainingReport

__all__ = ["LOGGER", "Backends", "LayerReport", "LayerType", "PlanReport", "TrainingReport",
           "layer_types", "mask_label", "plan_report"]
