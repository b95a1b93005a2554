#!/bin/bash
# Session 30, seventh call: the staging bound with its copies overlapped (--stage-overlap=1: step
# s + 1's guessed rows copied into one half of 2K slots while step s runs on the other), so that
# the copies share the GPU, the PCIe link and host memory with the step; with and without the
# CPU's loads ahead. One sequence, skew 20%, relu-llama-tiny's guess. F16, then Q4_0.
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
    --stage-ahead=1 --stage-overlap=1 --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
    > $out/staged_$d.log 2>&1
  echo "== staged, overlapped $d: rc $? at $((SECONDS - start)) s"
  grep -E "^staged|^round 1" $out/staged_$d.log | cut -c1-260
  sed -n '/^| dtype/,$p' $out/staged_$d.log
done
