#!/usr/bin/env bash
# Set up what the tests need (idempotent: seconds when already done), then run the test suite in the project
# venv. Extra arguments go to pytest:
#   scripts/test.sh                      # everything, live tritonserver tests included
#   scripts/test.sh -m "not live"        # skip the tests that start tritonserver
#   SKIP_SETUP=1 scripts/test.sh ...     # skip the set-up steps
#   SKIP_LINT=1 scripts/test.sh ...      # skip ruff and mypy (run first otherwise; any finding fails the run)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then
  scripts/setup.sh
  scripts/install_perf_tools.sh   # perf_analyzer + genai-perf for the smoke runs in tests/bench
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${SKIP_LINT:-0}" != 1 ]]; then
  # the rules and the strict modules are in pyproject.toml; ruff < 1 s, mypy ~1 min cold, seconds with its cache
  echo "[test] ruff check ."
  python -m ruff check .
  echo "[test] mypy (pyproject.toml [tool.mypy] files)"
  python -m mypy
fi
exec python -m pytest -q --durations=15 "$@"
