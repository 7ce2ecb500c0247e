#!/usr/bin/env bash
# perf_analyzer over gRPC streaming against a decoupled LLM model (vLLM-backend interface).
# Usage: scripts/perf/perf_analyzer.sh MODEL GRPC_PORT [INPUT_FILE] [extra perf_analyzer args...]
#   INPUT_FILE  default scripts/perf/inputs/chat_256.json (see scripts/perf/make_inputs.py)
#   extra args  replace the defaults "--concurrency-range 1 --request-count 16"
# Env: OUT_DIR (default artifacts/perf_analyzer/MODEL), PERF_ANALYZER (default tools/bin/perf_analyzer).
# Writes OUT_DIR/input_data.json (INPUT_FILE with every return_* flag), OUT_DIR/profile_export.json (per-response
# timestamps, ns) and prints TTFT/ITL computed from it last.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[[ $# -ge 2 ]] || { sed -n 2,7p "$0"; exit 2; }
MODEL="$1"; GRPC_PORT="$2"; shift 2
INPUT="$ROOT/scripts/perf/inputs/chat_256.json"
if [[ $# -gt 0 && "$1" != -* ]]; then INPUT="$1"; shift; fi
EXTRA=("$@")
[[ ${#EXTRA[@]} -gt 0 ]] || EXTRA=(--concurrency-range 1 --request-count 16)
OUT_DIR="${OUT_DIR:-$ROOT/artifacts/perf_analyzer/$MODEL}"
PERF_ANALYZER="${PERF_ANALYZER:-$ROOT/tools/bin/perf_analyzer}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PERF_ANALYZER" ]] || { echo "no $PERF_ANALYZER: run scripts/install_perf_tools.sh" >&2; exit 3; }
mkdir -p "$OUT_DIR"
# Every request asks for every optional output of serving/schema.py (the input file's requests, each with every
# return_* flag, written here): perf_analyzer's export of a declared output that a response lacks is
# uninitialized memory (genai_perf.sh says more)
"$PYTHON" "$ROOT/scripts/perf/make_inputs.py" --return-flags "$INPUT" "$OUT_DIR/input_data.json"
"$PERF_ANALYZER" -m "$MODEL" -i grpc -u "127.0.0.1:$GRPC_PORT" --streaming --input-data "$OUT_DIR/input_data.json" \
  --profile-export-file "$OUT_DIR/profile_export.json" "${EXTRA[@]}"
"$PYTHON" "$ROOT/scripts/perf/pa_export_stats.py" "$OUT_DIR/profile_export.json"
