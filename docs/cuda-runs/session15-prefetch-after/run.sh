#!/bin/bash
# Session 15: the norm products prefetch their second step's rows into L2 after the wait, before
# the norm (QX_PREFETCH_NEXT=2), and the products' grids as few blocks as take the same rounds
# (QX_ROUND_GRID=1), against base.
set -u
out=$1
V="base;QX_PREFETCH_NEXT=2;QX_ROUND_GRID=1;base;QX_PREFETCH_NEXT=2;QX_ROUND_GRID=1"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=$V" \
  timeout 420 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
