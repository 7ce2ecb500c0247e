#!/usr/bin/env bash
# Serve the model repository with tritonserver on loopback, in the foreground; Ctrl-C stops everything.
#
#   scripts/serve.sh                       # sets up when needed, then serves every model in model_repository/
#   MODELS=colocated scripts/serve.sh      # serve a subset (comma-separated; explicit model control)
#   scripts/serve.sh --log-verbose=1       # extra arguments go to tritonserver
#
# Nothing else is needed on one host: the router (pd_ensemble) pairs the prefill/decode models of its own
# server, and every PD instance hosts its own rendezvous. This script is a convenience: plain `tritonserver
# --model-repository=model_repository` (venv python first on PATH, the repo on PYTHONPATH) works too.
#
# One role per host (PD across servers): the fleet's members find each other through a membership registry,
# the embedded one (ROLE=registry, its own launcher) or etcd (PD_REGISTRY_URL=etcd://host:2379):
#   ROLE=registry scripts/serve.sh                                        # python -m bootstrap.membership
#   ROLE=router  PD_REGISTRY_URL=http://<registry host>:8998 scripts/serve.sh
#   ROLE=prefill PD_REGISTRY_URL=http://<registry host>:8998 ADVERTISE_HOST=<this host> scripts/serve.sh
#   ROLE=decode  PD_REGISTRY_URL=http://<registry host>:8998 ADVERTISE_HOST=<this host> scripts/serve.sh
#   ROLE=frontend GRPC_URL=<router host>:8001 scripts/serve.sh      # only the OpenAI front (python -m frontend)
# Losing the registry freezes membership only: routers keep pairing the instances they know.
#
# The OpenAI-compatible front (frontend/, its own process) starts with ROLE=all and ROLE=frontend on
# OPENAI_PORT (9000), in front of OPENAI_MODEL (default pd_ensemble; colocated when MODELS names it but not
# pd_ensemble).
#
# Env: HTTP_PORT (8000), GRPC_PORT (8001), METRICS_PORT (8002), REGISTRY_PORT (8998), HOST (127.0.0.1: the
#      address tritonserver listens on), ADVERTISE_HOST (HOST: how other hosts reach this one),
#      ROLE (all | router | prefill | decode; default all), MODELS (default: every model of the role),
#      PD_REGISTRY_URL (the fleet's registry; empty: none), PD_FLEET_SECRET / PD_FLEET_SECRET_FILE (required
#      when anything binds a non-loopback address), MODEL_REPOSITORY (<repo>/model_repository), SKIP_SETUP=1 (do not run scripts/setup.sh),
#      OPENAI (1: start the OpenAI front; default 1 for ROLE=all and frontend, else 0), OPENAI_PORT (9000),
#      OPENAI_MODEL, OPENAI_SERVED_MODEL_NAME (the name clients use; default OPENAI_MODEL), GRPC_URL (the
#      tritonserver the front calls; default HOST:GRPC_PORT), RESTART (1, the default: start tritonserver again
#      when it exits after it had become ready, e.g. a model's stub died; 0: exit with it).
#      DRAIN_TIMEOUT_S (30): on SIGTERM or Ctrl-C the server drains: it takes no new request, its open streams
#      run to their end for up to this many whole seconds (every model's drain_timeout_s, through
#      PD_DRAIN_TIMEOUT_S; the OpenAI front's graceful shutdown too), then ends what is left; tritonserver's
#      --exit-timeout-secs is EXIT_TIMEOUT_S (default DRAIN_TIMEOUT_S + 15). A second signal stops at once
#      (SIGKILL to tritonserver and its stubs, their shared memory removed); so does the first one while the
#      models still load (nothing is served yet). docs/healing.md, "Stops".
#      METRICS_HOST (127.0.0.1: the address of tritonserver's metrics port, which answers anyone; set it to
#      HOST or 0.0.0.0 only where a scraper on another host needs it).
#      With a fleet secret, tritonserver's admin APIs (model repository, model config, shared memory,
#      statistics, trace, logging) answer only requests with the header `pd-admin-key: <key>`, the key printed
#      by `python -m bootstrap.auth admin-key`; a HOST other than loopback without a secret refuses to start.
#      TLS on tritonserver's gRPC (docs/security.md): GRPC_SSL_CERT, GRPC_SSL_KEY (this server's PEM
#      certificate and key; they turn it on), GRPC_SSL_ROOT_CERT (the CA that signed the fleet's gRPC
#      certificates: this server's own clients, routers and the front verify servers with it; required with
#      GRPC_SSL_CERT, and for a ROLE=router or frontend host dialing TLS servers), GRPC_SSL_MUTUAL=1 (clients
#      must present a certificate signed by GRPC_SSL_ROOT_CERT; ours present GRPC_SSL_CLIENT_CERT /
#      GRPC_SSL_CLIENT_KEY, default GRPC_SSL_CERT / GRPC_SSL_KEY), GRPC_SSL_TARGET_NAME (the name clients
#      check in servers' certificates instead of the host they dial).
# Uses a tritonserver found on PATH (NGC container) when there is one, else the one in the nvidia-pytriton
# wheel.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST="${HOST:-127.0.0.1}"
HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
METRICS_HOST="${METRICS_HOST:-127.0.0.1}"
REGISTRY_PORT="${REGISTRY_PORT:-8998}"
DRAIN_TIMEOUT_S="${DRAIN_TIMEOUT_S:-30}"
if [[ ! "$DRAIN_TIMEOUT_S" =~ ^[0-9]+$ ]]; then
  echo "[serve] DRAIN_TIMEOUT_S must be a whole number of seconds, got '$DRAIN_TIMEOUT_S'" >&2; exit 2
