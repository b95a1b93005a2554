#!/bin/bash
set -u
out=$1
BACKEND_TIMEOUT=1 BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=48 --warmup=8 --bandwidths=0 --variants=base;FUSED_NORM=0;FUSED_NORM=1;FUSED_NORM=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
grep -E "PASSED|FAILED|Failure" $out/cuda_ops_test.log | head
for f in $out/bench_*.log; do grep -E "^\| |whole model" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
B=/tmp/pinfer-cuda-build/device-bundle
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: $NSYS"
[ -z "$NSYS" ] && exit 0
for fused in 1 0; do
  timeout 120 $NSYS profile -o $out/gpu_fused$fused --trace=cuda --cuda-graph-trace=node --force-overwrite=true \
    $B/bin/cuda_decode_bench --dtype=Q4_0 --modes=gpu --steps=6 --warmup=2 --bandwidths=0 --variants=FUSED_NORM=$fused > $out/nsys$fused.log 2>&1
  timeout 100 $NSYS stats --report cuda_gpu_trace --format csv --output $out/trace_fused$fused $out/gpu_fused$fused.nsys-rep > /dev/null 2>&1
  rm -f $out/gpu_fused$fused.nsys-rep $out/gpu_fused$fused.sqlite
  ls -la $out/ | grep trace
done
