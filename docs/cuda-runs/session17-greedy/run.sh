#!/bin/bash
# Session 17: the whole Q4_0 model with the greedy pick of 10d3017 (GreedyToken) against the old
# std::max_element, same process, alternating; measurement patch logits.patch (applies to
# 10d3017): LOGITS_DEST=0 GreedyToken on the bench's vector (the product's path), 3 the old
# std::max_element there, 2 no logits and no output head (the bound). With the bandwidths.
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
V="base;LOGITS_DEST=3;LOGITS_DEST=2"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "^bandwidth|^gpu \[|^\| |whole model" $out/bench_Q4_0.log | grep -v "^| dtype\|^|---" | cut -c1-140
