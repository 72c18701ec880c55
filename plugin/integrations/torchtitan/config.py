"""TOML job files -> torchtitan 0.3.0 ``Trainer.Config`` (the plugin's subclass).

torchtitan 0.3.0 configures jobs with Python functions; this module brings back TOML files
with torchtitan's own section and field names. A section maps onto the ``Trainer.Config``
field of the same name (``[training]`` -> ``config.training``, ``[parallelism]``,
``[lr_scheduler]``, ``[checkpoint]``, ``[metrics]``, ``[profiler]``, ``[compile]``,
``[comm]``, ``[debug]``, ``[activation_checkpoint]``, ``[dataloader]``), and each key onto a
field of that dataclass, type-checked against its annotation. A few sections are mapped:

- ``[job]``: ``dump_folder``, ``hf_assets_path`` (top-level fields), ``description``.
- ``[optimizer]``: ``name`` (Adam | AdamW), ``lr``, ``eps``, ``weight_decay``, ``beta1``,
  ``beta2``, ``implementation`` -> one catch-all parameter group.
- ``[activation_checkpoint]``: ``mode`` = "none" | "selective" | "full" picks the class.
- ``[dataloader]``: ``dataset = "synthetic"`` (default) is the plugin's packed synthetic
  dataset; any other name is torchtitan's HF text dataloader (``dataset``, ``dataset_path``)
  with the HF tokenizer from ``[job] hf_assets_path``.
- ``[model]`` (``Llama4Args``) and ``[varlen_cp]`` (``VarlenCPConfig``: ``enable``,
  ``strategy`` = auto | p2p | all_gather | a2a | a2a+p2p | dispatch, ``layout`` =
  dual_chunk | te | contiguous, ``backend`` = auto | triton | torch, ``min_chunk_tokens``,
  ``validate``): the plugin's.

Command-line ``--section.key value`` (or ``--section.key=value``) overrides the file. An
unknown section or key, or a value of the wrong type, raises ``ConfigError`` naming it and
where it came from (the file, or the command line), before anything is built.
Limits: list-of-dataclass fields (e.g. optimizer param groups) are not settable from TOML;
use the ``[optimizer]`` keys above.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _strategies() -> tuple[str, ...]:
    """"auto" plus every strategy varlen_cp ships (p2p, all_gather, a2a, a2a+p2p, dispatch)."""
    from ...strategies import STRATEGIES as NAMES

    return ("auto", *NAMES)

from ...plan import LAYOUTS  # noqa: E402  (every layout the plan knows, balanced included)

BACKENDS = ("auto", "triton", "torch")


class ConfigError(ValueError):
    """A TOML or command-line setting that cannot be applied."""


@dataclasses.dataclass(kw_only=True)
class VarlenCPConfig:
    """The ``[varlen_cp]`` section: context parallelism for packed documents."""

    enable: bool = True
    """Use varlen-cp's attention and sharding (False: refuse CP > 1, run cp=1 varlen)."""
    strategy: str = "p2p"
    """CP communication strategy: p2p, all_gather, a2a (n_heads % cp == 0), a2a+p2p,
    dispatch, or auto (chosen per plan and mask from the plan's cost estimates)."""
    layout: Literal["dual_chunk", "te", "contiguous", "balanced"] = "dual_chunk"
    """Which tokens each CP rank holds (see varlen_cp.CPPlan)."""
    backend: Literal["auto", "triton", "torch"] = "auto"
    """Attention kernels: auto = triton on CUDA, torch on CPU."""
    min_chunk_tokens: int = 64
    """dual_chunk: documents shorter than 2*cp*min_chunk_tokens are kept whole."""
    validate: bool = False
    """Check once that every CP rank built the same plan (one small all-reduce)."""

    def __post_init__(self) -> None:
        if self.strategy not in _strategies():
            raise ValueError(f"varlen_cp.strategy must be one of {_strategies()}, got "
                             f"{self.strategy!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"varlen_cp.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"varlen_cp.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.min_chunk_tokens < 1:
            raise ValueError(f"varlen_cp.min_chunk_tokens must be >= 1, got {self.min_chunk_tokens}")


# ------------------------------------------------------------------------ type checking
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', origin)}[{args}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


_NO = object()


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (int -> float, list -> tuple), or ``_NO`` if it does not fit."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _coerce(value, typing.get_args(tp)[0])
    if origin is Literal:
        return value if any(value == a and type(value) is type(a)
                            for a in typing.get_args(tp)) else _NO
    if origin in (typing.Union, types.UnionType):
        # Exact types first so that "float | int" keeps an int an int.
        args = typing.get_args(tp)
        for a in args:
            if isinstance(a, type) and type(value) is a:
                return value
        for a in args:
            out = _coerce(value, a)
            if out is not _NO:
                return out
        return _NO
    if tp is type(None) or tp is None:
        return None if value is None else _NO
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _NO
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                return _NO
            items = [_coerce(v, a) for v, a in zip(value, args)]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp) for v in value]
        if any(i is _NO for i in items):
            return _NO
        return list(items) if origin is list else tuple(items)
    if origin is dict:
        return dict(value) if isinstance(value, dict) else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, bool):
            return _NO
        return float(value) if isinstance(value, (int, float)) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    return _NO


