#!/bin/bash
# Session 26: two lanes again, after session26-final's two lanes came out at half their usual
# tokens/s (F16 98, Q4_0 184 at skew 20%) with one-sequence Q4_0 rounds ranging 72-159 in the
# same call: is it the host or the code? The same bundle as session26-final; per dtype
# `--modes=lanes`, skew 20%, three rounds, and the host's load before and after.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
cat /proc/loadavg; top -bn1 | head -15
for dt in Q4_0 F16; do
  left=$(( 500 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 200 ? left : 200 )) $bin/cuda_decode_bench --dtype=$dt --modes=lanes \
    --variant-modes=lanes --variants="base" --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
    > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
cat /proc/loadavg
