#!/bin/bash
# Session 23, second call: the first call's A/B again with more turns, skew 20% only: the cold
# side's partial sums added on the GPU (base, 3568a8a) against the callback adding them itself
# (COLD_PARTS=0), six times each in one process per dtype, one sequence and two lanes. Bundle as
# session23-parts (tar | xz -9e so that it fits the call's 64 MiB).
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
v="base;COLD_PARTS=0"
v="$v;$v;$v;$v;$v;$v"
for dt in Q4_0 F16; do
  timeout 250 $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes --variant-modes=pinfer,lanes \
    --variants="$v" --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== bench $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*(pinfer|lanes)|bandwidth after" $out/bench_$dt.log | cut -c1-120
done
# The whole service (whose cold callback, the exchange with the cpu-worker, writes one sum that
# SumParts then takes as one part), with the module's default and with PINFER_CUDA_COLD_PARTS=0
# (the copy of before), twice each.
for parts in 1 0 1 0; do
  d=$out/service_$parts; mkdir -p $d
  PINFER_CUDA_COLD_PARTS=$parts THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d \
    timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod >> $out/service_$parts.log 2>&1
  echo "== service COLD_PARTS=$parts: rc $? at $((SECONDS - start)) s"
  grep -E "reference|tokens/s|^\| " $out/service_$parts.log | tail -6
done
tar -czf $out/service_dirs.tgz -C $out service_1 service_0 && rm -rf $out/service_1 $out/service_0
# (unpacked into service_1/ and service_0/ here after the call)
