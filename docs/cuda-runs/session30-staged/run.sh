#!/bin/bash
# Session 30, third call: a bound for staging guessed cold rows in VRAM (new --modes=staged of
# cuda_decode_bench): before each step the K likeliest neurons of each layer's drawn guess are
# gathered into K extra GPU rows a layer, and the step computes the active ones among them on the
# GPU; the copies run before the step, so the step's tokens/s bounds a staging that hides its
# copies. One sequence, skew 20%; the guess relu-llama-tiny's (recall 0.95 at 1.6x, tier
# 0.82:0.31), then a perfect one. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for d in F16 Q4_0; do
  for g in 0.95:1.6:0.82:0.31 1:1:1:0; do
    LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 200 $bin/cuda_decode_bench --dtype=$d --modes=staged \
      --stage-rows=0,100,200,300 --stage-guess=$g --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
      > $out/staged_${d}_$g.log 2>&1
    echo "== staged $d $g: rc $? at $((SECONDS - start)) s"
    grep -E "^staged|^round" $out/staged_${d}_$g.log
    sed -n '/^| dtype/,$p' $out/staged_${d}_$g.log
  done
done
