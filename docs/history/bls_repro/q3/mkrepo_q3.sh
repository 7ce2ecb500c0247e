#!/bin/bash
D=/tmp/bls_repro/repos/q3; S=/tmp/bls_repro/src; rm -rf $D; mkdir -p $D/slow/1 $D/bls_parent/1
cp $S/child_model.py $D/slow/1/model.py
sed -e 's/NAME/slow/' -e 's/string_value: "3"/string_value: "150"/' $S/child_config.pbtxt > $D/slow/config.pbtxt
cat >> $D/slow/config.pbtxt <<'X'
parameters { key: "DELAY" value { string_value: "0.1" } }
parameters { key: "VERBOSE" value { string_value: "1" } }
X
cp $S/parent_model.py $D/bls_parent/1/model.py
sed -e 's/MODEVAL/thread/' -e 's/name: "parent"/name: "bls_parent"/' $S/parent_config.pbtxt > $D/bls_parent/config.pbtxt
echo 'parameters { key: "CHILDREN" value { string_value: "slow" } }' >> $D/bls_parent/config.pbtxt
