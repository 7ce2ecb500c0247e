#!/usr/bin/env bash
# genai-perf 0.0.16 (Triton gRPC, vLLM backend convention, streaming) against a decoupled LLM model.
# Usage: scripts/perf/genai_perf.sh MODEL GRPC_PORT [extra genai-perf profile args...]
#   extra args  replace the defaults "--concurrency 1 --request-count 16"
# Env: ISL (prompt tokens, default 256), OSL (new tokens, default 64), OUT_DIR (artifact dir, default
#   artifacts/genai_perf/MODEL), TOKENIZER (default .cache/tokenizers/smollm2, written by install_perf_tools.sh),
#   GENAI_PERF (default tools/bin/genai-perf), PYTHON (default .venv/bin/python).
# genai-perf sends sampling values as strings ({"max_tokens": "64"}), which the models accept. With the vllm
# backend --extra-inputs become separate input tensors, so ignore_eos cannot be set: outputs may end early at EOS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[[ $# -ge 2 ]] || { sed -n 2,10p "$0"; exit 2; }
MODEL="$1"; GRPC_PORT="$2"; shift 2
EXTRA=("$@")
[[ ${#EXTRA[@]} -gt 0 ]] || EXTRA=(--concurrency 1 --request-count 16)
OUT_DIR="${OUT_DIR:-$ROOT/artifacts/genai_perf/$MODEL}"
TOKENIZER="${TOKENIZER:-$ROOT/.cache/tokenizers/smollm2}"
GENAI_PERF="${GENAI_PERF:-$ROOT/tools/bin/genai-perf}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$GENAI_PERF" ]] || { echo "no $GENAI_PERF: run scripts/install_perf_tools.sh" >&2; exit 3; }
[[ -f "$TOKENIZER/tokenizer.json" ]] || { echo "no tokenizer at $TOKENIZER: run scripts/install_perf_tools.sh" >&2; exit 3; }
mkdir -p "$OUT_DIR"
# Ask for every optional output the models declare (serving/schema.py's return_* flags): perf_analyzer's profile
# export lists each declared output on every response and, for one the response does not carry, writes whatever
# its buffer held (floats like -3.99e+34 seen; a NaN there left profile_export.json empty in one CI run, and
# genai-perf failed on it).
mapfile -t RETURN_ALL < <("$PYTHON" "$ROOT/scripts/perf/make_inputs.py" --genai-perf-args)
[[ ${#RETURN_ALL[@]} -gt 0 ]] || { echo "no return_* flags from scripts/perf/make_inputs.py" >&2; exit 3; }
"$GENAI_PERF" profile -m "$MODEL" --backend vllm --streaming -u "127.0.0.1:$GRPC_PORT" \
  --tokenizer "$TOKENIZER" --synthetic-input-tokens-mean "${ISL:-256}" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "${OSL:-64}" --random-seed 0 \
  --artifact-dir "$OUT_DIR" --warmup-request-count 0 "${RETURN_ALL[@]}" "${EXTRA[@]}"
