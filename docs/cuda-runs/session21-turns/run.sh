#!/bin/bash
# Session 21, third call: SparseFfnToken's reduction in one column range per thread (was ~40
# ranges of 128 columns), the cold side alone again (--modes=coldrows: the cpu-worker's op against
# equal shares, call by call in turns; two lanes' cold calls with the waiting lane blocking on a
# mutex, polling, or on a pool of its own), then the 13B shape's two lanes with the waiting lane
# blocking (base, and TURNS=block: the same, run again between them) against polling (TURNS=spin).
# Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
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
  BENCH_FLAGS="--modes=pinfer,lanes --variant-modes=lanes --steps=48 --warmup=16 --variants=base;TURNS=spin;TURNS=block;TURNS=spin" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
for f in $out/bench_*.log; do grep -E "^\| |per token cold" $f | cut -c1-300; done
