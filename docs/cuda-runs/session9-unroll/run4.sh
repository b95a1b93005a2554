#!/bin/bash
# Scratch: tests, int8 product unroll A/B in one process, and ncu kernel durations of the Q4_0
# decode step with each unroll on the same machine.
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=pinfer,gpu --variant-modes=pinfer,gpu --steps=32 --warmup=8 --variants=base;QX_UNROLL=4;QX_UNROLL=2;QX_UNROLL=4" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out/r > $out/r.log 2>&1
grep -E "PASSED|FAILED|tests ran|built in" $out/r.log | head
for f in $out/r/bench_*.log; do grep -E "^\| |whole model|skew" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-200; done
B=/tmp/pinfer-cuda-build/device-bundle
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PINFER_CUDA_PRELAUNCH=0
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
K='regex:MatVecSplitQ8x|Norm|Rope|Attention|Gated'
for u in 2 4 2 4; do
  timeout 100 $NCU --metrics gpu__time_duration.sum -k "$K" --csv --print-units base \
    $B/bin/cuda_decode_bench --dtype=Q4_0 --modes=gpu --steps=1 --warmup=1 --layers=2 --variants=QX_UNROLL=$u > $out/ncu_u$u.csv 2> $out/ncu_u$u.err
  echo "== unroll $u"; python3 .device/ncu_table.py $out/ncu_u$u.csv 9
done
