#!/bin/bash
# Session 31, third call: the adaptive bench with every hot row as cache, three rounds per process
# (static, counting between steps, counting in the background taking turns; medians), to tell
# the counting thread's effect from the host's noise, and the swap gain (hysteresis) raised from
# 2 to 6 against the churn on matched text. One process each; F16 also with 15 cold threads (a
# core left for the counting thread). Bundle: gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod, packed to .device/cudamod.tar.xz.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
# dtype, cold threads, swap gain, decay
while read -r d t g decay; do
  run=${d}_${t}_${g}_$decay
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 120 $bin/cuda_decode_bench \
    --dtype=$d --modes=adaptive --warmup=48 --steps=64 --cache-fractions=1.0 --rounds=3 \
    --threads=$t --cache-gain=$g --cache-decay=$decay < /dev/null > $out/adaptive_$run.log 2>&1
  echo "== adaptive $run: rc $? at $((SECONDS - start)) s"
  sed -n '/^Medians/,$p' $out/adaptive_$run.log | grep -v "^$"
done <<'LIST'
F16 16 2 0.95
F16 15 2 0.95
F16 16 6 0.95
Q4_0 16 2 0.95
Q4_0 16 6 0.95
F16 16 6 0.98
LIST
