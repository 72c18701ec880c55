"""TOML launcher config: parsing, every error path, CLI overrides, mapping onto torchtitan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from varlen_cp.integrations.torchtitan.config import (ConfigError, load_config,  # noqa: E402
                                                      parse_cli)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def build(tmp_path: Path, text: str, *cli: str):
    return load_config(["--config", write(tmp_path, text), *cli], cpu=True)


def expect_error(tmp_path: Path, text: str, *cli: str, match: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        build(tmp_path, text, *cli)
    msg = str(info.value)
    for m in match:
        assert m in msg, f"{m!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------- error paths
def test_unknown_section_names_it_and_the_file(tmp_path):
    expect_error(tmp_path, "[trainng]\nsteps = 3\n", match=["[trainng]", "job.toml"])


def test_unknown_key_names_it_and_the_file(tmp_path):
    msg = expect_error(tmp_path, "[training]\nstepz = 3\n",
                       match=["'stepz'", "[training]", "job.toml"])
    assert "steps" in msg  # the known keys are listed


def test_wrong_type_names_key_type_and_file(tmp_path):
    expect_error(tmp_path, '[training]\nsteps = "ten"\n',
                 match=["training.steps", "int", "'ten'", "job.toml"])


def test_bool_is_not_an_int(tmp_path):
    expect_error(tmp_path, "[training]\nsteps = true\n", match=["training.steps", "int"])


def test_literal_value_out_of_range(tmp_path):
    expect_error(tmp_path, '[varlen_cp]\nstrategy = "ring"\n',
                 match=["varlen_cp.strategy", "'p2p'", "'ring'", "job.toml"])


def test_nested_unknown_key_in_model(tmp_path):
    expect_error(tmp_path, "[model]\nn_layer = 2\n", match=["'n_layer'", "[model]"])


def test_model_invariant_violation_names_section_and_file(tmp_path):
    expect_error(tmp_path, "[model]\nn_heads = 6\nn_kv_heads = 4\n",
                 match=["[model]", "job.toml", "n_kv_heads"])


def test_value_given_to_a_section(tmp_path):
    expect_error(tmp_path, "[training]\nsteps = 3\n", "--training", "5",
                 match=["--training must be --section.key"])


def test_top_level_key_outside_section(tmp_path):
    expect_error(tmp_path, "steps = 3\n", match=["'steps'", "section", "job.toml"])


def test_invalid_toml_syntax_names_file(tmp_path):
    expect_error(tmp_path, "[training\nsteps = 3\n", match=["job.toml", "not valid TOML"])


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--config", "/nonexistent/job.toml"], cpu=True)


def test_cli_unknown_key_names_command_line(tmp_path):
    expect_error(tmp_path, "", "--training.stepz", "3",
                 match=["'stepz'", "command line"])


def test_cli_unknown_section(tmp_path):
    expect_error(tmp_path, "", "--foo.bar", "3", match=["[foo]", "command line"])


def test_cli_wrong_type(tmp_path):
    expect_error(tmp_path, "", "--training.steps", "many",
                 match=["--training.steps (command line)", "int"])


def test_cli_positional_argument_rejected():
    with pytest.raises(ConfigError, match="unexpected command-line argument"):
        parse_cli(["job.toml"])


def test_cp_without_varlen_cp_enabled(tmp_path):
    expect_error(tmp_path, "[parallelism]\ncontext_parallel_degree = 2\n"
                 "[varlen_cp]\nenable = false\n", match=["enable = true", "job.toml"])


def test_cp_needs_spmd_types_backend(tmp_path):
    expect_error(tmp_path, "[parallelism]\ncontext_parallel_degree = 2\n"
                 'spmd_backend = "full_dtensor"\n', match=["spmd_types"])


def test_seq_len_must_fit_the_model(tmp_path):
    expect_error(tmp_path, "[model]\nmax_seq_len = 512\n[training]\nseq_len = 1024\n",
                 match=["training.seq_len", "max_seq_len"])


def test_alphabet_larger_than_vocab(tmp_path):
    expect_error(tmp_path, "[model]\nvocab_size = 128\n[dataloader]\nalphabet = 256\n",
                 match=["dataloader.alphabet", "vocab_size"])


def test_optimizer_unknown_key_and_bad_name(tmp_path):
    expect_error(tmp_path, "[optimizer]\nmomentum = 0.9\n", match=["'momentum'", "[optimizer]"])
    expect_error(tmp_path, '[optimizer]\nname = "SGD"\n', match=["optimizer.name", "'SGD'"])


def test_job_unknown_key(tmp_path):
    expect_error(tmp_path, '[job]\nfolder = "x"\n', match=["'folder'", "[job]"])


def test_activation_checkpoint_keys_need_a_mode(tmp_path):
    expect_error(tmp_path, '[activation_checkpoint]\npreserve_rng_state = false\n',
                 match=["mode"])
    expect_error(tmp_path, '[activation_checkpoint]\nmode = "sometimes"\n',
                 match=["activation_checkpoint.mode"])


def test_dataloader_post_init_checks(tmp_path):
    expect_error(tmp_path, "[dataloader]\nnoise = 2.0\n", match=["[dataloader]", "noise"])


# ---------------------------------------------------------------- mapping and overrides
def test_sections_map_onto_trainer_config(tmp_path):
    cfg = build(tmp_path, """
