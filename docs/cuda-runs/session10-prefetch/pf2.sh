#!/bin/bash
# Session 10: lookahead prefetch of cold rows, first run: op tests, backend tests, A/B.
set -u
out=$1
BENCH_TIMEOUT=200 BENCH_DTYPES="F16 Q4_0" BENCH_FLAGS="--modes=pinfer --steps=32 --warmup=8 --variants=base;COLD_GPU_SHARE=auto;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024+PREFETCH_KERNEL=1;COLD_GPU_SHARE=0.5+COLD_PREFETCH_ROWS=1024" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran|built in|Failure|error" $out/run.log | head -30
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |skew 20%|skew 40%|lookahead" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-260; done
