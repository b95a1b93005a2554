#!/bin/bash
# Session 30, ninth call: session30-gather's host had its CPU disturbed (cold callbacks of 6-40 ms
# a token instead of about 4), so the overlapped staging bench with the default 16-block gather
# again, F16, on a fresh host. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
# The 16-block gather (GatherRowsKernel as one grid-stride loop over every row's units, grid
# min(PINFER_CUDA_GATHER_BLOCKS or 16, units / 256)) was measured uncommitted and reverted after
# session30-adaptive: docs/benchmarks.md, run 47.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
PINFER_CUDA_COLD_AHEAD_PIN=1 PINFER_CUDA_COLD_AHEAD_HINT=3 LD_LIBRARY_PATH=/tmp/s/cudamod/lib \
  timeout 150 $bin/cuda_decode_bench --dtype=F16 --modes=staged --stage-rows=0,100,200 \
  --stage-ahead=1 --stage-overlap=1 --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
  > $out/staged_F16.log 2>&1
echo "== staged, overlapped F16, 16-block gather: rc $? at $((SECONDS - start)) s"
grep -E "^round" $out/staged_F16.log | cut -c1-250
sed -n '/^| dtype/,$p' $out/staged_F16.log