def _parse_cli_value(raw: str, tp: Any) -> Any:
    """A command-line string as a TOML literal (numbers, booleans, arrays), else the string."""
    if raw.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if typing.get_origin(tp) is list or tp is list or "list[" in str(tp):
        return [s for s in raw.split(",") if s]
    return raw


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


# ------------------------------------------------------------------------ application
def _fields(obj: Any) -> dict[str, Any]:
    """Field name -> resolved annotation for a dataclass instance."""
    try:
        hints = typing.get_type_hints(type(obj), include_extras=True)
    except Exception:  # unresolvable forward refs: fall back to the raw annotations
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(obj)
            if not f.name.startswith("_")}


def set_field(obj: Any, s: Setting, depth: int) -> None:
    """Apply ``s.path[depth:]`` to dataclass ``obj``, checking key and type."""
    key = s.path[depth]
    known = _fields(obj)
    if key not in known:
        section = ".".join(s.path[:depth]) or "top level"
        raise ConfigError(f"unknown key {key!r} in [{section}] ({s.where()}); known keys: "
                          f"{', '.join(sorted(known))}")
    tp = known[key]
    if depth + 1 < len(s.path):
        child = getattr(obj, key)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"{s.where()}: {'.'.join(s.path[:depth + 1])} is a value of type "
                              f"{_type_name(tp)}, not a section")
        set_field(child, s, depth + 1)
        return
    if dataclasses.is_dataclass(getattr(obj, key)):
        raise ConfigError(f"{s.where()}: {'.'.join(s.path)} is a section; set its keys instead")
    value = _parse_cli_value(s.value, tp) if s.raw else s.value
    coerced = _coerce(value, tp)
    if coerced is _NO:
        raise ConfigError(f"{s.where()}: wrong type for {'.'.join(s.path)}: expected "
                          f"{_type_name(tp)}, got {value!r} ({type(value).__name__})")
    setattr(obj, key, coerced)


