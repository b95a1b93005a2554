#!/bin/bash
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;ABLATE=norm1/norm2;ABLATE=rope/attn;ABLATE=act;ABLATE=norm1/norm2/rope/attn/act;ABLATE=wo;ABLATE=down;ABLATE=qkv;ABLATE=gate_up;ABLATE=qkv/wo/gate_up/down;base" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,6,7; done
