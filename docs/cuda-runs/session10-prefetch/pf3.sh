#!/bin/bash
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=240 BENCH_DTYPES="F16 Q4_0" BENCH_FLAGS="--modes=pinfer --steps=32 --warmup=8 --variants=COLD_GPU_SHARE=auto;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024+PREFETCH_KERNEL=1;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024+PREFETCH_KERNEL=1+PREFETCH_PRIORITY=1;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024+PREFETCH_KERNEL=1+PREFETCH_PRIORITY=1+PREFETCH_BLOCKS=48;COLD_GPU_SHARE=auto:0.7+COLD_PREFETCH_ROWS=1024+PREFETCH_KERNEL=1+PREFETCH_PRIORITY=1+PREFETCH_BLOCKS=4" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "built in" $out/run.log | head -30
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |skew 20%|skew 40%" $f | grep -v "^| dtype\|^|---\|active rows\|lookahead" | cut -c1-250; done
