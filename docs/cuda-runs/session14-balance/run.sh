#!/bin/bash
# Session 14: more parts a row for dense products whose last step idles (QX_BALANCE), and the
# gated product on every resident block (GATED_FULL_GRID); op and backend tests, then the whole
# Q4_0 model alternating.
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;QX_BALANCE=0;GATED_FULL_GRID=1;base;QX_BALANCE=0;GATED_FULL_GRID=1" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure" $f | head; done
cat $out/cuda_ops_test.log $out/cuda_backend_test.log | grep -E "(QuantRegs|ActivationInProduct|QuantizedModelStep).*(OK|FAILED)|Failure|Expected|Which is|NMSE" | head -20
for f in $out/bench_*.log; do grep -E "^\| |GPU busy" $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,4,6,7 | cut -c1-120; done
