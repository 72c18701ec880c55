"""The package as a user installs it: a wheel built from the source tree, installed into a
fresh virtualenv outside the tree, imported, its console script run, one CP call made.

The virtualenv gets the wheel with ``--no-deps`` first, then a ``.pth`` line that appends this
interpreter's site-packages (torch, triton, the frameworks) so that no multi-GB install is
needed. A plain path line in a ``.pth`` is only appended to ``sys.path``; the ``.pth`` files
inside that folder (this checkout's editable-install hook among them) are not run, and the
venv's own site-packages comes first, so ``varlen_cp`` can only come from the wheel: the
smoke script also asserts every module's ``__file__`` lies in the venv.

Also checked: the wheel holds exactly the source tree's modules (a new subpackage cannot be
left out again), its metadata declares the bounds CI's oldest stack pins, and the console
script starts. Cost: 23 s of CPU time in all (the module imports and the 2-rank call are
most of it); 75-93 s of wall time on this machine's 2 cores shared at load average 6-8.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

# slow: builds the wheel and a fresh virtualenv (~30 s on 2 cores)
pytestmark = pytest.mark.slow
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# import package -> its folder in the source tree (setup.py's PACKAGE_DIRS)
SOURCE_ROOTS = {"varlen_cp": ROOT / "plugin", "varlen_cp/kernels": ROOT / "kernels"}
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "plugin", "kernels"]
TIMEOUT_S = 300


def _run(cmd: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, **kw)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the build inputs (a stale build/ in the checkout
    cannot leak files into it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in BUILD_INPUTS:
        if not (ROOT / name).exists():
            continue
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    # no build isolation: setuptools comes from this environment, nothing is downloaded
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-q", "-w", tmp / "dist", src], cwd=tmp)
    (built,) = (tmp / "dist").glob("varlen_cp-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(python, site-packages) of a fresh virtualenv outside the tree holding the wheel."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    python = env_dir / "bin" / "python"
    # this environment's pip, installing into the new one; --no-deps: nothing else arrives
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
          "--no-index", "--disable-pip-version-check", "-q", wheel], cwd=tmp)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).stdout.strip())
    # after the install (pip must not see this checkout's varlen-cp while installing). Every
    # site-packages this interpreter reads: its own, and the shared stack's that the oldest
    # stack's venv adds with site.addsitedir (scripts/setup_oldest_env.sh).
    deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site / "zz_main_env.pth").write_text("".join(f"{p}\n" for p in deps))
    return python, site


def _wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if n.endswith(".py")}


def _source_modules() -> set[str]:
    """Every .py file of the source tree, named where the wheel must put it."""
    out = set()
    for package, folder in SOURCE_ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if package == "varlen_cp" and rel.parts[0] == "kernels":
                continue
            out.add(f"{package}/{rel.as_posix()}")
    return out


def test_wheel_holds_every_source_module(wheel):
    got, want = _wheel_modules(wheel), _source_modules()
    assert not want - got, f"missing from the wheel: {sorted(want - got)}"
    assert not got - want, f"in the wheel but not in plugin/ or kernels/: {sorted(got - want)}"


def _requirement_floor(requirements: list[str], name: str) -> str:
    for req in requirements:
        m = re.fullmatch(rf"{name}\s*>=\s*([\w.]+)\s*(;.*)?", req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"no '{name}>=' bound in {requirements}")


def test_metadata_floors_are_the_oldest_stack_ci_tests(wheel):
    """The wheel's declared lower bounds equal scripts/oldest-stack.txt's pins, which CI's
    oldest-stack job installs: a bound can't move without the tested stack moving too."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(name).decode())
    base = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    lines = (raw.split("#")[0].strip() for raw in (ROOT / "scripts/oldest-stack.txt").open())
    pins = dict(line.split("==") for line in lines if line)
    assert set(pins) == {"torch", "triton", "numpy"}, pins
    for name, pin in pins.items():
        # the floor's own minor series (its newest patch, as CI installs it)
        floor = Version(_requirement_floor(base, name))
        assert Version(pin) >= floor and Version(pin).release[:2] == floor.release[:2], \
            (name, pin, base)
    assert meta["Requires-Python"] == ">=3.11", meta["Requires-Python"]
    assert meta["Name"] == "varlen-cp"


def test_every_module_imports_from_the_installed_wheel(venv, tmp_path):
    python, site = venv
    smoke = shutil.copy(ROOT / "tests" / "wheel_smoke.py", tmp_path / "wheel_smoke.py")
    proc = _run([python, smoke, "imports", site], cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for m in _source_modules()}
    assert set(result["imported"]) | set(result["skipped"]) == want
    for name in result["skipped"]:  # only where the framework is absent from this environment
        framework = "torchtitan" if ".torchtitan" in name else "megatron"
        assert importlib.util.find_spec(framework) is None, name
    assert "varlen_cp.tables" in result["imported"]


def test_console_script_runs_from_the_wheel(venv, tmp_path):
    python, _ = venv
    script = python.parent / "varlen-cp-train"
    assert str(python.parent) in script.read_text().splitlines()[0]  # the venv's python
    proc = _run([script, "--help"], cwd=tmp_path)
    assert "varlen-cp-train" in proc.stdout and "--config" in proc.stdout, proc.stdout


def test_cp_call_from_the_installed_wheel(venv, tmp_path):
    python, _ = venv
    smoke = shutil.copy(ROOT / "tests" / "wheel_smoke.py", tmp_path / "wheel_smoke.py")
    proc = _run([python, smoke, "cp", tmp_path], cwd=tmp_path)
    print(proc.stdout)
    assert proc.stdout.count("cp ok rank") == 2, proc.stdout + proc.stderr
