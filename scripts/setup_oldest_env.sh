#!/usr/bin/env bash
# Create (once) the oldest-stack environment: varlen-cp[test] with the lower bounds of
# pyproject.toml pinned (scripts/oldest-stack.txt: torch 2.11.0, triton 3.6.0, numpy 1.26.4),
# on Python 3.12 where it exists (the lent GPU machines run 3.12), else python3. Prints the
# environment's python path on its last line.
#
#   VENV_OLDEST=/path/to/venv bash scripts/setup_oldest_env.sh   (default: .venv-oldest)
#   VARLEN_CP_CACHE=/path   where the shared stack lives (default: ~/.cache/varlen-cp)
#
# Two parts, because torch 2.11.0 only comes from the package index as its CUDA build (it
# runs on CPU): ~3.2 GB of wheels with its nvidia-* libraries, 4.7 GB installed, 2.5-6 min
# here (measured; the index's large wheels are not kept in pip's cache). So
#   - the STACK (every dependency of varlen-cp[test], resolved by pip from pyproject.toml
#     with the pins, then varlen-cp itself removed) is built once per machine under
#     $VARLEN_CP_CACHE, keyed by the pins, the dependency lines and the Python version, under
#     a lock; every clone shares it read-only;
#   - $VENV_OLDEST is this checkout's own small venv: an editable varlen-cp, and a .pth that
#     adds the stack's site-packages (seconds to create).
# Exit status 3 (and no path) when the pinned torch cannot be found at all (no network): the
# caller prints a SKIP line; every other failure is an error.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_OLDEST:-$ROOT/.venv-oldest}"
CACHE="${VARLEN_CP_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/varlen-cp}"
PINS="$ROOT/scripts/oldest-stack.txt"
cd "$ROOT"

say() { echo "setup_oldest_env: $*" >&2; }

base_python() {  # a working Python 3.12 (pyenv's shim may exist without it active), else python3
  local candidate
  for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' \
         >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  command -v python3
}

pins_match() {  # python [checkout]: torch / triton / numpy at the pinned versions, pytest
  # importable, and with a checkout, varlen_cp an editable install of it (one interpreter
  # start: importing torch takes seconds on a loaded machine)
  "$1" - "$PINS" "${2:-}" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, pathlib, sys
import hypothesis, pytest, torch  # noqa: F401
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        if md.version(name).split("+")[0] != version:
            sys.exit(1)
if sys.argv[2]:
    import varlen_cp
    sys.exit(pathlib.Path(varlen_cp.__file__).resolve().parent.parent
             != pathlib.Path(sys.argv[2]).resolve())
PY
}

checkout_complete() { pins_match "$VENV/bin/python" "$ROOT"; }

if [[ -x "$VENV/bin/python" ]] && checkout_complete; then
  echo "$VENV/bin/python"
  exit 0
fi

BASE_PYTHON="$(base_python)"
# the stack's key: what pip resolves from (the pins, the dependencies and the test extra)
# and the interpreter
key="$( { cat "$PINS"; "$BASE_PYTHON" -V; "$BASE_PYTHON" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(project["dependencies"], project["optional-dependencies"]["test"])'; } \
  | sha256sum | cut -c1-12)"
STACK="$CACHE/oldest-stack-$key"
mkdir -p "$CACHE"

build_stack() {  # under the lock; returns 3 when the pinned torch is not to be found
  pins_match "$STACK/bin/python" && [[ -f "$STACK/.complete" ]] && return 0
  say "installing the dependencies of varlen-cp[test] with" \
      "$(grep -v '^#' "$PINS" | tr '\n' ' ')on $("$BASE_PYTHON" -V) into $STACK" \
      "(minutes, once per machine)"
  rm -rf "$STACK"
  "$BASE_PYTHON" -m venv "$STACK"
  local log="$CACHE/oldest-stack-$key.log"
  # pip resolves the package's declared dependencies at the pins; then the package goes
  # (each checkout adds its own, editable). (The "is ignored" lines are pip's warnings
  # about this machine's local indexes, not errors.)
  if ! "$STACK/bin/python" -m pip install --disable-pip-version-check -c "$PINS" ".[test]" \
       >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" | tail -n 20 >&2
    local torch_pin
    torch_pin="$(grep -E '^torch==' "$PINS")"
    if ! "$STACK/bin/python" -m pip index versions torch 2>/dev/null \
         | grep -q -- "${torch_pin#torch==}"; then
      say "$torch_pin is not available from the package index (offline?)"
      return 3
    fi
    say "install into $STACK failed (log: $log)"
    return 1
  fi
  "$STACK/bin/python" -m pip uninstall --disable-pip-version-check -y -q varlen-cp >>"$log" 2>&1
  pins_match "$STACK/bin/python" || { say "$STACK is off the pins after install"; return 1; }
  rm -rf "$ROOT/build"  # left by the non-editable build of the checkout
  touch "$STACK/.complete"
}

set +e
(
  set -e
  flock -w 1800 9 || { say "timed out waiting for $CACHE/oldest-stack.lock"; exit 1; }
  build_stack
) 9>"$CACHE/oldest-stack.lock"
status=$?
set -e
[[ "$status" -eq 0 ]] || exit "$status"

# this checkout's venv: the stack (its .pth files included) plus an editable varlen-cp
rm -rf "$VENV"
"$BASE_PYTHON" -m venv --without-pip "$VENV"
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
stack_site="$("$STACK/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$stack_site')" > "$site/_varlen_cp_oldest_stack.pth"
"$STACK/bin/python" -m pip --python "$VENV/bin/python" install --disable-pip-version-check \
  -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" >&2 || true

checkout_complete || { say "$VENV is incomplete or off the pins after install"; exit 1; }
echo "$VENV/bin/python"
