#!/bin/bash
# Session 25, first call: software prefetching in the cold side's sparse FFN (SimdOptions).
# Variants in one process per dtype, taking turns, skew 20%: base (no software prefetch);
# COLD_NEXT_LINES=2 (before each group of eight neurons, two lines at each row start and 4 KB
# boundary of the next group's rows, into L2); COLD_ROW_PREFETCH=512 (the Q4_0 multi-row kernels
# prefetch 512 bytes ahead within each row); both. Bundle: cudamod only.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
lscpu | grep -E "Model name|L2|L3|NUMA node"
v="base;COLD_NEXT_LINES=2;COLD_ROW_PREFETCH=512;COLD_NEXT_LINES=2+COLD_ROW_PREFETCH=512"
for dt in Q4_0 F16; do
  [ $dt = F16 ] && v="base;COLD_NEXT_LINES=2;COLD_NEXT_LINES=4"
  v3="$v;$v;$v"
  left=$(( 580 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 330 ? left : 330 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes \
    --variant-modes=pinfer,lanes --variants="$v3" --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*pinfer|bandwidth after|cold callback" $out/bench_$dt.log | cut -c1-200
done
