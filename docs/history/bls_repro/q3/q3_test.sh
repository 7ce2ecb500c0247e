#!/bin/bash
# Q3: does a decoupled child's send() block / is_cancelled() flip when (A) its gRPC client is kill -9'd, (B) its BLS parent stub is kill -9'd
R=/tmp/bls_repro; V=/work/main/.venv; SP=$V/lib/python3.11/site-packages/pytriton/tritonserver
export PATH=$V/bin:$PATH
./mkrepo_q3.sh; rm -f $R/logs/slow.log
LOG=$R/logs/server_q3.log
$SP/bin/tritonserver --model-repository=$R/repos/q3 --backend-directory=$SP/backends \
  --http-address=127.0.0.1 --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 \
  --http-port=19200 --grpc-port=19201 --metrics-port=19202 --allow-gpu-metrics=false \
  --pinned-memory-pool-byte-size=0 --exit-timeout-secs=3 > $LOG 2>&1 &
SPID=$!
for i in $(seq 60); do curl -sf 127.0.0.1:19200/v2/health/ready && break; sleep 0.5; done
STUBPIDS=$(pgrep -P $SPID | tr "\n" " "); REGIONS=$(pgrep -P $SPID -a | grep -o "triton_python_backend_shm_region_[0-9a-f-]*" | sort -u | tr "\n" " "); echo "$STUBPIDS $REGIONS" >> $R/logs/mine.txt
PARENT=$(pgrep -P $SPID -a | grep "/bls_parent/" | awk '{print $1}')
echo "### A: gRPC client -> slow, kill -9 client after 2 s"
python stream_client.py slow 127.0.0.1:19201 > $R/logs/q3_clientA.out 2>&1 &
CP=$!; sleep 2; echo "kill -9 client at $(date +%s.%N | cut -c1-14)"; kill -KILL $CP; sleep 4
tail -3 $R/logs/q3_clientA.out
grep victim $R/logs/slow.log | grep -E "is_cancelled=True|cancelled at|FINAL" | head -3
echo "last victim lines:"; grep victim $R/logs/slow.log | tail -2
echo "### B: gRPC client -> bls_parent -> BLS slow; kill -9 parent stub $PARENT after 2 s"
python stream_client.py bls_parent 127.0.0.1:19201 > $R/logs/q3_clientB.out 2>&1 &
CP=$!; sleep 2; echo "kill -9 parent stub at $(date +%s.%N | cut -c1-14)"; kill -KILL $PARENT; sleep 8
tail -2 $R/logs/q3_clientB.out
echo "last BLS-child lines (request_id empty):"; grep -v victim $R/logs/slow.log | tail -3
echo "server log after parent kill:"; grep -aiE "stub|unhealthy|error" $LOG | tail -5
echo "### C: new direct request to slow after that (5 s)"
timeout 5 python stream_client.py slow 127.0.0.1:19201 > $R/logs/q3_clientC.out 2>&1; echo "client C responses: $(grep -c resp $R/logs/q3_clientC.out)"
echo "### server threads in SendBLSDecoupledResponse:"
timeout 30 gdb -p $SPID -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "SendBLSDecoupledResponse|ResponseSendDecoupled" | sed -E 's/ \(.*//' | sort | uniq -c
echo "### child stub threads in ResponseSender::Send:"
SLOW=$(pgrep -P $SPID -a | grep "/slow/" | awk '{print $1}')
timeout 30 gdb -p $SLOW -batch -ex "thread apply all bt 8" 2>/dev/null | grep -E "ResponseSender::Send" | sed -E 's/ \(.*//' | sort | uniq -c
kill -TERM $SPID; for i in $(seq 16); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
kill -0 $SPID 2>/dev/null && { echo "server did not exit on SIGTERM within 8 s -> KILL"; kill -KILL $SPID; }
sleep 0.5; for p in $STUBPIDS; do kill -KILL $p 2>/dev/null && echo "killed leftover stub $p"; done; sleep 0.3
for r in $REGIONS; do rm -f /dev/shm/$r; done
