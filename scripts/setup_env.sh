#!/usr/bin/env bash
# Create (once) the project's virtualenv and install varlen-cp into it with every extra the
# tests and the demo need: test, torchtitan (torch 2.14.1, torchtitan 0.3.0) and megatron
# (megatron-core 0.16.1). Prints the environment's python path on its last line.
#
#   VENV=/path/to/venv bash scripts/setup_env.sh      (default: .venv in the repository)
#
# A virtualenv keeps the system Python untouched; re-running is cheap when it is complete.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
cd "$ROOT"

complete() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md, pathlib, sys
import torchtitan, megatron.core, pytest, hypothesis, varlen_cp  # noqa: F401
# an editable install of *this* checkout, not another clone's
sys.exit(0 if pathlib.Path(varlen_cp.__file__).resolve().parent.parent ==
         pathlib.Path.cwd().resolve() else 1)
PY
}

if [[ -x "$VENV/bin/python" ]] && complete; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "setup_env: installing varlen-cp[test,torchtitan,megatron,bench] into $VENV (a few minutes, once)" >&2
python3 -m venv "$VENV"
# Progress on stderr (the last stdout line stays the python path): one line per package pip
# collects, then what it installed. pip's warnings about every package the machine's extra
# local indexes lack are not errors: filtered.
START=$(date +%s)
"$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
  -e ".[test,torchtitan,megatron,bench]" 2>&1 \
  | grep --line-buffered -v "is ignored: it is neither" \
  | grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR|error)" \
  | sed -u "s/^/setup_env: /" >&2 || true
echo "setup_env: done in $(( $(date +%s) - START )) s" >&2

complete || { echo "setup_env: $VENV is incomplete after install" >&2; exit 1; }
echo "$VENV/bin/python"
