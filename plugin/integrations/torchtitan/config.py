"""TOML job files -> torchtitan 0.3.0 ``Trainer.Config`` (the plugin's subclass).

torchtitan 0.3.0 configures jobs with Python functions; this module brings back TOML files
with torchtitan's own section and field names. A section maps onto the ``Trainer.Config``
field of the same name (``[training]`` -> ``config.training``, ``[parallelism]``,
``[lr_scheduler]``, ``[checkpoint]``, ``[metrics]``, ``[profiler]``, ``[compile]``,
``[comm]``, ``[debug]``, ``[override]``, ``[activation_checkpoint]``, ``[dataloader]``), and
each key onto a field of that dataclass. A few sections are mapped:

- ``[job]``: ``dump_folder``, ``hf_assets_path`` (top-level fields), ``description``.
- ``[optimizer]``: ``name`` (Adam | AdamW), ``lr``, ``eps``, ``weight_decay``, ``beta1``,
  ``beta2``, ``implementation`` -> one catch-all parameter group.
- ``[activation_checkpoint]``: ``mode`` = "none" | "selective" | "full" picks the class.
- ``[dataloader]``: ``dataset = "synthetic"`` (default) is the plugin's packed synthetic
  dataset; any other name is torchtitan's HF text dataloader (``dataset``, ``dataset_path``)
  with the HF tokenizer from ``[job] hf_assets_path``.
- ``[model]`` (``options.ModelSection``): ``name = "llama4_style"`` (default) is the
  project's Llama 4 style model with its own keys (``dim``, ``n_layers``, ...); ``name`` =
  one of torchtitan's models (``llama3``, ``qwen3``, ``gpt_oss``, ``deepseek_v3``, ...) with
  ``flavor`` (torchtitan's registry flavor, default "debugmodel") picks that model unchanged.
- ``[varlen_cp]`` (``options.VarlenCPSection``: ``varlen_cp.CPConfig`` + ``enable``).

The file, its sections and keys are read by the shared reader, ``varlen_cp.job_file``
(which ``varlen-cp-plan`` uses too, so a typo is the same line in both). TOML values of
plain types (bool, int, float, str, literals, optionals) are checked there (a bool is never
a number; an int given for a float field becomes a float); command-line strings and other
types are parsed by tyro (torchtitan's own CLI library, with torchtitan's rules, e.g.
comma-separated lists; ``tyro_value``). Each section is then built with
``dataclasses.replace``, so its own ``__post_init__`` checks run.

Command-line ``--section.key value`` (or ``--section.key=value``; a bare ``--section.key``
means true) overrides the file. An unknown section or key, or a value of the wrong type,
raises ``ConfigError`` naming it and where it came from (the file, or the command line),
before anything is built; so do parallelism degrees below 1, and (``_finish``) what the
first call would refuse: the strategy's head rule at this cp, the backend on this
machine's device, ``VARLEN_CP_MALLOC_TUNING`` (``varlen_cp.resolve.check_launch``).
Limits: list-of-dataclass fields (e.g. optimizer param groups) are not settable from TOML;
use the ``[optimizer]`` keys above.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from ...job_file import (ConfigError, Setting, by_section, check_output, describe,
                         flatten_toml, parse_cli, read_toml, rebuild)
from ...job_file import apply_section as _apply_section
from ...job_file import convert as _convert

# ------------------------------------------------------------------------ values (tyro)
def _constructor(tp: Any) -> Any:
    """tyro's constructor for values of type ``tp``, with torchtitan's tyro rules."""
    from torchtitan.config.manager import ConfigManager, custom_registry
    from tyro.constructors import ConstructorRegistry, PrimitiveTypeInfo

    if not getattr(_constructor, "rules", False):
        ConfigManager()  # registers torchtitan's rules (comma-separated lists, ...) once
        _constructor.rules = True  # type: ignore[attr-defined]
    with custom_registry:
        return ConstructorRegistry.get_primitive_spec(PrimitiveTypeInfo.make(tp, set()))


def tyro_value(s: Setting, tp: Any) -> Any:
    """The value of ``s`` as type ``tp`` parsed by tyro: every command-line string, and TOML
    values of the types the shared reader leaves to torchtitan's rules (lists, tuples,
    paths, ...); ConfigError naming the setting otherwise."""
    spec = _constructor(tp)
    name = ".".join(s.path)
    if not hasattr(spec, "instance_from_str"):
        raise ConfigError(f"{s.where()}: {name} (type {describe(tp)}) cannot be set from a "
                          "TOML file or the command line")
    value = s.value
    try:
        if s.raw:  # a command-line string, parsed as tyro parses --flag values
            raw = {"true": "True", "false": "False", "none": "None", "null": "None"}.get(
                value.lower(), value)
            tokens = [raw] if spec.nargs == 1 else [t for t in raw.split(",") if t]
            if spec.choices is None or all(t in spec.choices for t in tokens):
                return spec.instance_from_str(tokens)
        else:  # a TOML value: checked, then normalised through tyro's string form
            if isinstance(value, list) and typing.get_origin(tp) is tuple:
                value = tuple(value)
            bool_ok = not isinstance(value, bool) or bool in (tp, *typing.get_args(tp))
            if bool_ok and spec.is_instance(value):  # tyro takes True for an int; we do not
                return spec.instance_from_str(spec.str_from_instance(value))
    except (ValueError, TypeError):
        pass
    raise ConfigError(f"{s.where()}: wrong type for {name}: expected {describe(tp)}, got "
                      f"{value!r} ({type(value).__name__})")


def convert(s: Setting, tp: Any) -> Any:
    """``job_file.convert`` with tyro for what it leaves to torchtitan's rules."""
    return _convert(s, tp, tyro_value)


