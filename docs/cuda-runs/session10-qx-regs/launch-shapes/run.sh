#!/bin/bash
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=240 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --steps=48 --warmup=8 --variants=base;QX_GRID=balanced;QX_PARTS=2;QX_GRID=balanced+QX_PARTS=2;QX_PARTS=4;base;QX_GRID=balanced" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |whole model|by shape" $f | grep -v "^| dtype\|^|---" | cut -c1-330; done
