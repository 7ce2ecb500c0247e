#!/bin/bash
# usage: [GROUP=1] [TERM_AFTER=1] docs/history/bls_repro/init_stall/run.sh STOP_S [WAIT_S]
# tritonserver 2.51 (the bundled one) loads a model whose initialize takes 6 s; its stub is stopped (SIGSTOP)
# for STOP_S seconds during initialize, as a stub that gets no CPU for that long would be. Prints whether the
# model was loaded WAIT_S (default 20) seconds after the stub was resumed, and with gdb the parent's frame
# that holds the load. STOP_S=0 is the control. TERM_AFTER=1: then SIGTERM tritonserver, as a launcher whose ready
# timeout ran out would, and print how it ends.
set -u
STOP=$1; WAIT=${2:-20}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); V=$ROOT/.venv; SP=$V/lib/python3.11/site-packages/pytriton/tritonserver
export PATH=$V/bin:$PATH
W=$(mktemp -d); mkdir -p $W/repo/slow/1
cp "$(dirname "$0")/config.pbtxt" $W/repo/slow/; cp "$(dirname "$0")/model.py" $W/repo/slow/1/
export INIT_STALL_MARK=$W/init_started
$SP/bin/tritonserver --model-repository=$W/repo --backend-directory=$SP/backends \
  --http-address=127.0.0.1 --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 \
  --http-port=19200 --grpc-port=19201 --metrics-port=19202 --allow-gpu-metrics=false \
  --pinned-memory-pool-byte-size=0 --exit-timeout-secs=3 > $W/server.log 2>&1 &
SPID=$!
for i in $(seq 200); do [ -f $INIT_STALL_MARK ] && break; sleep 0.1; done
STUB=$(pgrep -P $SPID | head -1)
REGIONS=$(pgrep -P $SPID -a | grep -o "triton_python_backend_shm_region_[0-9a-f-]*" | sort -u)
echo "tritonserver $SPID, stub $STUB: stopped for $STOP s during initialize"
# GROUP=1: stop tritonserver with its stub (what Ctrl-Z on the launching shell does), resume both at once
VICTIMS=$STUB; [ "${GROUP:-0}" = 1 ] && VICTIMS="$SPID $STUB"
[ "$STOP" != 0 ] && { kill -STOP $VICTIMS; sleep $STOP; kill -CONT $VICTIMS; }
for i in $(seq $((WAIT * 2))); do grep -q "successfully loaded 'slow'" $W/server.log && break; sleep 0.5; done
if grep -q "successfully loaded 'slow'" $W/server.log; then echo "RESULT: model loaded"
else
  echo "RESULT: model NOT loaded $WAIT s after the stub resumed (stub $(kill -0 $STUB 2>/dev/null && echo alive || echo gone))"
  command -v gdb >/dev/null && gdb -p $SPID -batch -ex "thread apply all bt 8" 2>/dev/null \
    | grep -E "StubLauncher|LaunchStubProcess" | sed 's/ (.*//; s/^/  parent: /' | head -4
fi
if [ "${TERM_AFTER:-0}" = 1 ]; then
  DM0=$(dmesg | wc -l); kill -TERM $SPID
  for i in $(seq 40); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
  if kill -0 $SPID 2>/dev/null; then echo "SIGTERM: tritonserver still running after 20 s"
  else wait $SPID; echo "SIGTERM: tritonserver exit status $?"; fi
  kill -0 $STUB 2>/dev/null && echo "SIGTERM: stub still alive"
  grep -aE "lock_exception|terminate called|Signal \(|not healthy|Failed to" $W/server.log | cut -c1-160 | head -4
  dmesg | tail -n +$((DM0 + 1)) | grep -E "$SPID|$STUB" | head -3
fi
kill -KILL $SPID $STUB 2>/dev/null; wait $SPID 2>/dev/null
for r in $REGIONS; do rm -f /dev/shm/$r; done; rm -rf $W
