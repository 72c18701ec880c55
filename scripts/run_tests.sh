#!/usr/bin/env bash
# The README's test command; .ci/run calls it on a fresh clone.
#
#   bash scripts/run_tests.sh [--fast] [pytest args]
#
# --fast: the fast lane, `pytest -m "not slow and not cuda"` (under 5 minutes on 2 cores; a
# representative part of every folder of tests/, docs/testing.md) and nothing else (no
# oldest stack, no SLURM). Without it, the full run below, which .ci/run keeps.
#
# 1. installs varlen-cp with its test, torchtitan and megatron extras into .venv (once;
#    scripts/setup_env.sh), or uses $PYTHON if set;
# 2. runs the unit and multi-process tests (CPU is enough: without a GPU the Triton kernels
#    run on Triton's interpreter, switched on by tests/conftest.py);
# 3. on a full run (no pytest args), runs the kernel, plan and strategy tests again on the
#    oldest supported stack (torch 2.11, triton 3.6; scripts/test_oldest_stack.sh, its own
#    .venv-oldest over a stack downloaded once per machine); it prints "SKIP: oldest-stack:
#    <reason>" only when that stack cannot be downloaded (no network);
# 4. on a full run, runs the integration suite on a real two-node SLURM cluster in network
#    namespaces; it prints "SKIP: slurm-ci: <reason>" where the machine does not allow that
#    (not root, no netns).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON="$(bash scripts/setup_env.sh | tail -n 1)"
fi
export PYTHON

FAST=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  FAST=(-m "not slow and not cuda")
fi
full_run=0
if [[ "$#" -eq 0 && "${#FAST[@]}" -eq 0 ]]; then
  full_run=1
fi

# -q unless the caller sets the verbosity: a second -q (-qq) would hide pytest's result line.
QUIET=(-q)
for arg in "$@"; do
  case "$arg" in -q* | -v* | --quiet | --verbose) QUIET=() ;; esac
done

set +e
"$PYTHON" -m pytest "${QUIET[@]}" --timeout=900 "${FAST[@]}" "$@"
rc=$?
set -e
if [[ "$rc" -eq 5 ]]; then
  echo "run_tests: pytest collected no tests; that is a failure here" >&2
  rc=1
fi

if [[ "$full_run" -eq 1 ]]; then  # full runs only, not `run_tests.sh -k ...` or --fast
  bash scripts/test_oldest_stack.sh || rc=1
  bash integration_tests/ci_slurm/run_cluster.sh || rc=1
fi
exit "$rc"
