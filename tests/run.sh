#!/usr/bin/env bash
# Install what the test suite needs, then run all of it: bash tests/run.sh [pytest args]
# Exits non-zero when a test fails and when no test ran (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -e ".[dev]" || exit 1

python3 -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
