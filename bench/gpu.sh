#!/usr/bin/env bash
# The GPU suite in one command (bench/gpu_suite.py has the details):
#
#   bash bench/gpu.sh [--out DIR] [--parts tests,kernels,replay] [--budget SECONDS]
#   bash bench/gpu.sh --dry-run [--out DIR]      # CPU: the same pipeline, tiny shapes
#
# On a CUDA machine: the CUDA-only tests, the kernel benchmark (ours vs torch's varlen_attn
# and flex_attention) and the replay of a CP rank's kernel calls, within 10 minutes on an
# H100; writes DIR/<device>.json (+ plots when matplotlib is there), DIR = bench/results.
#
# Python: $PYTHON, else .venv/bin/python, else python3. Nothing is downloaded or installed:
# when varlen_cp is not importable from this checkout (the lent GPU machines have torch and
# triton but not this package), a temporary folder of symlinks maps the package names onto
# plugin/ and kernels/ (what pyproject's package-dir does) for this run only.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi

shim=""
cleanup() { if [[ -n "$shim" ]]; then rm -rf -- "$shim"; fi; }
trap cleanup EXIT

# Is varlen_cp importable, and is it THIS checkout's (not another tree's install)? Found,
# not imported: importing it would cost a torch import.
if ! "$py" - "$root" <<'EOF' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("varlen_cp")
here = os.path.realpath(os.path.join(sys.argv[1], "plugin", "__init__.py"))
sys.exit(0 if spec and spec.origin and os.path.realpath(spec.origin) == here else 1)
EOF
then
  shim="$(mktemp -d "${TMPDIR:-/tmp}/varlen_cp_path.XXXXXX")"
  mkdir "$shim/varlen_cp"
  for entry in "$root"/plugin/*; do
    ln -s "$entry" "$shim/varlen_cp/$(basename "$entry")"
  done
  ln -s "$root/kernels" "$shim/varlen_cp/kernels"
  export PYTHONPATH="$shim:$root${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu.sh: varlen_cp imported from $root through $shim (not installed here)"
fi

set +e
"$py" bench/gpu_suite.py "$@"
rc=$?
set -e
exit "$rc"
