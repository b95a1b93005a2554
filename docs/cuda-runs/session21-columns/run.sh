#!/bin/bash
# Session 21, sixth call: SparseFfnToken shares a layer's down rows among the threads by column
# ranges (no partial sums of the whole width, no second pass over them). The cold side alone
# (--modes=coldrows, with the fixed costs' line), the 13B shape (pinfer and two lanes, twice:
# base and COLD_BUNDLES=1, the same configuration), and the whole service with the cpu-worker's
# threads polling (default). The cold side alone also with the bench of dff8efd (the parts' partial
# sums; cp build/bench/cuda/cuda_decode_bench /tmp/svcb/cudamod/bin/cuda_decode_bench_dff8efd before
# the tar), the two taking turns. Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in Q4_0 F16; do
  for b in cuda_decode_bench_dff8efd cuda_decode_bench cuda_decode_bench_dff8efd cuda_decode_bench; do
    timeout 60 /tmp/s/cudamod/bin/$b --dtype=$dt --modes=coldrows >> $out/coldrows_$dt.log 2>&1
    echo "== coldrows $dt $b: rc $?"
  done
  grep -E "^command|^\|.*\| 16 \| |fixed costs" $out/coldrows_$dt.log
done
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 \
  BENCH_FLAGS="--modes=pinfer,lanes --variant-modes=pinfer,lanes --steps=48 --warmup=16 --variants=base;COLD_BUNDLES=1" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
for f in $out/bench_*.log; do grep -E "^\| |^bandwidth" $f | cut -c1-200; done
pkill -9 -f pinfer- 2>/dev/null
d=/tmp/svc-$RANDOM
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 120 \
  bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
echo "== service: rc $?"
grep -E "prompts match|check|concurrent streams|1 stream|did not stop" $d.log
cp $d.log $out/service.log
