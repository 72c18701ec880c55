"""TOML job file -> megatron-core ``TransformerConfig``, GPT model arguments, the
``[varlen_cp]`` options and the training loop's settings.

Sections: ``[model]`` (any ``TransformerConfig`` field, plus ``activation = "swiglu" |
"gelu" | "silu" | "relu"``), ``[gpt]`` (``GPTModel`` arguments: vocab_size,
max_sequence_length, position_embedding_type, rotary_base, ...), ``[parallel]``
(context_parallel_size, tensor_model_parallel_size, cp_comm_type,
hierarchical_context_parallel_sizes), ``[varlen_cp]`` (``VarlenCPOptions``: every
``varlen_cp.CPConfig`` field plus chunk_size, chunk_layers), ``[training]``
(``TrainingArgs``), ``[data]`` (``SyntheticDataConfig``). The file is read by the shared
reader (``varlen_cp.job_file``, as the torchtitan launcher and ``varlen-cp-plan`` read
theirs): a missing, folder, non-UTF-8 or bad TOML file, an unknown section or key and a
value of the wrong plain type are one ``ConfigError`` naming the key and the file, so a
typo never silently falls back to a default.

Limits: pipeline parallelism is not configurable (the demo uses megatron's no-pipelining
schedule); a per-layer ``cp_comm_type`` list becomes ``varlen_cp.strategy`` because
megatron-core 0.16.1 indexes that list off by one with CP > 1.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ...job_file import ConfigError, check_sections, check_table, fields_of, read_toml
from .data import SyntheticDataConfig
from .options import VarlenCPOptions

ACTIVATIONS = {"swiglu": (F.silu, True), "silu": (F.silu, False), "gelu": (F.gelu, False),
               "relu": (F.relu, False)}
SECTIONS = ("model", "gpt", "parallel", "varlen_cp", "training", "data")
_PARALLEL_KEYS = ("context_parallel_size", "tensor_model_parallel_size", "cp_comm_type",
                  "hierarchical_context_parallel_sizes")
# TransformerConfig fields owned by other sections (set from [parallel]) or by the runtime.
_RESERVED_MODEL_KEYS = set(_PARALLEL_KEYS) | {"pipeline_model_parallel_size",
                                               "activation_func", "gated_linear_unit"}
_REQUIRED_MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads")
_SPEC_KEYS = ("qk_layernorm", "moe_grouped_gemm")  # fields the layer spec also needs


@dataclass(kw_only=True, frozen=True)
class TrainingArgs:
    """steps: optimizer steps; micro_batches: packed rows per step (megatron's
    num_microbatches); lr/weight_decay/betas: AdamW; clip_grad: max grad norm (0 = off)."""

    steps: int = 10
    micro_batches: int = 1
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip_grad: float = 1.0
    seed: int = 42
    log_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batches", "log_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"training.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"training.warmup_steps must be an int >= 0, got "
                             f"{self.warmup_steps!r}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"training.{name} must be a number >= 0, got {v!r}")
        b = self.betas
        if not isinstance(b, (list, tuple)) or len(b) != 2 or not all(
                isinstance(x, (int, float)) and 0 <= x < 1 for x in b):
            raise ValueError(f"training.betas must be two numbers in [0, 1), got {b!r}")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        if not isinstance(self.seed, int):
            raise ValueError(f"training.seed must be an int, got {self.seed!r}")


@dataclass(kw_only=True)
class MegatronJob:
    """Everything a run needs; ``transformer`` is built lazily (it checks the CP size
    against the process groups only when a model is built)."""

    model: dict[str, Any]
    gpt: dict[str, Any]
    parallel: dict[str, Any]
    options: VarlenCPOptions
    training: TrainingArgs
    data: SyntheticDataConfig
    spec_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def context_parallel_size(self) -> int:
        return self.parallel.get("context_parallel_size", 1)

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.parallel.get("tensor_model_parallel_size", 1)

    def transformer_config(self, **overrides: Any) -> TransformerConfig:
        """The ``TransformerConfig`` (``overrides``: e.g. use_cpu_initialization)."""
        kwargs = dict(self.model)
        for key in _PARALLEL_KEYS:
            if key in self.parallel:
                kwargs[key] = self.parallel[key]
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)


def _dataclass_from(section: str, cls: type, table: dict[str, Any], source: str) -> Any:
    values = check_table(section, table, fields_of(cls), source)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:   # the class's own checks, named with the file
        raise ConfigError(f"{source}: [{section}] {e}") from None


def _model_types() -> dict[str, Any]:
    """[model]: every TransformerConfig field not owned elsewhere (with its type), plus
    ``activation``."""
    types = {k: v for k, v in fields_of(TransformerConfig).items()
             if k not in _RESERVED_MODEL_KEYS}
    return {**types, "activation": str}


def _model_keys() -> set[str]:
    return set(_model_types())


def _gpt_types() -> dict[str, Any]:
    """[gpt]: the GPTModel constructor's arguments that a job file may set (with their
    annotations where they resolve)."""
    params = inspect.signature(GPTModel.__init__).parameters
    try:
        hints = typing.get_type_hints(GPTModel.__init__)
    except Exception:  # unresolvable forward refs: the values are checked by GPTModel
        hints = {}
    return {k: hints.get(k, Any) for k in params
            if k not in {"self", "config", "transformer_layer_spec", "pre_process",
                         "post_process", "pg_collection", "vp_stage"}}


def _gpt_keys() -> set[str]:
    return set(_gpt_types())


_PARALLEL_TYPES = {"context_parallel_size": int, "tensor_model_parallel_size": int,
                   "cp_comm_type": Any, "hierarchical_context_parallel_sizes": Any}


def section_keys() -> dict[str, set[str]]:
    """Every key each section of a job file accepts (the validators' own sets; the docs
    test checks the keys the documentation names against them)."""
    return {"model": _model_keys(), "gpt": _gpt_keys(), "parallel": set(_PARALLEL_KEYS),
            "varlen_cp": {f.name for f in dataclasses.fields(VarlenCPOptions)},
            "training": {f.name for f in dataclasses.fields(TrainingArgs)},
            "data": {f.name for f in dataclasses.fields(SyntheticDataConfig)}}


def _model_section(table: dict[str, Any], source: str
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """[model] -> TransformerConfig kwargs and layer-spec kwargs."""
    reserved = sorted(set(table) & _RESERVED_MODEL_KEYS)
    if reserved:
        raise ValueError(f"[model]: key(s) {reserved} belong elsewhere: parallel sizes and "
                         f"cp_comm_type in [parallel], the activation as "
                         f"activation = {sorted(ACTIVATIONS)}")
    table = check_table("model", table, _model_types(), source)
    missing = [k for k in _REQUIRED_MODEL_KEYS if k not in table]
    if missing:
        raise ValueError(f"[model]: {missing} required")
    kwargs = dict(table)
    activation = kwargs.pop("activation", None)
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"[model] activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{activation!r}")
        kwargs["activation_func"], kwargs["gated_linear_unit"] = ACTIVATIONS[activation]
    if isinstance(kwargs.get("window_size"), list):
        kwargs["window_size"] = tuple(kwargs["window_size"])
    spec_kwargs = {k: kwargs[k] for k in _SPEC_KEYS if k in kwargs}
    if "normalization" in kwargs:
        spec_kwargs["normalization"] = kwargs["normalization"]
    if kwargs.get("num_moe_experts"):  # MoE layers are chosen by the layer spec
        spec_kwargs["num_experts"] = kwargs["num_moe_experts"]
    return kwargs, spec_kwargs


def _gpt_section(table: dict[str, Any], source: str) -> dict[str, Any]:
    table = check_table("gpt", table, _gpt_types(), source)
    for key in ("vocab_size", "max_sequence_length"):
        if key not in table:
            raise ValueError(f"[gpt]: {key} is required")
    return dict(table)


def _parallel_section(table: dict[str, Any], varlen: dict[str, Any], source: str
                      ) -> dict[str, Any]:
    out = check_table("parallel", table, _PARALLEL_TYPES, source)
    for key in ("context_parallel_size", "tensor_model_parallel_size"):
        v = out.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"[parallel] {key} must be an int >= 1, got {v!r}")
    comm = out.get("cp_comm_type")
    if isinstance(comm, list):
        if "strategy" in varlen:
            raise ValueError("[parallel] cp_comm_type is a per-layer list and "
                             "[varlen_cp] strategy is set too; give only one")
        varlen["strategy"] = comm  # see the module docstring
        del out["cp_comm_type"]
    return out


def job_from_dict(doc: dict[str, Any], source: str = "the job") -> MegatronJob:
    """Validate a parsed TOML document (read from ``source``) and split it into the run's
    parts; sections, keys and plain-typed values are checked by the shared reader
    (``varlen_cp.job_file``), the rest by the classes they become."""
    if not isinstance(doc, dict):
        raise ValueError(f"config must be a table, got {type(doc).__name__}")
    check_sections(doc, SECTIONS, source)
    if "model" not in doc or "gpt" not in doc:
        raise ValueError(f"{source}: sections [model] and [gpt] are required")
    varlen = dict(doc.get("varlen_cp", {}))
    parallel = _parallel_section(doc.get("parallel", {}), varlen, source)
    model, spec_kwargs = _model_section(doc["model"], source)
    job = MegatronJob(model=model, gpt=_gpt_section(doc["gpt"], source), parallel=parallel,
                      options=_dataclass_from("varlen_cp", VarlenCPOptions, varlen, source),
                      training=_dataclass_from("training", TrainingArgs,
                                               doc.get("training", {}), source),
                      data=_dataclass_from("data", SyntheticDataConfig, doc.get("data", {}),
                                           source),
                      spec_kwargs=spec_kwargs)
    job.options.check_num_layers(model["num_layers"])
    if job.data.alphabet > job.gpt["vocab_size"]:
        raise ValueError(f"[data] alphabet={job.data.alphabet} exceeds [gpt] vocab_size="
                         f"{job.gpt['vocab_size']}")
    return job


def load_config(path: str | Path) -> MegatronJob:
    """Read and validate a TOML job file (``varlen_cp.job_file.read_toml``: a missing file,
    a folder, bytes that are not UTF-8 or bad TOML are one error naming the file)."""
    return job_from_dict(read_toml(path, "--config"), str(path))