fi
EXIT_TIMEOUT_S="${EXIT_TIMEOUT_S:-$((DRAIN_TIMEOUT_S + 15))}"
MODEL_REPOSITORY="${MODEL_REPOSITORY:-$ROOT/model_repository}"
VENV="${VENV:-$ROOT/.venv}"
ROLE="${ROLE:-all}"
OPENAI_PORT="${OPENAI_PORT:-9000}"
case "$ROLE" in
  all) OPENAI="${OPENAI:-1}" ;;
  frontend) OPENAI=1 ;;
  registry) OPENAI=0 ;;
  router) MODELS="${MODELS:-pd_ensemble}" ;;
  prefill|decode)
    if [[ -z "${MODELS:-}" ]]; then   # every model of the role in the repository (prefill, prefill_1, ...)
      MODELS="$(grep -l "^name: \"$ROLE\(_[0-9a-z]*\)\?\"" "$MODEL_REPOSITORY"/*/config.pbtxt \
                | xargs -n1 dirname | xargs -n1 basename | paste -sd, -)"
    fi ;;
  *) echo "[serve] ROLE must be all, router, prefill, decode, frontend or registry, got '$ROLE'" >&2; exit 2 ;;
esac
OPENAI="${OPENAI:-0}"
GRPC_URL="${GRPC_URL:-$HOST:$GRPC_PORT}"
if [[ -z "${OPENAI_MODEL:-}" ]]; then
  case ",${MODELS:-pd_ensemble}," in
    *,pd_ensemble,*) OPENAI_MODEL=pd_ensemble ;;
    *,colocated,*) OPENAI_MODEL=colocated ;;
    *) OPENAI_MODEL="" ;;   # no public model served here: the front would have nothing to call
  esac
  if [[ "$ROLE" == frontend ]]; then OPENAI_MODEL=pd_ensemble; fi
fi

say() { echo "[serve] $*"; }

if [[ "${SKIP_SETUP:-0}" != 1 ]]; then "$ROOT/scripts/setup.sh"; fi
# stop_all finds tritonserver's model stubs with ps: without it a stop would SIGKILL tritonserver and leave its
# stubs behind (set-up installs procps; this is for SKIP_SETUP=1 on a machine set up by hand)
if [[ "$ROLE" != frontend && "$ROLE" != registry ]] && ! command -v ps >/dev/null; then
  echo "[serve] the ps command is missing (apt: procps): a stop finds tritonserver's model stubs with it" >&2
  exit 2
fi

# The python backend stub runs the first `python3` on PATH: it must be the venv's (numpy, torch, serving).
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# every model drains as long on a stop (serving/config.py reads it; the models' drain_timeout_s otherwise)
export PD_DRAIN_TIMEOUT_S="$DRAIN_TIMEOUT_S"
# NIXL/UCX: the KV transport picks its network from the advertised address itself (kv_transfer/network.py:
# that address's interface becomes UCX_NET_DEVICES, lo on loopback); set UCX_* here only to override it.
# Without RDMA devices, keep UCX's ib module out: with the system's libibverbs installed it loads a second
# libnl-route-3 beside nixl's bundled one, and every NIXL process segfaults at exit
# (kv_transfer/nixl_transport.py).
if [[ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then export UCX_MODULES="${UCX_MODULES:-^ib}"; fi
# How routers (in this server or others) reach this server's models: what they announce and describe.
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
  --metrics-address="$METRICS_HOST" --metrics-port="$METRICS_PORT"
  --allow-gpu-metrics=false --pinned-memory-pool-byte-size=0
  # the drain (DRAIN_TIMEOUT_S) and then the end of what is left, finalize and the stubs' exit, must fit in
  # it: past it tritonserver exits under its stubs
  --exit-timeout-secs="$EXIT_TIMEOUT_S"
  # auto-complete stays on: each model's outputs, and a public model's return_* inputs, come from
  # serving/schema.py through its model.py's auto_complete_config, which a short-lived stub per load runs (1.3 s
  # of a load on a quiet host: docs/healing.md). A repository whose every config declares its outputs already
  # (written by scripts/perf/server.py's complete_config) skips that stage below.
)
complete_configs=1
for config in "$MODEL_REPOSITORY"/*/config.pbtxt; do
  grep -q '^output *\[' "$config" 2>/dev/null || complete_configs=0
