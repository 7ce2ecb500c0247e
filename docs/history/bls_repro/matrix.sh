#!/bin/bash
cd /tmp/bls_repro
RUNS=${RUNS:-3}
for MODE in "$@"; do for C in ${CONCS:-16 64}; do for i in $(seq $RUNS); do
  OUT=$(./run_one.sh $MODE $C 500 m$i 2>&1)
  R=$(echo "$OUT" | grep RESULT | sed 's/RESULT //'); SEG=$(echo "$OUT" | grep -c "DURING_LOAD"); ALIVE=$(echo "$OUT" | grep -o "parent_alive_after_load=[A-Za-z]*")
  AB=$(grep -a -ciE "double free|corrupt|fastbin|tcache|unaligned" logs/server_${MODE}_${C}_m$i.log)
  echo "$MODE c=$C run=$i $R segv_during_load=$SEG malloc_abort=$AB $ALIVE"
  echo "$OUT" | grep DURING_LOAD | head -1
done; done; done
