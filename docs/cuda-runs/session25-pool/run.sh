#!/bin/bash
# Session 25: the lanes' shared cold pool with fewer threads. The op's bandwidth saturates near 12
# of the host's 16 threads (session24-lanes' coldrows tables), and every spare core is one that a
# stray thread can use without delaying a part. Variants in one process per dtype, four rounds,
# skew 20%, two lanes only: base (15 threads); LANES_POOL=14 / 13 / 12. Bundle: cudamod only,
# built at 8253a7f.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  left=$(( 560 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 280 ? left : 280 )) $bin/cuda_decode_bench --dtype=$dt --modes=lanes \
    --variant-modes=lanes --variants="base;LANES_POOL=14;LANES_POOL=13;LANES_POOL=12" \
    --rounds=4 --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
