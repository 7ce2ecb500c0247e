#!/bin/bash
# usage: mkrepo.sh MODE DIR
MODE=$1; D=$2; S=/tmp/bls_repro/src
rm -rf $D; mkdir -p $D
for c in child_a child_b; do mkdir -p $D/$c/1; cp $S/child_model.py $D/$c/1/model.py; sed "s/NAME/$c/" $S/child_config.pbtxt > $D/$c/config.pbtxt; done
mkdir -p $D/parent/1; cp $S/parent_model.py $D/parent/1/model.py; sed "s/MODEVAL/$MODE/" $S/parent_config.pbtxt > $D/parent/config.pbtxt
