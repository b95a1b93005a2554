#!/bin/bash
# Session 16: which products gain when their late blocks load x before their first rows.
set -u
out=$1
V="base;EB_ROPE=200;EB_ROPE=150;EB_ROPE=180;EB_ROPE=220;EB_ROPE=245;EB_ROPE=200+EB_ROWS=200;EB_ROPE=200+EB_ROWS=232;EB_ROPE=200+EB_ROWS=150"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --bandwidths=0 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
tail -5 $out/run.log | grep -v "^|"
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-80; done
