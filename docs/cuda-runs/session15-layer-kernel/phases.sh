#!/bin/bash
# Session 15: the layer kernel's phases, cumulative (LAYER_STOP=k runs the first k of the five),
# against the five kernels' (LAYER_KERNEL=0), and the barrier's polling (LAYER_POLL: 0 acquire +
# 32 ns sleep, 1 relaxed + sleep, 2 relaxed without sleep). Timing only: truncated layers compute
# nothing useful.
set -u
out=$1
V="base;LAYER_KERNEL=0"
for k in 1 2 3 4; do V="$V;LAYER_STOP=$k;LAYER_KERNEL=0+LAYER_STOP=$k"; done
V="$V;LAYER_POLL=1;LAYER_POLL=2;base;LAYER_KERNEL=0"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=$V" \
  timeout 420 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