def coerce_setting(s: Setting, tp: Any) -> Any:
    """The value of ``s`` checked against ``tp`` (for the mapped sections)."""
    value = _parse_cli_value(s.value, tp) if s.raw else s.value
    out = _coerce(value, tp)
    if out is _NO:
        raise ConfigError(f"{s.where()}: wrong type for {'.'.join(s.path)}: expected "
                          f"{_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return out


# ------------------------------------------------------------------------ mapping
GENERIC_SECTIONS = ("training", "parallelism", "lr_scheduler", "checkpoint", "metrics",
                    "profiler", "compile", "comm", "debug", "model", "varlen_cp")
MAPPED_SECTIONS = ("job", "optimizer", "activation_checkpoint", "dataloader")
JOB_KEYS = {"dump_folder": str, "hf_assets_path": str, "description": str}
OPTIMIZER_KEYS = {"name": Literal["Adam", "AdamW"], "lr": float, "eps": float,
                  "weight_decay": float, "beta1": float, "beta2": float,
                  "implementation": Literal["for-loop", "foreach", "fused"]}
AC_MODES = ("none", "selective", "full")


def _by_section(settings: list[Setting]) -> dict[str, list[Setting]]:
    out: dict[str, list[Setting]] = {}
    known = GENERIC_SECTIONS + MAPPED_SECTIONS
    for s in settings:
        if s.path[0] not in known:
            where = ("command line" if s.source == "command line" else s.source)
            raise ConfigError(f"unknown section [{s.path[0]}] ({'.'.join(s.path)} in {where}); "
                              f"known sections: {', '.join(known)}")
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
        out[s.path[1]] = coerce_setting(s, allowed[s.path[1]])
    return out


def _pick(settings: list[Setting], key: str) -> tuple[Setting | None, list[Setting]]:
    """The last setting of ``key`` (the command line comes last) and the others."""
    picked = [s for s in settings if len(s.path) == 2 and s.path[1] == key]
    rest = [s for s in settings if not (len(s.path) == 2 and s.path[1] == key)]
    return (picked[-1] if picked else None), rest


def _revalidate(obj: Any, section: str, settings: list[Setting]) -> Any:
    """Re-run a dataclass's ``__post_init__`` checks after its fields were set."""
    try:
        return dataclasses.replace(obj)
    except (ValueError, TypeError) as e:
        sources = sorted({s.source for s in settings}) or ["defaults"]
        raise ConfigError(f"[{section}] ({', '.join(sources)}): {e}") from e


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
        mode = coerce_setting(mode_setting, Literal["none", "selective", "full"])
        config.activation_checkpoint = {"none": None, "selective": SelectiveAC.Config(),
                                        "full": FullAC.Config()}[mode]
    if rest and config.activation_checkpoint is None:
        raise ConfigError(f"{rest[0].where()}: activation_checkpoint.mode is 'none'; set "
                          "mode = 'selective' or 'full' before other keys")
    for s in rest:
        set_field(config.activation_checkpoint, s, 1)


def _apply_dataloader(config: Any, settings: list[Setting]) -> None:
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from .data import SyntheticPackedDataLoader

    ds_setting, rest = _pick(settings, "dataset")
    if ds_setting is not None:
        name = coerce_setting(ds_setting, str)
        cls = SyntheticPackedDataLoader if name == "synthetic" else HuggingFaceTextDataLoader
        config.dataloader = cls.Config(dataset=name)
    for s in rest:
        set_field(config.dataloader, s, 1)
    config.dataloader = _revalidate(config.dataloader, "dataloader", settings)


def _finish(config: Any, by_section: dict[str, list[Setting]]) -> Any:
    """Cross-section checks, then the model spec, tokenizer and loss that depend on them."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from .data import SyntheticPackedDataLoader, SyntheticTokenizer
    from .model import llama4_model_spec

    config.model = _revalidate(config.model, "model", by_section.get("model", []))
    config.varlen_cp = _revalidate(config.varlen_cp, "varlen_cp", by_section.get("varlen_cp", []))
    vc, par, args = config.varlen_cp, config.parallelism, config.model
    cp = par.context_parallel_degree
    where = sorted({s.source for ss in by_section.values() for s in ss}) or ["defaults"]
    src = ", ".join(where)
    if cp > 1 and not vc.enable:
        raise ConfigError(f"{src}: parallelism.context_parallel_degree = {cp} needs "
                          "[varlen_cp] enable = true (torchtitan itself refuses varlen + CP)")
    if cp > 1 and par.spmd_backend != "spmd_types":
        raise ConfigError(f"{src}: varlen_cp context parallelism needs parallelism.spmd_backend"
                          f" = 'spmd_types', got {par.spmd_backend!r}")
    if cp > 1 and vc.strategy in ("a2a",) and args.n_heads % cp:
        raise ConfigError(f"{src}: varlen_cp.strategy 'a2a' needs model.n_heads "
                          f"({args.n_heads}) divisible by context_parallel_degree ({cp})")
    if par.pipeline_parallel_degree > 1:
        raise ConfigError(f"{src}: pipeline parallelism is not supported by varlen_cp")
    if config.training.seq_len > args.max_seq_len:
        raise ConfigError(f"{src}: training.seq_len ({config.training.seq_len}) exceeds "
                          f"model.max_seq_len ({args.max_seq_len})")
    if cp > 1 and config.training.seq_len % (2 * cp):
        raise ConfigError(f"{src}: torchtitan requires training.seq_len "
                          f"({config.training.seq_len}) divisible by 2 * context_parallel_degree")
    synthetic = isinstance(config.dataloader, SyntheticPackedDataLoader.Config)
    if synthetic:
        if config.dataloader.alphabet > args.vocab_size:
            raise ConfigError(f"{src}: dataloader.alphabet ({config.dataloader.alphabet}) must "
                              f"be <= model.vocab_size ({args.vocab_size})")
        config.tokenizer = SyntheticTokenizer.Config(vocab_size=args.vocab_size)
    else:
        config.tokenizer = HuggingFaceTokenizer.Config()
    config.model_spec = llama4_model_spec(args, strategy=vc.strategy, backend=vc.backend,
                                          validate=vc.validate)
    config.loss = CrossEntropyLoss.Config(global_vocab_size=args.vocab_size)
    try:
        return dataclasses.replace(config)  # torchtitan's own Trainer.Config checks
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"{src}: {e}") from e


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
        for s in by_section.get(section, []):
            set_field(config, s, 0)
    for section in ("training", "parallelism", "lr_scheduler", "checkpoint", "metrics",
                    "profiler", "compile", "comm", "debug"):
        if section in by_section:
            setattr(config, section, _revalidate(getattr(config, section), section,
                                                 by_section[section]))
    return _finish(config, by_section)


def load_config(args: list[str], *, cpu: bool = False) -> Any:
    """``--config FILE.toml [--section.key value ...]`` -> the trainer config."""
    path, cli = parse_cli(args)
    settings: list[Setting] = []
    if path is not None:
        settings = flatten_toml(load_toml(path), str(path))
    return build_trainer_config(settings + cli, cpu=cpu)
