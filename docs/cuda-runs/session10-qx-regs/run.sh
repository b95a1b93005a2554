#!/bin/bash
# Session 10: int8 product with x in registers: op tests, backend tests, A/B in one process.
set -u
out=$1
BENCH_TIMEOUT=240 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=pinfer,gpu --variant-modes=pinfer,gpu --steps=32 --warmup=8 --variants=base;QX_REGS=0;QX_REGS=1;QX_REGS=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran|built in|Failure|error|Expected|Which is|equal" $out/run.log | head -30
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |whole model|skew 20%:|skew 40%:" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-230; done
