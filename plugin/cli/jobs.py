"""What ``varlen-cp-plan`` plans for: CP degree, options, layer types and head shape, read
from a job file (the repo's configs/*.toml) and/or command-line flags.

Job files:
- torchtitan (``[parallelism]``, ``[varlen_cp]``, ``[model]``, ``[training]``): read with
  the launcher's own reader (``torchtitan_parts``: the launcher's ``load_config`` when
  torchtitan is installed, else the shared ``varlen_cp.job_file`` on what can be checked
  without it, naming the keys it could not), so a typo is the same error as at launch.
  The Llama 4 style model's
  layer masks come from its fields (``Llama4Args.layer_mask``); torchtitan's own models
  (``[model] name = "llama3"``, ...) are read from torchtitan's registry, which needs
  torchtitan installed. Heads are split over ``tensor_parallel_degree``; the dtype is
  ``[training] mixed_precision_param`` (torchtitan's default bfloat16); tokens per batch
  ``seq_len`` x ``local_batch_size``.
- megatron (``[gpt]`` / ``[parallel]`` sections): read with the megatron integration's
  ``load_config`` and its layer resolution (needs megatron-core installed).

Flags override the file (``--cp``, ``--layout``, ``--strategy``, ``--backend``, ``--mask``,
heads, ...);
without a file they describe the job alone. Mask syntax (``--mask``, repeatable):
``MASK[:LAYERS]`` with MASK a ``+``-joined list of ``causal`` (the default), ``full``
(bidirectional), ``chunk=N`` (Llama 4 chunked attention), ``window=L`` (causal sliding
window: L keys back) or ``window=L,R``; e.g. ``--mask chunk=8192:3 --mask causal:1``
(Llama 4), ``--mask window=4096:5 --mask causal:1``, ``--mask full+window=128,128``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from ..config import CPConfig, AttnShape
from ..job_file import apply_section, by_section, convert, flatten_toml, read_toml
from ..kernels.validation import MAX_HEAD_DIM
from ..plan.cpplan import MAX_CP_SIZE
from ..masks import AttnMask
from ..report import LayerType, layer_types

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Job:
    """A job as the planner sees it. ``config``: the plan's options (layout, strategy, ...);
    ``layers``: attention layer types with counts and strategies; ``rows`` x ``seq_len``
    tokens per batch (None: not given)."""

    source: str
    cp: int
    config: CPConfig
    layers: tuple[LayerType, ...]
    shape: AttnShape
    seq_len: int | None = None
    rows: int = 1
    unchecked: tuple[str, ...] = ()   # keys read without torchtitan that it did not check
    tp: int = 1                       # tensor-parallel degree (GPUs of a node per CP rank)


def _int(value: Any, where: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {value!r}")
    return value


def _counts(masks: list[AttnMask]) -> list[tuple[AttnMask, int]]:
    """Masks with their layer counts, in first-use order."""
    return [(m, masks.count(m)) for m in dict.fromkeys(masks)]


def read_job(path: str | Path) -> Job:
    """The job of a torchtitan or megatron TOML file (module docstring)."""
    doc = read_toml(path, "--config")
    if "gpt" in doc or "parallel" in doc:
        return megatron_job(Path(path))
    return torchtitan_job(doc, Path(path))


@dataclass(frozen=True)
class TorchtitanParts:
    """What the planner reads of a torchtitan job, whichever way the file was read."""

    varlen_cp: Any      # options.VarlenCPSection
    model: Any          # options.ModelSection
    cp: int
    tp: int
    seq_len: int
    rows: int
    dtype: str
    unchecked: tuple[str, ...] = ()


# torchtitan's keys the planner reads without torchtitan, with torchtitan 0.3.0's types
# (tests/package/test_job_files.py checks them against torchtitan's dataclasses)
READ_WITHOUT_TORCHTITAN = {
    ("parallelism", "context_parallel_degree"): int,
    ("parallelism", "tensor_parallel_degree"): int,
    ("training", "seq_len"): int,
    ("training", "local_batch_size"): int,
    ("training", "mixed_precision_param"): Literal["bfloat16", "float32"],
}


def torchtitan_parts(doc: dict[str, Any], path: Path) -> TorchtitanParts:
    """The job file read by the launcher's own reader when torchtitan is installed (every
    section, key, type and cross-section rule, as at launch; the backend is not checked
    against this machine, which only plans); without torchtitan by the same shared reader
    (``varlen_cp.job_file``) for the sections and keys it can know: section names, the
    plugin's ``[varlen_cp]`` and ``[model]`` whole, and the torchtitan keys it reads. The
    other keys of torchtitan's sections are listed as unchecked."""
    from ..integrations.torchtitan import config as launcher
    from ..integrations.torchtitan.train import missing_dependency

    if missing_dependency() is None:
        from ..integrations.torchtitan import cpu_mode

        if not cpu_mode.cuda_available():
            try:
                cpu_mode.enable_cpu_mode()  # before torchtitan picks its device
            except RuntimeError:  # the host process imported torchtitan already: reading
                pass              # the config does not need it
        root = logging.getLogger()   # torchtitan's logger: its config classes warn about
        level = root.level           # defaults of theirs (a checkpoint path) that do not
        root.setLevel(logging.ERROR)  # concern a plan
        try:
            c = launcher.load_config(["--config", str(path)], run_here=False)
        finally:
            root.setLevel(level)
        par, training = c.parallelism, c.training
        return TorchtitanParts(c.varlen_cp, c.model, par.context_parallel_degree,
                               par.tensor_parallel_degree, training.seq_len,
                               training.local_batch_size, training.mixed_precision_param)
    from ..integrations.torchtitan.options import ModelSection, VarlenCPSection

    settings = flatten_toml(doc, str(path))
    sections = by_section(settings, launcher.SECTIONS)
    values = {"context_parallel_degree": 1, "tensor_parallel_degree": 1, "seq_len": 2048,
              "local_batch_size": 1, "mixed_precision_param": "bfloat16"}
    unchecked = []
    for s in settings:   # in the file's order
        if s.path[0] in ("varlen_cp", "model"):
            continue
        tp = READ_WITHOUT_TORCHTITAN.get(s.path)
        if tp is None:
            unchecked.append(f"[{'.'.join(s.path[:-1])}] {s.path[-1]}")
        else:
            values[s.path[1]] = convert(s, tp)
    par = SimpleNamespace(data_parallel_shard_degree=-1, **{
        k: values[k] for k in ("context_parallel_degree", "tensor_parallel_degree")})
    launcher.check_degrees(par, sections.get("parallelism", []))
    for key in ("seq_len", "local_batch_size"):
        _int(values[key], f"{path}: [training] {key}")
    return TorchtitanParts(apply_section(VarlenCPSection(), sections.get("varlen_cp", [])),
                           apply_section(ModelSection(), sections.get("model", [])),
                           values["context_parallel_degree"], values["tensor_parallel_degree"],
                           values["seq_len"], values["local_batch_size"],
                           values["mixed_precision_param"], tuple(dict.fromkeys(unchecked)))


