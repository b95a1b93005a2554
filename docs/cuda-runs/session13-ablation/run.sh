#!/bin/bash
# Session 13: in-situ ablation of the five-kernel dense decode layer (measurement patch
# ablate.patch applied to the working tree that ran; not in the product): named kernels left out
# of every layer of the whole Q4_0 step, the output garbage, the step's time the point.
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;ABLATE=attn;ABLATE=wo;ABLATE=qkv;ABLATE=gate_up;ABLATE=down;ABLATE=qkv/wo/gate_up/down;base" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -d'|' -f2,3,6,7; done