done
if [[ "$complete_configs" == 1 ]]; then server_args+=(--disable-auto-complete-config); fi
# Explicit model control always (every model of the repository: --load-model=*), so that an operator can load,
# unload or reload one model through the repository API without touching the others (docs/healing.md).
server_args+=(--model-control-mode=explicit)
if [[ -n "${MODELS:-}" ]]; then
  IFS=',' read -ra models <<< "$MODELS"
  for m in "${models[@]}"; do server_args+=(--load-model="$m"); done
else
  server_args+=(--load-model='*')
fi
# ... which is also how code gets in (a load can carry a whole python model): with a fleet secret, the admin
# APIs answer only the fleet's admin key; a HOST that other hosts reach refuses to start without a secret
# (serving/triton/admin_access.py, docs/security.md). The registry checks its own bind.
if [[ "$ROLE" != registry && "$ROLE" != frontend ]]; then
  admin_out="$(python3 -m serving.triton.admin_access server-args --host "$HOST")" || exit 2
  if [[ -n "$admin_out" ]]; then
    mapfile -t admin_lines <<< "$admin_out"
    server_args+=("${admin_lines[@]}")
  fi
fi
# TLS on tritonserver's gRPC, and for our own gRPC clients of tritonservers (this server's stubs, a router,
# the front): every server of a fleet speaks TLS, or none does
if [[ -n "${GRPC_SSL_CERT:-}${GRPC_SSL_KEY:-}" ]]; then
  if [[ -z "${GRPC_SSL_CERT:-}" || -z "${GRPC_SSL_KEY:-}" || -z "${GRPC_SSL_ROOT_CERT:-}" ]]; then
    echo "[serve] GRPC_SSL_CERT, GRPC_SSL_KEY and GRPC_SSL_ROOT_CERT go together (docs/security.md)" >&2
    exit 2
  fi
  server_args+=(--grpc-use-ssl=true --grpc-server-cert="$GRPC_SSL_CERT" --grpc-server-key="$GRPC_SSL_KEY")
  if [[ "${GRPC_SSL_MUTUAL:-0}" == 1 ]]; then
    server_args+=(--grpc-use-ssl-mutual=true --grpc-root-cert="$GRPC_SSL_ROOT_CERT")
  fi
