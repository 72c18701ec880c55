"""The documentation names only what exists, and the README's usage example runs.

Checked over README.md, docs/*.md and integration_tests/README.md, against names read from
the code at test time (no list of option names lives here):

- links: every relative link resolves to a file inside the repository, and a ``#anchor``
  names a heading of its target (GitHub's heading slugs);
- options: every ``CPConfig`` field (and the fields of any dataclass it composes) is named
  in a code span; every keyword a code span or a python block gives a varlen_cp class or
  function (``CPConfig(...)``, ``CPPlan.build(...)``, ...; megatron's ``TransformerConfig``
  and ``GPTModel`` too) is in its signature (bare names too where the signature is
  keyword-only); every ``varlen_cp.x.y`` resolves; every repository path and test file
  named exists;
- job-file keys: ``[section] key`` spans, ``section.key`` spans, ``--section.key`` flags and
  the keys of every TOML block exist in the torchtitan launcher's sections (parsed from its
  ``--help``) or in megatron's job-file sections (``megatron.config.section_keys``);
- command-line flags: in a command of one of our CLIs (varlen-cp-plan, varlen-cp-train and
  the torchtitan launcher, the megatron entry point, the loss curve, bench scripts, the
  integration suite, torchrun in front of them) every flag is one that CLI parses (argparse
  parsers, read from the parser or the source); a flag named on its own is one of them.

``test_checker_reports_each_kind_of_mistake`` feeds the checker a page with one mistake of
each kind, so every check above is known to fail when it should. The README before issue
23 fails it (a ``chunk_tokens`` field of ``CPConfig``, a link to ``../shared/DESIGN.md``).
~15 s on 2 cores (the launcher's ``--help`` in a subprocess, megatron's import, the example
on 2 ranks).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.reference import assert_close_to_reference, reference_attn

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "integration_tests" / "README.md",
         *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PATH_ROOTS = ("plugin", "kernels", "bench", "tests", "configs", "scripts", "docs",
              "integration_tests", ".ci", "varlen_cp")
PLACEHOLDER = re.compile(r"[<>*$]|\.\.\.|\b[A-Z]{2,}\b|\bsection\.key\b")
# Flags of other tools that the docs explain in prose (their parsers are not ours to read).
OTHER_TOOLS = {"sbatch": {"--nodes", "--partition", "--account", "--time", "--gpus-per-node"},
               "py-spy": {"--pid", "--native"}}
FILE_SUFFIX = re.compile(r"\.(py|md|toml|json|jsonl|png|sh|txt|sbatch)$")


# ------------------------------------------------------------------ what the code defines
@functools.cache
def torchtitan_keys() -> dict[str, set[str]]:
    """The launcher's sections and keys, as its ``--help`` prints them."""
    pytest.importorskip("torchtitan")
    out = subprocess.run([sys.executable, "-m", "varlen_cp.integrations.torchtitan.train",
                          "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    keys: dict[str, set[str]] = {}
    section = None
    for line in out.stdout.splitlines():
        if m := re.fullmatch(r"\[([\w.]+)\]", line):
            section = keys.setdefault(m[1], set())
        elif section is not None and (m := re.match(r"  (\w+) = ", line)):
            section.add(m[1])
    assert "varlen_cp" in keys and "parallelism" in keys, out.stdout[:2000]
    return keys


@functools.cache
def megatron_keys() -> dict[str, set[str]]:
    pytest.importorskip("megatron.core")
    from varlen_cp.integrations.megatron.config import SECTIONS, section_keys

    keys = section_keys()
    assert set(keys) == set(SECTIONS)
    return keys


def toml_keys() -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for source in (torchtitan_keys(), megatron_keys()):
        for section, names in source.items():
            merged.setdefault(section, set()).update(names)
    return merged


def _argparse_flags(source: Path) -> set[str]:
    """Option strings of every ``add_argument`` call in a script (read with ``ast``)."""
    flags = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.startswith("-")}
    return flags | {"-h", "--help"}


@functools.cache
def cli_flags() -> dict[str, set[str]]:
    """Flags per program, from the parsers themselves."""
    from torch.distributed.run import get_args_parser

    from varlen_cp.cli.plan import build_parser
    from varlen_cp.integrations.torchtitan.train import NPROC_FLAGS

    def parser_flags(parser) -> set[str]:
        return {s for a in parser._actions for s in a.option_strings}

    flags = {"varlen-cp-plan": parser_flags(build_parser()),
             "torchrun": parser_flags(get_args_parser()),
             "launcher": {"--config", "--help", "-h", *NPROC_FLAGS}}
    for name, path in (("megatron", "plugin/integrations/megatron/train.py"),
                       ("loss_curve", "plugin/cli/loss_curve.py"),
                       ("integration_tests.run", "integration_tests/run.py")):
        flags[name] = _argparse_flags(REPO / path)
    for script in (REPO / "bench").glob("*.py"):
        flags[f"bench/{script.name}"] = _argparse_flags(script)
    for script in (REPO / "bench").glob("*.sh"):  # shell wrappers that pass "$@" on
        if m := re.search(r"(bench/\w+\.py)\"? \"\$@\"", script.read_text()):
            flags[f"bench/{script.name}"] = flags[m[1]]
    return flags


MODULE_PROGRAMS = {"varlen_cp.cli.plan": "varlen-cp-plan",
                   "varlen_cp.integrations.torchtitan.train": "launcher",
                   "varlen_cp.integrations.megatron.train": "megatron",
                   "varlen_cp.cli.loss_curve": "loss_curve",
                   "integration_tests.run": "integration_tests.run",
                   "torch.distributed.run": "torchrun"}
COMMAND_PROGRAMS = {"varlen-cp-plan": "varlen-cp-plan", "varlen-cp-train": "launcher",
                    "torchrun": "torchrun", "scripts/run_demo.sh": "launcher"}


@functools.cache
def namespace() -> dict[str, object]:
    """varlen_cp's public classes and functions by name (plus megatron's two the docs
    configure), for resolving ``Name(...)`` in the docs."""
    modules = ["varlen_cp", "varlen_cp.kernels", "varlen_cp.config", "varlen_cp.prefetch",
               "varlen_cp.report", "varlen_cp.sharding", "varlen_cp.plan",
               "varlen_cp.tables.auto", "varlen_cp.integrations.torchtitan.options",
               "varlen_cp.integrations.megatron"]
    ns: dict[str, object] = {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for key in dir(mod):
            obj = getattr(mod, key)
            if (not key.startswith("_") and (inspect.isclass(obj) or callable(obj))
                    and getattr(obj, "__module__", "").startswith("varlen_cp")):
                ns[key] = obj
    try:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
        ns.update(GPTModel=GPTModel, TransformerConfig=TransformerConfig)
    except ImportError:
        pass
    return ns


_MISSING = object()


@functools.cache
def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def framework_importable(dotted: str) -> bool:
    """Whether the adapter module behind ``dotted`` can be imported here. torchtitan must
    be switched to the CPU before its trainer is imported (as the launcher does, and the
    in-process torchtitan tests after this one expect)."""
    if ".integrations.megatron" in dotted:
        return _installed("megatron.core")
    if ".integrations.torchtitan" in dotted and not dotted.endswith(".options"):
        if not _installed("torchtitan.tools.utils"):
            return False
        from varlen_cp.integrations.torchtitan import cpu_mode

        if not cpu_mode.cuda_available():
            try:
                cpu_mode.enable_cpu_mode()
            except RuntimeError:  # an earlier test of this process imported torchtitan:
                pass              # resolving names does not need its device
    return True


def resolve(dotted: str) -> object:
    """The object a dotted name in the docs means; None when it is not ours to check,
    _MISSING when it is ours (varlen_cp.*, or a known name) and does not exist."""
    parts = dotted.split(".")
    if parts[0] == "varlen_cp":
        if not framework_importable(dotted):
            return None
        obj, i = importlib.import_module("varlen_cp"), 1
        for i in range(1, len(parts) + 1):  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                i -= 1
                break
        rest = parts[i:]
    elif parts[0] in namespace():
        obj, rest = namespace()[parts[0]], parts[1:]
    else:
        return None
    for attr in rest:
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) \
            else set()
        if attr in fields:
            return True  # a dataclass field without a class-level default
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def config_fields() -> set[str]:
    """CPConfig's fields, and those of every dataclass it composes."""
    from varlen_cp.config import CPConfig

    names, todo = set(), [CPConfig]
    while todo:
        cls = todo.pop()
        hints = inspect.get_annotations(cls, eval_str=False)
        for f in dataclasses.fields(cls):
            names.add(f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                todo.append(type(default))
            elif isinstance(hints.get(f.name), type) and dataclasses.is_dataclass(hints[f.name]):
                todo.append(hints[f.name])
    return names


# ------------------------------------------------------------------ reading a page
def split_page(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(prose with code blocks blanked out, [(language, block), ...])."""
    blocks = [(m[1], m[2]) for m in FENCE.finditer(text)]
    return FENCE.sub(lambda m: "\n" * m[0].count("\n"), text), blocks


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_page(text)
    return {slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", prose, re.M)}


def call_arguments(text: str, start: int) -> tuple[str, int]:
    """The text inside the parentheses that open at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], i
    return text[start + 1:], len(text)


def top_level_pieces(args: str) -> list[str]:
    pieces, depth, cur = [], 0, ""
    for ch in args:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            pieces.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return pieces + ([cur.strip()] if cur.strip() else [])


def check_signature(name: str, obj: object, names: list[str], bare: list[str],
                    signature_style: bool) -> list[str]:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    kw_only = all(p.kind is p.KEYWORD_ONLY for p in params.values())
    wrong = [n for n in names if n not in params]
    if kw_only or signature_style:
        wrong += [n for n in bare if n not in params]
    return [f"{name}(...) has no parameter {n!r}" for n in wrong]


def check_span_calls(span: str) -> list[str]:
    problems = []
    for m in re.finditer(r"([A-Za-z_][\w.]*)\(", span):
        obj = resolve(m[1])
        if obj is _MISSING:
            problems.append(f"{m[1]} does not exist")
        if obj in (None, _MISSING, True):
            continue
        pieces = top_level_pieces(call_arguments(span, m.end() - 1)[0])
        style = any(p == "*" or re.fullmatch(r"\w+=", p) for p in pieces)
        names = [p.split("=")[0].strip() for p in pieces if re.match(r"\w+\s*=", p)]
        bare = [p for p in pieces if re.fullmatch(r"[a-z_]\w*", p)]
        problems += check_signature(m[1], obj, names, bare, style)
    return problems


def check_python(block: str) -> list[str]:
    try:
        tree = ast.parse(block)
    except SyntaxError as e:
        return [f"python block does not parse: {e}"]
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = ast.unparse(node.func)
        obj = resolve(dotted) if re.fullmatch(r"[\w.]+", dotted) else None
        if obj is _MISSING:
            problems.append(f"{dotted} does not exist")
        if obj in (None, _MISSING, True):
            continue
        bare = [a.id for a in node.args if isinstance(a, ast.Name)]
        names = [k.arg for k in node.keywords if k.arg is not None]
        kw_only_bare = bare if all(
            p.kind is p.KEYWORD_ONLY for p in _params(obj)) else []
        problems += check_signature(dotted, obj, names, kw_only_bare, False)
    return problems


def _params(obj: object) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return []


def check_key(section: str, key: str, where: str) -> list[str]:
    if section == "section" or key == "key":  # the placeholders [section] key, --varlen_cp.key
        return []
    keys = toml_keys()
    if section not in keys:
        return [f"{where}: no job-file section [{section}]"]
    if key not in keys[section]:
        return [f"{where}: [{section}] has no key {key!r}"]
    return []


def check_command(tokens: list[str], where: str) -> list[str]:
    """Flags of one command line, if it runs one of our CLIs."""
    flags, problems, program, i = cli_flags(), [], None, 0
    tokens = [t.strip("[]") for t in tokens]
    while i < len(tokens) and re.fullmatch(r"\w+=.*", tokens[i]):
        i += 1  # environment assignments
    for j in range(i, len(tokens)):
        tok = tokens[j]
        if tok == "-m" and j + 1 < len(tokens):  # python -m / torchrun ... -m MODULE
            program = MODULE_PROGRAMS.get(tokens[j + 1], "other")
            continue
        if program is None:
            if tok in COMMAND_PROGRAMS and "/" not in tok:
                program = COMMAND_PROGRAMS[tok]
            elif tok in ("bash", "python", "python3") or "PYTHON" in tok:
                continue
            elif re.fullmatch(r"(bench|scripts)/\w+\.(py|sh)", tok):
                if not (REPO / tok).exists():
                    return [f"{where}: {tok} does not exist"]
                program = COMMAND_PROGRAMS.get(tok, tok)
            else:
                return problems
            continue
        if not tok.startswith("-") or program == "other" or PLACEHOLDER.search(tok):
            continue
        flag = tok.split("=", 1)[0]
        if "." in flag and program == "launcher":
            problems += check_key(*flag[2:].split(".", 1)[:2], where=f"{where}: {flag}")
        elif program in flags and flag not in flags[program]:
            problems.append(f"{where}: {program} has no flag {flag}")
    return problems


def commands(block: str) -> list[list[str]]:
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            out.append(shlex.split(line, comments=True))
        except ValueError:
            out.append(line.split())
    return out


def check_links(path: Path, text: str, prose: str, rel: object) -> list[str]:
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"\w+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:  # a heading of this page
            if anchor not in anchors(text):
                problems.append(f"{rel}: link {target}: no such heading on this page")
            continue
        dest = (path.parent / file_part).resolve()
        if not dest.is_relative_to(REPO) or not dest.exists():
            problems.append(f"{rel}: link {target} does not resolve inside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{rel}: link {target}: no heading #{anchor} in {dest.name}")
    return problems


def check_span(span: str, where: str) -> list[str]:
    """One inline code span: calls, job-file keys, flags, commands, paths."""
    problems = [f"{where}: {p}" for p in check_span_calls(span)]
    dotted = re.fullmatch(r"([a-z_]+)\.([a-z_0-9]+)(\s*=.*)?", span)
    if m := re.match(r"\[(\w+)\]\s+(\w+)\b", span):  # [section] key
        problems += check_key(m[1], m[2], where)
    elif dotted and dotted[1] in toml_keys() and not FILE_SUFFIX.search(span) and not (
            dotted[1] == "varlen_cp" and resolve(span.split()[0]) not in (None, _MISSING)):
        problems += check_key(dotted[1], dotted[2], where)  # section.key (not a module)
    elif re.fullmatch(r"varlen_cp(\.\w+)+", span) and resolve(span) is _MISSING:
        problems.append(f"{where}: {span} does not exist")
    if span.startswith("--"):  # a flag on its own
        flag = span.split()[0].split("=")[0]
        if "." in flag:
            problems += check_key(*flag[2:].split(".", 1)[:2], where=where)
        elif not PLACEHOLDER.search(flag) and not any(
                flag in f for f in (*cli_flags().values(), *OTHER_TOOLS.values())):
            problems.append(f"{where}: no CLI of varlen-cp (or torchrun) has {flag}")
    else:
        for tokens in commands(span):
            problems += check_command(tokens, where)
    path = re.fullmatch(r"\./?((?:%s)/[\w./-]*)" % "|".join(PATH_ROOTS), "./" + span)
    if path and not PLACEHOLDER.search(span):
        metric = path[1].startswith("varlen_cp/") and not FILE_SUFFIX.search(path[1])
        local = re.sub(r"^varlen_cp/", "plugin/", path[1])  # the package's source folder
        if not metric and not (REPO / local).exists():  # varlen_cp/plan_ms: a metric name
            problems.append(f"{where}: {path[1]} does not exist")
    elif re.fullmatch(r"test_[\w*]+\.py", span) and not list((REPO / "tests").rglob(span)):
        problems.append(f"{where}: no tests/{span}")
    return problems


def check_block(lang: str, block: str, where: str) -> list[str]:
    if lang == "python":
        return [f"{where}: {p}" for p in check_python(block)]
    if lang == "toml":
        return [p for section, table in tomllib.loads(block).items() for key in table
                for p in check_key(section, key, where)]
    if lang in ("bash", "sh", ""):
        return [p for tokens in commands(block) for p in check_command(tokens, where)]
    return []


def check_page(path: Path, text: str | None = None) -> list[str]:
    """Every problem of one page (``text`` stands in for the file's content in tests)."""
    text = path.read_text() if text is None else text
    prose, blocks = split_page(text)
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    problems = check_links(path, text, prose, rel)
    for m in SPAN.finditer(prose):
        span = m[1].replace("\n", " ")
        problems += check_span(span, f"{rel}: `{span[:60]}`")
    for lang, block in blocks:
        problems += check_block(lang, block, f"{rel}: {lang or 'text'} block")
    return problems


# ------------------------------------------------------------------ the tests
def test_every_page_names_only_what_exists():
    problems = [p for page in PAGES for p in check_page(page)]
    assert not problems, "\n".join(problems)


def test_every_config_field_is_documented():
    spans = {m[1].split(" = ")[0] for page in PAGES
             for m in SPAN.finditer(split_page(page.read_text())[0])}
    missing = sorted(config_fields() - spans)
    assert not missing, f"CPConfig fields named nowhere in README or docs/: {missing}"


def test_readme_fits_a_first_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines (the rest belongs in docs/)"
    first = "\n".join(lines[:60])
    for needed in ("pip install", "bash scripts/run_demo.sh", "bash scripts/run_tests.sh"):
        assert needed in first, f"{needed!r} is not on the README's first screen (60 lines)"


def test_checker_reports_each_kind_of_mistake():
    page = REPO / "docs" / "_example_not_committed.md"  # resolved like a page in docs/
    text = "\n".join([
        "# Title", "[dead](missing.md) [outside](../../shared/DESIGN.md) "
        "[anchor](api.md#no-such-heading) [fine](#title) [here](#no-heading-here)",
        "`CPConfig(strategy, no_such_field)` `CPPlan.build(cu, no_such_arg=1)`",
        "`varlen_cp.no_such_module` `[varlen_cp] no_such_key` `training.no_such_key`",
        "`--varlen_cp.no_such_key` `--no-such-flag` `varlen-cp-plan --no-such-plan-flag`",
        "`python -m varlen_cp.integrations.megatron.train --no-such-megatron-flag`",
        "`bench/no_such_file.py` `test_no_such_test.py` `bash scripts/no_such_script.sh`",
        "```toml", "[no_such_section]", "value = 1", "```",
        "```python", "AttnMask(causal=True, no_such_kw=1)", "```"])
    problems = "\n".join(check_page(page, text))
    for expected in ("missing.md", "../../shared/DESIGN.md", "#no-such-heading",
                     "#no-heading-here",
                     "'no_such_field'", "'no_such_arg'", "varlen_cp.no_such_module",
                     "'no_such_key'", "training] has no key", "no CLI of varlen-cp",
                     "--no-such-plan-flag", "--no-such-megatron-flag", "bench/no_such_file.py",
                     "tests/test_no_such_test.py", "scripts/no_such_script.sh",
                     "[no_such_section]", "'no_such_kw'"):
        assert expected in problems, f"{expected!r} not reported in:\n{problems}"
    assert "#title" not in problems


README_EXAMPLE_MARK = "from varlen_cp import AttnMask, AttnOptions, CPPlan, ContextParallelVarlenAttention"


def _run_readme_example(rank: int, world: int, code: str):
    import torch.distributed as dist

    dist.init_process_group = lambda *args, **kwargs: None  # the worker has joined already
    scope: dict = {}
    exec(compile(code, "README.md usage example", "exec"), scope)
    mask = scope["mask"]  # tensors go back by value (numpy): the worker exits right away
    return {"mask": (mask.causal, mask.window_size, mask.chunk_size),
            **{k: scope[k].detach().numpy() for k in ("out_global", "q", "k", "v",
                                                       "cu_seqlens")}}


def test_readme_usage_example_runs_on_two_ranks(tmp_path):
    _, blocks = split_page((REPO / "README.md").read_text())
    [code] = [b for lang, b in blocks if lang == "python" and README_EXAMPLE_MARK in b]
    results = run_distributed(_run_readme_example, 2, tmp_path, code)
    got = {k: torch.from_numpy(v) if k != "mask" else v for k, v in results[0].items()}
    assert (results[1]["out_global"] == results[0]["out_global"]).all()
    kw = dict(zip(("causal", "window_size", "chunk_size"), got["mask"]))
    cu = got["cu_seqlens"]
    ref64, _ = reference_attn(got["q"], got["k"], got["v"], cu, cu, **kw)
    plain, _ = reference_attn(got["q"], got["k"], got["v"], cu, cu, dtype=torch.float32, **kw)
    assert_close_to_reference("README example", got["out_global"], ref64, plain, factor=2.0,
                              floor=1e-5)
