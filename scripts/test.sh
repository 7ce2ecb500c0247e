#!/usr/bin/env bash
# Run the test suite in the project venv (scripts/setup.sh builds it). Extra arguments go to pytest:
#   scripts/test.sh                      # everything, live tritonserver tests included
#   scripts/test.sh -m "not live"        # skip the tests that start tritonserver
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python -m pytest -q --durations=15 "$@"