def torchtitan_job(doc: dict[str, Any], path: Path) -> Job:
    t = torchtitan_parts(doc, path)
    vc, model = t.varlen_cp, t.model
    if model.is_stock:
        masks, (hq, hkv, d, dv) = stock_layers(model.name, model.flavor, path)
    else:
        masks = [model.layer_mask(i) for i in range(model.n_layers)]
        hq, hkv, d, dv = model.n_heads, model.n_kv_heads, model.head_dim_, model.head_dim_
    shape = AttnShape(n_heads=max(hq // t.tp, 1), n_kv_heads=max(hkv // t.tp, 1), head_dim=d,
                      head_dim_v=None if dv == d else dv, dtype=DTYPES[t.dtype])
    config = CPConfig(**{f.name: getattr(vc, f.name) for f in dataclasses.fields(CPConfig)})
    return Job(f"{path} (torchtitan, model {model.name})", t.cp, config,
               tuple(layer_types(_counts(masks), vc.strategy, vc.a2a_size)), shape,
               t.seq_len, t.rows, t.unchecked, t.tp)


def stock_layers(name: str, flavor: str, path: Path
                 ) -> tuple[list[AttnMask], tuple[int, int, int, int]]:
    """Layer masks and head shape of torchtitan's model ``name`` / ``flavor`` (imports
    torchtitan)."""
    from ..integrations.torchtitan.train import missing_dependency

    if missing_dependency() is not None:
        raise ValueError(f"{path}: [model] name = {name!r} is one of torchtitan's models; "
                         f"reading its layers needs torchtitan (pip install "
                         f"\"varlen-cp[torchtitan]\"), or describe them with --mask, "
                         f"--heads, --kv-heads and --head-dim")
    from ..integrations.torchtitan import cpu_mode

    if not cpu_mode.cuda_available():
        try:
            cpu_mode.enable_cpu_mode()  # before torchtitan picks its device
        except RuntimeError:  # the host process imported torchtitan already: reading the
            pass              # registry does not need it
    from torchtitan.models.common.attention import BaseAttention, VarlenAttention

    from ..integrations.torchtitan.attention import window_to_mask
    from ..integrations.torchtitan.stock import _shape_of, stock_model_spec

    spec = stock_model_spec(name, flavor)
    masks, shapes = [], set()
    for _, attn, _, _ in spec.model.traverse(BaseAttention.Config):
        if isinstance(attn.inner_attention, VarlenAttention.Config):
            masks.append(window_to_mask(tuple(attn.inner_attention.window_size)))
            shapes.add(_shape_of(attn))
    if not masks or len(shapes) != 1:
        raise ValueError(f"{path}: model {name!r} ({flavor}) has {len(masks)} varlen "
                         f"attention layers with shapes {sorted(shapes)}; varlen-cp-plan "
                         f"needs at least one, all of one shape")
    return masks, shapes.pop()


def megatron_job(path: Path) -> Job:
    try:
        from ..integrations.megatron.config import load_config
        from ..integrations.megatron.planning import attn_shape, report_layers
    except ImportError as e:
        raise ValueError(f"{path} is a megatron job file; reading it needs megatron-core "
                         f"(pip install \"varlen-cp[megatron]\"): {e}") from None
    job = load_config(path)
    config = job.transformer_config(use_cpu_initialization=True)
    cp = job.context_parallel_size
    return Job(f"{path} (megatron)", cp, job.options, tuple(report_layers(config, job.options)),
               attn_shape(config), job.data.seq_len, job.training.micro_batches,
               tp=job.tensor_model_parallel_size)


# ---- flags --------------------------------------------------------------------------------
def parse_mask(text: str) -> tuple[AttnMask, int]:
    """``MASK[:LAYERS]`` (module docstring) -> (AttnMask, layer count)."""
    spec, _, layers = text.partition(":")
    count = 1
    if layers:
        try:
            count = int(layers)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"--mask {text!r}: the layer count after ':' must be an int "
                             f">= 1, got {layers!r}")
    causal, window, chunk = True, (-1, -1), None
    given: dict[str, str] = {}   # kind of term -> the term that set it
    for term in spec.split("+"):
        name, _, value = term.strip().partition("=")
        kind = "causal/full" if name in ("causal", "full") else name
        if kind in given:   # a second term of a kind would silently override the first
            raise ValueError(f"--mask {text!r}: {term.strip()!r} repeats or contradicts "
                             f"{given[kind]!r}; give each of causal / full, chunk=, window= "
                             f"at most once")
        given[kind] = term.strip()
        try:
            if name == "causal" and not value:
                causal = True
            elif name == "full" and not value:
                causal = False
            elif name == "chunk":
                chunk = int(value)
            elif name == "window":
                ends = [int(v) for v in value.split(",")]
                if len(ends) not in (1, 2):
                    raise ValueError
                window = (ends[0], ends[1] if len(ends) == 2 else 0)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--mask {text!r}: unknown term {term!r}; use causal, full, "
                             f"chunk=N, window=L or window=L,R joined by '+', then "
                             f"':LAYERS' (e.g. chunk=8192:3)") from None
    try:
        return AttnMask(causal=causal, window_size=window, chunk_size=chunk), count
    except ValueError as e:
        raise ValueError(f"--mask {text!r}: {e}") from None


