#!/bin/bash
# Session 16: the late blocks of a norm's full-grid product load x first (LATE_X_FIRST, default
# on): built on the H200 from the working tree, the op and backend tests, and an A/B on the whole
# Q4_0 model in one process.
set -u
out=$1
BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --variants=base;LATE_X_FIRST=0;base;LATE_X_FIRST=0;base;LATE_X_FIRST=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in|PASSED|FAILED|tests ran" $out/run.log | head
grep -E "Failure|Expected|Which is|late blocks" $out/cuda_ops_test.log | head -8
for f in $out/bench_*.log; do grep -E "^\| |whole model|bandwidth" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