def apply_section(obj: Any, settings: list[Setting], depth: int = 1) -> Any:
    """``job_file.apply_section`` with tyro for what it leaves to torchtitan's rules."""
    return _apply_section(obj, settings, depth, tyro_value)


# ------------------------------------------------------------------------ mapping
GENERIC_SECTIONS = ("training", "parallelism", "lr_scheduler", "checkpoint", "metrics",
                    "profiler", "compile", "comm", "debug", "override", "model", "varlen_cp")
MAPPED_SECTIONS = ("job", "optimizer", "activation_checkpoint", "dataloader")
SECTIONS = GENERIC_SECTIONS + MAPPED_SECTIONS
JOB_KEYS = {"dump_folder": str, "hf_assets_path": str, "description": str}
OPTIMIZER_KEYS = {"name": Literal["Adam", "AdamW"], "lr": float, "eps": float,
                  "weight_decay": float, "beta1": float, "beta2": float,
                  "implementation": Literal["for-loop", "foreach", "fused"]}



def _flat_keys(section: str, settings: list[Setting], allowed: dict[str, Any]
               ) -> dict[str, Any]:
    """Values of a mapped section whose keys are listed in ``allowed`` (key -> type)."""
    out: dict[str, Any] = {}
    for s in settings:
        if len(s.path) != 2 or s.path[1] not in allowed:
            raise ConfigError(f"unknown key {'.'.join(s.path[1:])!r} in [{section}] "
                              f"({s.where()}); known keys: {', '.join(allowed)}")
        out[s.path[1]] = convert(s, allowed[s.path[1]])
    return out


def _pick(settings: list[Setting], key: str) -> tuple[Setting | None, list[Setting]]:
    """The last setting of ``key`` (the command line comes last) and the others."""
    picked = [s for s in settings if len(s.path) == 2 and s.path[1] == key]
    rest = [s for s in settings if not (len(s.path) == 2 and s.path[1] == key)]
    return (picked[-1] if picked else None), rest


