#!/bin/bash
# Session 24, last call: the submitted code (2885d01: the thread pool's atomics on lines of their
# own, which the cpu-worker's pool also uses; the module's new per-token times): the op and module
# tests, the default modes of the 13B-shape bench (pinfer one sequence, dense layer offload, the
# whole model on the GPU) in F16 and Q4_0, the whole service, and, with the time left, two lanes
# at skew 20% four times in one process per dtype. Bundles: bench/make_service_bundle.sh build
# /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod;
# tar -cf - -C /tmp/svcb svc cudamod | xz -9e > .device/svc.tar.xz
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_FLAGS="--steps=48 --warmup=16" gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/device_run.log 2>&1
echo "== device_run: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |^\| (F16|Q4_0) \||bandwidth after" $out/device_run.log | cut -c1-170
d=$out/service; mkdir -p $d
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 110 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "== service: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/service.log | tail -6
tar -czf $out/service_dir.tgz -C $out service && rm -rf $out/service
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in Q4_0 F16; do
  left=$(( 585 - (SECONDS - start) ))
  (( left < 50 )) && { echo "skipped lanes $dt: time"; continue; }
  timeout $left /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=lanes \
    --variants="base;base;base;base" --skews=0.2 --steps=48 --warmup=16 > $out/lanes_$dt.log 2>&1
  echo "== lanes $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*lanes|bandwidth after" $out/lanes_$dt.log | cut -c1-130
done
