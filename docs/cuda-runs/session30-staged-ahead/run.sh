#!/bin/bash
# Session 30, fourth call: the staging bound (--modes=staged) with and without the CPU loading
# the rest of the guess ahead (--stage-ahead=1, pinned prefetcht0 loads as in run 46), F16 and
# Q4_0, one sequence at skew 20%, relu-llama-tiny's guess (recall 0.95 at 1.6x, tier 0.82:0.31).
# Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for d in F16 Q4_0; do
  PINFER_CUDA_COLD_AHEAD_PIN=1 PINFER_CUDA_COLD_AHEAD_HINT=3 LD_LIBRARY_PATH=/tmp/s/cudamod/lib \
    timeout 250 $bin/cuda_decode_bench --dtype=$d --modes=staged --stage-rows=0,100,200 \
    --stage-ahead=1 --rounds=3 --skews=0.2 --steps=48 --warmup=16 > $out/staged_$d.log 2>&1
  echo "== staged $d: rc $? at $((SECONDS - start)) s"
  grep -E "^staged" $out/staged_$d.log
  sed -n '/^| dtype/,$p' $out/staged_$d.log
done
