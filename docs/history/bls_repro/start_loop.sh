#!/bin/bash
# usage: docs/history/bls_repro/start_loop.sh [N]
# N rounds (default 40): two full PD servers (prefill, decode, pd_ensemble + bootstrap; OpenAI front off) started
# at once on ports 8000-8002/8998 and 8100-8102/8999 while two torch processes (2 threads each) keep both cores
# busy; two requests to each; Ctrl-C (SIGINT to each serve.sh group). One line per round in $OUT/results.txt:
# load time, readiness, requests, and counts of abort/trap signs in the server logs and in dmesg (logs of a bad
# round are kept in $OUT). Looks for the load-time abort of docs/bls_in_triton_2.51.md section 6.
N=${1:-40}; ROOT=$(cd "$(dirname "$0")/../.." && pwd); OUT=${OUT:-/tmp/start_loop}; PY=$ROOT/.venv/bin/python
mkdir -p $OUT; cd $ROOT
BURN='import time, torch; torch.set_num_threads(2); a = torch.randn(1024, 1024); t = time.monotonic() + 50
while time.monotonic() < t: a @ a'
SIGNS="lock_exception|terminate called|Signal \((4|6|7|11)\)|Segmentation|Aborted|not healthy|core dumped"
for it in $(seq $N); do
  DM0=$(dmesg | wc -l); burners=(); pids=(); state=""
  for b in 1 2; do timeout 60 $PY -c "$BURN" >/dev/null 2>&1 & burners+=($!); done
  for s in 0 1; do
    off=$((s * 100))
    SKIP_SETUP=1 OPENAI=0 MODELS=prefill,decode,pd_ensemble HTTP_PORT=$((8000 + off)) GRPC_PORT=$((8001 + off)) \
      METRICS_PORT=$((8002 + off)) BOOTSTRAP_PORT=$((8998 + s)) setsid scripts/serve.sh > $OUT/serve_${it}_$s.log 2>&1 &
    pids+=($!)
  done
  t0=$(date +%s)
  for s in 0 1; do
    ok=0
    for i in $(seq 360); do
      curl -sf 127.0.0.1:$((8000 + s * 100))/v2/health/ready >/dev/null && { ok=1; break; }
      kill -0 ${pids[$s]} 2>/dev/null || break; sleep 0.5
    done
    state="$state s$s:ready=$ok"
  done
  tready=$(( $(date +%s) - t0 ))
  for s in 0 1; do for q in 1 2; do
    timeout 60 $PY scripts/generate.py "Tell me about Paris" --max-tokens 8 --url 127.0.0.1:$((8001 + s * 100)) \
      >/dev/null 2>&1 && state="$state ok" || state="$state FAIL"
  done; done
  for s in 0 1; do kill -INT -- -${pids[$s]} 2>/dev/null; done
  for s in 0 1; do
    for i in $(seq 60); do kill -0 ${pids[$s]} 2>/dev/null || break; sleep 0.5; done
    kill -0 ${pids[$s]} 2>/dev/null && { state="$state s$s:KILLED"; kill -KILL -- -${pids[$s]}; }
  done
  kill ${burners[@]} 2>/dev/null; wait 2>/dev/null
  bad=$(cat $OUT/serve_${it}_*.log | grep -acE "$SIGNS")
  traps=$(dmesg | tail -n +$((DM0 + 1)) | grep -ciE "trap|segfault|general protection")
  echo "$(date +%T) round=$it ready_s=$tready$state bad_log_lines=$bad dmesg_traps=$traps" | tee -a $OUT/results.txt
  if [ "$bad" = 0 ] && [ "$traps" = 0 ] && [[ "$state" != *FAIL* && "$state" != *ready=0* && "$state" != *KILLED* ]]; then
    rm -f $OUT/serve_${it}_*.log
  else dmesg | tail -n +$((DM0 + 1)) > $OUT/dmesg_$it.txt; fi
done
