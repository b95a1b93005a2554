#!/bin/bash
# Session 21, second call: the cold side alone (--modes=coldrows) with the two deals taking turns
# call by call (session 21's first call measured them in sequence and the host drifted more than
# they differ), and two lanes' cold calls on one pool taken in turns against a pool of half the
# threads per lane; then the 13B shape's two lanes with the bench's variant COLD_POOLS=split
# against one shared pool (base, and COLD_POOLS=shared: the same, run again between them). Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in Q4_0 F16; do
  timeout 120 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; grep -E "^\|.*\| 16 \| (150|295|500|838) \||two lanes \||difference" $out/coldrows_$dt.log
done
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 \
  BENCH_FLAGS="--modes=pinfer,lanes --variant-modes=lanes --steps=48 --warmup=16 --variants=base;COLD_POOLS=split;COLD_POOLS=shared;COLD_POOLS=split" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
for f in $out/bench_*.log; do grep -E "^\| |per token cold" $f | cut -c1-300; done
