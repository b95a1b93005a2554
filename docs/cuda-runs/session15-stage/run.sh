#!/bin/bash
# Session 15: a dense product's first rows staged in shared memory by the bulk copy engine
# (QX_STAGE, default on) against loaded into registers (QX_STAGE=0); the op tests first.
set -u
out=$1
V="base;QX_STAGE=0;base;QX_STAGE=0"
BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=$V" \
  timeout 400 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
grep -E "PASSED|FAILED|Failure" $out/cuda_ops_test.log | head
grep -E "Failure|Expected|Which is|error" $out/cuda_ops_test.log | head -10
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
