#!/bin/bash
# Session 21, fourth call: SparseFfnToken's reduction now sums 16 columns at a time over every
# part (7c9e593; bundle of the commit after it, which drops the variants TURNS and COLD_POOLS). The cold side alone (--modes=coldrows: the cpu-worker's op against equal shares,
# call by call in turns), the 13B shape with the op (base, and COLD_DEAL=ops: the same, run again)
# against equal shares (COLD_DEAL=static), and the whole service (its cpu-worker runs the op)
# sleeping (--spin-us 0) and polling (default). Bundles: bench/make_service_bundle.sh build
# /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod;
# tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in Q4_0 F16; do
  timeout 120 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; grep -E "^\|.*\| 16 \| (64|150|295|500|838|1382) \||difference" $out/coldrows_$dt.log
done
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 \
  BENCH_FLAGS="--modes=pinfer,lanes --variant-modes=pinfer,lanes --steps=48 --warmup=16 --variants=base;COLD_DEAL=static;COLD_DEAL=ops;COLD_DEAL=static" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
for f in $out/bench_*.log; do grep -E "^\| " $f | cut -c1-200; done
pkill -9 -f pinfer- 2>/dev/null
for spin in 0 200; do
  d=/tmp/svc-spin$spin-$RANDOM
  THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 CPU_FLAGS="--spin-us $spin" OUT=$d timeout 120 \
    bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
  echo "== cpu-worker --spin-us $spin: rc $?"
  grep -E "prompts match|check|concurrent streams|1 stream|did not stop" $d.log
  cat $d.log >> $out/service.log
  pkill -9 -f pinfer- 2>/dev/null
done
