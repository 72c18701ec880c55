#!/usr/bin/env bash
# Install varlen-cp with its test extra, then run the test suite.
# This is the README's test command; .ci/run calls it on a fresh clone.
# Extra arguments go to pytest (e.g. `bash scripts/run_tests.sh -k masks`).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"

# No GPU: Triton kernels run on its interpreter (tests/conftest.py switches it on).
set +e
python3 -m pytest -q --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
