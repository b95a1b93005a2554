#!/bin/bash
# Session 24, second call: where a layer's turn between the two sides goes. New per-token line
# (ForwardStats' host_launch, gpu_cold_gap, gpu_cold_in: the host queueing the next layer; on the
# GPU, x published -> the cold side's signal seen -> the next layer's first kernel). Variants in
# one process per dtype, skew 20%, one sequence and two lanes: base; TIMES=0 (no per-layer timing
# events, to see what recording them costs); COLD_PARTS=0 (the callback sums its parts; the GPU
# copies one sum). Bundle as session24-lanes (cudamod only).
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
which nsys ncu 2>&1 | head -2; ls /usr/local/cuda/bin 2>/dev/null | grep -E "nsys|ncu" | head
v="base;TIMES=0;COLD_PARTS=0"
v="$v;$v;$v"
for dt in Q4_0 F16; do
  left=$(( 590 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 280 ? left : 280 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes \
    --variant-modes=pinfer,lanes --variants="$v" --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*pinfer|bandwidth after|queueing" $out/bench_$dt.log | cut -c1-250
done
