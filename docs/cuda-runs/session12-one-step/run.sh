#!/bin/bash
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=pinfer,gpu --variant-modes=pinfer,gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;QX_ONE_STEP=0;base;QX_ONE_STEP=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure" $f | head; done
grep -E "QuantRegs.*(OK|FAILED)|Failure" $out/cuda_ops_test.log | head -5
for f in $out/bench_*.log; do grep -E "^\| |GPU busy" $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,4,6,7 | cut -c1-120; done
