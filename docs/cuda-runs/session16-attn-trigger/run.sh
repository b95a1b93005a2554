#!/bin/bash
# Session 16: the attention releases the output projection's blocks at its start (base), after its wait (ATTN_TRIGGER=1) or at its end (2).
set -u
out=$1
V="base;ATTN_TRIGGER=1;ATTN_TRIGGER=2"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --bandwidths=0 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
tail -5 $out/run.log | grep -v "^|"
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-80; done
