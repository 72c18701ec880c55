"""Which kernels a layer type's calls run on: the report's backend coverage.

``Backends`` says where a step's kernel calls go: the FlashAttention route (``FlashRoute``:
the calls exact in FA's varlen form run there; None: every call on our kernels, Triton on
CUDA, the PyTorch twin on CPUs), why there is none, and our kernels' tile sizes.

- ``Backends.step(backend, device, shape)``: what the step resolves, with the same calls
  ``varlen_cp.resolve`` makes (``resolve.kernel_route`` with the shape's ``lse_grad`` /
  ``row_max``), so the coverage reads the tables
  the step's prepare cached (training logs, metrics);
- ``Backends.planned(backend, shape)``: offline, for ``varlen-cp-plan`` (no GPU there):
  "flash" / "fa4" build the FA forms as a GPU run with that backend would, where the
  library takes this kind of call (:func:`planned_reason`: ``kernels.flash.call_limits``,
  the limits of the call alone, those of an sm90 GPU); "auto" counts as FA-capable: what FA
  *can* take (on the GPU, auto runs FA4 where installed, torch's flash ops where they run
  FA3 / FA4 or the GPU predates sm90, else our Triton kernels, and then none of it);
  "triton" / "torch": none.

``layer_coverage`` counts one layer type's calls on ``plan.cp_rank`` with
``tables.coverage.flash_coverage``: the share of the visible pairs and of the kernel
calls in FA's form. Tile sizes do not change it (FA forms and the set of calls depend on
positions only, ``holders.set_calls``); they only pick the cached entries. At cp 1 it is
the single-device op's one call ("local"), which takes FA's form where exact too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shape import AttnShape
from ..kernels.flash import call_limits
from ..kernels.validation import BACKENDS
from ..masks import AttnMask
from ..plan import CPPlan
from ..resolve import kernel_route
from ..tables.coverage import LOCAL, FlashCoverage, flash_coverage
from ..tables.flash_form import FlashRoute
from ..tables.hybrid import default_a2a_size

DEFAULT_BLOCK = (128, 128)
"""Tiles when the step's are unknown (offline): they do not change the coverage."""


@dataclass(frozen=True)
class Backends:
    """Where a step's kernel calls run: ``route`` (None: our kernels only; ``reason`` says
    why), ``block`` our kernels' tiles, ``backend`` as configured, ``note`` how it was
    resolved (for the text)."""

    backend: str
    route: FlashRoute | None
    reason: str | None = None
    block: tuple[int, int] = DEFAULT_BLOCK
    note: str = ""

    @property
    def flash(self) -> str | None:
        """The FlashAttention-class backend the FA-form calls run on (None: none)."""
        return None if self.route is None else self.route.backend

    @classmethod
    def step(cls, backend: str, device: torch.device | str, shape: AttnShape) -> "Backends":
        """As the step resolves them (``build_layer_tables``: same route, same tiles)."""
        check_backend(backend, "backend")
        device = torch.device(device)
        _, block, route, reason = kernel_route(backend, device, shape)
        return cls(backend, route, reason, block, f"as the step resolves it on {device}")

    @classmethod
    def planned(cls, backend: str, shape: AttnShape) -> "Backends":
        """Offline (module docstring): no device, no package needed."""
        check_backend(backend, "--backend")
        if backend in ("triton", "torch"):
            return cls(backend, None, f"backend {backend!r}: our kernels only",
                       note="our kernels only")
        lib = "fa4" if backend == "auto" else backend   # auto's FA rules are FA4's, the
        reason = planned_reason(lib, shape)               # widest (a superset of flash's)
        route = None if reason else FlashRoute.of(lib, shape.dtype, shape.n_heads,
                                                  shape.n_kv_heads, shape.head_dim,
                                                  shape.value_dim)
        note = ("counted as FA-capable: what FlashAttention can take, FA4's rules; where "
                "auto picks Triton on the GPU, none of it runs there" if backend == "auto" else
                "FA forms as a GPU run builds them, sm90 rules")
        return cls(backend, route, reason, DEFAULT_BLOCK, note)


def check_backend(backend: object, where: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)}, got {backend!r}")


def planned_reason(backend: str, shape: AttnShape) -> str | None:
    """Why ``backend`` ("flash" / "fa4") cannot take this model's calls on any machine
    (None: it can): ``kernels.flash.call_limits``, the limits of the call alone (FA4's
    sm100 head-dim limits are a machine's, not applied)."""
    return call_limits(backend, shape.dtype, shape.head_dim, shape.value_dim, shape.lse_grad,
                       shape.row_max)


def layer_coverage(plan: CPPlan, mask: AttnMask, strategy: str, backends: Backends,
                   stages: int | None, a2a_size: int | None, shape: AttnShape
                   ) -> FlashCoverage:
    """``flash_coverage`` of the running ``strategy`` ("local" at cp 1) on ``plan.cp_rank``
    with the step's stage count and, for a2a+p2p, group size (None: the default the
    heads allow, as the strategy resolves it)."""
    if strategy == "a2a+p2p" and a2a_size is None:
        a2a_size = default_a2a_size(shape.n_heads, shape.n_kv_heads, plan.cp_size)
    return flash_coverage(plan, mask, LOCAL if plan.cp_size == 1 else strategy,
                          backends.route, backends.block, stages,
                          a2a_size if strategy == "a2a+p2p" else None)
