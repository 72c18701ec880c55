#!/usr/bin/env bash
# Create (once) the oldest-stack virtualenv: varlen-cp[test] with the lower bounds of
# pyproject.toml pinned (scripts/oldest-stack.txt: torch 2.11.0, triton 3.6.0, numpy 1.26.4),
# on Python 3.12 where it exists (the lent GPU machines run 3.12), else python3. Prints the
# environment's python path on its last line.
#
#   VENV_OLDEST=/path/to/venv bash scripts/setup_oldest_env.sh   (default: .venv-oldest)
#
# torch 2.11.0 comes from the package index as its CUDA build (it runs on CPU): ~3.2 GB of
# wheels with its nvidia-* libraries, 4.7 GB installed, ~2.5 min here (measured). Re-running
# is cheap once the environment is complete and matches the pins.
# Exit status 3 (and no path) when the pinned torch cannot be found at all (no network): the
# caller prints a SKIP line; every other failure is an error.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_OLDEST:-$ROOT/.venv-oldest}"
PINS="$ROOT/scripts/oldest-stack.txt"
cd "$ROOT"

complete() {
  "$VENV/bin/python" - "$PINS" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, pathlib, sys
import pytest, hypothesis, torch, varlen_cp  # noqa: F401
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        if md.version(name).split("+")[0] != version:
            sys.exit(1)
# an editable install of *this* checkout, not another clone's
sys.exit(0 if pathlib.Path(varlen_cp.__file__).resolve().parent.parent ==
         pathlib.Path.cwd().resolve() else 1)
PY
}

if [[ -x "$VENV/bin/python" ]] && complete; then
  echo "$VENV/bin/python"
  exit 0
fi
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
BASE_PYTHON="$(base_python)"
echo "setup_oldest_env: installing varlen-cp[test] with $(tr '\n' ' ' < <(grep -v '^#' "$PINS"))on $("$BASE_PYTHON" -V) into $VENV (minutes, once)" >&2
rm -rf "$VENV"
"$BASE_PYTHON" -m venv "$VENV"
log="$VENV/install.log"
# (pip warns about every package the machine's extra local indexes lack: not errors, filtered)
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -c "$PINS" \
     -e ".[test]" >"$log" 2>&1; then
  grep -v "is ignored: it is neither" "$log" | tail -n 20 >&2
  torch_pin="$(grep -E '^torch==' "$PINS")"
  if ! "$VENV/bin/python" -m pip index versions torch 2>/dev/null \
       | grep -q -- "${torch_pin#torch==}"; then
    echo "setup_oldest_env: $torch_pin is not available from the package index (offline?)" >&2
    exit 3
  fi
  echo "setup_oldest_env: install into $VENV failed (log: $log)" >&2
  exit 1
fi

complete || { echo "setup_oldest_env: $VENV is incomplete or off the pins after install" >&2; exit 1; }
echo "$VENV/bin/python"
