#!/bin/bash
# Session 15: the dense int8 products' grids at one block a multiprocessor (QX_BLOCKS_PER_SM=1;
# the gated product too with QX_GATED_BLOCKS_PER_SM=1), so that the next kernel's blocks are
# resident beside them and load their first rows early, against all resident blocks (base).
set -u
out=$1
V="base;QX_BLOCKS_PER_SM=1;QX_BLOCKS_PER_SM=1+QX_GATED_BLOCKS_PER_SM=1;base;QX_BLOCKS_PER_SM=1;QX_BLOCKS_PER_SM=1+QX_GATED_BLOCKS_PER_SM=1"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=$V" \
  timeout 420 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
