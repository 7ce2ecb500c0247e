#!/bin/bash
# usage: run_one.sh MODE STREAMS TOTAL [TAG] [extra server args]
# Starts a fresh server with children+parent(MODE), drives the client, reports crash signs, stops server.
MODE=$1; STREAMS=$2; TOTAL=$3; TAG=${4:-r}; shift 4; EXTRA="$@"
R=/tmp/bls_repro; V=/work/main/.venv; SP=$V/lib/python3.11/site-packages/pytriton/tritonserver
export PATH=$V/bin:$PATH
REPO=$R/repos/$MODE; $R/mkrepo.sh $MODE $REPO
LOG=$R/logs/server_${MODE}_${STREAMS}_${TAG}.log
rm -f $R/logs/parent.log $R/logs/child_*.log
DM0=$(dmesg | wc -l)
$SP/bin/tritonserver --model-repository=$REPO --backend-directory=$SP/backends \
  --http-address=127.0.0.1 --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 \
  --http-port=19100 --grpc-port=19101 --metrics-port=19102 --allow-gpu-metrics=false \
  --pinned-memory-pool-byte-size=0 --log-verbose=0 --exit-timeout-secs=3 $EXTRA > $LOG 2>&1 &
SPID=$!
for i in $(seq 60); do curl -sf 127.0.0.1:19100/v2/health/ready && break; sleep 0.5; done
PP=$(pgrep -P $SPID -a | grep "/parent/" | awk "{print \$1}")
STUBPIDS=$(pgrep -P $SPID | tr "\n" " "); REGIONS=$(pgrep -P $SPID -a | grep -o "triton_python_backend_shm_region_[0-9a-f-]*" | sort -u | tr "\n" " "); echo "$STUBPIDS $REGIONS" >> $R/logs/mine.txt
timeout 200 python $R/client.py --streams $STREAMS --total $TOTAL --deadline 60 --req-timeout 8 | tee -a $LOG.client
sleep 1
STUBS=$(pgrep -P $SPID -c); grep -q "State:.*[RS]" /proc/$PP/status 2>/dev/null && echo parent_alive_after_load=yes || echo parent_alive_after_load=NO; DM1=$(dmesg | wc -l)
kill -TERM $SPID; for i in $(seq 16); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
kill -0 $SPID 2>/dev/null && { echo "server did not exit, KILL"; kill -KILL $SPID; }
sleep 0.5
for p in $STUBPIDS; do kill -KILL $p 2>/dev/null && echo "killed leftover stub $p"; done; sleep 0.3
for r in $REGIONS; do rm -f /dev/shm/$r; done
echo "stubs_alive_at_end=$STUBS"
grep -aiE "unhealthy|not healthy|segfault|double free|corrupt|fastbin|Stub process|abort|Signal" $LOG | sort | uniq -c | head -8
PIDRE=$(echo $STUBPIDS | sed "s/ /\\|/g"); dmesg | sed -n "$((DM0+1)),${DM1}p" | grep -i segfault | grep "\[\($PIDRE\)\]" | sed "s/^/DURING_LOAD: /" | head -3; dmesg | tail -n +$((DM1+1)) | grep -i segfault | grep "\[\($PIDRE\)\]" | sed "s/^/AT_SHUTDOWN: /" | head -3
grep -a -c EXC $R/logs/parent.log 2>/dev/null | sed 's/^/parent_EXC=/'
