#!/usr/bin/env bash
# The kernel, plan and CP-strategy tests on the oldest supported stack (pyproject.toml's lower
# bounds: torch 2.11.0, triton 3.6.0, numpy 1.26.4, Python 3.12; scripts/oldest-stack.txt),
# besides the main stack that scripts/run_tests.sh tests in full. Part of its full run.
#
#   bash scripts/test_oldest_stack.sh [pytest args]      (default: the subset below)
#
# The environment is .venv-oldest (VENV_OLDEST to move it), a small venv of this checkout over
# a stack that scripts/setup_oldest_env.sh downloads once per machine (3.2 GB). Prints
# "SKIP: oldest-stack: <reason>" and exits 0 only when that stack cannot be downloaded at all
# (no network); any other failure exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."

# Covers the wheel (built, installed, imported on this stack, one CP call), every kernel
# (Triton on its interpreter, forward and backward, every mask; the api, merge and tile
# schedule), the plan, the host tables of every strategy, and every CP strategy (p2p,
# all_gather, a2a, a2a+p2p, dispatch, staged overlap) at 2-4 ranks against the
# single-process reference; the FlashAttention routing (torch 2.11's aten flash op schema,
# the CPU emulator registered through this torch's torch.library, the FA forms, every
# strategy on "flash" / "fa4"). Left to the main stack: the torch twin's and the reliability
# suites, the integrations (torchtitan 0.3.0 needs torch 2.14), and the cross-check of the
# schedule builders against their per-token twin (85 of test_cp_schedules.py's 109 s under
# load; pure integer math). Measured cost: README "Supported versions".
TESTS=(
  tests/kernels/test_environment.py
  tests/package/test_packaging.py
  tests/kernels/test_triton_kernels.py
  tests/kernels/test_api.py
  tests/kernels/test_merge.py
  tests/kernels/test_tile_schedule.py
  tests/plan/test_plan.py
  tests/tables/test_cp_schedules.py
  --deselect tests/tables/test_cp_schedules.py::test_schedules_match_the_per_token_builder
  tests/strategies/test_cp_strategies.py
  tests/tables/test_cp_dispatch.py
  tests/strategies/test_cp_overlap.py
  tests/kernels/test_flash_emulator.py
  tests/kernels/test_flash_resolve.py
  tests/tables/test_flash_form.py
  tests/strategies/test_cp_flash.py
  tests/kernels/test_rows_kernels.py
)
# triton 3.6's interpreter converts one-element arrays with int(), which numpy 1.25+ flags
# once per kernel step (~2800 lines of the same DeprecationWarning; an error from numpy 2.4,
# see kernels/environment.py)
FILTER=(-W "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

start=$(date +%s)
setup_log="$(mktemp)"
status=0
python_path="$(bash scripts/setup_oldest_env.sh 2>"$setup_log" | tail -n 1)" || status=$?
cat "$setup_log" >&2
if [[ "$status" -eq 3 ]]; then
  echo "SKIP: oldest-stack: $(tail -n 1 "$setup_log" | sed 's/^setup_oldest_env: //')"
  rm -f "$setup_log"
  exit 0
fi
rm -f "$setup_log"
if [[ "$status" -ne 0 || -z "$python_path" ]]; then
  echo "FAIL: oldest-stack: could not set up the environment (exit $status)" >&2
  exit 1
fi
versions="$("$python_path" -c 'import sys, torch, triton, numpy
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"triton {triton.__version__}, numpy {numpy.__version__}")')"
echo "oldest-stack: $versions (environment ready in $(( $(date +%s) - start )) s)"

tests_start=$(date +%s)
if [[ "$#" -gt 0 ]]; then TESTS=("$@"); fi
"$python_path" -m pytest -q --timeout=900 -p no:cacheprovider "${FILTER[@]}" "${TESTS[@]}"
rc=$?
if [[ "$rc" -eq 5 ]]; then
  echo "oldest-stack: pytest collected no tests; that is a failure here" >&2
  rc=1
fi
echo "oldest-stack: tests finished in $(( $(date +%s) - tests_start )) s (exit $rc)," \
     "$(( $(date +%s) - start )) s in all"
exit "$rc"
