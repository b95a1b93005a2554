#!/bin/bash
# Session 24, after session24-last: its F16 process ran while the host's CPU was disturbed (the
# cold callback 17.8 ms a token against 5.1 in session24-final, the same binaries), so the F16
# default modes again, twice, in processes of their own. Bundle as session24-last.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for i in 1 2; do
  timeout 200 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=F16 --steps=48 --warmup=16 > $out/bench_F16_$i.log 2>&1
  echo "== F16 $i: rc $? at $((SECONDS - start)) s"
  grep -E "^\| F16 \||bandwidth after|per token cold" $out/bench_F16_$i.log | cut -c1-200
done
