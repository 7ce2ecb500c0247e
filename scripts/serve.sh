#!/usr/bin/env bash
# Serve the model repository with tritonserver on loopback, in the foreground; Ctrl-C stops everything.
#
#   scripts/serve.sh                       # sets up when needed, then serves every model in model_repository/
#   MODELS=colocated scripts/serve.sh      # serve a subset (comma-separated; explicit model control)
#   scripts/serve.sh --log-verbose=1       # extra arguments go to tritonserver
#
# One role per host (PD across servers; the bootstrap service runs once per fleet):
#   ROLE=router  BOOTSTRAP=1 scripts/serve.sh                          # pd_ensemble + the fleet's bootstrap
#   ROLE=prefill PD_BOOTSTRAP_URL=http://<router host>:8998 ADVERTISE_HOST=<this host> scripts/serve.sh
#   ROLE=decode  PD_BOOTSTRAP_URL=http://<router host>:8998 ADVERTISE_HOST=<this host> scripts/serve.sh
#
# Env: HTTP_PORT (8000), GRPC_PORT (8001), METRICS_PORT (8002), BOOTSTRAP_PORT (8998), HOST (127.0.0.1: the
#      address tritonserver listens on), ADVERTISE_HOST (HOST: how other hosts reach this one),
#      ROLE (all | router | prefill | decode; default all), MODELS (default: every model of the role),
#      BOOTSTRAP (1: start the bootstrap service here; default 1 for ROLE=all, else 0 and PD_BOOTSTRAP_URL names
#      the fleet's), MODEL_REPOSITORY (<repo>/model_repository), SKIP_SETUP=1 (do not run scripts/setup.sh).
# Uses a tritonserver found on PATH (NGC container) when there is one, else the one in the nvidia-pytriton wheel.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST="${HOST:-127.0.0.1}"
HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"
MODEL_REPOSITORY="${MODEL_REPOSITORY:-$ROOT/model_repository}"
VENV="${VENV:-$ROOT/.venv}"
ROLE="${ROLE:-all}"
case "$ROLE" in
  all) BOOTSTRAP="${BOOTSTRAP:-1}" ;;
  router) MODELS="${MODELS:-pd_ensemble}"; BOOTSTRAP="${BOOTSTRAP:-0}" ;;
  prefill|decode) BOOTSTRAP="${BOOTSTRAP:-0}"
    if [[ -z "${MODELS:-}" ]]; then   # every model of the role in the repository (prefill, prefill_1, ...)
      MODELS="$(grep -l "^name: \"$ROLE\(_[0-9a-z]*\)\?\"" "$MODEL_REPOSITORY"/*/config.pbtxt \
                | xargs -n1 dirname | xargs -n1 basename | paste -sd, -)"
    fi ;;
  *) echo "[serve] ROLE must be all, router, prefill or decode, got '$ROLE'" >&2; exit 2 ;;
esac

say() { echo "[serve] $*"; }

if [[ "${SKIP_SETUP:-0}" != 1 ]]; then "$ROOT/scripts/setup.sh"; fi

# The python backend stub runs the first `python3` on PATH: it must be the venv's (numpy, torch, serving).
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NIXL/UCX between the prefill and decode processes: notifications through shared memory, TCP on loopback only.
export UCX_MM_ERROR_HANDLING="${UCX_MM_ERROR_HANDLING:-y}"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
# Without RDMA devices, keep UCX's ib module out: with the system's libibverbs installed it loads a second
# libnl-route-3 beside nixl's bundled one, and every NIXL process segfaults at exit (kv_transfer/nixl_transport.py).
if [[ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then export UCX_MODULES="${UCX_MODULES:-^ib}"; fi
export PD_BOOTSTRAP_URL="${PD_BOOTSTRAP_URL:-http://${ADVERTISE_HOST:-$HOST}:$BOOTSTRAP_PORT}"
# How routers (in this server or others) reach this server's models: registered with the bootstrap service.
export PD_GRPC_URL="${PD_GRPC_URL:-${ADVERTISE_HOST:-$HOST}:$GRPC_PORT}"

server_args=()
if command -v tritonserver >/dev/null 2>&1; then
  TRITONSERVER="$(command -v tritonserver)"
else
  TRITON_DIR="$(python3 -c 'import importlib.util as u; print(u.find_spec("pytriton").submodule_search_locations[0])')/tritonserver"
  TRITONSERVER="$TRITON_DIR/bin/tritonserver"
  server_args+=(--backend-directory="$TRITON_DIR/backends")
fi
server_args+=(
  --model-repository="$MODEL_REPOSITORY"
  --http-address="$HOST" --http-port="$HTTP_PORT"
  --grpc-address="$HOST" --grpc-port="$GRPC_PORT"
  --metrics-address="$HOST" --metrics-port="$METRICS_PORT"
  --allow-gpu-metrics=false --pinned-memory-pool-byte-size=0
  --exit-timeout-secs="${EXIT_TIMEOUT_S:-20}"
)
if [[ -n "${MODELS:-}" ]]; then
  server_args+=(--model-control-mode=explicit)
  IFS=',' read -ra models <<< "$MODELS"
  for m in "${models[@]}"; do server_args+=(--load-model="$m"); done
fi

pids=()
stopping=0
# stop_all: TERM what was started here, newest first (tritonserver before the bootstrap service, so the models
# deregister from a live rendezvous), each given up to 25 s, then KILL; idempotent.
stop_all() {
  [[ $stopping == 1 ]] && return
  stopping=1
  say "stopping ${pids[*]:-nothing}"
  local i pid
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 250); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

if [[ "$BOOTSTRAP" == 1 ]]; then
  say "bootstrap service on $PD_BOOTSTRAP_URL"
  python3 -m bootstrap --host "$HOST" --port "$BOOTSTRAP_PORT" &
  pids+=($!)
fi

say "$TRITONSERVER ${server_args[*]} $*"
"$TRITONSERVER" "${server_args[@]}" "$@" &
pids+=($!)

# Foreground until tritonserver (or the bootstrap service) exits; its status is ours.
set +e
wait -n "${pids[@]}"
status=$?
set -e
say "a child exited with status $status"
exit "$status"
