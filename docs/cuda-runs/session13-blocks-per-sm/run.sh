#!/bin/bash
# Session 13: the int8 product at one block an SM (so that the next kernel's blocks fit beside
# it and load their first rows while it runs) against as many as fit; whole Q4_0 model.
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;QX_BLOCKS_PER_SM=1;base;QX_BLOCKS_PER_SM=1" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| |GPU busy" $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,4,6,7 | cut -c1-120; done
