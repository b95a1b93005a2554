#!/bin/bash
# Session 17: the attention's trigger A/B (session 16's +2.0-2.3%) again, built on the H200 as
# session 16 built it (device_build_run.sh), because three A/Bs of the bundle built on the Debian
# machine found it level or slower (session17-table, session17-table2). Tests skipped (1 s).
set -u
out=$1
V="base;ATTN_LATE_TRIGGER=0"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "configure|built in" $out/run.log | head -3
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |whole model" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
