#!/bin/bash
# Session 17 (logits.patch applies to 33a0fe6 and includes the bandwidth change that afed03e
# commit): what the host's end of a whole-Q4_0-model decode step costs. Measurement patch
# logits.patch (the bench only): LOGITS_DEST=0 copies the logits into the bench's vector
# (pageable, as before), 1 into pinned memory, 2 copies none and skips the output head (the
# next token is made up). The bench prints Forward's wall time and the host argmax's per step.
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
V="base;LOGITS_DEST=1;LOGITS_DEST=2"
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=64 --warmup=16 --bandwidths=0 --variants=$V;$V;$V" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "^gpu \[|^\| " $out/bench_Q4_0.log | grep -v "^| dtype\|^|---" | cut -c1-120