def default_trainer_config() -> Any:
    """The plugin's defaults before any TOML: a tiny Llama 4 style model on synthetic data."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig

    from .data import SyntheticPackedDataLoader
    from .trainer import VarlenCPMetrics, VarlenCPTrainer

    return VarlenCPTrainer.Config(
        hf_assets_path="",
        dump_folder="./outputs/varlen_cp",
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=1, seq_len=2048, steps=10),
        dataloader=SyntheticPackedDataLoader.Config(),
        metrics=VarlenCPMetrics.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )


def _apply_job(config: Any, settings: list[Setting]) -> None:
    for key, value in _flat_keys("job", settings, JOB_KEYS).items():
        if key != "description":
            setattr(config, key, value)


def _apply_optimizer(config: Any, settings: list[Setting]) -> None:
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    if not settings:
        return
    values = _flat_keys("optimizer", settings, OPTIMIZER_KEYS)
    kwargs = dict(config.optimizer.param_groups[0].optimizer_kwargs)
    for key in ("lr", "eps", "weight_decay"):
        if key in values:
            kwargs[key] = values[key]
    betas = list(kwargs.get("betas", (0.9, 0.95)))
    betas[0], betas[1] = values.get("beta1", betas[0]), values.get("beta2", betas[1])
    kwargs["betas"] = tuple(betas)
    name = values.get("name", config.optimizer.param_groups[0].optimizer_name)
    config.optimizer = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name,
                                       optimizer_kwargs=kwargs)],
        implementation=values.get("implementation", config.optimizer.implementation))


def _apply_activation_checkpoint(config: Any, settings: list[Setting]) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    mode_setting, rest = _pick(settings, "mode")
    if mode_setting is not None:
        mode = convert(mode_setting, Literal["none", "selective", "full"])
        config.activation_checkpoint = {"none": None, "selective": SelectiveAC.Config(),
                                        "full": FullAC.Config()}[mode]
    if rest and config.activation_checkpoint is None:
        raise ConfigError(f"{rest[0].where()}: activation_checkpoint.mode is 'none'; set "
                          "mode = 'selective' or 'full' before other keys")
    if rest:
        config.activation_checkpoint = apply_section(config.activation_checkpoint, rest)


def _apply_dataloader(config: Any, settings: list[Setting]) -> None:
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from .data import SyntheticPackedDataLoader

    ds_setting, rest = _pick(settings, "dataset")
    if ds_setting is not None:
        name = convert(ds_setting, str)
        cls = SyntheticPackedDataLoader if name == "synthetic" else HuggingFaceTextDataLoader
        config.dataloader = cls.Config(dataset=name)
    config.dataloader = apply_section(config.dataloader, rest) if rest else \
        rebuild(config.dataloader, {}, "dataloader", settings)


def _model_spec(config: Any, settings: list[Setting], src: str) -> Any:
    """The ``ModelSpec`` the ``[model]`` section picks (the Llama 4 style model, or one of
    torchtitan's models unchanged)."""
    from .model import llama4_model_spec
    from .options import LLAMA4_ONLY_KEYS
    from .stock import UnsupportedModel, check_supported, stock_model_spec

    args, vc = config.model, config.varlen_cp
    if not args.is_stock:
        return llama4_model_spec(args, options=vc.attn_options)
    for s in settings:
        if s.path[1] in LLAMA4_ONLY_KEYS:
            raise ConfigError(f"{s.where()}: model.{s.path[1]} applies to the llama4_style "
                              f"model only; model.name = {args.name!r} is torchtitan's own "
                              "model: choose its size with model.flavor")
    try:
        check_supported(args.name, config.parallelism.context_parallel_degree)
        return stock_model_spec(args.name, args.flavor)
    except (UnsupportedModel, ValueError) as e:
        raise ConfigError(f"{src}: {e}") from e


DEGREES = ("context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
           "data_parallel_replicate_degree", "expert_parallel_degree")


def check_degrees(par: Any, settings: list[Setting]) -> None:
    """Every parallelism degree >= 1 (``data_parallel_shard_degree``: -1, the rest, or >= 1),
    named with the setting that gave it; before the world-size rule divides by them."""
    for name in (*DEGREES, "data_parallel_shard_degree"):
        value = getattr(par, name, 1)
        lowest = -1 if name == "data_parallel_shard_degree" else 1
        if value >= 1 or value == lowest:
            continue
        given = [s for s in settings if s.path[1:] == (name,)]
        origin = given[-1].where() if given else "defaults"
        rule = "-1 (the rest of the world) or >= 1" if lowest == -1 else ">= 1"
        raise ConfigError(f"{origin}: parallelism.{name} must be {rule}, got {value}")


def _launch_shape(config: Any, model: Any) -> Any:
    """The attention shape the trainer will have on each rank (heads split over TP), read
    from the model config before anything is built."""
    from .stock import _shape_of, rank_shape

    return rank_shape(_shape_of(model.first_attention),
                      tp=config.parallelism.tensor_parallel_degree,
                      dtype=config.training.mixed_precision_param)


def _check_launch(vc: Any, shape: Any, cp: int, src: str) -> None:
    """``varlen_cp.resolve.check_launch`` on the device this process trains on (CUDA when
    there is one: no CUDA context is made for it), and the library's environment variable
    (``host_memory.malloc_tuning``)."""
    from ...host_memory import malloc_tuning
    from ...resolve import check_launch
    from . import cpu_mode

    device = "cuda" if cpu_mode.cuda_available() else "cpu"
    try:
        check_launch(vc.attn_options, shape, cp, device, vc.layout_spec())
    except ValueError as e:
        raise ConfigError(f"{src}: varlen_cp on {device}: {e}") from e
    try:
        malloc_tuning()
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _finish(config: Any, by_section: dict[str, list[Setting]], run_here: bool) -> Any:
    """Cross-section checks, then the model spec, tokenizer and loss that depend on them.
    ``run_here``: the job runs in this process (its backend and environment are checked);
    False for a job that is only read (``varlen-cp-plan``)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from ...resolve import check_heads
    from .data import SyntheticPackedDataLoader, SyntheticTokenizer

    vc, par = config.varlen_cp, config.parallelism
    cp = par.context_parallel_degree
    where = sorted({s.source for ss in by_section.values() for s in ss}) or ["defaults"]
    src = ", ".join(where)
    check_degrees(par, by_section.get("parallelism", []))
    if cp > 1 and not vc.enable:
        raise ConfigError(f"{src}: parallelism.context_parallel_degree = {cp} needs "
                          "[varlen_cp] enable = true (torchtitan itself refuses varlen + CP)")
    if cp > 1 and par.spmd_backend != "spmd_types":
        raise ConfigError(f"{src}: varlen_cp context parallelism needs parallelism.spmd_backend"
                          f" = 'spmd_types', got {par.spmd_backend!r}")
    if par.pipeline_parallel_degree > 1:
        raise ConfigError(f"{src}: pipeline parallelism is not supported by varlen_cp")
    spec = _model_spec(config, by_section.get("model", []), src)
    model = spec.model
    if vc.enable or not config.model.is_stock:   # varlen-cp's attention runs (llama4_style:
        shape = _launch_shape(config, model)     # always), so its options are checked now
        try:  # the strategy's own head rule (Ulysses' split), at every cp
            check_heads(vc.attn_options, shape.n_heads, shape.n_kv_heads, cp)
        except ValueError as e:
            raise ConfigError(f"{src}: varlen_cp.strategy {vc.strategy!r} with the model's "
                              f"heads and context_parallel_degree {cp}: {e}") from e
        if run_here:
            _check_launch(vc, shape, cp, src)
    if run_here:   # where the run writes (checkpoints, traces): before it starts
        check_output("job.dump_folder", config.dump_folder, folder=True)
    seq_len = config.training.seq_len
    if seq_len > model.max_seq_len:
        raise ConfigError(f"{src}: training.seq_len ({seq_len}) exceeds the model's "
                          f"max_seq_len ({model.max_seq_len})")
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"{src}: torchtitan requires training.seq_len ({seq_len}) divisible "
                          "by 2 * context_parallel_degree")
    vocab = model.vocab_size
    if isinstance(config.dataloader, SyntheticPackedDataLoader.Config):
        if config.dataloader.alphabet > vocab:
            raise ConfigError(f"{src}: dataloader.alphabet ({config.dataloader.alphabet}) must "
                              f"be <= the model's vocab_size ({vocab})")
        config.tokenizer = SyntheticTokenizer.Config(vocab_size=vocab)
    else:
        config.tokenizer = HuggingFaceTokenizer.Config()
    config.model_spec = spec
    config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    try:
        return dataclasses.replace(config)  # torchtitan's own Trainer.Config checks
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"{src}: {e}") from e


def check_world_size(config: Any, world_size: int) -> None:
    """ConfigError unless ``world_size`` processes can hold the parallelism degrees (the
    rule of torchtitan's ``ParallelDims``, which otherwise fails with a bare assertion):
    dp_replicate x dp_shard x cp x tp x pp == world size, dp_shard = -1 taking the rest."""
    par = config.parallelism
    cp, tp, pp = (par.context_parallel_degree, par.tensor_parallel_degree,
                  par.pipeline_parallel_degree)
    rep, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    group = rep * cp * tp * pp
    fits = world_size % group == 0 if shard == -1 else rep * shard * cp * tp * pp == world_size
    if fits:
        return
    need = group if shard == -1 else group * shard
    parts = [f"{name} ({value})" for name, value in (
        ("context_parallel_degree", cp), ("tensor_parallel_degree", tp),
        ("pipeline_parallel_degree", pp), ("data_parallel_replicate_degree", rep),
        ("data_parallel_shard_degree", shard)) if value not in (1, -1)]
    rule = (f"a multiple of {need}" if shard == -1 else f"exactly {need}")
    fix = (f"start {need} processes (torchrun --nproc_per_node {need} ..., or this "
           f"launcher's --nproc_per_node {need})")
    if cp > 1:
        fix += " or set --parallelism.context_parallel_degree 1"
    verb = "needs" if len(parts) == 1 else "need"
    raise ConfigError(f"parallelism: {' x '.join(parts) or 'the degrees'} {verb} a world "
                      f"size that is {rule}, but {world_size} process"
                      f"{'es were' if world_size != 1 else ' was'} started: {fix}")


def build_trainer_config(settings: list[Setting], *, cpu: bool = False,
                         run_here: bool = True) -> Any:
    """Apply ``settings`` (TOML first, command line last) to the plugin's defaults;
    ``run_here`` as in ``_finish``."""
    from . import cpu_mode

    if cpu:
        settings = [Setting((sec, key), value, "CPU mode")
                    for sec, kv in cpu_mode.cpu_overrides().items()
                    for key, value in kv.items()] + settings
    sections = by_section(settings, SECTIONS)
    config = default_trainer_config()
    _apply_job(config, sections.get("job", []))
    _apply_optimizer(config, sections.get("optimizer", []))
    _apply_activation_checkpoint(config, sections.get("activation_checkpoint", []))
    _apply_dataloader(config, sections.get("dataloader", []))
    for section in GENERIC_SECTIONS:
        if section in sections:
            setattr(config, section, apply_section(getattr(config, section),
                                                   sections[section]))
    return _finish(config, sections, run_here)


def load_config(args: list[str], *, cpu: bool = False, run_here: bool = True) -> Any:
    """``--config FILE.toml [--section.key value ...]`` -> the trainer config (``run_here``
    False: only read, e.g. to plan it; the backend is not checked against this machine)."""
    path, cli = parse_cli(args)
    settings: list[Setting] = []
    if path is not None:
        settings = flatten_toml(read_toml(path, "--config"), str(path))
    return build_trainer_config(settings + cli, cpu=cpu, run_here=run_here)