[job]
dump_folder = "/tmp/x"
description = "demo"
[training]
steps = 7
seq_len = 512
max_norm = 2          # int accepted for float | int
[parallelism]
context_parallel_degree = 2
[optimizer]
lr = 1e-3
beta2 = 0.99
[lr_scheduler]
warmup_steps = 1
[metrics]
log_freq = 3
[activation_checkpoint]
mode = "full"
[model]
n_layers = 2
dim = 64
n_heads = 4
n_kv_heads = 1
max_seq_len = 512
[varlen_cp]
strategy = "all_gather"
layout = "te"
""")
    from torchtitan.distributed.activation_checkpoint import FullAC

    assert cfg.dump_folder == "/tmp/x"
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.max_norm) == (7, 512, 2)
    assert cfg.parallelism.context_parallel_degree == 2
    group = cfg.optimizer.param_groups[0]
    assert group.optimizer_kwargs["lr"] == 1e-3 and group.optimizer_kwargs["betas"] == (0.9, 0.99)
    assert cfg.lr_scheduler.warmup_steps == 1 and cfg.metrics.log_freq == 3
    assert isinstance(cfg.activation_checkpoint, FullAC.Config)
    assert cfg.varlen_cp.strategy == "all_gather" and cfg.varlen_cp.layout == "te"
    layers = cfg.model_spec.model.layers
    assert len(layers) == 2 and layers[0].attention.inner_attention.options.strategy == "all_gather"
    # CPU mode defaults: fp32 parameters
    assert cfg.training.mixed_precision_param == "float32"


def test_cli_overrides_toml(tmp_path):
    cfg = build(tmp_path, "[training]\nsteps = 7\n[varlen_cp]\nstrategy = \"p2p\"\n",
                "--training.steps", "9", "--varlen_cp.strategy=all_gather",
                "--model.use_qk_norm", "--optimizer.lr", "0.01")
    assert cfg.training.steps == 9
    assert cfg.varlen_cp.strategy == "all_gather"
    assert cfg.model.use_qk_norm is True
    assert cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] == 0.01


def test_cli_list_and_none_values(tmp_path):
    cfg = build(tmp_path, "", "--compile.components", "model,loss",
                "--debug.seed", "none", "--lr_scheduler.decay_ratio", "0.5")
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.debug.seed is None and cfg.lr_scheduler.decay_ratio == 0.5


def test_override_section_uses_torchtitans_parser(tmp_path):
    target = "varlen_cp.integrations.torchtitan.stock.fp32_experts"
    cfg = build(tmp_path, f'[override]\nimports = ["{target}"]\n')
    assert cfg.override.imports == [target]
    cfg = build(tmp_path, "", "--override.imports", f"{target},{target}2")
    assert cfg.override.imports == [target, f"{target}2"]


def test_hf_dataset_selects_torchtitan_dataloader(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    cfg = build(tmp_path, '[job]\nhf_assets_path = "assets/tok"\n'
                '[dataloader]\ndataset = "c4_test"\n')
    assert isinstance(cfg.dataloader, HuggingFaceTextDataLoader.Config)
    assert cfg.dataloader.dataset == "c4_test"
    assert isinstance(cfg.tokenizer, HuggingFaceTokenizer.Config)
    assert cfg.hf_assets_path == "assets/tok"


@pytest.mark.parametrize("name", ["llama4_debug_cp2.toml", "llama4_scout_style_cp8.toml",
                                  "swa_debug_cp2.toml"])
def test_shipped_configs_load(name):
    cfg = load_config(["--config", str(REPO / "configs" / name)], cpu=True)
    assert cfg.model_spec is not None and cfg.varlen_cp.enable


def test_launcher_exits_2_with_one_line_error(tmp_path):
    path = write(tmp_path, "[training]\nstepz = 1\n")
    proc = subprocess.run([sys.executable, "-m", "varlen_cp.integrations.torchtitan.train",
                           "--config", path],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "stepz" in proc.stderr and "job.toml" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_softmax_type_and_track_max_logit_keys(tmp_path):
    expect_error(tmp_path, '[model]\nsoftmax_type = "softmax1"\n',
                 match=["model.softmax_type", "'learnable'", "'softmax1'", "job.toml"])
    expect_error(tmp_path, "[model]\ntrack_max_logit = 1\n",
                 match=["model.track_max_logit", "bool", "job.toml"])
    cfg = build(tmp_path, '[model]\nsoftmax_type = "learnable"\n', "--model.track_max_logit")
    inner = cfg.model_spec.model.layers[0].attention.inner_attention
    assert (inner.softmax_type, inner.track_max_logit) == ("learnable", True)
    assert inner.n_heads == cfg.model.n_heads


# ---------------------------------------------------------------- [varlen_cp] = CPConfig
def test_varlen_cp_section_is_cpconfig_plus_enable(tmp_path):
    from dataclasses import fields

    from varlen_cp import AttnOptions
    from varlen_cp.config import CPConfig
    from varlen_cp.integrations.torchtitan.options import VarlenCPSection

    assert issubclass(VarlenCPSection, CPConfig)
    assert [f.name for f in fields(VarlenCPSection)] == \
        [f.name for f in fields(CPConfig)] + ["enable"]
    cfg = build(tmp_path, '[varlen_cp]\nstrategy = "a2a+p2p"\na2a_size = 1\n'
                'layout = "balanced"\ntile_tokens = 128\nprefetch = false\nvalidate = false\n')
    vc = cfg.varlen_cp
    assert (vc.strategy, vc.a2a_size, vc.layout, vc.tile_tokens, vc.prefetch, vc.validate) \
        == ("a2a+p2p", 1, "balanced", 128, False, False)
    inner = cfg.model_spec.model.layers[0].attention.inner_attention
    assert inner.options == vc.attn_options == AttnOptions(strategy="a2a+p2p", a2a_size=1,
                                                           validate=False)
    # CPConfig's own cross-field checks, named with the section
    expect_error(tmp_path, "[varlen_cp]\nlayout = \"dual_chunk\"\ntile_tokens = 128\n",
                 match=["[varlen_cp]", "job.toml", "varlen_cp.tile_tokens", "balanced"])
    expect_error(tmp_path, "[varlen_cp]\nlayout = \"dual_chunk\"\nmin_chunk_tokens = 0\n",
                 match=["varlen_cp.min_chunk_tokens", ">= 1"])
    # an option of another layout is refused, not ignored (the default layout: balanced)
    expect_error(tmp_path, "[varlen_cp]\nmin_chunk_tokens = 64\n",
                 match=["varlen_cp.min_chunk_tokens applies to layout 'dual_chunk' only",
                        "layout='balanced'"])
    # the strategy's head rule, with the model's heads, before anything is built
    expect_error(tmp_path, "[varlen_cp]\nstrategy = \"a2a\"\n",
                 "--parallelism.context_parallel_degree", "3",
                 match=["job.toml", "varlen_cp.strategy 'a2a'", "Hq=8 must be divisible by 3"])
    expect_error(tmp_path, "[varlen_cp]\nprefetch = 1\n",
                 match=["varlen_cp.prefetch", "bool", "job.toml"])


# ---------------------------------------------------------------- torchtitan's own models
STOCK = "[model]\nname = \"{name}\"\n{extra}[training]\nseq_len = 512\n"


def test_stock_model_selection(tmp_path):
    from torchtitan.models.common.attention import VarlenAttention

    cfg = build(tmp_path, STOCK.format(name="gpt_oss", extra=""),
                "--parallelism.context_parallel_degree", "2")
    assert (cfg.model_spec.name, cfg.model_spec.flavor) == ("gpt_oss", "debugmodel")
    assert cfg.model.flavor == "debugmodel"
    # built with varlen attention: its windows are the layers' masks; the trainer swaps it
    inner = [layer.attention.inner_attention for layer in cfg.model_spec.model.layers]
    assert all(isinstance(i, VarlenAttention.Config) for i in inner)
    assert [i.window_size for i in inner] == [(127, 0), (-1, 0)] * 2
    assert cfg.tokenizer.vocab_size == 2048 and cfg.loss.global_vocab_size == 2048
    cfg = build(tmp_path, STOCK.format(name="llama3", extra='flavor = "debugmodel"\n'),
                "--varlen_cp.strategy", "a2a", "--parallelism.context_parallel_degree", "2")
    assert cfg.model_spec.name == "llama3"


def test_stock_model_errors(tmp_path):
    expect_error(tmp_path, STOCK.format(name="llama3", extra="dim = 64\n"),
                 match=["[model] dim in", "job.toml", "llama4_style", "model.flavor"])
    expect_error(tmp_path, STOCK.format(name="llama3", extra='flavor = "tiny"\n'),
                 match=["model.flavor 'tiny'", "llama3", "debugmodel", "8B"])
    expect_error(tmp_path, '[model]\nflavor = "debugmodel"\n',
                 match=["[model]", "model.flavor applies to torchtitan's models"])
    expect_error(tmp_path, '[model]\nname = "llama2"\n',
                 match=["[model]", "model.name", "'llama2'", "'qwen3'"])
    expect_error(tmp_path, STOCK.format(name="qwen3_5", extra=""),
                 match=["job.toml", "'qwen3_5' is not supported", "DeltaNet"])
    expect_error(tmp_path, STOCK.format(name="kimi_k2_7", extra=""),
                 "--parallelism.context_parallel_degree", "2",
                 match=["'kimi_k2_7'", "vision", "context_parallel_degree = 1"])
    expect_error(tmp_path, STOCK.format(name="qwen3", extra="").replace("512", "8192"),
                 match=["training.seq_len (8192)", "max_seq_len (4096)"])


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gpt_oss", "deepseek_v3"])
def test_stock_configs_load(name):
    cfg = load_config(["--config", str(REPO / "configs" / f"{name}_debug_cp2.toml")], cpu=True)
    assert cfg.model_spec.name == name and cfg.varlen_cp.enable
    assert cfg.parallelism.context_parallel_degree == 2


# ---------------------------------------------------------------- launcher
HIDE_TORCHTITAN = """
import importlib.abc, runpy, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torchtitan":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = ["train", "--config", "job.toml"]
runpy.run_module("%s", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["varlen_cp.integrations.torchtitan.train"])
def test_launcher_without_torchtitan_names_the_extra(tmp_path, module):
    proc = subprocess.run([sys.executable, "-c", HIDE_TORCHTITAN % module],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert 'pip install "varlen-cp[torchtitan]"' in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # a launcher process (test_launcher_exits_2_with_one_line_error stays)
def test_new_launcher_path_exits_2_with_one_line_error(tmp_path):
    path = write(tmp_path, "[training]\nstepz = 1\n")
    proc = subprocess.run([sys.executable, "-m", "varlen_cp.integrations.torchtitan.train",
                           "--config", path], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert "stepz" in proc.stderr and "job.toml" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_and_test_extra():
    """``varlen-cp-train`` and ``varlen-cp-plan`` point at their entry points; numpy is a
    dependency of the package itself (torch warns without it, Triton's CPU interpreter
    imports it)."""
    import importlib

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for script in ("varlen-cp-train", "varlen-cp-plan"):
        module, func = project["scripts"][script].split(":")
        assert callable(getattr(importlib.import_module(module), func))
    assert any(req.startswith("numpy") for req in project["dependencies"])


def test_enable_false_runs_at_cp1(tmp_path):
    """[varlen_cp] enable = false: CP is refused, cp=1 loads (the Llama 4 style model keeps
    varlen-cp's attention; torchtitan's models keep torchtitan's)."""
    cfg = build(tmp_path, "[varlen_cp]\nenable = false\n")
    assert not cfg.varlen_cp.enable and cfg.parallelism.context_parallel_degree == 1
