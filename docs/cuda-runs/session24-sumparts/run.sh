#!/bin/bash
# Session 24, fourth call: SumParts' launch shape (PINFER_CUDA_SUM_PARTS=WxT: floats per load,
# threads per block; default 1x256). The op test over every shape, the module tests, then the
# shapes taking turns in one process per dtype (one sequence and two lanes, skew 20%), read
# through the per-token "from the signal to the next layer" time (GPU events). Bundle: cudamod
# only (gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar | xz -9e).
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_DTYPES=" " gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/device_run.log 2>&1
echo "== tests: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |FAILED" $out/device_run.log | head
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
v="base;SUM_PARTS=4x64;SUM_PARTS=4x32;SUM_PARTS=2x128;SUM_PARTS=1x64"
v="$v;$v"
for dt in Q4_0 F16; do
  left=$(( 585 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt: time"; continue; }
  timeout $(( left < 260 ? left : 260 )) /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt \
    --modes=pinfer,lanes --variant-modes=pinfer,lanes --variants="$v" --skews=0.2 --steps=48 \
    --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*pinfer|bandwidth after|queueing" $out/bench_$dt.log | cut -c1-250
done
