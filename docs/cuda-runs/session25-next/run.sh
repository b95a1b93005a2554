#!/bin/bash
# Session 25, second call: the next group's prefetch (SimdOptions::next_group_lines) again, with
# more rounds, since session25-prefetch ran on a disturbed host. Variants in one process per
# dtype, taking turns, skew 20%, one sequence and two lanes: base (no software prefetch);
# COLD_NEXT_LINES=1 / 2 (before each group of eight neurons, that many lines at each row start
# and 4 KB boundary of the next group's rows, into L2). Bundle: cudamod only, as session25-prefetch.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  v="base;COLD_NEXT_LINES=1;COLD_NEXT_LINES=2"
  [ $dt = F16 ] && v="base;COLD_NEXT_LINES=2"
  v8="$v;$v;$v;$v;$v;$v;$v;$v"
  left=$(( 580 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 300 ? left : 300 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes \
    --variant-modes=pinfer,lanes --variants="$v8" --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
done