OPTION_FLAGS = ("layout", "strategy", "backend", "a2a_size", "overlap_stages", "tile_tokens",
                "min_chunk_tokens", "pad_multiple")


def _head_flags(args: Any) -> str:
    """The head-shape flags given, as typed (an error about the shape names them)."""
    return " ".join(f"{flag} {getattr(args, key)}" for key, flag in (
        ("heads", "--heads"), ("kv_heads", "--kv-heads"), ("head_dim", "--head-dim"),
        ("head_dim_v", "--head-dim-v")) if getattr(args, key) is not None) or "heads"


def with_flags(job: Job | None, args: Any) -> Job:
    """``job`` (None: defaults) with the command-line flags applied; ValueError naming the
    flag on a bad value or a missing one."""
    if job is None:
        if args.heads is None:
            raise ValueError("--heads is required without --config (the model's query heads "
                             "per tensor-parallel rank)")
        try:
            shape = AttnShape(n_heads=args.heads, n_kv_heads=args.kv_heads or args.heads,
                              head_dim=128)
        except ValueError as e:
            raise ValueError(f"{_head_flags(args)}: {e}") from None
        job = Job("command line", 1, CPConfig(),
                  tuple(layer_types([(AttnMask(), 1)], "p2p")), shape)
    cp = job.cp if args.cp is None else _int(args.cp, "--cp")
    if cp > MAX_CP_SIZE:   # before any plan: the message names the flag
        raise ValueError(f"--cp must be at most {MAX_CP_SIZE} (a plan's rank-pair tables "
                         f"grow with cp**2), got {cp}")
    options = {k: getattr(args, k) for k in OPTION_FLAGS if getattr(args, k) is not None}
    config = job.config
    if options:
        if "layout" in options and options["layout"] != config.layout:
            # the other layout's options do not apply to the new one
            for key in ("min_chunk_tokens", "tile_tokens", "pad_multiple"):
                options.setdefault(key, None)
        if "strategy" in options and "a2a_size" not in options:
            options["a2a_size"] = None
        if "strategy" in options and "overlap_stages" not in options:
            options["overlap_stages"] = None
        try:
            config = dataclasses.replace(config, **options)
        except ValueError as e:
            raise ValueError(f"--{str(e).split(' ', 1)[0].replace('_', '-')}: {e}") from None
    layers = job.layers
    if args.mask:
        masks = [parse_mask(m) for m in args.mask]
        strategy = config.strategy if isinstance(config.strategy, str) else layers[0].strategy
        layers = tuple(layer_types(masks, strategy, config.a2a_size))
    if "strategy" in options or "a2a_size" in options:
        layers = tuple(dataclasses.replace(t, strategy=config.strategy,
                                           a2a_size=config.a2a_size) for t in layers)
    shape = job.shape
    changes = {k: v for k, v in (("n_heads", args.heads), ("n_kv_heads", args.kv_heads),
                                 ("head_dim", args.head_dim), ("head_dim_v", args.head_dim_v))
               if v is not None}
    if args.heads is not None and args.kv_heads is None and job.source == "command line":
        changes["n_kv_heads"] = args.heads
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
        changes["dtype"] = DTYPES[args.dtype]
    if changes:
        try:
            shape = dataclasses.replace(shape, **changes)
        except ValueError as e:
            raise ValueError(f"{_head_flags(args)}: {e}") from None
    for key, dim in (("head_dim", shape.head_dim), ("head_dim_v", shape.value_dim)):
        if dim > MAX_HEAD_DIM:   # as the kernels refuse it (kernels.validation)
            where = ("--" + key.replace("_", "-") if key in changes
                     else f"{job.source}: the model's {key}")
            raise ValueError(f"{where} must be at most {MAX_HEAD_DIM} (the kernels' limit), "
                             f"got {dim}")
    seq_len = job.seq_len if args.seq_len is None else _int(args.seq_len, "--seq-len")
    changed = job.source != "command line" and (options or args.mask or changes or args.cp)
    return Job(f"{job.source} with command-line changes" if changed else job.source, cp,
               config, layers, shape, seq_len, job.rows, job.unchecked, job.tp)
