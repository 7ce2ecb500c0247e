#!/usr/bin/env bash
# Run the client tests of Triton's vLLM backend (github.com/triton-inference-server/vllm_backend, ci/) against
# this repository's pd_ensemble (or MODEL=colocated), on a server this script starts on the default ports.
#
#   git clone https://github.com/triton-inference-server/vllm_backend /tmp/vllm_backend
#   scripts/run_vllm_backend_tests.sh /tmp/vllm_backend            # pytest -k / -x ... may follow
#
# Their code is copied to a temporary folder (never into this repository) with the model name `vllm_opt`
# replaced by MODEL. Run: ci/L0_backend_vllm/enabled_stream, ci/L0_backend_vllm/request_cancellation,
# ci/L0_additional_outputs_vllm. Left aside, as they need vLLM itself or OPT-125m's exact text:
# enabled_stream's `..._exclude_input_in_output_default` (expects OPT's words), every test of
# ci/L0_backend_vllm/vllm_backend (load vLLM model folders, or expect OPT's words), accuracy_test and
# metrics_test (compare with / read vLLM's own engine). request_cancellation's last two assertions look for
# vLLM's own log lines ("[vllm] Cancelling the request") in the server log: the server log is linked where
# the test reads it, and those two assertions fail here by design (this server is not vLLM).
# Env: MODEL (pd_ensemble), SKIP_SETUP=1 (do not run scripts/setup.sh), READY_TIMEOUT_S (300).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${1:?usage: $0 <vllm_backend checkout> [pytest args]}"
shift
MODEL="${MODEL:-pd_ensemble}"
case "$MODEL" in
  pd_ensemble) MODELS="pd_ensemble,prefill,decode" ;;
  *) MODELS="$MODEL" ;;
esac
[[ -d "$SRC/ci/L0_additional_outputs_vllm" ]] || { echo "no vllm_backend ci/ under $SRC" >&2; exit 2; }
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then "$ROOT/scripts/setup.sh"; fi

WORK="$(mktemp -d)"
LOG="$WORK/server.log"
cleanup() { [[ -n "${SERVER:-}" ]] && kill -TERM "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
cp -r "$SRC/ci/common" "$SRC/ci/L0_backend_vllm" "$SRC/ci/L0_additional_outputs_vllm" "$WORK/"
grep -rl '"vllm_opt"' "$WORK" | xargs sed -i "s/\"vllm_opt\"/\"$MODEL\"/g"

MODELS="$MODELS" SKIP_SETUP=1 "$ROOT/scripts/serve.sh" >"$LOG" 2>&1 &
SERVER=$!
deadline=$((SECONDS + ${READY_TIMEOUT_S:-300}))
until curl -sf "127.0.0.1:8000/v2/models/$MODEL/ready" >/dev/null; do
  if (( SECONDS > deadline )) || ! kill -0 "$SERVER" 2>/dev/null; then tail -50 "$LOG"; exit 1; fi
  sleep 1
done
echo "[vllm-tests] $MODEL ready; running the vLLM backend's client tests"
cd "$WORK"
ln -s "$LOG" L0_backend_vllm/request_cancellation/request_cancellation_server.log
# shellcheck disable=SC1091
. "$ROOT/.venv/bin/activate"
status=0
(cd L0_backend_vllm/enabled_stream && python -m pytest -q -p no:cacheprovider enabled_stream_test.py \
   -k "not exclude_input_in_output_default" "$@") || status=1
(cd L0_backend_vllm/request_cancellation && python -m pytest -q -p no:cacheprovider request_cancellation_test.py "$@") \
   || status=1
(cd L0_additional_outputs_vllm && python -m pytest -q -p no:cacheprovider additional_outputs_test.py "$@") || status=1
exit $status
