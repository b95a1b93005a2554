#!/bin/bash
# Session 25: the cold side's fixed cost per call. Variants in one process per dtype, four rounds,
# skew 20%, one sequence and two lanes: base; COLD_FIRST_LINES=16 / 45 (each part of the sparse
# FFN prefetches that many lines of its first group's first rows before it zeroes its partial sum
# and quantizes x: SimdOptions::first_group_lines); LANES_POOL=16 (the lanes' shared pool with all
# 16 threads instead of 15). Bundle: cudamod only, built at fc0bca8.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  left=$(( 560 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 280 ? left : 280 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes \
    --variant-modes=pinfer,lanes --variants="base;COLD_FIRST_LINES=16;COLD_FIRST_LINES=45;LANES_POOL=16" \
    --rounds=4 --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
