#!/bin/bash
# Scratch: per-kernel times of pinfer-mode decode steps (Q4_0, F16) under Nsight Compute.
# PRELAUNCH=0: under ncu a launch waits for its kernels, and a queued layer's first kernel waits
# for a signal the host sends only after that launch returns.
set -u
out=$1
BENCH_DTYPES=" " OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 gpu-worker/cuda/device_build_run.sh .device/sdk $out/b > $out/b.log 2>&1
B=/tmp/pinfer-cuda-build/device-bundle
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PINFER_CUDA_PRELAUNCH=0
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for dt in Q4_0 F16; do
  timeout 200 $NCU --metrics gpu__time_duration.sum --cache-control none --csv --print-units base \
    $B/bin/cuda_decode_bench --dtype=$dt --modes=pinfer --skews=0.2 --steps=1 --warmup=1 --layers=2 \
    > $out/ncu_pinfer_$dt.csv 2> $out/ncu_pinfer_$dt.err
  tail -3 $out/ncu_pinfer_$dt.err
  wc -l $out/ncu_pinfer_$dt.csv
done