fi
if [[ -n "${GRPC_SSL_ROOT_CERT:-}" ]]; then
  export PD_GRPC_SSL_ROOT_CERT="$GRPC_SSL_ROOT_CERT"
  client_cert="${GRPC_SSL_CLIENT_CERT:-}" client_key="${GRPC_SSL_CLIENT_KEY:-}"
  if [[ -z "$client_cert" && "${GRPC_SSL_MUTUAL:-0}" == 1 ]]; then
    client_cert="${GRPC_SSL_CERT:-}" client_key="${GRPC_SSL_KEY:-}"
  fi
  if [[ -n "$client_cert" ]]; then
    export PD_GRPC_SSL_CLIENT_CERT="$client_cert" PD_GRPC_SSL_CLIENT_KEY="$client_key"
  fi
  if [[ -n "${GRPC_SSL_TARGET_NAME:-}" ]]; then export PD_GRPC_SSL_TARGET_NAME="$GRPC_SSL_TARGET_NAME"; fi
fi
front_tls=()   # the same for the OpenAI front: PD_GRPC_SSL_ROOT_CERT -> --grpc-ssl-root-cert, ...
for setting in ROOT_CERT CLIENT_CERT CLIENT_KEY TARGET_NAME; do
  var="PD_GRPC_SSL_$setting" flag="${setting,,}"
  if [[ -n "${!var:-}" ]]; then front_tls+=("--grpc-ssl-${flag//_/-}" "${!var}"); fi
done

