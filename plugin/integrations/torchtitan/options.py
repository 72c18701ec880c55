"""The plugin's own TOML sections: ``[varlen_cp]`` (``CPConfig`` + ``enable``) and ``[model]``.

Its own module so that the trainer and the config loader both import it and not each other;
no torchtitan import, so ``varlen-cp-plan`` validates job files with it.
``VarlenCPSection`` IS ``varlen_cp.config.CPConfig``
(strategy, layout, backend, a2a_size, overlap_stages, validate, min_chunk_tokens,
tile_tokens, pad_multiple, prefetch, report; validated there, through the ``AttnOptions`` and
layout spec it composes) plus the one torchtitan extra, ``enable``.
``ModelSection`` is the project's Llama 4 style model (``Llama4Args``) plus ``flavor``:
``name`` = one of ``STOCK_MODELS`` picks torchtitan's own model of that name and flavor,
and the Llama 4 fields then do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...config import CPConfig
from .llama4_args import Llama4Args

LLAMA4_NAME = "llama4_style"
STOCK_MODELS = ("llama3", "qwen3", "qwen3_5", "gpt_oss", "deepseek_v3", "kimi_k2_7")
"""torchtitan 0.3.0's language models, by their registry (module) name."""


@dataclass(frozen=True, kw_only=True)
class VarlenCPSection(CPConfig):
    """The ``[varlen_cp]`` section: every ``CPConfig`` option, plus ``enable``."""

    enable: bool = True
    """Use varlen-cp's attention and sharding (false: torchtitan's own, which refuses
    varlen attention with context parallelism)."""

    def __post_init__(self) -> None:
        CPConfig.__post_init__(self)
        if not isinstance(self.enable, bool):
            raise ValueError(f"enable must be a bool, got {self.enable!r}")


@dataclass(kw_only=True)
class ModelSection(Llama4Args):
    """The ``[model]`` section: ``name`` (``llama4_style``, the project's Llama 4 style
    model, whose fields follow; or one of torchtitan's models, ``STOCK_MODELS``) and
    ``flavor`` (torchtitan's registry flavor, e.g. "debugmodel"; stock models only)."""

    flavor: str = ""
    """torchtitan model flavor (stock models only; default "debugmodel")."""

    def __post_init__(self) -> None:
        if self.name not in (LLAMA4_NAME, *STOCK_MODELS):
            raise ValueError(f"model.name must be one of {(LLAMA4_NAME, *STOCK_MODELS)}, got "
                             f"{self.name!r}")
        if self.is_stock:
            self.flavor = self.flavor or "debugmodel"
        elif self.flavor:
            raise ValueError(f"model.flavor applies to torchtitan's models {STOCK_MODELS} "
                             f"only, got flavor={self.flavor!r} with name={self.name!r}")
        Llama4Args.__post_init__(self)

    @property
    def is_stock(self) -> bool:
        return self.name in STOCK_MODELS


LLAMA4_ONLY_KEYS = tuple(f.name for f in fields(Llama4Args) if f.name != "name")
"""``[model]`` keys that only the Llama 4 style model has."""
