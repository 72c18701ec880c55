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

Values are parsed and type-checked by tyro (torchtitan's own CLI library, with torchtitan's
rules, e.g. comma-separated lists): a command-line string with the field type's tyro
constructor, a TOML value with its ``is_instance`` check (plus: a bool is never a number)
and normalised through it (an int given for a float field becomes a float). Each section is
then built with ``dataclasses.replace``, so its own ``__post_init__`` checks run.

Command-line ``--section.key value`` (or ``--section.key=value``; a bare ``--section.key``
means true) overrides the file. An unknown section or key, or a value of the wrong type,
raises ``ConfigError`` naming it and where it came from (the file, or the command line),
before anything is built.
Limits: list-of-dataclass fields (e.g. optimizer param groups) are not settable from TOML;
use the ``[optimizer]`` keys above.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A TOML or command-line setting that cannot be applied."""


# ------------------------------------------------------------------------ sources
@dataclasses.dataclass
class Setting:
    """One value to apply: dotted path (section.key[.subkey]), value, where it came from."""

    path: tuple[str, ...]
    value: Any
    source: str
    raw: bool = False  # a command-line string still to be parsed against the field type

    def where(self) -> str:
        if self.source == "command line":
            return f"--{'.'.join(self.path)} (command line)"
        section = ".".join(self.path[:-1])
        return f"[{section}] {self.path[-1]} in {self.source}"


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a syntax error names the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from e


def flatten_toml(data: dict[str, Any], source: str) -> list[Setting]:
    """TOML tables -> settings; top-level keys must live in a section."""
    out: list[Setting] = []

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, prefix + (key,))
            elif not prefix:
                raise ConfigError(f"{source}: key {key!r} must be inside a [section]")
            else:
                out.append(Setting(prefix + (key,), value, source))

    walk(data, ())
    return out


def parse_cli(args: list[str]) -> tuple[str | None, list[Setting]]:
    """``--config FILE`` and ``--section.key value`` pairs from the command line."""
    config_path: str | None = None
    settings: list[Setting] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected command-line argument {arg!r} "
                              "(expected --config FILE or --section.key value)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                value = "true"  # a bare flag: --debug.print_config
            else:
                value = nxt
                i += 1
        i += 1
        if name == "config":
            config_path = value
            continue
        parts = tuple(name.split("."))
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"command-line option --{name} must be --section.key")
        settings.append(Setting(parts, value, "command line", raw=True))
    return config_path, settings


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


# ------------------------------------------------------------------------ values (tyro)
def _describe(tp: Any) -> str:
    """A type as a user reads it: int, float | int, 'p2p' | 'te', list[str]."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_args(tp):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _constructor(tp: Any) -> Any:
    """tyro's constructor for values of type ``tp``, with torchtitan's tyro rules."""
    from torchtitan.config.manager import ConfigManager, custom_registry
    from tyro.constructors import ConstructorRegistry, PrimitiveTypeInfo

    if not getattr(_constructor, "rules", False):
        ConfigManager()  # registers torchtitan's rules (comma-separated lists, ...) once
        _constructor.rules = True  # type: ignore[attr-defined]
    with custom_registry:
        return ConstructorRegistry.get_primitive_spec(PrimitiveTypeInfo.make(tp, set()))


def convert(s: Setting, tp: Any) -> Any:
    """The value of ``s`` as type ``tp``; ConfigError naming the setting otherwise."""
    spec = _constructor(tp)
    name = ".".join(s.path)
    if not hasattr(spec, "instance_from_str"):
        raise ConfigError(f"{s.where()}: {name} (type {_describe(tp)}) cannot be set from a "
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
    raise ConfigError(f"{s.where()}: wrong type for {name}: expected {_describe(tp)}, got "
                      f"{value!r} ({type(value).__name__})")


# ------------------------------------------------------------------------ sections
def _fields(obj: Any) -> dict[str, Any]:
    """Settable field name -> resolved annotation of a dataclass instance."""
    try:
        hints = typing.get_type_hints(type(obj))
    except Exception:  # unresolvable forward refs: fall back to the raw annotations
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(obj)
            if f.init and not f.name.startswith("_")}


def _rebuild(obj: Any, values: dict[str, Any], section: str, settings: list[Setting]) -> Any:
    """``obj`` with ``values``, its ``__post_init__`` checks run; errors name the section,
    the field (``section.field``) and where the settings came from."""
    try:
        return dataclasses.replace(obj, **values)
    except (ValueError, TypeError, AssertionError) as e:
        msg = str(e)
        field_names = {f.name for f in dataclasses.fields(obj)}
        if msg.split(" ", 1)[0] in field_names:  # "strategy must be ..." -> "varlen_cp.strat..."
            msg = f"{section}.{msg}"
        sources = sorted({s.source for s in settings}) or ["defaults"]
        raise ConfigError(f"[{section}] ({', '.join(sources)}): {msg}") from e