pids=()
triton_pid=""
stopping=0
# live_stubs PID: how many python-backend stubs (not zombies) PID still runs
live_stubs() { ps -o stat=,comm= --ppid "$1" 2>/dev/null | grep -c '^[^Z][^ ]* *triton_python' || true; }
# catches_term PID: whether PID has its own SIGTERM handler. tritonserver installs it only once every model of
# its start has loaded (src/main.cc); until then it runs with SIGTERM and SIGINT ignored (start_triton), so
# that no signal kills it under its loading stubs, which then crash on their way out (docs/healing.md,
# "Stops")
catches_term() {
  local mask
  mask="$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null)"
  [[ -n "$mask" ]] && (( (16#$mask >> 14) & 1 ))
}
# kill_triton_now PID: SIGKILL tritonserver PID and its python-backend stubs in one call (no stub outlives its
# server: an orphaned stub tears itself down under its running threads), then remove the stubs' shared memory
# (/dev/shm/triton_python_backend_shm_region_*, named on their command lines)
kill_triton_now() {
  local pid=$1 stub regions=() arg
  local stubs=()
  mapfile -t stubs < <(ps -o pid= --ppid "$pid" 2>/dev/null | tr -d ' ')
  for stub in "${stubs[@]}"; do
    while IFS= read -r -d '' arg; do
      if [[ "$arg" == triton_python_backend_shm_region* ]]; then regions+=("$arg"); fi
    done < "/proc/$stub/cmdline" 2>/dev/null || true
  done
  kill -KILL "${stubs[@]}" "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true   # our child: reaped at once
  for arg in "${regions[@]}"; do rm -f "/dev/shm/$arg"; done
}
# stop_all: the first call drains: TERM to everything started here at once (tritonserver drains its models,
# the front its streams), each waited for up to the exit timeout + 10 s, then KILLed; tritonserver still
# loading its models is killed at once instead (nothing to drain; catches_term). A second call (a second
# signal) stops at once. tritonserver is also KILLed once it has run 2 s without any model stub: every model
# finalized, and what it still waits for is a model version whose stub was killed (tritonserver 2.51 never
# frees the requests that stub held: docs/healing.md).
stop_all() {
  if [[ $stopping == 1 ]]; then
    if [[ $stopping_now == 0 ]]; then
      stopping_now=1
      say "second signal: stopping at once"
      if [[ -n "$triton_pid" ]]; then kill_triton_now "$triton_pid"; fi
      kill -KILL "${pids[@]}" 2>/dev/null || true
    fi
    return
  fi
  stopping=1
  say "stopping ${pids[*]:-nothing} (draining for up to ${DRAIN_TIMEOUT_S} s; a second signal stops at once)"
  local i pid idle
  for pid in "${pids[@]}"; do
    if [[ "$pid" == "$triton_pid" ]] && kill -0 "$pid" 2>/dev/null && ! catches_term "$pid"; then
      say "tritonserver is still loading its models: stopping it at once"
      kill_triton_now "$pid"
    else
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[i]}
    idle=0
    for _ in $(seq $(( (EXIT_TIMEOUT_S + 10) * 10 ))); do
      kill -0 "$pid" 2>/dev/null || break
      if [[ $stopping_now == 1 ]]; then break; fi
      if [[ "$pid" == "$triton_pid" && "$(live_stubs "$pid")" == 0 ]]; then
        idle=$((idle + 1))
        if ((idle >= 20)); then say "tritonserver waits with no model stub left: SIGKILL"; break; fi
      else
        idle=0
      fi
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      if [[ "$pid" == "$triton_pid" ]]; then
        kill_triton_now "$pid"
      else
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
  done
  wait 2>/dev/null || true
  rm -f "${ready_mark:-}"
}
stopping_now=0
# on_signal STATUS: stop_all, then exit with STATUS; a signal that comes while a process is being started and
# recorded in pids (spawning) waits until it is recorded, or stop_all would not know it and leave it running
spawning=0
pending_signal=""
on_signal() {
  if [[ $spawning == 1 ]]; then pending_signal=$1; return; fi
  stop_all
  exit "$1"
}
# spawned: the process just started is recorded; act on a signal that came meanwhile
spawned() {
  spawning=0
  if [[ -n "$pending_signal" ]]; then on_signal "$pending_signal"; fi
}
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
# a script that starts this one in the background (`&`) starts it with SIGINT ignored, and bash cannot trap a
# signal ignored on entry: say so, since only SIGTERM will stop it then
if (( 0x$(awk '/^SigIgn:/ {print $2}' /proc/$$/status 2>/dev/null || echo 0) & 2 )); then
  echo "[serve] SIGINT is ignored here (started in the background by a script): stop with SIGTERM (kill $$)" >&2
fi
trap '[[ $stopping == 1 ]] || stop_all' EXIT

if [[ "$ROLE" == registry ]]; then
  say "membership registry on http://$HOST:$REGISTRY_PORT"
  exec python3 -m bootstrap.membership --host "$HOST" --port "$REGISTRY_PORT" \
    --advertise-host "${ADVERTISE_HOST:-$HOST}"
fi

triton_index=-1
triton_started_s=0
triton_pid=""
ready_mark="$(mktemp "${TMPDIR:-/tmp}/serve-ready.XXXXXX")"
# http_ok HOST PORT PATH: whether HOST (a bind address of this host) answers GET PATH on PORT with 200 (plain
# bash /dev/tcp, nothing to install)
http_ok() {
  local host=$1 line
  [[ "$host" == 0.0.0.0 ]] && host=127.0.0.1
  { exec 3<>"/dev/tcp/$host/$2"; } 2>/dev/null || return 1
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$host" >&3
  IFS= read -r -t 5 line <&3 || line=""
  exec 3>&-
  [[ "$line" == *" 200 "* ]]
}
# mark_ready PID ARGS...: writes PID to $ready_mark once that tritonserver answers 200 on /v2/health/ready
# and, unless ARGS turn metrics off, on /metrics (Triton binds the metrics port last: one taken by another
# socket fails the start after HTTP said ready); gives up when PID exits. Whether a server ever became ready
# is what tells a start-up failure (exit, do not loop) from a later death (start it again).
mark_ready() {
  local pid=$1 metrics=1
  shift
  [[ " $* " == *" --allow-metrics=false "* ]] && metrics=0
  while kill -0 "$pid" 2>/dev/null; do
    if http_ok "$HOST" "$HTTP_PORT" /v2/health/ready \
        && { ((metrics == 0)) || http_ok "$METRICS_HOST" "$METRICS_PORT" /metrics; }; then
      echo "$pid" > "$ready_mark"
      say_ready "$metrics"
      return 0
    fi
    sleep 1
  done
}
# say_ready METRICS: the one line that says this server is ready, with every endpoint it serves (the OpenAI
# front's once its /health answers, up to 60 s; METRICS 0: metrics off)
say_ready() {
  local line="ready: HTTP $HOST:$HTTP_PORT  gRPC $HOST:$GRPC_PORT" i
  if (($1)); then line+="  metrics $METRICS_HOST:$METRICS_PORT"; fi
  if [[ "$OPENAI" == 1 && -n "$OPENAI_MODEL" ]]; then
    for i in $(seq 60); do http_ok "$HOST" "$OPENAI_PORT" /health && break; sleep 1; done
    line+="  OpenAI http://$HOST:$OPENAI_PORT/v1"
  fi
  say "$line  (models: ${MODELS:-every model in $MODEL_REPOSITORY})"
}
# start_triton ARGS...: tritonserver in the background, at its place in pids
start_triton() {
  spawning=1
  say "$TRITONSERVER ${server_args[*]//pd-admin-key=*/pd-admin-key=<admin key>} $*"
  # SIGTERM and SIGINT ignored until tritonserver installs its own handlers (once its models loaded): a signal
  # during the load is stop_all's to act on (catches_term), not a death under the loading stubs
  if [[ -e /dev/nvidiactl ]]; then
    (trap '' TERM INT; exec "$TRITONSERVER" "${server_args[@]}" "$@") &
  else   # no GPU: tritonserver 2.51 logs "CudaDriverHelper has not been initialized." at every start, an error
    # line with nothing to act on here; everything else it says passes through (the filter ignores the signals
    # too: it ends with tritonserver's output, not before, or a signal to the whole group would cut the log)
    (trap '' TERM INT; exec "$TRITONSERVER" "${server_args[@]}" "$@") \
      2> >(trap '' TERM INT; exec grep --line-buffered -v 'CudaDriverHelper has not been' >&2) &
  fi
  triton_pid=$!
  triton_started_s=$SECONDS
  if ((triton_index < 0)); then triton_index=${#pids[@]}; fi
  pids[triton_index]=$triton_pid
  spawned
  mark_ready "$triton_pid" "$@" &
}
if [[ "$ROLE" != frontend ]]; then start_triton "$@"; fi

if [[ "$OPENAI" == 1 && -n "$OPENAI_MODEL" ]]; then
  spawning=1
  say "OpenAI front on http://$HOST:$OPENAI_PORT/v1 -> $OPENAI_MODEL at $GRPC_URL"
  python3 -m frontend --host "$HOST" --port "$OPENAI_PORT" --grpc-url "$GRPC_URL" --model "$OPENAI_MODEL" \
    --served-model-name "${OPENAI_SERVED_MODEL_NAME:-$OPENAI_MODEL}" \
    --graceful-shutdown-s "$DRAIN_TIMEOUT_S" "${front_tls[@]}" &
  pids+=($!)
  spawned
fi

# Foreground until tritonserver exits before it ever became ready (a start-up failure) or, without one, the
# front exits; its status is ours. A tritonserver that exits after that (a model's stub died and its guardian
# ended the server, docs/healing.md; a crash) is started again, unless RESTART=0. The front's death does not
# stop tritonserver: one role never takes down another.
set +e
while true; do
  if [[ -n "$triton_pid" ]]; then wait "$triton_pid"; else wait -n "${pids[@]}"; fi
  status=$?
  if [[ -n "$triton_pid" && "${RESTART:-1}" == 1 ]] && ! kill -0 "$triton_pid" 2>/dev/null \
      && [[ "$(cat "$ready_mark" 2>/dev/null)" == "$triton_pid" ]]; then
    say "tritonserver exited with status $status after $((SECONDS - triton_started_s)) s: starting it again"
    start_triton "$@"
    continue
  fi
  break
done
set -e
say "tritonserver${triton_pid:+ ($triton_pid)} exited with status $status"
exit "$status"