def apply_section(obj: Any, settings: list[Setting], depth: int = 1) -> Any:
    """Dataclass ``obj`` with ``settings`` (their ``path[depth:]``) applied, in order (the
    command line comes last, so it wins)."""
    known = _fields(obj)
    section = ".".join(settings[0].path[:depth]) if settings else "?"
    values: dict[str, Any] = {}
    nested: dict[str, list[Setting]] = {}
    for s in settings:
        key = s.path[depth]
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in [{section}] ({s.where()}); known keys: "
                              f"{', '.join(sorted(known))}")
        child_is_section = dataclasses.is_dataclass(getattr(obj, key))
        if depth + 1 < len(s.path):
            if not child_is_section:
                raise ConfigError(f"{s.where()}: {'.'.join(s.path[:depth + 1])} is a value of "
                                  f"type {_describe(known[key])}, not a section")
            nested.setdefault(key, []).append(s)
        elif child_is_section:
            raise ConfigError(f"{s.where()}: {'.'.join(s.path)} is a section; set its keys "
                              "instead")
        else:
            values[key] = convert(s, known[key])
    for key, sub in nested.items():
        values[key] = apply_section(getattr(obj, key), sub, depth + 1)
    return _rebuild(obj, values, section, settings)


# ------------------------------------------------------------------------ mapping
GENERIC_SECTIONS = ("training", "parallelism", "lr_scheduler", "checkpoint", "metrics",
                    "profiler", "compile", "comm", "debug", "override", "model", "varlen_cp")
MAPPED_SECTIONS = ("job", "optimizer", "activation_checkpoint", "dataloader")
JOB_KEYS = {"dump_folder": str, "hf_assets_path": str, "description": str}
OPTIMIZER_KEYS = {"name": Literal["Adam", "AdamW"], "lr": float, "eps": float,
                  "weight_decay": float, "beta1": float, "beta2": float,
                  "implementation": Literal["for-loop", "foreach", "fused"]}


def _by_section(settings: list[Setting]) -> dict[str, list[Setting]]:
    out: dict[str, list[Setting]] = {}
    known = GENERIC_SECTIONS + MAPPED_SECTIONS
    for s in settings:
        if s.path[0] not in known:
            raise ConfigError(f"unknown section [{s.path[0]}] ({'.'.join(s.path)} in "
                              f"{s.source}); known sections: {', '.join(known)}")
        out.setdefault(s.path[0], []).append(s)
    return out


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
        _rebuild(config.dataloader, {}, "dataloader", settings)


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


def _finish(config: Any, by_section: dict[str, list[Setting]]) -> Any:
    """Cross-section checks, then the model spec, tokenizer and loss that depend on them."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from ...resolve import check_heads
    from .data import SyntheticPackedDataLoader, SyntheticTokenizer
    from .stock import _shape_of

    vc, par = config.varlen_cp, config.parallelism
    cp = par.context_parallel_degree
    where = sorted({s.source for ss in by_section.values() for s in ss}) or ["defaults"]
    src = ", ".join(where)
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
    if cp > 1:  # the strategy's own head rule (Ulysses' split), before anything is built
        n_heads, n_kv_heads = _shape_of(model.first_attention)[:2]
        tp = par.tensor_parallel_degree   # heads per TP rank, as the trainer's AttnShape
        try:
            check_heads(vc.attn_options, max(n_heads // tp, 1), max(n_kv_heads // tp, 1), cp)
        except ValueError as e:
            raise ConfigError(f"{src}: varlen_cp.strategy {vc.strategy!r} with the model's "
                              f"heads and context_parallel_degree {cp}: {e}") from e
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


def build_trainer_config(settings: list[Setting], *, cpu: bool = False) -> Any:
    """Apply ``settings`` (TOML first, command line last) to the plugin's defaults."""
    from . import cpu_mode

    if cpu:
        settings = [Setting((sec, key), value, "CPU mode")
                    for sec, kv in cpu_mode.cpu_overrides().items()
                    for key, value in kv.items()] + settings
    by_section = _by_section(settings)
    config = default_trainer_config()
    _apply_job(config, by_section.get("job", []))
    _apply_optimizer(config, by_section.get("optimizer", []))
    _apply_activation_checkpoint(config, by_section.get("activation_checkpoint", []))
    _apply_dataloader(config, by_section.get("dataloader", []))
    for section in GENERIC_SECTIONS:
        if section in by_section:
            setattr(config, section, apply_section(getattr(config, section),
                                                   by_section[section]))
    return _finish(config, by_section)


def load_config(args: list[str], *, cpu: bool = False) -> Any:
    """``--config FILE.toml [--section.key value ...]`` -> the trainer config."""
    path, cli = parse_cli(args)
    settings: list[Setting] = []
    if path is not None:
        settings = flatten_toml(load_toml(path), str(path))
    return build_trainer_config(settings + cli, cpu=cpu)
